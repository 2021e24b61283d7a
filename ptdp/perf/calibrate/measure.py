"""`ptdp calibrate`: measure this machine and fit the performance model's constants.

What is measured (ptdp/perf/calibrate/microbench.py) and what it becomes in the cluster TOML that
`ptdp simulate --device FILE` and `ptdp plan --device FILE` read (ptdp/perf/cost/hardware.py):

- the GEMMs of a transformer layer (QKV, projection, MLP in and out, a weight gradient)
  over hidden sizes, their operands rotating through sets past the last-level cache (in a
  step a weight was last touched a layer pass ago) -> `gemm_curve_flops` /
  `gemm_curve_efficiency`, a non-decreasing
  efficiency curve over GEMM FLOPs (ptdp/perf/calibrate/fit.py), and `gemm_efficiency`, its top;
- causal fused attention (torch SDPA) over sequence lengths and head sizes ->
  `attention_curve_*`, forward and backward efficiency (each non-decreasing) over the
  causal FLOPs per sequence and head, and `attention_efficiency` /
  `attention_backward_ratio` at the longest sequence;
- norms, activations, softmax, a residual add and the AdamW step, and the input gradients
  of the first five, from inside the caches to past them -> `[device.achieved.memory_kernels]`,
  each kernel's bandwidth over the bytes a call moves (ptdp/perf/cost/kernels.py prices a layer's
  kernels one by one with it), and `memory_efficiency`, the median forward kernel past the
  caches (against the nominal bandwidth of the base cluster, or as the bandwidth itself
  where there is none, on CPUs);
- a one-element kernel -> `kernel_overhead_us`;
- on a CPU, ptdp's own model at a negligible size (0 and 2 layers, forward and backward)
  -> `layer_overhead_us` and `head_overhead_us`: what Python, module calls and autograd
  cost per layer and per embedding + head + loss, beyond the kernels timed above;
- on a CPU, ptdp's optimizer step (gradient norm, clipping, AdamW, the 16-bit copy) on
  the same model at 0 and 2 layers -> `optimizer_overhead_us`: per step and per parameter
  tensor, beyond the bytes it moves (a CPU's foreach AdamW runs each op tensor by tensor);
- ptdp's zero-bubble split backward (B, then W's deferred weight-gradient GEMMs)
  against autograd's fused one on two layers (on a GPU, two of the 1.3B GPT's) ->
  `split_backward_ratio` (`wgrad_cost.split_backward_ratio`);
- on CPUs under torchrun, the same model at tp = 2 over two ranks against tp = 1 ->
  `collective_sync_us`: what each blocking collective between compute costs in place
  beyond what the fitted link charges it (the ranks' resynchronisation, the
  tensor-parallel autograd functions; `waits.collective_sync`, its rounds taken in
  three spells over the run); one layer at the
  benchmark's base size, each followed by a small all-reduce, against the two apart ->
  `wait_after_compute_us`: what such a wait costs more after a layer's compute, the
  ranks then out of step (`waits.wait_after_compute`); the same model at cp = 2 against
  none -> `ring_sync_us`: what each key/value shift of ring attention costs beyond what
  the point-to-point fit charges it (`waits.ring_sync`);
- under torchrun, all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point
  over message sizes and group sizes -> the `[node]` link (groups inside a node) and the
  `[network]` link (one rank per node, when there are several nodes) as latency +
  bandwidth, a least squares fit over every ring collective of the link's groups; each
  collective's own fit is kept under `[calibration]`, and written into its link as
  `<op>_latency_us` / `<op>_bandwidth_gb_s` (the all-to-all's prices expert parallelism's
  dispatch and combine, `ptdp.perf.cost.experts`).

A single process keeps the base cluster's links and node size (`--base`, default: the
built-in file of this GPU); with none (a CPU), its links are marked not measured.
Peaks: a GPU in ptdp/perf/cost/flops.py keeps its datasheet peak; any other device (a CPU) gets
the best GEMM rate measured as its peak, so its curve tops out at 1.
"""

from __future__ import annotations

import datetime
import os
import platform
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ptdp.config.sections import ModelConfig
from ptdp.errors import ConfigError
from ptdp.files import write_file
from ptdp.outputs import check_output_file
from ptdp.parallel import comm
from ptdp.perf.calibrate import microbench as mb
from ptdp.perf.calibrate import waits
from ptdp.perf.calibrate.calibration_file import Calibration, CollectiveFit, render_toml, summary
from ptdp.perf.calibrate.fit import LinkFit, collective_bytes, fit_latency_bandwidth, monotone_curve
from ptdp.perf.calibrate.timing import Timing
from ptdp.perf.calibrate.wgrad_cost import split_backward_ratio
from ptdp.perf.cost.context import kv_block_bytes
from ptdp.perf.cost.flops import DENSE_PEAK_TFLOPS, device_kind
from ptdp.perf.cost.hardware import GIB, System, load_system, system_for_device_name


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


