"""`ptdp calibrate`: measure this machine and fit the performance model's constants.

What is measured (ptdp/perf/calibrate/microbench.py) and what it becomes in the cluster TOML that
`ptdp simulate --device FILE` and `ptdp plan --device FILE` read (ptdp/perf/cost/hardware_file.py):

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

This module holds `calibrate`, which runs a sweep (its sizes and the loops over them are in
ptdp/perf/calibrate/sweep.py) and turns the figures into the `Calibration` above, and the
command around it (`run_calibrate`: launch, measure, write the file, print).
"""

from __future__ import annotations

import datetime
import os
import platform
import warnings
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
from ptdp.perf.calibrate.sweep import (
    SWEEPS,
    Sweep,
    measure_collectives,
    measure_compute,
    measure_stream,
    planned_figures,
    sweep_name,
)
from ptdp.perf.calibrate.wgrad_cost import split_backward_ratio
from ptdp.perf.cost.context import kv_block_bytes
from ptdp.perf.cost.flops import DENSE_PEAK_TFLOPS, device_kind
from ptdp.perf.cost.hardware import GIB, System
from ptdp.perf.cost.hardware_file import load_system, system_for_device_name


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
        host_memory_bytes=host_memory_bytes(),
        collectives=tuple(collectives),
        links=links,
        base=base,
        info={
            "date": datetime.date.today().isoformat(),
            "host": platform.node(),
            "torch": torch.__version__,
            "threads": str(torch.get_num_threads()),
            "sweep": sweep_name(sweep, device.type),
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


def host_memory_bytes() -> float | None:
    """This machine's physical memory (POSIX sysconf); None where it cannot be read."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


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
