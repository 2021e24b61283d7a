"""Checkpoint file I/O that checksums the bytes it moves, so no file is read a second time
for its CRC-32.

Writing: `SummingWriter` is DCP's `FileSystemWriter` (several writer threads, one file
each, `__<rank>_<i>.distcp`) whose streams update a `zlib.crc32` with every block as it is
written; the record of a rank's files (ptdp/checkpoint/writer.py `record_written`) takes
those sums instead of reading the files back. A file the writer did not see (none should
exist) is still summed from disk, so the record is always whole.

Loading: `BackgroundCheck` checksums this rank's share of the files in a thread while DCP
reads the tensors (the two overlap; on a cold cache the check mostly reads what the load
brought into the page cache or the other way round), and its problems are raised, naming
the damaged file, once the load is done (ptdp/checkpoint/manager.py).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem


class _SummedFile:
    """A binary file open for writing whose every written block updates a CRC-32."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self.crc = 0
        self.nbytes = 0

    def write(self, block) -> int:
        n = self._raw.write(block)  # a buffered file writes all of it, or raises
        self.crc = zlib.crc32(block, self.crc)
        self.nbytes += len(memoryview(block).cast("B"))
        return n

    def __getattr__(self, name: str):  # tell, fileno, flush, close: the file's own
        return getattr(self._raw, name)


class _SummingFileSystem(FileSystem):
    """DCP's local file system, recording {file name: {"bytes", "crc32"}} of what it writes
    (each file is written by one writer thread; the lock guards the shared record)."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            summed = _SummedFile(raw)
            yield summed
        with self._lock:
            self.sums[Path(path).name] = {"bytes": summed.nbytes, "crc32": summed.crc}


class SummingWriter(dcp.FileSystemWriter):
    """DCP's file-system writer with `threads` writer threads (one file each) whose files
    are checksummed as they are written (`sums`)."""

    def __init__(self, path: Path, threads: int) -> None:
        super().__init__(path, thread_count=threads)
        self.fs = _SummingFileSystem()

    @property
    def sums(self) -> dict[str, dict[str, int]]:
        return self.fs.sums


class BackgroundCheck:
    """`check()` (a list of problems) run in a thread of its own from construction;
    `problems()` waits for it. Used as a context manager, the thread is always joined."""

    def __init__(self, check: Callable[[], list[str]]) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ptdp-verify")
        self._future: Future = self._pool.submit(check)

    def problems(self) -> list[str]:
        return self._future.result()

    def __enter__(self) -> BackgroundCheck:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)
