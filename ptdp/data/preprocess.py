"""Tokenize text corpora into an indexed dataset plus a JSON sidecar naming its tokenizer.

Inputs are ``.txt`` files (one document each) and JSON Lines files (``.jsonl``/``.json``, one
object per line with a ``text`` field), or folders holding them. Output, for ``PREFIX``:
``PREFIX.bin``/``PREFIX.idx`` (Megatron's format, see ``indexed.py``) and ``PREFIX.json``, which
records the tokenizer so training and generation decode with the one that encoded.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ptdp.data.indexed import IndexedWriter, optimal_dtype
from ptdp.data.tokenizers import (
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    train_bpe_from_iterator,
)
from ptdp.errors import DataError

FORMAT = "ptdp-indexed-v1"
TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".json")
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
    """Path of the tokenizer.json beside the data, or ``"bytes"``."""


def sidecar_path(prefix: str | Path) -> Path:
    """``PREFIX.json``."""
    return Path(f"{prefix}.json")


def find_input_files(inputs: Iterable[str | Path]) -> list[Path]:
    """Expand folders to their ``*.txt``/``*.jsonl``/``*.json`` files, sorted for determinism."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            suffixes = TEXT_SUFFIXES + JSON_SUFFIXES
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
            if not found:
                raise DataError(
                    f"{path}: folder holds no .txt, .jsonl or .json files; add some or pass "
                    f"the files themselves"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{path}: input not found; check the path")
    return files


def _json_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                hint = (
                    " (a JSON array? write one object per line instead)"
                    if lineno == 1 and line.lstrip().startswith("[")
                    else ""
                )
                raise DataError(
                    f"{path}:{lineno}: invalid JSON ({e.msg}){hint}; each line must be one "
                    f'JSON object like {{"text": "..."}}'
                ) from e
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(
                    f"{path}:{lineno}: no string 'text' field; each line must be one JSON "
                    f'object like {{"text": "..."}}'
                )
            yield obj["text"]


def iter_documents(files: Iterable[Path]) -> Iterator[str]:
    """Yield every non-empty document's text, in file order."""
    for path in files:
        try:
            if path.suffix in JSON_SUFFIXES:
                texts: Iterable[str] = _json_lines(path)
            else:
                # Bytes then decode: no newline translation, so "\r\n" survives the round trip.
                texts = [path.read_bytes().decode("utf-8")]
            for text in texts:
                if text:
                    yield text
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-8 ({e}); re-encode it as UTF-8") from e


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


def _check_tokenizer_slot(target: Path, prefix: Path) -> None:
    """Refuse to overwrite a tokenizer.json that another dataset's sidecar relies on."""
    if not target.exists():
        return
    for other in sorted(target.parent.glob("*.json")):
        if other == target or other == sidecar_path(prefix):
            continue
        try:
            meta = json.loads(other.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and meta.get("format") == FORMAT:
            if meta.get("tokenizer") == TOKENIZER_FILE:
                raise DataError(
                    f"{target}: already used by the dataset described in {other}, and "
                    f"replacing it would break that dataset; write to another directory"
                )


def _resolve_tokenizer(
    spec: str, files: list[Path], prefix: Path, vocab_size: int
) -> tuple[Tokenizer, str]:
    """Return the tokenizer and the sidecar's tokenizer entry, saving a tokenizer.json if any."""
    if spec == "bytes":
        return ByteTokenizer(), "bytes"
    target = prefix.parent / TOKENIZER_FILE
    if spec == "bpe":
        _check_tokenizer_slot(target, prefix)
        return train_bpe_from_iterator(iter_documents(files), vocab_size, target), TOKENIZER_FILE
    source = load_tokenizer(spec)
    if not isinstance(source, HFTokenizer):
        raise DataError(f"{spec}: expected a tokenizer.json path")
    if not (target.exists() and os.path.samefile(source.path, target)):
        if target.exists() and target.read_bytes() != source.path.read_bytes():
            _check_tokenizer_slot(target, prefix)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source.path, target)
    return HFTokenizer(target), TOKENIZER_FILE


def preprocess(
    inputs: list[str | Path],
    output_prefix: str | Path,
    tokenizer: str,
    vocab_size: int = 4096,
    workers: int = 1,
    progress: bool = True,
) -> PreprocessResult:
    """Tokenize ``inputs`` into ``PREFIX.bin``/``.idx``/``.json``; each document ends with EOD.

    Args:
        inputs: files or folders (folders: every ``*.txt``/``*.jsonl``/``*.json``, recursively).
        output_prefix: path prefix of the output files; its folder is created.
        tokenizer: ``"bytes"``, ``"bpe"`` (train one of ``vocab_size`` on the inputs) or the
            path of a tokenizer.json. Any tokenizer.json is stored as ``tokenizer.json`` beside
            the data.
        vocab_size: BPE vocabulary size; only used with ``"bpe"``.
        workers: encoding processes. The output is byte-identical for any count.
        progress: show a progress bar on stderr.
    """
    if not inputs:
        raise DataError("no inputs given; pass .txt/.jsonl/.json files or folders holding them")
    if workers < 1:
        raise DataError(f"workers={workers}; use 1 or more encoding processes")
    prefix = Path(output_prefix)
    files = find_input_files(inputs)
    if next(iter_documents(files), None) is None:
        raise DataError(
            f"no documents found in {len(files)} input file(s) (first: {files[0]}): every "
            f"input is empty; pass files with text"
        )
    tok, tok_entry = _resolve_tokenizer(str(tokenizer), files, prefix, vocab_size)
    spec = "bytes" if tok_entry == "bytes" else str(prefix.parent / TOKENIZER_FILE)
    dtype = optimal_dtype(tok.vocab_size)
    chunks = _chunks(iter_documents(files), _DOCS_PER_CHUNK)
    if workers == 1:
        results = (_encode_docs(tok, dtype.str, chunk) for chunk in chunks)
    else:
        results = _ordered_map(((spec, dtype.str, chunk) for chunk in chunks), workers)
    bar = tqdm(desc=f"tokenizing {prefix.name}", unit="doc", file=sys.stderr, disable=not progress)
    with IndexedWriter(prefix, dtype) as writer, bar:
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
        tokenizer="bytes" if tok_entry == "bytes" else spec,
    )
    _write_sidecar(result, tok_entry, files)
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


def _write_sidecar(result: PreprocessResult, tok_entry: str, files: list[Path]) -> None:
    meta = {
        "format": FORMAT,
        "tokenizer": tok_entry,
        "vocab_size": result.vocab_size,
        "eod_id": result.eod_id,
        "num_docs": result.num_docs,
        "num_tokens": result.num_tokens,
        "inputs": [str(f) for f in files],
    }
    path = sidecar_path(result.prefix)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


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
    if entry == "bytes":
        tok: Tokenizer = ByteTokenizer()
    elif isinstance(entry, str):
        tok = HFTokenizer(Path(prefix).parent / entry)
    else:
        raise DataError(f"{sidecar_path(prefix)}: no 'tokenizer' entry; re-run `ptdp preprocess`")
    if (tok.vocab_size, tok.eod_id) != (meta.get("vocab_size"), meta.get("eod_id")):
        raise DataError(
            f"{sidecar_path(prefix)}: records vocab_size={meta.get('vocab_size')}, "
            f"eod_id={meta.get('eod_id')} but {tok.name} has {tok.vocab_size}, {tok.eod_id}; "
            f"the tokenizer was replaced, restore it or re-run `ptdp preprocess`"
        )
    return tok
