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
    (each file is written by one writer thread; the lock guards the shared record).

    DCP's extra writer threads are neither joined when the calling thread fails nor heard
    from when they fail themselves (their exception is only printed). So every stream
    keeps the error that ended it in `errors`, and `close()` refuses new streams and waits
    for open ones: after it no thread writes into the directory being cleaned up."""

    def __init__(self) -> None:
        self.sums: dict[str, dict[str, int]] = {}
        self.errors: list[BaseException] = []
        self._open = 0
        self._closed = False
        self._lock = threading.Condition()

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if "w" not in mode:
            with super().create_stream(path, mode) as raw:
                yield raw
            return
        with self._lock:
            if self._closed:
                raise OSError(f"checkpoint write to {path} stopped: another writer failed")
            self._open += 1
        try:
            with super().create_stream(path, mode) as raw:
                summed = _SummedFile(raw)
                yield summed
            with self._lock:
                self.sums[Path(path).name] = {"bytes": summed.nbytes, "crc32": summed.crc}
        except BaseException as exc:
            with self._lock:
                self.errors.append(exc)
            raise
        finally:
            with self._lock:
                self._open -= 1
                self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.wait_for(lambda: self._open == 0)


class SummingWriter(dcp.FileSystemWriter):
    """DCP's file-system writer with `threads` writer threads (one file each) whose files
    are checksummed as they are written (`sums`). A write fails if any thread's did, and
    returns (or raises) only once no thread writes any more."""

    def __init__(self, path: Path, threads: int) -> None:
        # No read-ahead: items are resolved one at a time (LazySavePlanner frees each copy).
        super().__init__(path, thread_count=threads, per_thread_copy_ahead=0)
        self.fs = _SummingFileSystem()

    def write_data(self, plan, planner):
        try:
            written = super().write_data(plan, planner)
        except BaseException:
            self.fs.close()  # the other threads were not joined: stop them and wait
            raise
        if self.fs.errors:  # every thread was joined; one of them failed
            raise self.fs.errors[0]
        return written

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
