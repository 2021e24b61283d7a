"""How `ptdp calibrate` times a call: in batches of the same call, or one call at a time
between others, and on CUDA with events.

On CUDA, work is timed with CUDA events recorded around the calls and the host waits on the
end event (kernels are asynchronous: a host clock alone would time the launches); the
device is synchronised before each batch so no earlier work leaks in. On CPU the host
clock times the calls at torch's thread count, the one `ptdp train` runs with (it keeps
torch's default, or OMP_NUM_THREADS as torchrun sets it).

A batch figure is the time per call of the fastest of a few batches, each long enough to
dwarf the clock's resolution: other work on a shared machine only ever adds time, so the
fastest batch is the closest to what the hardware does for that call repeated. A CPU
kernel inside a training step is not repeated, though: `in_context_seconds` times it the
way a step runs it, after other kernels.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Timing:
    """How long to time each figure: `trials` batches of calls lasting `min_seconds` each."""

    min_seconds: float
    trials: int
    max_calls: int = 1000

    def calls(self, one: float) -> int:
        """Calls per batch for a call that took `one` seconds: `min_seconds` of them."""
        return max(1, min(self.max_calls, int(self.min_seconds / max(one, 1e-7))))

    def at_least(self, trials: int) -> Timing:
        """The same batches, `trials` of them or more (figures that move between batches)."""
        return replace(self, trials=max(self.trials, trials))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, timing: Timing) -> float:
    """Seconds per call of `fn` in the fastest batch (after one untimed warm-up call)."""
    fn()  # warm-up: allocations, kernel selection, lazy initialisation
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    one = time.perf_counter() - start
    calls = timing.calls(one)
    per_call = []
    for _ in range(timing.trials):
        synchronize(device)
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            per_call.append(begin.elapsed_time(end) / 1e3 / calls)  # elapsed_time is in ms
        else:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - start) / calls)
    return min(per_call)


def interleaved_seconds(
    fns: list[Callable[[], object]], device: torch.device, timing: Timing
) -> list[float]:
    """Seconds per call of each of `fns`, the fastest of `timing.trials` batches, with one
    batch of each in turn per trial: figures that are subtracted from each other then see
    the same moments of a shared machine, not one a quiet moment and the other a busy one."""
    calls = []
    for fn in fns:
        fn()  # warm-up
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        one = time.perf_counter() - start
        calls.append(timing.calls(one))
    best = [float("inf")] * len(fns)
    for _ in range(timing.trials):
        for i, (fn, n) in enumerate(zip(fns, calls)):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(n):
                fn()
            synchronize(device)
            best[i] = min(best[i], (time.perf_counter() - start) / n)
    return best


def in_context_rounds(fns: list[Callable[[], object]], timing: Timing) -> list[list[float]]:
    """CPU: seconds of every call of each of `fns`, timed on its own in rounds that call each
    fn once in turn (see `in_context_seconds`); one list per fn, round by round, so that
    calls of one round can be set against each other."""
    for fn in fns:
        fn()  # warm-up
    start = time.perf_counter()
    for fn in fns:
        fn()
    round_seconds = max(time.perf_counter() - start, 1e-7)
    budget = timing.min_seconds * timing.trials * len(fns)
    rounds = max(timing.trials, min(timing.max_calls, int(budget / round_seconds)))
    spent: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, spent):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return spent


def in_context_seconds(
    fns: list[Callable[[], object]], device: torch.device, timing: Timing
) -> list[float]:
    """CPU: seconds per call of each of `fns`, every call timed on its own in rounds that
    call each fn once in turn; each fn's median call. A training step never runs one kernel
    back to back: each call follows others that have filled the core's private caches
    with their own tensors, and runs on inputs and output buffers that are no longer there.
    Timed in batches of the same call, small kernels keep everything in L1/L2 and ran 2-8
    times faster on the Xeon of BENCHMARKS.md (a layer norm on 256 KiB: 29 us in a batch,
    45-74 us between other kernels; a residual add: 6 against 28-36 us) than between
    other kernels, as a step runs them. Rounds: as many as `timing` would spend on batches
    (at least `timing.trials`); the median, since a step's kernel is a typical call, not
    the luckiest one. `device` is unused (a CPU needs no synchronisation): the signature is
    `interleaved_seconds`', so either can time the same calls."""
    return [statistics.median(times) for times in in_context_rounds(fns, timing)]
