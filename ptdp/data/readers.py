"""Documents from the corpus formats `ptdp preprocess` reads, one text per document.

- ``.txt``: the whole file is one document.
- ``.jsonl``/``.json``: JSON Lines, one object per line; the text is the ``text_key`` field.
- ``.parquet``, ``.arrow`` (Arrow IPC file or stream, as Hugging Face ``datasets`` caches):
  one document per row, the ``text_key`` column.
- A folder written by ``datasets.Dataset.save_to_disk``: one document per row, the same
  column, read with ``datasets.load_from_disk``.

Tables need pyarrow and saved datasets need ``datasets`` (``pip install 'ptdp[data]'``); both
are imported only when such an input is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ptdp.errors import DataError

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".json")
TABLE_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + TABLE_SUFFIXES
_ROWS_PER_BATCH = 1024


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` (it holds state.json and dataset_info.json)."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _refuse_dataset_dict(path: Path) -> None:
    """A ``DatasetDict`` folder holds one saved dataset per split: which one is ambiguous."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir() and is_saved_dataset(p))
        first = path / splits[0] if splits else path / "train"
        raise DataError(
            f"{path}: a DatasetDict saved by save_to_disk (splits: {', '.join(splits)}); pass "
            f"one split's folder, e.g. --input {first}"
        )


def _walk(folder: Path) -> list[Path]:
    """Corpus files under ``folder`` in sorted path order; a saved dataset is one entry."""
    found: list[Path] = []
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            _refuse_dataset_dict(path)
            found.extend([path] if is_saved_dataset(path) else _walk(path))
        elif path.is_file() and path.suffix in SUFFIXES:
            found.append(path)
    return found


def find_input_files(inputs: Iterable[str | Path]) -> list[Path]:
    """Expand folders to their corpus files (sorted, for determinism); a saved dataset folder
    stays one input."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            _refuse_dataset_dict(path)
            if is_saved_dataset(path):
                files.append(path)
                continue
            found = _walk(path)
            if not found:
                raise DataError(
                    f"{path}: folder holds no {', '.join(SUFFIXES)} files or saved datasets; "
                    f"add some or pass the files themselves"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"{path}: input not found; check the path")
    return files


def _json_lines(path: Path, text_key: str) -> Iterator[str]:
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
                    f'JSON object like {{"{text_key}": "..."}}'
                ) from e
            if not isinstance(obj, dict) or not isinstance(obj.get(text_key), str):
                keys = f" (its keys: {', '.join(obj)})" if isinstance(obj, dict) else ""
                raise DataError(
                    f"{path}:{lineno}: no string '{text_key}' field{keys}; each line must be "
                    f'one JSON object like {{"{text_key}": "..."}}, or pick the field with '
                    f"--text-key"
                )
            yield obj[text_key]


def _import(module: str, what: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        raise DataError(
            f"reading {what} needs the '{module.split('.')[0]}' package: pip install 'ptdp[data]'"
        ) from e


def _require_column(names: list[str], text_key: str, where: str) -> None:
    if text_key not in names:
        raise DataError(
            f"{where}: no column '{text_key}' (columns: {', '.join(names)}); pick the text "
            f"column with --text-key"
        )


def _column_texts(batches: Iterable[Any], text_key: str, where: str) -> Iterator[str]:
    """The ``text_key`` column of Arrow record batches or tables, refusing non-text cells."""
    pa = _import("pyarrow", where)
    names_of_text = ("is_string", "is_large_string", "is_string_view")  # the last: pyarrow 16+
    is_text = [getattr(pa.types, name) for name in names_of_text if hasattr(pa.types, name)]
    row = 0
    for batch in batches:
        names = batch.schema.names
        _require_column(names, text_key, where)
        column = batch.column(names.index(text_key))
        if not any(test(column.type) for test in is_text):
            raise DataError(
                f"{where}: column '{text_key}' holds {column.type}, not text; pick the text "
                f"column with --text-key"
            )
        # Offsets and UTF-8 checked before Python reads them: a damaged memory-mapped file
        # (a saved dataset, an Arrow stream) would otherwise crash the process.
        column.validate(full=True)
        for i, text in enumerate(column.to_pylist()):
            if text is None:
                raise DataError(f"{where}: row {row + i} has no '{text_key}' (null); drop it")
            yield text
        row += len(column)


@contextmanager
def _damaged(path: Path, what: str) -> Iterator[None]:
    """pyarrow's errors on a damaged table (a truncated file, a corrupt page or message, text
    that is not UTF-8, which Arrow's string columns always are) as a DataError naming it."""
    pa = _import("pyarrow", f"{path} ({what})")
    try:
        yield
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        detail = " ".join(str(e).split())[:200]
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise DataError(f"{path}: cannot be read ({detail}); check the path") from e
        raise DataError(
            f"{path}: the {what} is damaged or cut short ({detail}); re-create or "
            "re-download it, or leave it out of --input"
        ) from e


