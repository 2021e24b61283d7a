"""Joining a launch: read the environment torchrun or srun sets, start the process group,
leave it (on success or failure) without hanging on a peer.

torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) win when
WORLD_SIZE or RANK is set; otherwise an srun task reads SLURM's (ptdp/parallel/slurm.py);
otherwise the process runs alone."""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import NoReturn

import torch
import torch.distributed as dist

from ptdp.errors import ConfigError, PtdpError, report_error
from ptdp.parallel.slurm import is_srun_task, read_slurm_task

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets besides WORLD_SIZE, and the env:// rendezvous reads."""


class Launcher(Enum):
    """How the ranks meet: `ENV` through env:// (torchrun, or the variables set by hand),
    `SLURM` through tcp:// to the store rank 0 hosts (srun alone)."""

    ENV = "env"
    SLURM = "slurm"


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    launcher: Launcher = Launcher.ENV
    elastic: bool = False
    """Under torchrun's agent, which hosts the store (TORCHELASTIC_RUN_ID)."""
    restart: int = 0
    """torchrun's restart count (TORCHELASTIC_RESTART_COUNT)."""
    requeue: int = 0
    """SLURM's count of this job's requeues (SLURM_RESTART_COUNT)."""

    @property
    def is_restart(self) -> bool:
        """The launcher started this process again after a failure (torchrun
        --max-restarts) or the scheduler requeued the job (SLURM)."""
        return self.restart > 0 or self.requeue > 0

    def restart_text(self) -> str:
        """How this process was restarted, for the log and events.jsonl."""
        parts = [f"torchrun restart {self.restart}"] if self.restart else []
        parts += [f"SLURM requeue {self.requeue}"] if self.requeue else []
        return ", ".join(parts) or "first launch"

    @classmethod
    def from_environ(cls) -> LaunchEnv:
        """Rank and world size from torchrun's variables, else from srun's; one process
        when neither is set.

        A partial set (WORLD_SIZE > 1 without the rest, as when a variable leaks from
        another shell) is refused here rather than left to hang in the rendezvous."""
        env = os.environ
        if not env.get("WORLD_SIZE") and not env.get("RANK") and is_srun_task(env):
            task = read_slurm_task(env)
            return cls(
                rank=task.rank,
                world_size=task.world_size,
                local_rank=task.local_rank,
                node_rank=task.node_rank,
                master_addr=task.master_addr,
                master_port=task.master_port,
                launcher=Launcher.SLURM,
                requeue=_lenient_int("SLURM_RESTART_COUNT"),
            )
        launch = cls(
            rank=_env_int("RANK", 0),
            world_size=_env_int("WORLD_SIZE", 1),
            local_rank=_env_int("LOCAL_RANK", 0),
            node_rank=_lenient_int("GROUP_RANK"),
            master_addr=env.get("MASTER_ADDR", ""),
            master_port=_lenient_int("MASTER_PORT"),  # env:// reads it; here for messages
            elastic=bool(env.get("TORCHELASTIC_RUN_ID")),
            restart=_lenient_int("TORCHELASTIC_RESTART_COUNT"),
            requeue=_lenient_int("SLURM_RESTART_COUNT"),  # srun launching torchrun
        )
        n = launch.world_size
        if n > 1 and not dist.is_initialized():  # a harness may have made the group itself
            missing = [name for name in TORCHRUN_VARS if not env.get(name)]
            if missing:
                under_srun = (
                    "; under srun, unset WORLD_SIZE: ptdp reads SLURM_PROCID and SLURM_NTASKS"
                    if is_srun_task(env)
                    else ""
                )
                raise ConfigError(
                    f"WORLD_SIZE={n} is set but {', '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} not: the process was not started "
                    f"by torchrun; launch `torchrun --nproc-per-node {n} -m ptdp ...`, which "
                    f"sets them all, or unset WORLD_SIZE to run as one process{under_srun}"
                )
        if n < 1 or not 0 <= launch.rank < n:
            raise ConfigError(
                f"RANK={launch.rank} with WORLD_SIZE={n} is not a valid launch (need "
                "0 <= RANK < WORLD_SIZE); start the processes with torchrun"
            )
        return launch

    def store_host(self) -> str:
        """Who hosts the launcher's key-value store, for the message when it is gone."""
        where = f"{self.master_addr or '?'}:{self.master_port or '?'}"
        if self.elastic:
            return f"the torchrun agent at {where} (the first node)"
        return f"rank 0 at {where}"


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


def _lenient_int(name: str) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    asked = requested
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        # srun --gpus-per-task=1 (or CUDA_VISIBLE_DEVICES per process) leaves each process
        # one visible GPU, index 0 whatever its local rank.
        one = torch.cuda.is_available() and torch.cuda.device_count() == 1
        requested = f"cuda:{0 if one else local_rank}"
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ConfigError(
            f"device '{requested}' is not one torch knows; use auto, cpu or cuda"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device '{asked}' asked for, but this torch ({torch.__version__}) sees no "
                "CUDA device; use cpu (--train.device cpu, or --device cpu for generate)"
            )
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
    # The rendezvous init_process_group would do, kept: the store outlives it. env:// reads
    # torchrun's variables (and finds its agent's store); srun's are read into `env`.
    if env.launcher is Launcher.SLURM:
        store, rank, world_size = _meet_at_rank0(env, timeout)
    else:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # A restarted run meets in the same store as the run before it when torchrun's static
    # rendezvous (--master-addr/--master-port) keeps it: keys of its own, so that no rank
    # reads the address of a process of the previous attempt.
    group_store = dist.PrefixStore(f"ptdp/attempt{env.restart}/", store) if env.restart else store
    dist.init_process_group(
        backend=backend, store=group_store, rank=rank, world_size=world_size, timeout=timeout
    )
    return store


def _meet_at_rank0(env: LaunchEnv, timeout: timedelta) -> tuple[dist.Store, int, int]:
    """The store rank 0 hosts at master_addr:master_port; the others connect to it."""
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    url = f"tcp://{host}:{env.master_port}"
    try:
        return next(dist.rendezvous(url, rank=env.rank, world_size=env.world_size, timeout=timeout))
    except (RuntimeError, ValueError) as exc:  # DistStoreError (a timeout) is a RuntimeError
        raise ConfigError(
            f"rank {env.rank} of {env.world_size} (node {env.node_rank}) could not meet the "
            f"others at the store of {env.store_host()} within "
            f"{timeout.total_seconds():g} s ({' '.join(str(exc).split())[:200]}): start all "
            f"SLURM_NTASKS={env.world_size} tasks with srun (`ptdp train` run directly in the "
            "batch script is one process), check that the other nodes reach that host, or set "
            "MASTER_PORT if another job holds the port"
        ) from exc


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
        report_error(f"ptdp {command}: error: rank {rank}: {exc}")
    elif isinstance(exc, KeyboardInterrupt):
        if str(exc):  # what a second Ctrl-C lost
            report_error(f"ptdp {command}: interrupted: rank {rank}: {exc}")
    else:
        traceback.print_exception(exc)
    exit_now(130 if isinstance(exc, KeyboardInterrupt) else 2 if isinstance(exc, PtdpError) else 1)
