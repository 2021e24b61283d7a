"""Writing a file whole or not at all: the one way ptdp's writers put bytes on disk.

- `write_file(path, data)`: the bytes go to a temporary file beside `path`, are flushed
  to the disk (fsync) and renamed over `path`, so a reader sees the old file or the new
  one, never half of one; on any error the temporary file is removed and `path` is left
  as it was.
- `replacing(path)`: the same for a library that writes to a path itself (safetensors,
  a tokenizer's `save`): it writes the temporary path it is given.
- `append_line(path, line)`: one record appended (metrics.jsonl, events.jsonl); a record
  the disk had no room for is cut back off, so the file ends after its last whole line.
- `full_disk_error(exc, path, needed)`: a full disk (ENOSPC, or a quota: EDQUOT) as an
  `OutputError` naming the path, the bytes needed and the bytes free, and the fix.

Every file is created with the permissions of the user's umask (0o666 less the umask), as
`open` would make it, never the 0o600 of `tempfile.mkstemp`.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ptdp.errors import PtdpError

FULL = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a full disk (or of a full quota, which a user sees the same way)."""


class OutputError(PtdpError, OSError):
    """A file that could not be written (the disk is full); nothing partial is left.
    An OSError too, so that code catching a failed write catches it."""

    def __init__(self, message: str, code: int, path: Path) -> None:
        super().__init__(code, message, str(path))
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # so that it crosses process boundaries (spawned ranks)
        return (type(self), (self.message, self.errno, Path(self.filename)))


def size_text(n: int) -> str:
    """Bytes, with the binary unit a person reads (12,345 bytes, 4.2 MiB, 1.3 GiB)."""
    if n < 1 << 20:
        return f"{n:,} bytes"
    return f"{n / 2**20:,.1f} MiB" if n < 1 << 30 else f"{n / 2**30:,.2f} GiB"


def free_bytes(path: Path) -> int | None:
    """The bytes free on the disk holding `path` (its nearest existing folder)."""
    for folder in (path, *path.parents):
        if folder.is_dir():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def disk_full_message(path: Path, needed: int | None, what: str = "") -> str:
    """`path` could not be written for lack of space: the path, the bytes needed and free,
    what was left, and the fix."""
    path = Path(path)
    free = free_bytes(path.parent)
    need = f"{size_text(needed)} needed" if needed else "more space needed"
    room = f", {size_text(free)} free" if free is not None else ""
    return (
        f"the disk is full (no space left on device) writing {path} ({need}{room} on the "
        f"disk holding {path.parent}); {what or 'nothing partial was left'}; free space "
        "there or write elsewhere, then run the command again"
    )


def full_disk_error(
    exc: BaseException, path: Path, needed: int | None = None, what: str = ""
) -> OutputError | None:
    """The OutputError for `exc` if it is a full disk's, else None (`what`: what the
    failure left, when it is not "nothing partial"). Build it once the partial file is
    removed, so the space it names as free is the space there is."""
    if isinstance(exc, OutputError) or not isinstance(exc, OSError) or exc.errno not in FULL:
        return None
    return OutputError(disk_full_message(path, needed, what), exc.errno, Path(path))


def temporary_beside(path: Path) -> Path:
    """A name for a temporary file in `path`'s folder that no other writer uses; hidden
    and ending in .tmp, so no pattern of ptdp's (step_*, *.json) takes it for a result."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


def _umask() -> int:
    """The process's umask: from /proc (Linux), else read by setting it and putting it
    back at once (which another thread's file creation could see for that instant)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def replacing(path: str | Path, needed: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; once the block is done, it is flushed
    to disk, given the umask's permissions (a library may have made it 0o600, as
    safetensors does) and renamed over `path`. On any error it is removed and `path` is
    untouched (a full disk: an OutputError, see `full_disk_error`)."""
    path = Path(path)
    tmp = temporary_beside(path)
    try:
        yield tmp
        _fsync(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        error = full_disk_error(exc, path, needed)
        if error is None:
            raise
        raise error from exc
    finally:
        tmp.unlink(missing_ok=True)


def write_file(path: str | Path, data: bytes | str) -> Path:
    """Write `data` (text as UTF-8) as the whole content of `path`, atomically."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with replacing(path, len(raw)) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    return path


def append_line(path: str | Path, line: str) -> None:
    """Append `line` and a newline in one write to a file opened for appending (records of
    several processes do not interleave). If the disk cannot hold all of it, the file is
    cut back to its length before, so it never ends in part of a record."""
    path = Path(path)
    raw = (line + "\n").encode("utf-8")
    existed = path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.fstat(fd).st_size
        try:
            if os.write(fd, raw) < len(raw):  # the disk filled partway through
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        except OSError as exc:
            os.ftruncate(fd, start)
            if not existed:
                path.unlink(missing_ok=True)
            error = full_disk_error(exc, path, len(raw), "the record was not written")
            if error is None:
                raise
            raise error from exc
    finally:
        os.close(fd)