def _parquet_texts(path: Path, text_key: str) -> Iterator[str]:
    pq = _import("pyarrow.parquet", f"{path} (Parquet)")
    with _damaged(path, "Parquet file"), pq.ParquetFile(path) as f:
        _require_column(f.schema_arrow.names, text_key, str(path))
        batches = f.iter_batches(batch_size=_ROWS_PER_BATCH, columns=[text_key])
        yield from _column_texts(batches, text_key, str(path))


def _arrow_texts(path: Path, text_key: str) -> Iterator[str]:
    """An Arrow IPC file, or an IPC stream (the format of Hugging Face ``datasets`` caches)."""
    pa = _import("pyarrow", f"{path} (Arrow)")
    with _damaged(path, "Arrow file"), pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
            batches: Iterable[Any] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid as e:
            source.seek(0)
            if source.read(6) == b"ARROW1":
                raise  # an IPC file's magic: a damaged file, not a stream
            source.seek(0)
            try:
                batches = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                raise DataError(
                    f"{path}: not an Arrow IPC file or stream ({e}); pass .arrow files written "
                    f"by pyarrow or Hugging Face datasets"
                ) from e
        yield from _column_texts(batches, text_key, str(path))


def _saved_dataset_texts(path: Path, text_key: str) -> Iterator[str]:
    datasets = _import("datasets", f"{path} (a saved Hugging Face dataset)")
    with _damaged(path, "saved dataset"):
        ds = datasets.load_from_disk(str(path))
        _require_column(ds.column_names, text_key, str(path))
        # Arrow tables of rows in the dataset's order (a saved selection or shuffle included).
        tables = ds.select_columns([text_key]).with_format("arrow").iter(batch_size=_ROWS_PER_BATCH)
        yield from _column_texts(tables, text_key, str(path))


def text_bytes_bound(files: Iterable[Path]) -> int | None:
    """At least the bytes of text `files` hold, from their sizes without reading them (a BPE
    learns at most that many merges from them): a text or JSON file's size, a Parquet file's
    uncompressed data size; None with an Arrow file or a saved dataset (maybe compressed)."""
    total = 0
    for path in files:
        if path.is_dir() or path.suffix == ".arrow":
            return None
        if path.suffix != ".parquet":
            total += path.stat().st_size
            continue
        pq = _import("pyarrow.parquet", f"{path} (Parquet)")
        try:
            meta = pq.read_metadata(path)
        except (OSError, ValueError):  # damaged: reading it says so
            return None
        total += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return total


def iter_documents(files: Iterable[Path], text_key: str = "text") -> Iterator[str]:
    """Yield every non-empty document's text, in file order (rows in table order)."""
    for path in files:
        try:
            if path.is_dir():
                texts: Iterable[str] = _saved_dataset_texts(path, text_key)
            elif path.suffix in JSON_SUFFIXES:
                texts = _json_lines(path, text_key)
            elif path.suffix == ".parquet":
                texts = _parquet_texts(path, text_key)
            elif path.suffix == ".arrow":
                texts = _arrow_texts(path, text_key)
            else:
                # Bytes then decode: no newline translation, so "\r\n" survives the round trip.
                texts = [path.read_bytes().decode("utf-8")]
            for text in texts:
                if text:
                    yield text
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-8 ({e}); re-encode it as UTF-8") from e
