"""One run per run directory.

A live run holds an OS file lock (`flock`) on RUN_DIR/ptdp.lock for its whole life: rank 0
takes it, before any process group, so every rank of one launch shares it and a second
training into the directory is refused, naming the holder's process. The kernel releases
the lock when the process ends, however it ends, so a crash never leaves a stale lock; the
file itself is removed on a clean exit and harmless when left.

A new run (not resuming) into a directory that holds a previous run's files is refused with
the fix, or, with `train.overwrite`, those files are deleted first; nothing of them is ever
truncated by a new run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path

from ptdp.errors import CheckpointError, ConfigError

LOCK_FILE = "ptdp.lock"
RUN_FILES = (
    "config.toml", "metrics.jsonl", "events.jsonl", "checkpoints", "tensorboard", "wandb",
    "timeline.json", "timeline.png",
)  # fmt: skip
"""What a training run writes into its run directory (a `ptdp simulate` beside it is not
one)."""


class RunDirLock:
    """The lock on a run directory, held until `release()` (or the process's end)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None
        self.unsupported = ""
        """Why no lock could be taken: the filesystem has none (Lustre without -o flock)."""
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # never truncates
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ConfigError(self._held(run_dir)) from None
                self.unsupported = exc.strerror or str(exc)
                return
            if _same_file(fd, self.path):  # not a file a releasing holder just removed
                self.fd = fd
            else:
                os.close(fd)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(self.fd, 0)
        os.write(self.fd, (json.dumps(holder) + "\n").encode())

    def _held(self, run_dir: Path) -> str:
        try:
            holder = json.loads(self.path.read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
            who = f"process {holder['pid']} on {holder['host']}, running since {since}"
        except (OSError, ValueError, KeyError, TypeError):
            who = "a process that is still starting"
        return (
            f"train.run_dir {run_dir} is in use by another training ({who}), which holds "
            f"{self.path}; wait for that run to end or stop it, or choose another "
            "--train.run_dir (nothing in the directory was changed)"
        )

    def release(self) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking: a waiter then sees a new file
        os.close(self.fd)
        self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def hold_run_dir(run_dir: Path, rank: int) -> RunDirLock | None:
    """Rank 0 locks the run directory (it exists); the other ranks share rank 0's lock."""
    return RunDirLock(run_dir) if rank == 0 else None


def previous_run(run_dir: Path) -> list[str]:
    """The names of a previous run's files in `run_dir`."""
    return [name for name in RUN_FILES if _present(run_dir / name)]


def _present(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def refuse_previous_run(run_dir: Path, overwrite: bool, has_checkpoint: bool) -> list[str]:
    """For a new run: the previous run's files to delete (`overwrite`), or a refusal."""
    found = previous_run(run_dir)
    if not found or overwrite:
        return found
    what = "checkpoints" if has_checkpoint else f"a previous run's {', '.join(found)}"
    raise CheckpointError(
        f"{run_dir} already holds {what}; pass --resume (or --train.resume always) to continue "
        "that run or choose another --train.run_dir; --train.overwrite true deletes that run's "
        "files and starts afresh (nothing was changed)"
    )


def delete_previous_run(run_dir: Path, names: list[str]) -> None:
    """`train.overwrite`: rank 0, holding the lock, deletes the previous run's files."""
    for name in names:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def check_init_source(run_dir: Path, init_from: str, names: list[str]) -> None:
    """`train.overwrite` would delete the weights checkpoint.init_from names."""
    source = Path(init_from).resolve()
    for name in names:
        if source.is_relative_to((run_dir / name).resolve()):
            raise ConfigError(
                f"checkpoint.init_from = {init_from} lies in {run_dir / name}, which "
                "train.overwrite would delete; copy it elsewhere first, or continue that run "
                "with --resume"
            )
