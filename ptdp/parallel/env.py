"""Joining a torchrun launch: read the environment torchrun sets, start the process group,
leave it (on success or failure) without hanging on a peer."""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from ptdp.errors import ConfigError, PtdpError

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets besides WORLD_SIZE, and the env:// rendezvous reads."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        """Rank and world size from torchrun's variables; one process when they are absent.

        A partial set (WORLD_SIZE > 1 without the rest, as when a variable leaks from
        another shell) is refused here rather than left to hang in the rendezvous."""
        env = os.environ
        launch = cls(
            rank=_env_int("RANK", 0),
            world_size=_env_int("WORLD_SIZE", 1),
            local_rank=_env_int("LOCAL_RANK", 0),
        )
        n = launch.world_size
        if n > 1 and not dist.is_initialized():  # a harness may have made the group itself
            missing = [name for name in TORCHRUN_VARS if not env.get(name)]
            if missing:
                raise ConfigError(
                    f"WORLD_SIZE={n} is set but {', '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not: the process was not started "
                    f"by torchrun; launch `torchrun --nproc-per-node {n} -m ptdp ...`, which "
                    "sets them all, or unset WORLD_SIZE to run as one process"
                )
        if n < 1 or not 0 <= launch.rank < n:
            raise ConfigError(
                f"RANK={launch.rank} with WORLD_SIZE={n} is not a valid launch (need "
                "0 <= RANK < WORLD_SIZE); start the processes with torchrun"
            )
        return launch


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={value!r} is not an integer; unset it or launch "
            "with torchrun, which sets it"
        ) from None


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        requested = f"cuda:{local_rank}"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("train.device = cuda but no CUDA device is visible; use cpu")
        torch.cuda.set_device(device)
    return device


def init_process_group(
    env: LaunchEnv, device: torch.device, timeout_s: float = 300
) -> dist.Store | None:
    """Start the default group (NCCL on GPUs, gloo on CPUs) unless one process or a group
    already exists (a test harness, a notebook). Returns the launcher's key-value store
    when this call created the group (the watchdog's channel), else None."""
    if env.world_size == 1 or dist.is_initialized():
        return None
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    # The env:// rendezvous init_process_group would do, kept: the store outlives it.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )
    return store


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """Flush and exit without the interpreter's finalisers. After a multi-process run, gloo
    has been seen to abort a finished process in a C++ destructor at exit ("terminate called
    without an active exception"), which the launcher would report as a failure; and after
    a failure, finalisers could block on a dead peer's connection."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def leave_failed_rank(command: str, rank: int, exc: BaseException) -> NoReturn:
    """A rank of a multi-process run failed (or stopped because another did): report it and
    exit now, with 130 for an interrupt, 2 for a ptdp error (bad input), 1 otherwise."""
    if isinstance(exc, PtdpError):
        print(f"ptdp {command}: error: rank {rank}: {exc}", file=sys.stderr)
    elif not isinstance(exc, KeyboardInterrupt):
        traceback.print_exception(exc)
    exit_now(130 if isinstance(exc, KeyboardInterrupt) else 2 if isinstance(exc, PtdpError) else 1)