def _link_fits(fits: list[CollectiveFit]) -> dict[str, tuple[LinkFit | None, str]]:
    """One latency + bandwidth per link: the fit over every all-reduce, all-gather and
    reduce-scatter sample of its groups (the ring collectives whose cost formula the model
    applies to the link; point-to-point, often far cheaper per call on gloo, and the
    all-to-all keep their own fits, written as the link's `<op>_*` keys, and enter only
    when nothing else was measured)."""
    links: dict[str, tuple[LinkFit | None, str]] = {}
    for span in ("node", "network"):
        chosen = [f for f in fits if f.span == span and f.op not in ("p2p", "all_to_all")]
        chosen = chosen or [f for f in fits if f.span == span]
        xs = [(collective_bytes(f.op, n, f.ranks), t) for f in chosen for n, t in f.samples]
        if not xs:
            continue
        ops = sorted({f"{f.op} x{f.ranks}" for f in chosen})
        try:
            links[span] = (fit_latency_bandwidth(xs), "measured: " + ", ".join(ops))
        except ValueError as exc:  # too noisy to fit: say so, keep the base's or a placeholder
            warnings.warn(f"{span} link not fitted: {exc}", stacklevel=2)
    return links


def calibrate(
    device: torch.device,
    sweep: Sweep,
    *,
    precision: str = "auto",
    base: System | None = None,
    progress: bool = True,
) -> Calibration:
    """Measure `device` (and, with a process group, the links) and fit the constants.

    Collective over the world when a process group exists: every rank calls it.
    """
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    world = comm.world_group()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world.size))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    total = planned_figures(sweep, world.size, per_node, device.type)
    bar = tqdm(
        total=total,
        desc="calibrating",
        unit="figure",
        disable=not progress or world.rank != 0 or None,
    )

    def step(what: str) -> None:
        bar.set_postfix_str(what, refresh=False)
        bar.update()

    try:
        gemms, attention = measure_compute(device, dtype, sweep, step)
        stream = measure_stream(device, dtype, sweep, step)
        step("kernel launch")
        launch = mb.launch_seconds(device, sweep.timing)
        step("framework overhead")
        framework = (
            mb.framework_overhead(dtype, device, sweep.timing) if device.type == "cpu" else None
        )
        optimizer = (
            mb.optimizer_overhead(dtype, device, sweep.timing) if device.type == "cpu" else None
        )
        step("split backward")
        split = split_backward_ratio(dtype, device, sweep.timing)  # GPUs: the 1.3B layer
        waited = world.size > 1 and device.type == "cpu"  # the waits' own figures
        pair = mb.build_groups(world.size, 2, 1) if waited else None
        rounds: list[float] = []  # collective_sync's, in spells apart (waits.SYNC_SPELLS)

        def sync_spell() -> None:
            if pair is not None:
                per_spell = -(-waits.SYNC_ROUNDS // waits.SYNC_SPELLS)
                rounds.extend(waits.sync_rounds(dtype, device, sweep.timing, pair, per_spell))

        sync_spell()
        collectives = (
            measure_collectives(device, dtype, sweep, per_node, step) if world.size > 1 else []
        )
        in_place, after_compute, ring = None, 0.0, None
        if pair is not None:
            step("collective sync")
            sync_spell()
            after_compute = waits.wait_after_compute(dtype, device, sweep.timing, pair)
            step("ring attention sync")
            ring = waits.ring_sync(dtype, device, sweep.timing, pair)
            sync_spell()
            in_place = waits.collective_sync(rounds, dtype)
    finally:
        bar.close()
    links = _link_fits(collectives)
    kind = device_kind(name) if device.type == "cuda" else None
    table_peak = DENSE_PEAK_TFLOPS.get(kind or "", {}).get(precision, 0.0) * 1e12
    peak = table_peak or max(s.flops / t for s, t in gemms)
    curve = monotone_curve([(s.flops, s.flops / (t * peak)) for s, t in gemms])
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, per_node)
    return Calibration(
        device_name=name,
        device_type=device.type,
        kind=kind if table_peak else ("cpu" if device.type == "cpu" else "measured"),
        precision=precision,
        peak=peak,
        peak_measured=not table_peak,
        gemm=tuple(gemms),
        curve=curve,
        attention=tuple(attention),
        stream=tuple(stream),
        launch_seconds=launch,
        memory_bytes=memory,
        # CUDA without a base file: None, the per-layout formula (`ptdp.perf.cost.reserve`).
        reserved_bytes=base.device.reserved_bytes
        if base
        else (None if device.type == "cuda" else 1 * GIB),
        nominal_bandwidth=base.device.memory_bandwidth if base else 0.0,
        ranks=world.size,
        gpus_per_node=per_node if world.size > 1 else (base.gpus_per_node if base else 1),
        collectives=tuple(collectives),
        links=links,
        base=base,
        info={
            "date": datetime.date.today().isoformat(),
            "host": platform.node(),
            "torch": torch.__version__,
            "threads": str(torch.get_num_threads()),
            "sweep": _sweep_name(sweep, device.type),
        },
        framework=framework,
        optimizer=optimizer,
        split_ratio=split,
        sync=_sync(in_place, after_compute, links, collectives),
        ring=_ring(ring, collectives, torch.empty((), dtype=dtype).element_size()),
    )


