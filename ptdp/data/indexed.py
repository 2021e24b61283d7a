"""Megatron-LM's memory-mapped indexed dataset: a ``.bin`` of tokens plus an ``.idx`` index.

Reading and writing Megatron's exact layout lets users reuse data preprocessed by Megatron-LM
(``tools/preprocess_data.py``) and lets Megatron read ours. ``.idx``, all little-endian:

    magic          9 bytes  b"MMIDIDX\\x00\\x00"
    version        uint64   1
    dtype code     uint8    see ``DTYPE_CODES``
    N              uint64   number of sequences
    D              uint64   number of document indices (documents + 1)
    sizes          int32[N] tokens per sequence
    pointers       int64[N] byte offset of each sequence in ``.bin``
    doc_idx        int64[D] 0, then the sequence index where each document ends

``.bin`` is the raw concatenated token array. Our writer stores one sequence per document, so
``doc_idx == [0, 1, ..., N]``.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import numpy as np

from ptdp.errors import DataError
from ptdp.files import full_disk_error, size_text

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's codes; the numbers are part of the file format.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF: dict[np.dtype, int] = {dt: code for code, dt in DTYPE_CODES.items()}
# magic, version (Q), dtype code (B), N (Q), D (Q).
_HEADER = struct.Struct("<9sQBQQ")
_COPY_CHUNK = 1 << 24


def optimal_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype Megatron would pick: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def bin_path(prefix: str | Path) -> Path:
    """``PREFIX.bin``; a suffix is appended, never substituted, so dots in prefixes survive."""
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    """``PREFIX.idx``."""
    return Path(f"{prefix}.idx")


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


class IndexedWriter:
    """Streams documents into ``PREFIX.bin.tmp``; ``finalize`` writes the index and renames.

    Writing under temporary names means a crashed or interrupted run never leaves a
    half-written dataset under the real name. As a context manager it finalizes on success
    and deletes the temporary files on error.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type | str) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no Megatron code; use one of {_CODE_OF}")
        self._bin = bin_path(prefix)
        self._idx = idx_path(prefix)
        self._bin.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(_tmp(self._bin), "wb")  # noqa: SIM115 - closed in finalize/abort
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]
        self._finalized = False
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._range = None

    @property
    def num_docs(self) -> int:
        """Documents written so far."""
        return len(self._doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens written so far."""
        return sum(self._sizes)

    def add_document(self, tokens: np.ndarray | Sequence[int]) -> None:
        """Append one document as one sequence."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {arr.shape}")
        if self._range is not None and arr.size and arr.dtype != self.dtype:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._range[0] or hi > self._range[1]:
                raise DataError(
                    f"{self._bin}: token ids {lo}..{hi} do not fit in {self.dtype}; "
                    f"write with a wider dtype, e.g. optimal_dtype(vocab_size)"
                )
        data = np.ascontiguousarray(arr, dtype=self.dtype).tobytes()
        with self._disk_full(self._bin, self._file.tell() + len(data)):
            self._file.write(data)
        self._sizes.append(int(arr.size))
        self._doc_idx.append(len(self._sizes))

    def merge(self, prefix: str | Path) -> None:
        """Append a finished dataset (e.g. one worker's shard), keeping its document bounds."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(
                f"{idx_path(prefix)}: dtype {other.dtype} differs from {self.dtype} being "
                f"written to {self._bin}; re-run `ptdp preprocess` with the same tokenizer"
            )
        offset = len(self._sizes)
        self._sizes.extend(int(n) for n in other.sizes)
        self._doc_idx.extend(offset + int(d) for d in other.doc_idx[1:])
        with open(bin_path(prefix), "rb") as src, self._disk_full(self._bin):
            shutil.copyfileobj(src, self._file, _COPY_CHUNK)

    def finalize(self) -> None:
        """Write the index and move both files to their real names."""
        if self._finalized:
            return
        with self._disk_full(self._bin):
            self._file.close()  # writes what is buffered
        sizes = np.asarray(self._sizes, dtype=np.int64)
        if sizes.size and sizes.max() > np.iinfo(np.int32).max:
            raise DataError(f"{self._bin}: a document exceeds 2**31 tokens; split it")
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.asarray(self._doc_idx, dtype=np.int64)
        with self._disk_full(self._idx), open(_tmp(self._idx), "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(sizes), len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
        # .bin first: a reader never sees a new .idx paired with an old .bin.
        os.replace(_tmp(self._bin), self._bin)
        os.replace(_tmp(self._idx), self._idx)
        self._finalized = True

    @contextmanager
    def _disk_full(self, path: Path, needed: int | None = None) -> Iterator[None]:
        """A full disk: the temporary files are removed and the error names `path` (and at
        least the bytes `needed` in all)."""
        closed = self._file.closed
        written = "" if closed else f"{size_text(self._file.tell())} of tokens written; "
        what = f"{written}the temporary files were removed and {self.prefix}.* is as it was"
        try:
            yield
        except OSError as exc:
            if full_disk_error(exc, path) is None:
                raise
            self.abort()  # first, so the message counts the space it frees
            raise full_disk_error(exc, path, needed, what) from exc

    def abort(self) -> None:
        """Close and delete the temporary files; the real names are left untouched."""
        try:
            self._file.close()
        except OSError:
            pass  # a full disk cannot take the buffered rest: the file is removed anyway
        for path in (_tmp(self._bin), _tmp(self._idx)):
            path.unlink(missing_ok=True)
        self._finalized = True

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin``/``PREFIX.idx``, validated on open.

    Attributes:
        dtype: token dtype.
        sizes: int32[N] tokens per sequence.
        pointers: int64[N] byte offsets into ``.bin``.
        doc_idx: int64[D] document boundaries in sequence indices.
        num_tokens: total tokens in ``.bin``.
        tokens: flat 1-D memmap of the whole ``.bin``.
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        self.bin_path = bin_path(prefix)
        self.idx_path = idx_path(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError(
                    f"{path}: dataset file not found; create the dataset with `ptdp preprocess` "
                    f"or point the data prefix at an existing PREFIX.bin/PREFIX.idx pair"
                )
        self._read_index()
        self._map_bin()

    def _fail(self, path: Path, problem: str) -> DataError:
        return DataError(
            f"{path}: {problem}; the dataset is corrupt or incomplete, "
            f"re-create it with `ptdp preprocess`"
        )

    def _read_index(self) -> None:
        path = self.idx_path
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
            raise self._fail(path, "not a Megatron indexed dataset index (bad magic bytes)")
        if len(head) < _HEADER.size:
            raise self._fail(path, f"truncated header ({len(head)} of {_HEADER.size} bytes)")
        _, version, code, n, d = _HEADER.unpack(head)
        if version != VERSION:
            raise DataError(
                f"{path}: index version {version} is not supported (only {VERSION}); "
                f"re-create the dataset with `ptdp preprocess`"
            )
        if code not in DTYPE_CODES:
            raise self._fail(path, f"unknown dtype code {code}")
        self.dtype = DTYPE_CODES[code]
        expected = _HEADER.size + 4 * n + 8 * n + 8 * d
        # Megatron's multimodal variant appends int8[N] sequence modes; tolerate exactly that.
        if file_size < expected:
            raise self._fail(path, f"truncated: {file_size} bytes, header implies {expected}")
        if file_size not in (expected, expected + n):
            raise self._fail(path, f"{file_size - expected} unexpected trailing bytes")
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        offset = _HEADER.size
        self.sizes = np.frombuffer(buf, dtype="<i4", count=n, offset=offset)
        offset += 4 * n
        self.pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=offset)
        offset += 8 * n
        self.doc_idx = np.frombuffer(buf, dtype="<i8", count=d, offset=offset)
        self._check_index(path, n, d)

    def _check_index(self, path: Path, n: int, d: int) -> None:
        if n and int(self.sizes.min()) < 0:
            raise self._fail(path, "negative sequence length")
        expected = np.zeros(n, dtype=np.int64)
        np.cumsum(self.sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=expected[1:])
        if not np.array_equal(expected, self.pointers):
            bad = int(np.flatnonzero(expected != self.pointers)[0])
            raise self._fail(
                path,
                f"sequence pointers inconsistent with lengths (sequence {bad} points at byte "
                f"{int(self.pointers[bad])}, expected {int(expected[bad])})",
            )
        docs = self.doc_idx
        if d < 1 or docs[0] != 0 or docs[-1] != n or bool(np.any(np.diff(docs) < 0)):
            raise self._fail(path, f"document index is not 0..{n} ascending")
        self.num_tokens = int(self.sizes.sum(dtype=np.int64))

    def _map_bin(self) -> None:
        path = self.bin_path
        size = path.stat().st_size
        expected = self.num_tokens * self.dtype.itemsize
        if size != expected:
            raise self._fail(
                path,
                f"{size} bytes but {self.idx_path.name} lists {self.num_tokens} tokens of "
                f"{self.dtype} = {expected} bytes (truncated or mismatched .bin)",
            )
        # np.memmap cannot map an empty file.
        if size == 0:
            self.tokens: np.ndarray = np.empty(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self.sizes)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix}")
        i %= n
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sizes[i])]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({str(self.prefix)!r}, sequences={len(self)}, "
            f"tokens={self.num_tokens}, dtype={self.dtype})"
        )
