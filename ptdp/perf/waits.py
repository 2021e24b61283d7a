"""What waiting on other ranks costs on a device whose host runs the collectives (a CPU),
measured for `ptdp calibrate` on ptdp's own model under torchrun.

Two figures, both beyond what the fitted links charge the bytes:
- `collective_sync`: each blocking collective between compute costs a fixed time in place
  (the later rank is woken and scheduled only after the earlier one went back to compute;
  the tensor-parallel autograd functions' own Python);
- `lockstep_compute`: the compute between two such waits runs slower than the same
  compute back to back, by a factor. A step that waits on another rank pays, per stretch
  of compute, the slower rank's time (the larger of two noisy times is above either's
  typical one), and compute woken from a wait starts on a vCPU the host may have given
  away. Measured as a slope over two sizes, so the fixed cost per wait above cancels.

Every function here is collective: every rank calls it.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from ptdp.parallel import comm
from ptdp.perf.microbench import Timing, lockstep_batch, slowest, synchronize

SIZE = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 8, "vocab_size": 64}
"""ptdp's GPT at a size whose arithmetic is negligible: what remains is per-call cost."""
SYNC_ROUNDS = 45
"""Rounds of `collective_sync`: over 15, its median moved from 1.2 to 1.8 ms a call between
calibrations minutes apart on a 2-vCPU VM, over 45 within 1.72-1.84 ms (2026-11-25); a
tensor-parallel step of the prediction benchmark waits on it 40-80 times."""
LOCKSTEP_SIZES = (
    {"num_layers": 1, "hidden_size": 64, "num_heads": 4, "seq_length": 64, "vocab_size": 256},
    {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "seq_length": 64, "vocab_size": 256},
)
"""Two sizes of ptdp's GPT for `lockstep_compute`'s slope: a forward + backward of about 2
and 13 ms on one core of a 2020s server CPU (b 2 and 4)."""
LOCKSTEP_BATCH = (2, 4)


def _model_step(
    size: dict, batch: int, device: torch.device, dtype: torch.dtype, tp: comm.Group | None = None
) -> Callable[[], object]:
    """A forward + backward of ptdp's GPT at `size` (`tp`: its tensor-parallel group)."""
    from ptdp.config import ModelConfig
    from ptdp.model.gpt import GPT

    cfg = ModelConfig(**size, dropout=0.0)
    model = GPT(cfg, layers=range(cfg.num_layers), tp=tp).to(device=device, dtype=dtype)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), device=device)
    return lambda: model(tokens, tokens).backward()


def _waiting_batch(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Seconds per call of `calls` calls of `fn`, each after a barrier (a blocking wait on
    the other ranks), timed by the slowest rank."""
    size = comm.world_group().size
    comm.barrier(None, size)
    start = time.perf_counter()
    for _ in range(calls):
        comm.barrier(None, size)
        fn()
    synchronize(device)
    comm.barrier(None, size)
    return slowest(time.perf_counter() - start, device) / calls


def _calls(fn: Callable[[], object], device: torch.device, timing: Timing) -> int:
    """Calls per batch: `timing.min_seconds` of them, after a warm-up."""
    lockstep_batch(fn, 1, device)
    one = lockstep_batch(fn, 1, device)
    return max(1, min(timing.max_calls, int(timing.min_seconds / max(one, 1e-7))))


def _lockstep_trials(
    fns: list[Callable[[], object]], device: torch.device, timing: Timing
) -> list[list[float]]:
    """Seconds per call of each of `fns` in each of `timing.trials` rounds (one batch of each
    in turn per round), for calls that may wait on other ranks: every batch starts after a
    barrier and is timed by its slowest rank."""
    batch = functools.partial(lockstep_batch, device=device)
    calls = [_calls(fn, device, timing) for fn in fns]
    return [[batch(fn, n) for fn, n in zip(fns, calls)] for _ in range(timing.trials)]


def collective_sync(
    dtype: torch.dtype, device: torch.device, timing: Timing, pair: comm.Group
) -> tuple[float, float, int]:
    """(per call, per layer, bytes per call): what each blocking collective of a tensor-
    parallel layer costs a step in place, what tensor parallelism over `pair` adds to a
    layer's forward and backward at a negligible size, and the bytes each call reduces.

    Timed on ptdp's own GPT at `SIZE` with 0 and 2 layers, forward and backward, at tp = 1
    and at tp = 2 over `pair`: a layer at tp = 2 waits on two all-reduces forward and two
    backward (Shoeybi et al.'s f and g), each between the ranks' compute, so a quarter of
    its extra time is one such call in place: its transfer, the ranks' resynchronisation
    and the tensor-parallel autograd functions' Python. The figure is the median over
    rounds of each round's difference (its four batches back to back), not the fastest: a
    wait's cost varies from call to call and a step pays its typical value on every call,
    and pairing the batches of one round keeps a neighbour's job from landing on one side of
    the difference only.
    """
    fns = [
        _model_step({**SIZE, "num_layers": layers}, 1, device, dtype, tp)
        for tp in (comm.Group.single(), pair)
        for layers in (0, 2)
    ]
    timing = Timing(timing.min_seconds, max(timing.trials, SYNC_ROUNDS), timing.max_calls)
    layers = [
        ((two2 - two0) - (one2 - one0)) / 2  # per layer: 4 all-reduces
        for one0, one2, two0, two2 in _lockstep_trials(fns, device, timing)
    ]
    layer = max(0.0, statistics.median(layers))
    nbytes = SIZE["seq_length"] * SIZE["hidden_size"] * torch.empty((), dtype=dtype).element_size()
    return layer / 4, layer, nbytes


def lockstep_compute(dtype: torch.dtype, device: torch.device, timing: Timing) -> float:
    """How many times its back-to-back time the compute between two blocking waits takes,
    the step paying the slowest rank's (at least 1).

    ptdp's GPT at the two `LOCKSTEP_SIZES`, forward + backward, each in batches run back
    to back on every rank at once and in batches with a barrier before every call, each
    batch timed by its slowest rank, one batch of each of the four per round: the round's
    figure is (waiting large - waiting small) / (back to back large - back to back small),
    so the barrier's own cost and the per-wait cost (`collective_sync`) cancel. The median
    over rounds: a step pays the typical stretch, not the luckiest.
    """
    small, large = (
        _model_step(size, b, device, dtype) for size, b in zip(LOCKSTEP_SIZES, LOCKSTEP_BATCH)
    )
    fns = (small, large)
    calls = [_calls(fn, device, timing) for fn in fns]
    ratios = []
    for _ in range(max(timing.trials, 11)):
        free = [lockstep_batch(fn, n, device) for fn, n in zip(fns, calls)]
        waiting = [_waiting_batch(fn, n, device) for fn, n in zip(fns, calls)]
        if free[1] > free[0]:
            ratios.append((waiting[1] - waiting[0]) / (free[1] - free[0]))
    return max(1.0, statistics.median(ratios)) if ratios else 1.0
