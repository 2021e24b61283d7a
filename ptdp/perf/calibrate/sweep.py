"""What `ptdp calibrate` times, by device type, and the loops that time it.

A `Sweep` names the sizes to time (the hidden sizes of a layer's GEMMs, the attention
kernel's sequences and head sizes, the memory-bound kernels' inputs, the collectives'
messages) and how long to time each call; `SWEEPS` holds the defaults and `--quick`'s, for
GPUs and CPUs. The loops run the microbenchmarks (`ptdp.perf.calibrate.microbench`) over a
sweep's compute, its memory-bound kernels and its collectives (each collective fitted to
latency + bandwidth, `ptdp.perf.calibrate.fit`), one progress step per figure, which
`planned_figures` counts beforehand. What the figures become in the cluster file is
`ptdp.perf.calibrate.measure`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ptdp.parallel import comm
from ptdp.perf.calibrate import microbench as mb
from ptdp.perf.calibrate.calibration_file import CollectiveFit
from ptdp.perf.calibrate.fit import collective_bytes, fit_latency_bandwidth
from ptdp.perf.calibrate.timing import Timing


@dataclass(frozen=True)
class Sweep:
    """What to measure, and for how long."""

    hidden: tuple[int, ...]
    """Hidden sizes whose layer GEMMs are timed (on `tokens` rows)."""
    tokens: int
    attention_seq: tuple[int, ...]
    """Sequence lengths of the attention timings (batch = tokens // s, at least 1)."""
    heads: int
    head_dim: int
    attention_dims: tuple[int, ...]
    """Smaller head sizes, timed at the three shortest sequences as well."""
    cold_bytes: int
    """GEMM operands rotate through sets filling this much (past the last-level cache)."""
    stream_bytes: tuple[int, ...]
    """Input sizes of the memory-bound kernels, growing from inside the caches to well past
    the last level (a layer's tensors may fit in them); the largest gives
    `memory_efficiency`."""
    message_bytes: tuple[int, ...]
    max_call_s: float
    """Skip any GEMM or attention call predicted to take longer than this."""
    timing: Timing


KIB, MIB = 2**10, 2**20
SWEEPS: dict[tuple[str, bool], Sweep] = {
    ("cuda", False): Sweep(
        hidden=(256, 512, 1024, 2048, 4096, 8192),
        tokens=4096,
        attention_seq=(512, 1024, 2048, 4096, 8192),
        heads=16,
        head_dim=128,
        attention_dims=(64,),
        cold_bytes=128 * MIB,  # past an H100's 50 MB L2
        stream_bytes=(4 * MIB, 32 * MIB, 512 * MIB),  # to past an H100's 50 MB L2
        message_bytes=tuple(64 * KIB * 4**i for i in range(7)),  # to 256 MiB
        max_call_s=0.5,
        timing=Timing(0.05, 5),
    ),
    ("cuda", True): Sweep(
        hidden=(512, 2048, 8192),
        tokens=2048,
        attention_seq=(1024, 4096),
        heads=16,
        head_dim=128,
        attention_dims=(),
        cold_bytes=128 * MIB,
        stream_bytes=(8 * MIB, 128 * MIB),
        message_bytes=(64 * KIB, 4 * MIB, 64 * MIB),
        max_call_s=0.2,
        timing=Timing(0.01, 3),
    ),
    ("cpu", False): Sweep(
        hidden=(64, 128, 256, 512, 1024, 2048, 4096),
        tokens=1024,
        attention_seq=(128, 256, 512, 1024, 2048),
        heads=8,
        head_dim=64,
        attention_dims=(16, 32),
        cold_bytes=64 * MIB,  # past a server CPU's last-level cache
        stream_bytes=(256 * KIB, 2 * MIB, 16 * MIB, 64 * MIB),  # to past a server CPU's LLC
        message_bytes=tuple(4 * KIB * 4**i for i in range(7)),  # to 16 MiB
        max_call_s=0.25,
        timing=Timing(0.03, 7),  # short batches, many: some miss a neighbour's job
    ),
    ("cpu", True): Sweep(  # the shapes of small CPU runs (benchmarks/perf_model/prediction.py's)
        hidden=(32, 64, 128, 256),
        tokens=512,
        attention_seq=(128, 512),
        heads=4,
        head_dim=32,
        attention_dims=(16,),
        cold_bytes=64 * MIB,
        stream_bytes=(256 * KIB, 2 * MIB),
        message_bytes=(4 * KIB, 64 * KIB, 1 * MIB),
        max_call_s=0.02,
        timing=Timing(0.005, 7),  # as the default: many short batches on a shared CPU
    ),
}
"""Defaults by device type: under five minutes on one GPU or a small CPU; --quick: seconds."""


Progress = Callable[[str], None]


def measure_compute(
    device: torch.device, dtype: torch.dtype, sweep: Sweep, step: Progress
) -> tuple[list[tuple[mb.GemmShape, float]], list[tuple[mb.AttentionShape, float, float]]]:
    """GEMMs by growing hidden size, then attention by growing sequence (and at the smaller
    head sizes of `sweep.attention_dims` at the three shortest sequences), each skipped once
    the best rate so far predicts a call longer than `sweep.max_call_s` (attention at the
    shortest sequence never is). The two smallest
    hidden sizes are always timed, so that one call slowed by a neighbour's job (the best
    rate of a single figure) cannot cut the sweep short."""
    gemms: list[tuple[mb.GemmShape, float]] = []
    for i, hidden in enumerate(sweep.hidden):
        for shape in mb.layer_gemm_shapes(hidden, sweep.tokens):
            step(shape.name)
            best = max((s.flops / t for s, t in gemms), default=0.0)
            if i >= 2 and shape.flops / best > sweep.max_call_s:
                continue
            seconds = mb.gemm_seconds(shape, dtype, device, sweep.timing, sweep.cold_bytes)
            gemms.append((shape, seconds))
    attention: list[tuple[mb.AttentionShape, float, float]] = []
    rate = max(s.flops / t for s, t in gemms)
    shortest = sorted(sweep.attention_seq)[:3]
    plan = [(s, sweep.head_dim) for s in sweep.attention_seq]
    plan += [(s, d) for d in sweep.attention_dims for s in shortest]
    shapes = []
    for seq, dim in plan:
        shape = mb.AttentionShape(max(1, sweep.tokens // seq), sweep.heads, seq, dim)
        if seq == shortest[0] or 3.5 * shape.causal_flops / rate <= sweep.max_call_s:
            shapes.append(shape)  # the shortest sequence's always: cheapest of all
    step(f"attention, {len(shapes)} shapes in rounds")
    for _ in plan[1:]:  # the bar counts every planned shape
        step("attention")
    timed = mb.attention_seconds(shapes, dtype, device, sweep.timing)
    attention = [(shape, f, b) for shape, (f, b) in zip(shapes, timed)]
    return gemms, attention


def measure_stream(
    device: torch.device, dtype: torch.dtype, sweep: Sweep, step: Progress
) -> list[tuple[str, float, float]]:
    """(kernel, bytes moved, seconds) of every memory-bound kernel, and of its backward as
    `<kernel>_backward`, at every size of the sweep."""
    rows = []
    for nbytes in sweep.stream_bytes:  # the kernels of one size in rounds, then freed
        calls = [
            (kernel, nbytes, backward)
            for kernel in mb.STREAM_KERNELS
            for backward in (False, True)[: 1 + (kernel in mb.WITH_BACKWARD)]
        ]
        timed = mb.stream_seconds(calls, dtype, device, sweep.timing)
        for (kernel, _, backward), (moved, seconds) in zip(calls, timed):
            step(kernel + "_backward" * backward)
            rows.append((kernel + "_backward" * backward, moved, seconds))
    return rows


def collective_plans(world: int, per_node: int) -> list[tuple[int, int, str, tuple[str, ...]]]:
    """(ranks, stride, span, collectives) to time: groups of 2, 4, ... and all ranks of a
    node (neighbours), and one rank per node when there are several nodes; point-to-point
    once per link, between a pair of neighbours (or of nodes)."""
    sizes = sorted({n for n in (2, 4, 8, 16, 32, 64) if n < per_node} | {per_node} - {1})
    plans = [(n, 1, "node", mb.COLLECTIVES if n == 2 else mb.COLLECTIVES[:4]) for n in sizes]
    if world > per_node:
        plans.append((world // per_node, per_node, "network", mb.COLLECTIVES))
    return plans


def measure_collectives(
    device: torch.device, dtype: torch.dtype, sweep: Sweep, per_node: int, step: Progress
) -> list[CollectiveFit]:
    """Each collective of `collective_plans`, over `sweep.message_bytes`, fitted to
    latency + bandwidth. Collective: every rank calls it."""
    world = comm.world_group().size
    fits = []
    for ranks, stride, span, ops in collective_plans(world, per_node):
        group = mb.build_groups(world, ranks, stride)
        pair = group if ranks == 2 or "p2p" not in ops else mb.build_groups(world, 2, stride)
        for op in ops:
            g = pair if op == "p2p" else group
            samples = []
            for nbytes in sweep.message_bytes:
                step(f"{op} x{ranks} {span} {nbytes // KIB} KiB")
                seconds = mb.collective_seconds(op, nbytes, g, dtype, device, sweep.timing)
                samples.append((nbytes, seconds))
            n = 2 if op == "p2p" else ranks
            xs = [(collective_bytes(op, b, n), t) for b, t in samples]
            try:
                fit, note = fit_latency_bandwidth(xs), ""
            except ValueError as exc:
                fit, note = None, str(exc)
            fits.append(CollectiveFit(op, n, span, tuple(samples), fit, note))
    return fits


def planned_figures(sweep: Sweep, world: int, per_node: int, device_type: str = "cpu") -> int:
    """How many figures `calibrate` times (the progress bar's total)."""
    plans = collective_plans(world, per_node) if world > 1 else []
    comms = sum(len(ops) for *_, ops in plans) * len(sweep.message_bytes)
    kernels = len(mb.STREAM_KERNELS) + len(mb.WITH_BACKWARD)
    seqs = len(sweep.attention_seq)
    attention = seqs + len(sweep.attention_dims) * min(3, seqs)
    compute = 5 * len(sweep.hidden) + attention + kernels * len(sweep.stream_bytes) + 3
    sync = world > 1 and device_type == "cpu"  # the collectives' and the ring's waits
    return compute + comms + 2 * sync


def sweep_name(sweep: Sweep, device_type: str) -> str:
    """`quick`, `default` or `custom`: which of `SWEEPS` `sweep` is on this device type."""
    names = {SWEEPS.get((device_type, q)): n for q, n in ((True, "quick"), (False, "default"))}
    return names.get(sweep, "custom")
