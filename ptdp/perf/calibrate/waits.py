"""What a blocking collective between compute costs in place on a device whose host runs
the collectives (a CPU), beyond what the fitted links charge its bytes: the later rank is
woken and scheduled only after the earlier one went back to compute, and the
tensor-parallel autograd functions run their own Python. Measured for `ptdp calibrate` on
ptdp's own model under torchrun; every function here is collective: every rank calls it.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ptdp.parallel import comm
from ptdp.perf.calibrate.microbench import TINY_GPT, lockstep_batch, tiny_gpt
from ptdp.perf.calibrate.timing import Timing

SYNC_ROUNDS = 45
"""Rounds of `collective_sync`. On a 2-vCPU VM (2026-11-25) four back-to-back runs over 15
rounds gave 1.20-1.84 ms a call, over 45 1.72-1.84 ms; calibrations minutes apart still
differ up to twofold, as the host's load moves what a wait costs. A tensor-parallel step
of benchmarks/perf_model/prediction.py waits on it 40-80 times."""
SYNC_SPELLS = 3
"""`ptdp calibrate` takes `SYNC_ROUNDS` in this many spells, apart (before its collectives'
sweep, after it, and last): on the same VM (2026-11-27) four spells of 15 rounds, 10 s
apart, gave 1443, 1058, 890 and 1078 us a call in place in one run, and 786-1077 in two
more; in one spell, a slow one set the figure, and the files of 13 calibrations ranged
391-874 us, the high ones putting tp = 2 25% over its measured step."""


def _calls(fn: Callable[[], object], device: torch.device, timing: Timing) -> int:
    """Calls per batch: `timing.min_seconds` of them, after a warm-up."""
    lockstep_batch(fn, 1, device)
    one = lockstep_batch(fn, 1, device)
    return timing.calls(one)


def _lockstep_trials(
    fns: list[Callable[[], object]], device: torch.device, timing: Timing
) -> list[list[float]]:
    """Seconds per call of each of `fns` in each of `timing.trials` rounds (one batch of each
    in turn per round), for calls that may wait on other ranks: every batch starts after a
    barrier and is timed by its slowest rank."""
    batch = functools.partial(lockstep_batch, device=device)
    calls = [_calls(fn, device, timing) for fn in fns]
    return [[batch(fn, n) for fn, n in zip(fns, calls)] for _ in range(timing.trials)]


def collective_sync(samples: Sequence[float], dtype: torch.dtype) -> tuple[float, float, int]:
    """(per call, per layer, bytes per call): what each blocking collective of a tensor-
    parallel layer costs a step in place, what tensor parallelism over a pair of ranks adds
    to a layer's forward and backward at a negligible size, and the bytes each call reduces,
    from `sync_rounds`' samples (`ptdp calibrate` takes them in `SYNC_SPELLS` spells).

    Timed on ptdp's own GPT at `microbench.TINY_GPT` with 0 and 2 layers, forward and
    backward, at tp = 1 and at tp = 2 over two ranks: a layer at tp = 2 waits on two
    all-reduces forward and two backward (Shoeybi et al.'s f and g), each between the
    ranks' compute, so a quarter of its extra time is one such call in place: its
    transfer, the ranks' resynchronisation and the tensor-parallel autograd functions'
    Python. The figure is the median over rounds of each round's difference (its four
    batches back to back), not the fastest: a wait's cost varies from call to call and a
    step pays its typical value on every call, and pairing the batches of one round keeps a
    neighbour's job from landing on one side of the difference only.
    """
    layer = max(0.0, statistics.median(samples))
    tokens = TINY_GPT["seq_length"] * TINY_GPT["hidden_size"]
    nbytes = tokens * torch.empty((), dtype=dtype).element_size()
    return layer / 4, layer, nbytes


def sync_rounds(
    dtype: torch.dtype,
    device: torch.device,
    timing: Timing,
    pair: comm.Group,
    rounds: int = SYNC_ROUNDS,
) -> list[float]:
    """Each round's extra seconds of a tiny tp = 2 layer (`collective_sync`'s samples, at
    least `rounds` of them): a caller may pool rounds taken at different times."""
    fns: list[Callable[[], object]] = []
    for tp in (comm.Group.single(), pair):
        for layers in (0, 2):
            model, tokens = tiny_gpt(layers, device, dtype, tp)
            fns.append(lambda m=model, t=tokens: m(t, t).backward())
    return [
        ((two2 - two0) - (one2 - one0)) / 2  # per layer: 4 all-reduces
        for one0, one2, two0, two2 in _lockstep_trials(fns, device, timing.at_least(rounds))
    ]


RING_SHIFTS = 4
"""Shifts a cp = 2 ring layer waits on, forward and backward: the key/value block forward;
backward the block again, the gradient accumulator, and its hop home."""


def ring_sync(
    dtype: torch.dtype, device: torch.device, timing: Timing, pair: comm.Group
) -> tuple[float, float]:
    """(per shift, per layer) seconds: what each key/value shift of ptdp's ring attention
    costs in place at a negligible size, and what a cp = 2 layer over `pair` adds to a
    layer's forward and backward.

    `collective_sync`'s method at cp = 2: ptdp's GPT at `TINY_GPT` with 0 and 2 layers,
    forward and backward, with the ring over `pair` against without it on the same local
    tokens (half the window, as each cp rank holds), the median round's extra per layer,
    over its `RING_SHIFTS` waits. A shift is an isend and an irecv both ways at once,
    waited on between the ring's own small kernels and Python (the block plan, the
    log-sum-exp merge, the accumulator): on the Xeon of BENCHMARKS.md a layer's ring cost
    5.1 ms at this size, 1.3 ms a shift, twice a tensor-parallel all-reduce's.
    """
    from ptdp.config.sections import ModelConfig
    from ptdp.model.gpt import GPT
    from ptdp.parallel.context import split_sequence

    cfg = ModelConfig(**TINY_GPT, dropout=0.0)
    window = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length + 1), device=device)
    tokens, labels, positions = split_sequence(window[:, :-1], window[:, 1:], None, pair)
    half = replace(cfg, seq_length=tokens.shape[1])  # a cp rank's local tokens
    fns: list[Callable[[], object]] = []
    for cp, model_cfg, pos in ((comm.Group.single(), half, None), (pair, cfg, positions)):
        for layers in (0, 2):
            model = GPT(model_cfg, layers=range(layers), cp=cp).to(device=device, dtype=dtype)
            fns.append(lambda m=model, p=pos: m(tokens, labels, positions=p).backward())
    timing = timing.at_least(SYNC_ROUNDS)
    layers = [
        ((ring2 - ring0) - (one2 - one0)) / 2
        for one0, one2, ring0, ring2 in _lockstep_trials(fns, device, timing)
    ]
    layer = max(0.0, statistics.median(layers))
    return layer / RING_SHIFTS, layer


AFTER_COMPUTE_ROUNDS = 20
"""Rounds of `wait_after_compute`. On the 2-vCPU Xeon of BENCHMARKS.md three runs of 12
rounds gave 0.47, 0.67 and 0.87 ms a wait (one round's figure moved -0.9 to +2.7 ms), and
calibrations minutes apart 0.56-1.04 ms."""
AFTER_COMPUTE_CALLS = 20
"""Layers and waits per batch: a wait after compute took 0.4 ms or 2.5-8 ms, a third of
them the latter, so a batch holds enough of them that its mean is the step's."""
LAYER_CHUNK = {"hidden_size": 128, "seq_length": 128, "num_heads": 4}
"""ptdp's GPT layer at benchmarks/perf_model/prediction.py's base size, batch 2: a forward and
backward of a few milliseconds whose tensors (about 3 MiB) outgrow a core's private cache, as
the compute between a real layer's waits does."""


def wait_after_compute(
    dtype: torch.dtype, device: torch.device, timing: Timing, pair: comm.Group
) -> float:
    """Seconds a blocking collective costs in place after a layer's compute, beyond the same
    collective back to back and the compute alone: per round, a batch of one layer of
    ptdp's GPT (`LAYER_CHUNK`, forward and backward) each followed by a small all-reduce
    over `pair`, less a batch of the layers alone and a batch of the all-reduces alone; the
    median round's figure per wait.

    `collective_sync`'s tiny model has almost no compute between its waits, so its ranks
    stay in step. After milliseconds of compute they do not: on the Xeon of BENCHMARKS.md
    a small all-reduce right after a layer returned in 0.4 ms on two calls of three and in
    2.5-8 ms on the third, while the other rank had long returned from it, and the layer
    after a wait runs on caches gloo's threads have used. A step sums its waits, so it pays
    their mean: the figure is a batch's, not a single call's.
    """
    model, tokens = tiny_gpt(1, device, dtype, batch=2, **LAYER_CHUNK)
    flag = torch.zeros(512, dtype=dtype, device=device)

    def layer() -> None:
        model(tokens, tokens).backward()

    def wait() -> None:
        comm.all_reduce_sum_(flag, pair)

    def both() -> None:
        layer()
        wait()

    batch = functools.partial(lockstep_batch, calls=AFTER_COMPUTE_CALLS, device=device)
    for fn in (layer, wait, both):
        lockstep_batch(fn, 2, device)  # warm-up
    rounds = max(AFTER_COMPUTE_ROUNDS, timing.trials)
    extra = [batch(both) - batch(layer) - batch(wait) for _ in range(rounds)]
    return max(0.0, statistics.median(extra))
