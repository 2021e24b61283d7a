"""What `ptdp calibrate` measured (`Calibration`), the cluster TOML it writes, its summary.

The file has the tables of every cluster file (ptdp/perf/cost/hardware_file.py reads
`[device]`, `[device.achieved]`, `[node]`, `[network]`) and a `[calibration]` table the loader
skips: when, where and how it was measured, and every figure behind the fitted constants.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ptdp.perf.calibrate.fit import LinkFit, monotone_curve
from ptdp.perf.cost.hardware import BACKWARD_FLOPS, GB, GIB, LINK_OPS, Link, System

DESCRIPTION = (
    "Time GEMMs over the shapes of a transformer layer, fused attention, memory-bound kernels "
    "(norms, activations, the optimizer step) and, under torchrun, all-reduce, all-gather, "
    "reduce-scatter, all-to-all and point-to-point over message and group sizes; fit the "
    "performance model's constants (a GEMM efficiency curve, achieved bandwidth, link latency "
    "and bandwidth) and write a cluster TOML for `ptdp simulate|plan --device FILE`. CPU "
    "(gloo) or CUDA (NCCL): `torchrun --nproc-per-node N -m ptdp calibrate` measures the "
    "links too."
)
"""`ptdp calibrate --help` (here, not in the torch-importing measure.py: parsing stays fast)."""

if TYPE_CHECKING:  # torch: not imported when only the help text is wanted
    from ptdp.perf.calibrate import microbench as mb


@dataclass(frozen=True)
class CollectiveFit:
    op: str
    ranks: int
    span: str
    """"node" (neighbouring ranks) or "network" (one rank per node)."""
    samples: tuple[tuple[int, float], ...]
    """(message bytes, seconds per call)."""
    fit: LinkFit | None
    note: str = ""


@dataclass(frozen=True)
class Calibration:
    """Everything measured, and the constants fitted from it."""

    device_name: str
    device_type: str
    kind: str
    precision: str
    peak: float
    peak_measured: bool
    gemm: tuple[tuple[mb.GemmShape, float], ...]
    curve: tuple[tuple[float, float], ...]
    attention: tuple[tuple[mb.AttentionShape, float, float], ...]
    stream: tuple[tuple[str, float, float], ...]
    """(kernel, bytes moved, seconds), each kernel at growing sizes; `<kernel>_backward` for
    its input gradient."""
    launch_seconds: float
    memory_bytes: float
    reserved_bytes: float | None
    """None: no `reserved_gib` written; `ptdp.perf.cost.reserve` prices it per layout."""
    nominal_bandwidth: float
    ranks: int
    gpus_per_node: int
    collectives: tuple[CollectiveFit, ...]
    links: dict[str, tuple[LinkFit | None, str]]
    """"node" and "network": the fit (None: taken from the base) and where it came from."""
    base: System | None
    info: dict[str, str] = field(default_factory=dict)
    framework: tuple[tuple[float, float], tuple[float, float]] | None = None
    """(forward, backward) seconds per layer and for the embedding + head + loss that no
    kernel runs (microbench.framework_overhead); measured on CPUs only, where nothing hides
    it (on a GPU the host runs ahead of the kernels)."""
    optimizer: tuple[float, float] | None = None
    """(per step, per parameter tensor) seconds of ptdp's optimizer step beyond its bytes
    (microbench.optimizer_overhead); CPUs only."""
    sync: tuple[float, float, float] | None = None
    """(per blocking collective beyond what the fitted link charges it, per tp = 2 layer
    forward and backward against tp = 1, of the first: what one costs in place after a
    layer's compute) seconds (`waits.collective_sync`, `waits.wait_after_compute`); on
    CPUs under torchrun only."""
    split_ratio: float | None = None
    """(B + W) / fused seconds of ptdp's zero-bubble split backward
    (`wgrad_cost.split_backward_ratio`; on GPUs two layers of the 1.3B GPT)."""
    host_memory_bytes: float | None = None
    """This machine's host memory (written as `[node] host_memory_gib`; None: unknown)."""
    ring: tuple[float, float] | None = None
    """(per key/value shift of ring attention beyond what the fitted point-to-point link
    charges it, per cp = 2 layer forward and backward against none) seconds
    (`waits.ring_sync`); on CPUs under torchrun only."""

    @property
    def kernel_curves(self) -> dict[str, tuple[tuple[float, float], ...]]:
        """Each kernel's (bytes moved per call, bytes/s), sizes increasing."""
        curves: dict[str, list[tuple[float, float]]] = {}
        for kernel, nbytes, seconds in self.stream:
            curves.setdefault(kernel, []).append((nbytes, nbytes / seconds))
        return {k: tuple(sorted(v)) for k, v in curves.items()}

    @property
    def largest_bandwidths(self) -> dict[str, float]:
        """Each kernel's bytes/s at the largest size measured (past the caches)."""
        return {k: curve[-1][1] for k, curve in self.kernel_curves.items()}

    @property
    def achieved_bandwidth(self) -> float:
        """The median forward kernel's bandwidth past the caches: a typical memory-bound
        kernel, which one slow kernel the model's layer may not even run (RMS norm, unfused
        on CPUs, in a LayerNorm model) or one batch hit by a neighbour's job cannot drag down
        as it drags a total. What a layer's kernels cost when priced one by one is
        `kernel_curves` (ptdp/perf/cost/kernels.py)."""
        forward = [bw for k, bw in self.largest_bandwidths.items() if not k.endswith("_backward")]
        return statistics.median(forward)

    @property
    def attention_efficiency(self) -> float:
        shape, fwd, _ = max(self.attention, key=lambda r: (r[0].s, r[0].d))
        return shape.causal_flops / (fwd * self.peak)

    @property
    def attention_backward_ratio(self) -> float:
        _, fwd, bwd = max(self.attention, key=lambda r: (r[0].s, r[0].d))
        return bwd / fwd

    @property
    def attention_curve(self) -> tuple[tuple[float, float, float], ...]:
        """(causal FLOPs per sequence and head, forward efficiency, backward efficiency)
        knots, each efficiency fitted non-decreasing (as the GEMM curve); the backward's
        FLOPs are counted as `BACKWARD_FLOPS` times the forward's. Short sequences and small
        heads give the kernel less work per program (on a CPU, whose flash kernel takes keys
        in blocks of 512, a causal sequence shorter than that skips nothing), so one
        efficiency at the longest sequence over-credits them. Fitted rather than taken knot
        by knot: a backward is timed as (forward + backward) - forward, and one knot's
        ratio of two such figures can be off by 2 (5.6 and 0.9 beside 2-3 in one run)."""
        forward = monotone_curve(
            [
                (2.0 * a.s * a.s * a.d, a.causal_flops / (f * self.peak))
                for a, f, _ in self.attention
            ]
        )
        backward = monotone_curve(
            [
                (2.0 * a.s * a.s * a.d, BACKWARD_FLOPS * a.causal_flops / (b * self.peak))
                for a, _, b in self.attention
            ]
        )
        return tuple((x, y, by) for (x, y), (_, by) in zip(forward, backward))


def _value(v: object) -> str:
    """A TOML value: strings quoted, floats to 8 significant digits, lists inline."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        text = f"{v:.8g}"
        return text if any(c in text for c in ".en") else f"{text}.0"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    text = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def _table(name: str, rows: dict[str, object], comment: str = "") -> list[str]:
    head = f"[{name}]" + (f"  # {comment}" if comment else "")
    return [head, *(f"{k} = {_value(v)}" for k, v in rows.items()), ""]


def _link_rows(fit: LinkFit | None, base: Link | None, source: str) -> dict[str, object]:
    if fit is not None:  # the fitted bandwidth is what collectives achieve: efficiency 1
        bandwidth, efficiency, latency = fit.bandwidth / GB, 1.0, fit.latency * 1e6
    elif base is not None:
        bandwidth, efficiency, latency = base.bandwidth / GB, base.efficiency, base.latency * 1e6
    else:  # one process and no base: nothing to go on
        bandwidth, efficiency, latency = 1.0, 1.0, 100.0
    rows: dict[str, object] = {
        "link": source,
        "bandwidth_gb_s": float(bandwidth),
        "efficiency": float(efficiency),
        "latency_us": float(latency),
    }
    if fit is None and base is not None and base.step_latency > 0:  # the base's ring steps
        rows["step_latency_us"] = float(base.step_latency * 1e6)
    return rows


def _op_rows(cal: Calibration, span: str) -> dict[str, object]:
    """The span's own fit of point-to-point and of each ring collective (its largest group's)
    as the link's `<op>_latency_us` and `<op>_bandwidth_gb_s` keys (none if not fitted): on
    gloo the collectives' rates differ threefold, which one link's figures average away."""
    rows: dict[str, object] = {}
    for op in ("p2p", *LINK_OPS):
        fits = [c for c in cal.collectives if c.op == op and c.span == span and c.fit]
        if fits:
            fit = max(fits, key=lambda c: c.ranks).fit
            rows |= {
                f"{op}_latency_us": fit.latency * 1e6,
                f"{op}_bandwidth_gb_s": fit.bandwidth / GB,
            }
    return rows


def _links(cal: Calibration) -> tuple[dict[str, object], dict[str, object]]:
    base = cal.base
    unmeasured = "not measured: run `torchrun --nproc-per-node N -m ptdp calibrate`"
    node_fit, node_src = cal.links.get("node", (None, ""))
    if node_fit is None:
        node_src = f"{base.intra.name} (from {base.name}, not measured)" if base else unmeasured
    node = _link_rows(node_fit, base.intra if base else None, node_src)
    if node_fit is not None:
        node |= _op_rows(cal, "node")
    net_fit, net_src = cal.links.get("network", (None, ""))
    if net_fit is None and base is not None:
        net_src = f"{base.inter.name} (from {base.name}, not measured)"
        network = _link_rows(None, base.inter, net_src)
    elif net_fit is None and node_fit is not None:  # one node: its own link stands in
        network = dict(node, link="one node measured: the in-node link, not a network")
    else:
        network = _link_rows(net_fit, None, net_src or unmeasured) | _op_rows(cal, "network")
    return node, network


def _knots(curve: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """The curve without the inside knots of flat runs (the same curve, read log-linearly)."""
    keep = [
        knot
        for i, knot in enumerate(curve)
        if i in (0, len(curve) - 1) or not curve[i - 1][1] == knot[1] == curve[i + 1][1]
    ]
    return [(float(x), float(y)) for x, y in keep]


def render_toml(cal: Calibration, name: str) -> str:
    """The cluster file for `cal`, named `name`."""
    achieved_bw = cal.achieved_bandwidth
    nominal = cal.nominal_bandwidth or achieved_bw
    device: dict[str, object] = {"name": cal.device_name, "kind": cal.kind}
    if cal.peak_measured:
        device["peak_tflops"] = {cal.precision: cal.peak / 1e12}
    device |= {"memory_gib": cal.memory_bytes / GIB, "memory_bandwidth_gb_s": nominal / GB}
    curve = _knots(cal.curve)
    achieved = {
        "gemm_efficiency": curve[-1][1],
        "gemm_curve_flops": [x for x, _ in curve],
        "gemm_curve_efficiency": [y for _, y in curve],
        "attention_efficiency": cal.attention_efficiency,
        "attention_backward_ratio": cal.attention_backward_ratio,
        "attention_curve_flops": [x for x, _, _ in cal.attention_curve],
        "attention_curve_efficiency": [y for _, y, _ in cal.attention_curve],
        "attention_curve_backward_efficiency": [b for _, _, b in cal.attention_curve],
        "memory_efficiency": achieved_bw / nominal,
        "kernel_overhead_us": cal.launch_seconds * 1e6,
    }
    if cal.reserved_bytes is not None:
        achieved["reserved_gib"] = cal.reserved_bytes / GIB
    if cal.framework is not None:
        layer, head = cal.framework
        achieved["layer_overhead_us"] = [layer[0] * 1e6, layer[1] * 1e6]
        achieved["head_overhead_us"] = [head[0] * 1e6, head[1] * 1e6]
    if cal.optimizer is not None:
        achieved["optimizer_overhead_us"] = [cal.optimizer[0] * 1e6, cal.optimizer[1] * 1e6]
    if cal.split_ratio is not None:
        achieved["split_backward_ratio"] = cal.split_ratio
    if cal.sync is not None:
        achieved["collective_sync_us"] = cal.sync[0] * 1e6
        achieved["wait_after_compute_us"] = cal.sync[2] * 1e6
    if cal.ring is not None:
        achieved["ring_sync_us"] = cal.ring[0] * 1e6
    node, network = _links(cal)
    peak = "best GEMM measured (no datasheet peak)" if cal.peak_measured else "datasheet"
    described = f"calibrated {cal.device_name} on {cal.info.get('host', '?')}"
    lines = [
        f"# Measured by `ptdp calibrate` on {cal.info.get('date', '?')}: {cal.device_name},",
        f"# {cal.ranks} rank(s), {cal.precision} GEMMs, peak = {peak}.",
        f'name = "{name}"',
        f"description = {_value(described)}",
        "",
        *_table("device", device),
        *_table("device.achieved", achieved, "fitted by ptdp/perf/calibrate/fit.py"),
        *_table(
            "device.achieved.memory_kernels",
            {k: [[b, bw / GB] for b, bw in c] for k, c in cal.kernel_curves.items()},
            "[bytes moved per call, GB/s], growing sizes (ptdp/perf/cost/kernels.py)",
        ),
        *_table("node", {"gpus": cal.gpus_per_node, **_host(cal), **node}),
        *_table("network", network),
        *_calibration_tables(cal),
    ]
    return "\n".join(lines)


def _host(cal: Calibration) -> dict[str, float]:
    """The node's host memory in GiB: this machine's, else the base file's, else none."""
    gib = cal.host_memory_bytes or (cal.base.host_memory_bytes if cal.base else None)
    return {"host_memory_gib": round(gib / GIB, 1)} if gib else {}


