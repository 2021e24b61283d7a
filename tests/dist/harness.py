"""run_ranks(): start N processes, join them in one gloo group, re-raise a rank's error.

Rendezvous goes through a file in a fresh temporary directory (no port races between
tests), each child runs on one thread, and a hung or crashed child fails the test with
its rank named instead of blocking the suite.

Children are forked from a forkserver that has imported torch and ptdp once (`PRELOAD`),
not spawned: a spawned child imports torch again (a 2-rank start took 2.5-5.4 s on the
2-core VM, against 0.2 s forked), and most multi-process tests start one group or more. A
forked child starts as clean as a spawned one: the server only imported modules (no CUDA
context, no process group; a fork copies only its main thread), and each child takes the
caller's environment, working directory, stdout and stderr, as a spawned child would.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A child process failed; the message carries its rank and traceback."""


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "ptdp.train.run", "tests.helpers"]
"""What the forkserver imports once for every child: torch, torch._dynamo (which the first
optimizer step imports, 0.5 s), and the trainer, which pulls in nearly all of ptdp (a test
module's own imports are what is left to each child)."""


def _child(
    index: int,
    fn: Callable[..., Any],
    world_size: int,
    store: str,
    errors: Any,
    args: tuple,
    caller: tuple[dict[str, str], str, int, int],
) -> None:
    # The forkserver's environment, cwd, stdout and stderr are those of when it started
    # (another test's, under pytest's capture): take the caller's, as a spawned child would.
    env, cwd, stdout, stderr = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for target, fd in ((1, stdout), (2, stderr)):
        os.dup2(fd, target)
        os.close(fd)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(index), WORLD_SIZE=str(world_size), LOCAL_RANK=str(index))
    backend = os.environ.get("PTDP_TEST_BACKEND", "gloo")
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=index,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        torch.manual_seed(1000 + index)
        fn(index, world_size, *args)
        if dist.is_initialized():
            dist.barrier()  # tear down together
            dist.destroy_process_group()
    except BaseException:
        errors.put((index, traceback.format_exc()))
        raise
    # Success: leave without running interpreter finalisers. With gloo, a child exiting
    # normally occasionally aborts in a C++ destructor ("terminate called without an
    # active exception"), after all its work is done and checked.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Fd:
    """A file descriptor of the caller that reaches each child as its own descriptor: pickled
    into a child's start request, it travels with it (multiprocessing's DupFd)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(wrapped: Any) -> int:
    return wrapped.detach()


MESH_FAILED = "Gloo connectFullMesh failed"
"""Gloo's error when a rank's TCP pairs do not all connect inside init_process_group: rare
and transient on a loaded machine (PyTorch's own tests see it, pytorch/pytorch#53270), and
before any test code has run."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180) -> None:
    """Run `fn(rank, world_size, *args)` in `world_size` processes; raise the first error.

    `fn` must be a module-level function (it is pickled into spawned children). A spawn
    whose group failed to connect (`MESH_FAILED`, raised by init_process_group itself) is
    started once more; any other failure is the test's.
    """
    try:
        _spawn(fn, world_size, args, timeout_s)
    except RankError as exc:
        if MESH_FAILED not in str(exc) or "init_process_group" not in str(exc):
            raise
        print(f"run_ranks: the gloo group did not connect, spawning again:\n{exc}", file=sys.stderr)
        _spawn(fn, world_size, args, timeout_s)


def _spawn(fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts, on the first spawn
    errors = ctx.SimpleQueue()
    sys.stdout.flush()
    sys.stderr.flush()
    caller = (dict(os.environ), os.getcwd(), _Fd(1), _Fd(2))
    with tempfile.TemporaryDirectory() as tmp:
        procs = mp.start_processes(
            _child,
            args=(fn, world_size, os.path.join(tmp, "store"), errors, args, caller),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not procs.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    alive = [i for i, p in enumerate(procs.processes) if p.is_alive()]
                    raise RankError(f"ranks {alive} still running after {timeout_s} s (hang?)")
        except mp.ProcessRaisedException as exc:
            first = errors.get() if not errors.empty() else (None, str(exc))
            raise RankError(f"rank {first[0]} failed:\n{first[1]}") from None
        except mp.ProcessExitedException as exc:
            raise RankError(f"rank {exc.error_index} exited with code {exc.exit_code}") from None
        finally:
            for p in procs.processes:
                if p.is_alive():
                    p.terminate()
