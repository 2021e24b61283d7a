"""spawn(): run a benchmark's worker on N CPU ranks (gloo) and return rank 0's result.

The multi-process benchmarks (data_parallel, tensor_parallel, pipeline_efficiency,
checkpoint) share this launcher. Rendezvous goes through a file in a fresh temporary
directory, so there are no port races; each rank runs one thread, so ranks share the cores
evenly instead of oversubscribing them; rank 0's return value comes back as JSON through a
file, because spawned processes cannot return values. `timed(fn)` is a figure of the
slowest rank. tests/dist/harness.py is the tests'
counterpart: benchmarks must not import tests, and want a result rather than pass/fail.

Import it as `benchmarks.common.spawn`: a benchmark run as `python benchmarks/<group>/x.py`
puts the repository root on sys.path first (benchmarks/README.md).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _child(
    rank: int,
    world: int,
    store: str,
    timeout_s: float,
    out: str,
    fn: Callable[..., object],
    args: tuple,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    result = fn(rank, world, *args)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()  # leave together
    dist.destroy_process_group()
    # As tests/dist/harness.py: gloo may abort in a C++ destructor at normal interpreter exit,
    # after all the work is done; leave without running the finalisers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., object], world: int, *args: object, timeout_s: float = 300.0) -> Any:
    """Run `fn(rank, world, *args)` on `world` spawned ranks; return rank 0's result.

    `fn` must be module-level (it is pickled into the children) and return something
    `json.dumps` accepts; other ranks' results are dropped. `timeout_s` bounds every
    collective. A rank's exception re-raises here (torch.multiprocessing names the rank).
    """
    # OpenMP reads its thread count when the children import torch, before set_num_threads.
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.start_processes(
                _child,
                args=(world, os.path.join(tmp, "store"), timeout_s, out, fn, args),
                nprocs=world,
                start_method="spawn",
            )
            return json.loads(Path(out).read_text())
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def timed(fn) -> float:
    """Seconds of `fn()` on the slowest rank (barriers on both sides)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()
