"""What a rank failure is and how it is told: which errors are a peer's failure rather than
this rank's, the one line naming the rank that failed first, and the SIGKILL that ends a
silent rank on this host. Apart from the watchdog's thread (`watchdog.py`) and its store
records (`heartbeats.py`) because these are pure judgements on an exception or a failure
record, testable without a store or a thread.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import torch.distributed as dist

from ptdp.errors import PtdpError

_COMM_ERROR_MARKS = ("gloo/", "Connection reset", "Connection closed", "Timed out", "NCCL")


class PeerFailure(PtdpError):
    """Another rank failed first; this rank stopped because of it."""


def is_communication_error(exc: BaseException) -> bool:
    """A collective or receive that broke (a peer died, a timeout), not a fault of here."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_ERROR_MARKS)


def to_stderr(message: str) -> None:
    """Print now: the process may exit right after (the watchdog's forced exit)."""
    print(message, file=sys.stderr, flush=True)


def summary(exc: BaseException, limit: int = 300) -> str:
    """An exception's type and message on one line of at most about `limit` characters."""
    text = " ".join(str(exc).split()) or "(no message)"
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def describe_failure(first: dict) -> str:
    """One line naming the rank that failed first, where it was and its error."""
    who = f" (pid {first['pid']} on {first['host']})" if "pid" in first else ""
    return f"rank {first['rank']}{who} failed first, {first['where']}: {first['error']}"


def end_silent_rank(first: dict, rank: int) -> None:
    """A silent rank on this host is SIGKILLed (by rank `rank`, which read its failure): if
    it is frozen (SIGSTOP, a hung process) it cannot act on its launcher's SIGTERM, and
    torchrun would wait 30 s before its own SIGKILL and the restart. A rank that is gone is
    left alone."""
    pid, mine = first.get("pid"), first.get("host") == socket.gethostname()
    if first.get("how") != "no heartbeat" or not mine or pid in (None, os.getpid()):
        return  # (several ranks in one process: tests)
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = "?"  # no /proc: kill answers whether it exists
    if state in ("Z", "X"):  # dead already, not yet reaped by its launcher
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    to_stderr(
        f"rank {rank}: sent SIGKILL to rank {first['rank']} (pid {pid}), silent on "
        "this host, so that its launcher sees it exit"
    )