def _calibration_tables(cal: Calibration) -> list[str]:
    gemm = {
        "shape": [s.name for s, _ in cal.gemm],
        "mnk": [[s.m, s.n, s.k] for s, _ in cal.gemm],
        "tflops": [s.flops / t / 1e12 for s, t in cal.gemm],
    }
    attention = {
        "bhsd": [[a.b, a.a, a.s, a.d] for a, _, _ in cal.attention],
        "forward_ms": [f * 1e3 for _, f, _ in cal.attention],
        "backward_ms": [b * 1e3 for _, _, b in cal.attention],
        "forward_tflops": [a.causal_flops / f / 1e12 for a, f, _ in cal.attention],
    }
    memory = {k: bw / GB for k, bw in cal.largest_bandwidths.items()}
    lines = [
        *_table("calibration", dict(cal.info), "what was measured; the loader skips it"),
        *_table("calibration.gemm", gemm),
        *_table("calibration.attention", attention, "causal SDPA"),
        *_table("calibration.memory_gb_s", memory, "at the largest size"),
    ]
    if cal.sync is not None:
        call, layer, after = (v * 1e6 for v in cal.sync)
        rows = {"per_call_us": call, "tp2_layer_us": layer, "wait_after_compute_us": after}
        note = "tp = 2 against tp = 1, h 32; layers at h 128 each with a wait, less both apart"
        lines += _table("calibration.collective_sync", rows, note)
    if cal.ring is not None:
        shift, layer = (v * 1e6 for v in cal.ring)
        rows = {"per_shift_us": shift, "cp2_layer_us": layer}
        lines += _table("calibration.ring_sync", rows, "cp = 2 against none, h 32")
    for c in cal.collectives:
        rows: dict[str, object] = {"op": c.op, "ranks": c.ranks, "span": c.span}
        if c.fit is not None:
            rows |= {
                "latency_us": c.fit.latency * 1e6,
                "bandwidth_gb_s": c.fit.bandwidth / GB,
                "rms_relative_error": c.fit.rms_relative_error,
            }
        else:
            rows["not_fitted"] = c.note
        rows |= {
            "message_bytes": [n for n, _ in c.samples],
            "seconds": [t for _, t in c.samples],
        }
        lines += ["[[calibration.collectives]]", *(f"{k} = {_value(v)}" for k, v in rows.items())]
        lines.append("")
    return lines