def _sync(
    in_place: tuple[float, float, int] | None,
    after_compute: float,
    links: dict[str, tuple[LinkFit | None, str]],
    fits: list[CollectiveFit],
) -> tuple[float, float, float] | None:
    """(per call, per tp = 2 layer, wait after compute) seconds: a tensor-parallel
    all-reduce in place less what the model already charges it (the all-reduce's own fit,
    which the file writes into the link; else the in-node link's), so that link + sync is
    the call in place; and what a wait costs more after a layer's compute
    (`waits.wait_after_compute`), which the model adds to the waits that follow compute."""
    if in_place is None:
        return None
    call, layer, nbytes = in_place
    own = next((f.fit for f in fits if (f.op, f.ranks, f.span) == ("all_reduce", 2, "node")), None)
    fit = own or links.get("node", (None, ""))[0]  # what the model charges an all-reduce
    charged = fit.seconds(collective_bytes("all_reduce", nbytes, 2)) if fit else 0.0
    return max(0.0, call - charged), layer, after_compute


def _ring(
    ring: tuple[float, float] | None, fits: list[CollectiveFit], e: int
) -> tuple[float, float] | None:
    """(per shift, per cp = 2 layer) seconds: a ring shift in place less what the model
    charges its bytes (the point-to-point fit, which the file writes into the link), so
    that link + ring sync is the shift in place. `e`: the measured dtype's element size."""
    if ring is None:
        return None
    shift, layer = ring
    p2p = next((f.fit for f in fits if (f.op, f.span) == ("p2p", "node")), None)
    model = ModelConfig(**mb.TINY_GPT)
    kv = kv_block_bytes(model, micro_batch=1, tp=1, cp=2, e=e)
    charged = p2p.seconds(kv) if p2p else 0.0
    return max(0.0, shift - charged), layer


def _sweep_name(sweep: Sweep, device_type: str) -> str:
    names = {SWEEPS.get((device_type, q)): n for q, n in ((True, "quick"), (False, "default"))}
    return names.get(sweep, "custom")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def resolve_base(base: str, device: torch.device) -> System | None:
    """`--base`: a built-in name or file; auto = this GPU's built-in file (none on CPU)."""
    if base == "none":
        return None
    if base != "auto":
        return load_system(base)
    return (
        system_for_device_name(torch.cuda.get_device_name(device))
        if device.type == "cuda"
        else None
    )


def write_calibration(cal: Calibration, path: Path) -> System:
    """Write the cluster TOML and load it back (so a file that cannot load is never left)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, render_toml(cal, path.stem))
    try:
        return load_system(path)
    except ConfigError:
        path.rename(path.with_suffix(".broken.toml"))
        raise


def run_calibrate(out: str, *, quick: bool, base: str, precision: str) -> int:
    """The command: launch (torchrun or one process), measure, write, print (rank 0)."""
    from ptdp.parallel.env import (
        LaunchEnv,
        exit_now,
        init_process_group,
        leave_failed_rank,
        pick_device,
    )

    env = LaunchEnv.from_environ()
    if env.rank == 0:  # before anything is measured: the output can be written
        check_output_file(out or "runs/calibration/cpu.toml", "--out")
    device = pick_device("auto", env.local_rank)
    init_process_group(env, device)
    try:
        sweep = SWEEPS[(device.type, quick)]
        cal = calibrate(device, sweep, precision=precision, base=resolve_base(base, device))
        if env.rank == 0:
            name = "cpu" if device.type == "cpu" else (cal.kind or "gpu")
            path = Path(out or f"runs/calibration/{name}.toml")
            write_calibration(cal, path)
            print(summary(cal))
            print(f"wrote {path}; use it with `ptdp simulate --device {path}` (or `ptdp plan`)")
    except BaseException as exc:
        if env.world_size == 1:
            raise
        leave_failed_rank("calibrate", env.rank, exc)
    if env.world_size > 1:
        exit_now(0)
    return 0
