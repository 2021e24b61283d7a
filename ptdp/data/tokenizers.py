"""Tokenizers: raw UTF-8 bytes, or a Hugging Face ``tokenizer.json`` (e.g. a byte-level BPE).

Both round-trip text exactly: ``decode(encode(x)) == x``. That holds for the byte tokenizer by
construction and for byte-level BPE because every byte maps to a symbol of the initial alphabet
(the GPT-2 scheme, Radford et al. 2019). ``train_bpe`` builds such a tokenizer from a corpus.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import tokenizers as hf
from tokenizers import decoders, models, pre_tokenizers, trainers

from ptdp.errors import DataError

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    """What preprocessing and generation need from a tokenizer."""

    name: str
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


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


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` loaded from a ``tokenizer.json``.

    Special-token strings inside the text are encoded as ordinary text, so a document that
    mentions ``<|endoftext|>`` cannot forge a document boundary and still round-trips.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = str(self.path)
        if not self.path.is_file():
            raise DataError(
                f"{self.path}: tokenizer file not found; pass 'bytes', 'bpe' or the path of an "
                f"existing tokenizer.json"
            )
        try:
            self._tok = hf.Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise DataError(
                f"{self.path}: not a valid Hugging Face tokenizer.json ({e}); pass a file saved "
                f"by `tokenizers.Tokenizer.save` or use tokenizer 'bpe' to train one"
            ) from e
        self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = self._find_eod()

    def _find_eod(self) -> int:
        eod = self._tok.token_to_id(EOD_TOKEN)
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


def train_bpe_from_iterator(
    texts: Iterable[str], vocab_size: int, save_path: str | Path
) -> HFTokenizer:
    """Train a byte-level BPE on ``texts`` and save it as a ``tokenizer.json``.

    The initial alphabet is all 256 byte symbols, so any text encodes, even characters the
    corpus never showed. ``vocab_size`` counts the alphabet and ``<|endoftext|>``; the result is
    smaller when the corpus runs out of merges.
    """
    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < minimum:
        raise DataError(
            f"vocab_size {vocab_size} is too small for byte-level BPE: the 256 byte symbols and "
            f"{EOD_TOKEN} need {minimum}; use a vocab_size of at least {minimum}"
        )
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
    # Save then rename, so an interrupted run never leaves a half-written tokenizer.
    tmp = save_path.with_name(save_path.name + ".tmp")
    tok.save(str(tmp))
    os.replace(tmp, save_path)
    return HFTokenizer(save_path)


def _file_texts(files: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            yield Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: cannot read as UTF-8 text ({e}); fix or drop it") from e


def train_bpe(files: list[Path], vocab_size: int, save_path: Path) -> HFTokenizer:
    """Train a byte-level BPE on plain-text files (each read whole) and save it."""
    return train_bpe_from_iterator(_file_texts(files), vocab_size, save_path)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"bytes"`` gives ``ByteTokenizer``; a tokenizer.json path (or its folder) an HFTokenizer."""
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir() and (path / TOKENIZER_FILE).is_file():
        path = path / TOKENIZER_FILE
    if path.is_file():
        return HFTokenizer(path)
    raise DataError(
        f"{spec}: unknown tokenizer, neither 'bytes' nor an existing tokenizer.json; pass "
        f"'bytes' or the path of a tokenizer.json (`ptdp preprocess` with tokenizer 'bpe' "
        f"trains one)"
    )