def summary(cal: Calibration) -> str:
    """What a user reads after a calibration: the fitted constants, one line each."""
    top, small = cal.curve[-1], cal.curve[0]
    source = "measured" if cal.peak_measured else "datasheet"
    lines = [
        f"{cal.device_name}: {cal.precision}, {cal.info.get('threads', '?')} threads, "
        f"{cal.ranks} rank(s)",
        f"  GEMM peak {cal.peak / 1e12:.3g} TFLOP/s ({source}); "
        f"efficiency {small[1]:.2f} at {small[0]:.2g} FLOPs .. {top[1]:.2f} at {top[0]:.2g}",
        f"  attention (causal SDPA) forward efficiency {cal.attention_efficiency:.2f}, "
        f"backward / forward {cal.attention_backward_ratio:.2f}",
        "  memory-bound kernels past the caches: "
        + ", ".join(f"{k} {bw / GB:.3g}" for k, bw in cal.largest_bandwidths.items())
        + f" GB/s (median forward: {cal.achieved_bandwidth / GB:.3g})",
        f"  kernel launch {cal.launch_seconds * 1e6:.3g} us",
    ]
    if cal.framework is not None:
        (lf, lb), (hf, hb) = cal.framework
        lines.append(
            f"  framework (Python, autograd) per layer F {lf * 1e6:.3g} us B {lb * 1e6:.3g} us;"
            f" embedding + head + loss F {hf * 1e6:.3g} us B {hb * 1e6:.3g} us"
        )
    if cal.sync is not None:
        call, layer, after = cal.sync
        lines.append(
            f"  each blocking collective between compute: {call * 1e6:.3g} us beyond the "
            f"link's cost, {after * 1e6:.3g} us more right after a layer's compute (a tp = 2 "
            f"layer, forward and backward, adds {layer * 1e6:.3g} us)"
        )
    if cal.ring is not None:
        shift, layer = cal.ring
        lines.append(
            f"  each ring attention shift: {shift * 1e6:.3g} us beyond the link's cost (a "
            f"cp = 2 layer, forward and backward, adds {layer * 1e6:.3g} us)"
        )
    for c in cal.collectives:
        fit = c.fit
        got = (
            f"{fit.latency * 1e6:.3g} us + bytes / {fit.bandwidth / GB:.3g} GB/s "
            f"(rms error {100 * fit.rms_relative_error:.0f}%)"
            if fit
            else f"not fitted: {c.note}"
        )
        lines.append(f"  {c.op} x{c.ranks} ({c.span}): {got}")
    for span, (fit, _) in cal.links.items():
        if fit:
            lines.append(
                f"  {span} link: {fit.latency * 1e6:.3g} us, {fit.bandwidth / GB:.3g} GB/s"
            )
    return "\n".join(lines)
