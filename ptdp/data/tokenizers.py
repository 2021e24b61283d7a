"""Tokenizers: raw UTF-8 bytes, or a Hugging Face ``tokenizer.json`` (e.g. a byte-level BPE).

Both round-trip text exactly: ``decode(encode(x)) == x``. That holds for the byte tokenizer by
construction and for byte-level BPE because every byte maps to a symbol of the initial alphabet
(the GPT-2 scheme, Radford et al. 2019). ``train_bpe`` builds such a tokenizer from a corpus.

Every tokenizer has a ``tokenizer.json`` form (``to_json``), so a dataset or checkpoint holds the
file it was made with: the byte tokenizer's is a byte-level BPE without merges whose ids are the
byte values, which ``load_tokenizer`` recognises and turns back into ``ByteTokenizer``. A model
directory without a ``tokenizer.json`` (SentencePiece, tiktoken) is read by ``transformers``
and converted to one.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import tokenizers as hf
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from ptdp.errors import DataError
from ptdp.files import replacing

EOD_TOKEN = "<|endoftext|>"
EOD_FALLBACKS = ("</s>", "<|end_of_text|>", "<eos>")
"""End-of-sequence tokens of other model families (Llama 1/2 and Mistral, Llama 3, Gemma),
tried in order when a tokenizer has no ``<|endoftext|>``; then the lowest special id."""
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    """What preprocessing and generation need from a tokenizer."""

    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def to_json(self) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are UTF-8 bytes and 256 is end-of-document: no file, no training."""

    name = "bytes"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # Ids >= 256 (EOD, or a padded vocabulary's spare rows) carry no text.
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def to_json(self) -> str:
        """The same tokenizer as a Hugging Face ``tokenizer.json`` (see ``byte_tokenizer_json``)."""
        return byte_tokenizer_json()


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves,
    the others (controls, space, soft hyphen) for the code points from 256 upwards in order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    symbols, spare = [], 256
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(spare))
            spare += 1
    return symbols


@functools.cache
def byte_tokenizer_json() -> str:
    """``ByteTokenizer`` as a ``tokenizer.json``: a byte-level BPE with no merges whose 256
    symbols have the byte values as ids, and ``<|endoftext|>`` = 256. The pre-tokenizer does
    not split (no regex), so every byte is one token, as in ``ByteTokenizer``."""
    vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
    tok = hf.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOD_TOKEN, special=True)])
    return tok.to_str()


