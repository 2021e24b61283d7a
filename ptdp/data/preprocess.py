"""Tokenize text corpora into an indexed dataset plus a JSON sidecar naming its tokenizer.

Inputs are ``.txt`` files (one document each), JSON Lines, Parquet and Arrow files and saved
Hugging Face datasets (one document per line or row, its ``text_key`` field), or folders
holding them (``readers.py``). Output, for ``PREFIX``: ``PREFIX.bin``/``PREFIX.idx``
(Megatron's format, see ``indexed.py``), ``tokenizer.json`` beside them (the byte tokenizer
has one too) and ``PREFIX.json``, which names it, so training and generation decode with the
tokenizer that encoded.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ptdp.data.indexed import IndexedWriter, bin_path, idx_path, optimal_dtype
from ptdp.data.readers import SUFFIXES, find_input_files, iter_documents, text_bytes_bound
from ptdp.data.tokenizers import (
    TOKENIZER_FILE,
    ByteTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe_from_iterator,
)
from ptdp.errors import DataError
from ptdp.files import replacing, write_file
from ptdp.outputs import make_output_dir, refuse_empty

FORMAT = "ptdp-indexed-v1"
_DOCS_PER_CHUNK = 64


@dataclass(frozen=True)
class PreprocessResult:
    """What ``preprocess`` wrote."""

    prefix: Path
    num_docs: int
    num_tokens: int
    vocab_size: int
    eod_id: int
    tokenizer: str
    """Path of the tokenizer.json beside the data (the byte tokenizer's too)."""

    def __str__(self) -> str:  # what `ptdp preprocess` prints
        return (
            f"wrote {self.prefix}.bin/.idx: {self.num_docs:,} documents, "
            f"{self.num_tokens:,} tokens, vocabulary {self.vocab_size}"
        )


def sidecar_path(prefix: str | Path) -> Path:
    """``PREFIX.json``."""
    return Path(f"{prefix}.json")


def _chunks(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_docs(tok: Tokenizer, dtype: str, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(tok.encode(t) + [tok.eod_id], dtype=dtype) for t in texts]


@functools.lru_cache(maxsize=1)
def _worker_tokenizer(spec: str) -> Tokenizer:
    # One load per worker process (workers live for one preprocess call, so the file cannot
    # change under the cache); tasks carry only the spec string, not the tokenizer.
    return load_tokenizer(spec)


def _encode_chunk(task: tuple[str, str, list[str]]) -> list[np.ndarray]:
    spec, dtype, texts = task
    return _encode_docs(_worker_tokenizer(spec), dtype, texts)


def _sidecar_entries(folder: Path) -> dict[Path, str]:
    """The ptdp dataset sidecars in `folder` and the tokenizer entry each names."""
    found = {}
    for other in sorted(folder.glob("*.json")):
        try:
            meta = json.loads(other.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("format") == FORMAT:
            found[other] = str(meta.get("tokenizer"))
    return found


def _check_tokenizer_slot(target: Path, prefix: Path) -> None:
    """Refuse to replace a tokenizer.json that preprocessing did not write for this prefix:
    one another dataset's sidecar relies on, or one no sidecar names (a Hugging Face model
    folder's, a user's)."""
    if not target.exists():
        return
    users = [s for s, entry in _sidecar_entries(target.parent).items() if entry == TOKENIZER_FILE]
    others = [s for s in users if s != sidecar_path(prefix)]
    if others:
        raise DataError(
            f"{target}: already used by the dataset described in {others[0]}, and "
            f"replacing it would break that dataset; write to another directory"
        )
    if not users:
        raise DataError(
            f"{target}: already there and not written by `ptdp preprocess` (no dataset "
            f"sidecar in {target.parent} names it), so it is left alone; write the dataset "
            f"to another directory, or pass --tokenizer {target} to encode with it"
        )


def _check_prefix(output_prefix: str | Path) -> Path:
    """The prefix names files to write, never a directory, and never replaces a file that
    preprocessing did not write: PREFIX.json must be a ptdp sidecar if it is there, and
    PREFIX.bin/.idx must have one."""
    raw = str(output_prefix)
    refuse_empty(raw, "--output-prefix")
    prefix = Path(raw)
    if raw.endswith(("/", os.sep)) or prefix.name in ("", ".", "..") or prefix.is_dir():
        raise DataError(
            f"--output-prefix '{raw}' names a directory; a prefix names the files to write, "
            f"PREFIX.bin/.idx/.json: give one inside it, e.g. {prefix / 'corpus'}"
        )
    sidecar = sidecar_path(prefix)
    ours = sidecar.is_file() and _sidecar_entries(prefix.parent).get(sidecar) is not None
    for path in (sidecar, bin_path(prefix), idx_path(prefix)):
        if path.exists() and not ours:
            raise DataError(
                f"{path} is already there and not written by `ptdp preprocess` (it has no "
                f"dataset sidecar {sidecar.name}), so it is left alone; choose another "
                "--output-prefix"
            )
    return prefix


def _resolve_tokenizer(
    spec: str, files: list[Path], prefix: Path, vocab_size: int, text_key: str
) -> Tokenizer:
    """Save the tokenizer as ``tokenizer.json`` beside the data and return it, loaded back."""
    target = prefix.parent / TOKENIZER_FILE
    if spec == "bpe":
        _check_tokenizer_slot(target, prefix)
        corpus = text_bytes_bound(files)  # checks vocab_size against it before training
        return train_bpe_from_iterator(iter_documents(files, text_key), vocab_size, target, corpus)
    text = (ByteTokenizer() if spec == "bytes" else load_tokenizer(spec)).to_json()
    if not (target.is_file() and target.read_bytes() == text.encode("utf-8")):
        _check_tokenizer_slot(target, prefix)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_file(target, text)
    return load_tokenizer(target)


def preprocess(
    inputs: list[str | Path],
    output_prefix: str | Path,
    tokenizer: str,
    vocab_size: int = 4096,
    workers: int = 1,
    progress: bool = True,
    text_key: str = "text",
) -> PreprocessResult:
    """Tokenize ``inputs`` into ``PREFIX.bin``/``.idx``/``.json``; each document ends with EOD.

    Args:
        inputs: files or folders (folders: every corpus file of ``readers.SUFFIXES``
            recursively, a saved Hugging Face dataset as a whole).
        output_prefix: path prefix of the output files; its folder is created.
        tokenizer: ``"bytes"``, ``"bpe"`` (train one of ``vocab_size`` on the inputs), the
            path of a tokenizer.json or a Hugging Face model directory. It is stored as
            ``tokenizer.json`` beside the data.
        vocab_size: BPE vocabulary size; only used with ``"bpe"``.
        workers: encoding processes. The output is byte-identical for any count.
        progress: show a progress bar on stderr.
        text_key: the field (JSON lines) or column (Parquet, Arrow, datasets) holding the text.
    """
    if not inputs:
        raise DataError(
            f"no inputs given; pass {'/'.join(SUFFIXES)} files, saved datasets or folders "
            f"holding them"
        )
    if workers < 1:
        raise DataError(f"workers={workers}; use 1 or more encoding processes")
    prefix = _check_prefix(output_prefix)
    make_output_dir(prefix.parent, "--output-prefix", prefix)
    files = find_input_files(inputs)
    if next(iter_documents(files, text_key), None) is None:
        raise DataError(
            f"no documents found in {len(files)} input file(s) (first: {files[0]}): every "
            f"input is empty; pass files with text"
        )
    new_tokenizer = not (prefix.parent / TOKENIZER_FILE).exists()
    try:
        return _write_dataset(
            files, prefix, str(tokenizer), vocab_size, workers, progress, text_key
        )
    except BaseException:
        if new_tokenizer:  # a failed run leaves no tokenizer.json it wrote behind either
            (prefix.parent / TOKENIZER_FILE).unlink(missing_ok=True)
        raise


def _write_dataset(
    files: list[Path],
    prefix: Path,
    tokenizer: str,
    vocab_size: int,
    workers: int,
    progress: bool,
    text_key: str,
) -> PreprocessResult:
    """The tokenizer.json, then PREFIX.bin/.idx, then the sidecar that names them."""
    tok = _resolve_tokenizer(tokenizer, files, prefix, vocab_size, text_key)
    spec = str(prefix.parent / TOKENIZER_FILE)
    dtype = optimal_dtype(tok.vocab_size)
    chunks = _chunks(iter_documents(files, text_key), _DOCS_PER_CHUNK)
    if workers == 1:
        results = (_encode_docs(tok, dtype.str, chunk) for chunk in chunks)
    else:
        results = _ordered_map(((spec, dtype.str, chunk) for chunk in chunks), workers)
    bar = tqdm(desc=f"tokenizing {prefix.name}", unit="doc", file=sys.stderr, disable=not progress)
    writer = IndexedWriter(prefix, dtype)
    try:
        with bar:
            for docs in results:
                for doc in docs:
                    writer.add_document(doc)
                bar.update(len(docs))
        result = PreprocessResult(
            prefix=prefix,
            num_docs=writer.num_docs,
            num_tokens=writer.num_tokens,
            vocab_size=tok.vocab_size,
            eod_id=tok.eod_id,
            tokenizer=spec,
        )
        # The sidecar is written before the data take their names, so a full disk at any
        # point leaves the previous dataset (or none) whole under PREFIX.
        with replacing(sidecar_path(prefix)) as tmp:
            tmp.write_text(_sidecar_text(result, TOKENIZER_FILE, files), encoding="utf-8")
            writer.finalize()
    except BaseException:
        writer.abort()
        raise
    return result


def _ordered_map(
    tasks: Iterable[tuple[str, str, list[str]]], workers: int
) -> Iterator[list[np.ndarray]]:
    """``_encode_chunk`` over ``tasks`` in worker processes, results in task order.

    At most ``2 * workers`` chunks are in flight, so a large corpus is never all in memory
    (``Pool.imap`` would queue every result). spawn, because fork would copy the parent's
    tokenizer thread pool; a worker that cannot start raises instead of being respawned forever.
    """
    spawn = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(workers, mp_context=spawn) as pool:
            pending: deque[Future[list[np.ndarray]]] = deque()
            for task in tasks:
                pending.append(pool.submit(_encode_chunk, task))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    except BrokenProcessPool as e:
        raise DataError(
            f"tokenizer worker processes died ({e}); run from a script file whose entry point "
            f"is guarded by `if __name__ == '__main__':`, or use workers=1"
        ) from e


def _sidecar_text(result: PreprocessResult, tok_entry: str, files: list[Path]) -> str:
    meta = {
        "format": FORMAT,
        "tokenizer": tok_entry,
        "vocab_size": result.vocab_size,
        "eod_id": result.eod_id,
        "num_docs": result.num_docs,
        "num_tokens": result.num_tokens,
        "inputs": [str(f) for f in files],
    }
    return json.dumps(meta, indent=2) + "\n"


def read_metadata(prefix: str | Path) -> dict[str, object] | None:
    """The sidecar ``PREFIX.json`` as a dict, or None when absent (e.g. data made by Megatron)."""
    path = sidecar_path(prefix)
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(
            f"{path}: unreadable dataset sidecar ({e}); re-run `ptdp preprocess`"
        ) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(
            f"{path}: not a ptdp dataset sidecar (expected format {FORMAT!r}); rename or remove "
            f"it, or re-run `ptdp preprocess`"
        )
    return meta


def load_data_tokenizer(prefix: str | Path) -> Tokenizer | None:
    """The tokenizer named by the sidecar of ``prefix``, or None when there is no sidecar."""
    meta = read_metadata(prefix)
    if meta is None:
        return None
    entry = meta.get("tokenizer")
    if entry == "bytes":  # written before the byte tokenizer had a file
        tok: Tokenizer = ByteTokenizer()
    elif isinstance(entry, str):
        tok = load_tokenizer(Path(prefix).parent / entry)
    else:
        raise DataError(f"{sidecar_path(prefix)}: no 'tokenizer' entry; re-run `ptdp preprocess`")
    if (tok.vocab_size, tok.eod_id) != (meta.get("vocab_size"), meta.get("eod_id")):
        raise DataError(
            f"{sidecar_path(prefix)}: records vocab_size={meta.get('vocab_size')}, "
            f"eod_id={meta.get('eod_id')} but {tok.name} has {tok.vocab_size}, {tok.eod_id}; "
            f"the tokenizer was replaced, restore it or re-run `ptdp preprocess`"
        )
    return tok