def _is_byte_tokenizer(text: str) -> bool:
    """Whether a tokenizer.json's text is ``byte_tokenizer_json`` (the length test skips
    parsing a real vocabulary's megabytes)."""
    canonical = byte_tokenizer_json()
    if abs(len(text) - len(canonical)) > len(canonical):
        return False
    try:
        return json.loads(text) == json.loads(canonical)
    except ValueError:
        return False


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` loaded from a ``tokenizer.json``.

    Special-token strings inside the text are encoded as ordinary text, so a document that
    mentions ``<|endoftext|>`` cannot forge a document boundary and still round-trips.
    """

    def __init__(self, path: str | Path, text: str | None = None) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        if text is None:
            if not self.path.is_file():
                raise DataError(
                    f"{self.path}: tokenizer file not found; pass 'bytes', 'bpe' or the path of "
                    f"an existing tokenizer.json"
                )
            # Bytes then decode: no newline translation, so copies stay byte-identical.
            try:
                text = self.path.read_bytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{self.path}: not a valid Hugging Face tokenizer.json (not UTF-8 text: "
                    f"{exc}); pass a file saved by `tokenizers.Tokenizer.save` or use tokenizer "
                    "'bpe' to train one"
                ) from None
        self._json = text
        try:
            self._tok = hf.Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise DataError(
                f"{self.path}: not a valid Hugging Face tokenizer.json ({e}); pass a file saved "
                f"by `tokenizers.Tokenizer.save` or use tokenizer 'bpe' to train one"
            ) from e
        self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = self._find_eod()

    def _find_eod(self) -> int:
        for name in (EOD_TOKEN, *EOD_FALLBACKS):
            eod = self._tok.token_to_id(name)
            if eod is not None:
                return eod
        specials = sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        if specials:
            return specials[0]
        raise DataError(
            f"{self.path}: tokenizer has no {EOD_TOKEN!r} and no special tokens to end documents "
            f"with; add a special token to it or train one with tokenizer 'bpe'"
        )

    def encode(self, text: str) -> list[int]:
        # No post-processor: BOS/CLS templates would put non-text tokens inside documents.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        # Specials only enter through appended EOD (encode treats their strings as text),
        # so dropping them gives back exactly the encoded text.
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def to_json(self) -> str:
        """The ``tokenizer.json`` text this tokenizer was loaded from."""
        return self._json

    @classmethod
    def from_model_dir(cls, path: Path) -> HFTokenizer:
        """A Hugging Face model directory without ``tokenizer.json`` (SentencePiece's
        ``tokenizer.model``, tiktoken, or vocab + merges files): ``transformers`` reads it and
        converts it to its fast form, whose ``tokenizer.json`` is what ptdp keeps."""
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise DataError(
                f"{path}: holds no tokenizer.json, and reading its tokenizer files needs "
                f"transformers: pip install 'ptdp[hf]' (or pass a tokenizer.json)"
            ) from e
        try:
            auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises many kinds (OSError, ValueError, ...)
            raise DataError(
                f"{path}: transformers cannot load a tokenizer from this directory ({e}); "
                f"pass a Hugging Face model directory or a tokenizer.json"
            ) from e
        if not getattr(auto, "is_fast", False):
            raise DataError(
                f"{path}: transformers loaded a slow {type(auto).__name__} that has no "
                f"tokenizer.json form; install the converter's dependencies (sentencepiece, "
                f"protobuf, tiktoken) or pass a tokenizer.json"
            )
        return cls(path, auto.backend_tokenizer.to_str())


MAX_VOCAB = 2**31 - 1
"""The most token ids a dataset can store (int32 from 65,500 ids: ptdp/data/indexed.py)."""
BPE_SLOT_BYTES = 33
"""What the BPE trainer's table takes per slot; it reserves vocab_size entries at once, in
the next power of two of slots above 8/7 of them (hashbrown: 1e9 asked 70.9 GB of memory)."""


def bpe_vocab(vocab_size: int, corpus_bytes: int | None = None) -> int:
    """The vocabulary size to train with, checked before training: at least the alphabet,
    at most what int32 ids hold, and a table the trainer can allocate. A corpus of at most
    `corpus_bytes` of text teaches at most that many merges, so a larger size is cut to it
    (the same tokenizer, without reserving memory it never fills)."""
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < minimum:
        raise DataError(
            f"vocab_size {vocab_size} is too small for byte-level BPE: the 256 byte symbols and "
            f"{EOD_TOKEN} need {minimum}; use a vocab_size of at least {minimum}"
        )
    teaches = minimum + corpus_bytes if corpus_bytes is not None else None
    corpus = f"; these inputs teach at most {teaches:,} tokens" if teaches else ""
    if vocab_size > MAX_VOCAB:
        raise DataError(
            f"vocab_size {vocab_size:,} exceeds {MAX_VOCAB:,}, the most token ids a dataset can "
            f"store (int32){corpus}; use a smaller --vocab-size, e.g. 32000"
        )
    size = min(vocab_size, teaches or vocab_size)
    slots = 1 << max(3, -(-size * 8 // 7) - 1).bit_length()
    need, memory = slots * BPE_SLOT_BYTES, _memory_bytes()
    if memory and need > memory:
        raise DataError(
            f"vocab_size {vocab_size:,} makes the BPE trainer reserve {need / 2**30:,.1f} GiB, "
            f"more than this machine's {memory / 2**30:,.1f} GiB of memory and swap{corpus}; "
            "use a smaller --vocab-size, e.g. 32000"
        )
    return size


def _memory_bytes() -> int | None:
    """RAM plus swap (what the kernel lets one allocation reserve), None if unknown."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        kib = {line.split(":")[0]: int(line.split()[1]) for line in lines if line.strip()}
        return (kib["MemTotal"] + kib.get("SwapTotal", 0)) * 1024
    except (OSError, ValueError, KeyError, IndexError):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None


def train_bpe_from_iterator(
    texts: Iterable[str], vocab_size: int, save_path: str | Path, corpus_bytes: int | None = None
) -> HFTokenizer:
    """Train a byte-level BPE on ``texts`` and save it as a ``tokenizer.json``.

    The initial alphabet is all 256 byte symbols, so any text encodes, even characters the
    corpus never showed. ``vocab_size`` counts the alphabet and ``<|endoftext|>``; the result is
    smaller when the corpus runs out of merges. ``corpus_bytes``: at least the bytes of text
    ``texts`` holds, if known (see `bpe_vocab`).
    """
    vocab_size = bpe_vocab(vocab_size, corpus_bytes)
    tok = hf.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    save_path = Path(save_path)
    save_path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(save_path) as tmp:  # never a half-written tokenizer.json
        tok.save(str(tmp))
    return HFTokenizer(save_path)


def _file_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            yield Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: cannot read as UTF-8 text ({e}); fix or drop it") from e


def train_bpe(files: list[Path], vocab_size: int, save_path: Path) -> HFTokenizer:
    """Train a byte-level BPE on plain-text files (each read whole) and save it."""
    corpus = sum(Path(f).stat().st_size for f in files)
    return train_bpe_from_iterator(_file_texts(files), vocab_size, save_path, corpus)


def load_tokenizer(spec: str | Path) -> ByteTokenizer | HFTokenizer:
    """``"bytes"`` or the byte tokenizer's file give ``ByteTokenizer``; any other
    tokenizer.json, or a model directory (holding one, or files ``transformers`` converts), an
    ``HFTokenizer``."""
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file():
            return HFTokenizer.from_model_dir(path)
        path = path / TOKENIZER_FILE
    if path.is_file():
        tok = HFTokenizer(path)
        return ByteTokenizer() if _is_byte_tokenizer(tok.to_json()) else tok
    raise DataError(
        f"{spec}: unknown tokenizer, neither 'bytes' nor an existing tokenizer.json or model "
        f"directory; pass 'bytes' or the path of a tokenizer.json (`ptdp preprocess` with "
        f"tokenizer 'bpe' trains one)"
    )


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether two tokenizers encode alike: both the byte tokenizer, or the same file text."""
    if isinstance(a, ByteTokenizer) or isinstance(b, ByteTokenizer):
        return isinstance(a, ByteTokenizer) and isinstance(b, ByteTokenizer)
    return a.to_json() == b.to_json()
