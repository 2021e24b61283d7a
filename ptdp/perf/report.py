"""Text and JSON forms of predictions and plans, for `ptdp simulate` and `ptdp plan`."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from ptdp.config.enums import Precision
from ptdp.config.files import to_dict
from ptdp.config.sections import RunConfig
from ptdp.outputs import make_output_dir
from ptdp.perf.cost.hardware import GIB, System
from ptdp.perf.cost.host_memory import Start
from ptdp.perf.cost.memory import MemoryEstimate
from ptdp.perf.cost.reserve import fit
from ptdp.perf.host_report import host_dict, host_lines
from ptdp.perf.plan.compare import Comparison
from ptdp.perf.plan.planner import Option, PlanResult, Progress
from ptdp.perf.rank_rows import shown_ranks
from ptdp.perf.simulate.plot import plot_timelines, write_chrome_trace
from ptdp.perf.simulate.simulator import Prediction


def memory_terms(m: MemoryEstimate) -> dict[str, float]:
    """One pipeline rank's memory by term, in GiB: `total` is the model's count (the terms
    before it), `reserve` what the framework holds beside it (`ptdp.perf.cost.reserve`)."""
    terms = ("params", "gathered", "grads", "grad_buckets", "optimizer", "activations")
    return {
        **{name: getattr(m, name) / GIB for name in (*terms, "working", "stash", "total")},
        "reserve": m.reserved / GIB,
    }


def fit_dict(p: Prediction) -> dict:
    """Whether the layout fits, at its limiting pipeline rank (the most memory with its
    reserve): where that rank sits, what it needs against the device's memory, by term."""
    lay, m = p.layout, p.limiting
    span = lay.tp * lay.cp * lay.dp  # the global ranks of one pipeline rank (pp slowest)
    return {
        "fits": p.fits,
        "limiting_rank": {
            "pp_rank": m.rank,
            "stages": lay.stages.stages_of(m.rank),
            "first_global_rank": m.rank * span,
            "last_global_rank": (m.rank + 1) * span - 1,
        },
        "need_gib": (m.total + m.reserved) / GIB,
        "capacity_gib": p.device_memory / GIB,
        "over_by_gib": p.over_by / GIB,
        "limiting_memory_gib": memory_terms(m),
    }


def prediction_dict(p: Prediction) -> dict:
    """The numbers of a prediction (no events), JSON-ready: its layout, then its fit
    (`fit_dict`)."""
    lay = p.layout
    return {
        "layout": {
            "world_size": lay.world_size,
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "vpp": lay.vpp,
            "num_microbatches": lay.num_microbatches,
            "sequence_parallel": lay.sequence_parallel,
            "zero": lay.zero,
            "cp": lay.cp,
            "ep": lay.ep,
            "etp": lay.etp,
        },
        **fit_dict(p),
        "iteration_seconds": p.iteration_seconds,
        "pipeline_seconds": p.pipeline_seconds,
        "bubble_fraction": p.bubble_fraction,
        "tflops_per_device": p.tflops_per_device,
        "model_tflops_per_device": p.model_tflops_per_device,
        "mfu": p.mfu,
        "hfu": p.hfu,
        "tokens_per_second": p.tokens_per_second,
        "layer_ms": {"F": p.layer.f * 1e3, "B": p.layer.b * 1e3, "W": p.layer.w * 1e3},
        "p2p_ms": p.p2p_seconds * 1e3,
        "dp_reduce_seconds": p.dp_seconds,
        "cp_layer_ms": {"wire": p.cp_seconds[0] * 1e3, "exposed": p.cp_seconds[1] * 1e3},
        "ep_layer_ms": p.ep_seconds * 1e3,
        "optimizer_seconds": p.optimizer_seconds,
        "busy_seconds": list(p.busy),
        "idle_seconds": list(p.idle),
        "memory_gib": [
            {
                "pp_rank": m.rank,
                **{k: v for k, v in memory_terms(m).items() if k != "reserve"},
                "reserved": m.reserved / GIB,
                "in_flight": m.in_flight,
            }
            for m in p.memory
        ],
    }


def format_prediction(
    p: Prediction,
    system: System,
    precision: Precision,
    software: str = "ptdp",
    *,
    start: Start = Start.ANY,
    async_save: bool = False,
) -> str:
    """A human summary: time, model TFLOP/s and MFU first (what a layout achieves), executed
    FLOPs apart, bubble, per-pass costs and memory per rank; then host memory per rank, the
    node checked for `start` and the run's saves (`ptdp.perf.host_report`)."""
    lay = p.layout
    usable = fit(p.memory, system.device)[1] / GIB
    lines = [
        f"system: {system.name} ({system.description})",
        f"layout: {lay.describe()}",
        f"precision: {precision.value} | software: {software}",
        f"predicted iteration: {p.iteration_seconds:.4g} s | {p.tokens_per_second:,.0f} tokens/s"
        f" | {p.model_tflops_per_device:.1f} model TFLOP/s per GPU | MFU {100 * p.mfu:.1f}%",
        f"executed with recomputation: {p.tflops_per_device:.1f} TFLOP/s per GPU | HFU "
        f"{100 * p.hfu:.1f}% (counts recomputed FLOPs, so compare layouts by model TFLOP/s)",
        f"pipeline: {p.pipeline_seconds:.4g} s, bubble {p.bubble_fraction:.3f} of the ideal time"
        f" | one layer F {1e3 * p.layer.f:.3g} ms B {1e3 * p.layer.b:.3g} ms"
        f" W {1e3 * p.layer.w:.3g} ms | p2p {1e3 * p.p2p_seconds:.3g} ms"
        f" | dp reduce {p.dp_seconds:.3g} s | optimizer {p.optimizer_seconds:.3g} s",
        *(
            [
                f"context parallel K/V transfers per layer and microbatch (F + B): "
                f"{1e3 * p.cp_seconds[0]:.3g} ms, {1e3 * p.cp_seconds[1]:.3g} ms exposed"
            ]
            if lay.cp > 1
            else []
        ),
        *(
            [
                f"expert parallel all-to-alls per MoE layer and microbatch (F + B, dispatch and "
                f"combine each way): {1e3 * p.ep_seconds:.3g} ms"
            ]
            if lay.ep > 1
            else []
        ),
        f"memory per GPU (GiB; {usable:.1f} usable on {system.device.name} at the fullest rank,"
        " after its reserve: CUDA context, NCCL buffers, allocator):",
        "  pp rank | params | grads | optimizer | activations (in flight) | working | stash"
        " | total | reserve",
    ]
    if any(m.grad_buckets for m in p.memory):
        lines.append("  (grads: ZeRO-2/3's 1/dp plus its full-size buckets in flight)")
    if any(m.gathered for m in p.memory):
        lines.append("  (params: ZeRO-3's 1/dp plus the layers gathered for compute and prefetch)")
    for r in shown_ranks(len(p.memory), p.limiting.rank):
        if r is None:
            lines.append("      ... |")
            continue
        m = p.memory[r]
        lines.append(
            f"  {m.rank:7d} | {(m.params + m.gathered) / GIB:6.2f} | "
            f"{(m.grads + m.grad_buckets) / GIB:5.2f} | "
            f"{m.optimizer / GIB:9.2f} | {m.activations / GIB:11.2f} ({m.in_flight:3d}) | "
            f"{m.working / GIB:7.2f} | {m.stash / GIB:5.2f} | {m.total / GIB:5.2f} | "
            f"{m.reserved / GIB:7.2f}"
        )
    host = host_lines(p, system, start, async_save) if p.host else []
    return "\n".join([*lines, fit_line(p, system), *host])


def fit_line(p: Prediction, system: System) -> str:
    """The verdict, once: whether the layout fits, what its limiting pipeline rank needs
    (count and reserve) of the device's memory, and by how much it is over or under."""
    m, capacity = p.limiting, p.device_memory / GIB
    need = (m.total + m.reserved) / GIB
    over = sum(x.total + x.reserved > p.device_memory for x in p.memory)
    what = (
        f"needs {need:.2f} GiB of {capacity:.2f} GiB on pp rank {m.rank}"
        f" ({m.total / GIB:.2f} counted + {m.reserved / GIB:.2f} reserve"
    )
    if p.fits:
        return f"fits: {what}, the fullest rank), {capacity - need:.2f} GiB to spare"
    ranks = f"; {over} of {len(p.memory)} pp ranks over" if over > 1 else ""
    return (
        f"does not fit on {system.device.name}: {what}{ranks}), over by {p.over_by / GIB:.2f} GiB"
    )


def write_timeline(p: Prediction, out: Path, title: str) -> tuple[Path | None, Path]:
    """timeline.png (None without matplotlib) and trace.json (open in Perfetto) under `out`."""
    events = {"simulated": p.events}
    make_output_dir(out, "--out")
    trace = write_chrome_trace(out / "trace.json", events)
    try:
        png = plot_timelines(out / "timeline.png", events, title=title)
    except ImportError:  # matplotlib is optional: pip install "ptdp[bench]"
        png = None
    return png, trace


def simulation_output(
    p: Prediction,
    system: System,
    out: Path,
    as_json: bool,
    cfg: RunConfig,
    software: str,
    start: Start = Start.ANY,
) -> str:
    """Write the timeline under `out`; the prediction as text (or JSON) naming the files;
    host memory checked for `start` (`--start`) and the config's saves."""
    title = f"{system.name}: {p.layout.describe()} ({p.layout.schedule})"
    png, trace = write_timeline(p, out, title)
    precision, async_save = cfg.train.precision, cfg.train.async_save
    if as_json:
        return json.dumps(
            {
                **prediction_dict(p),
                **host_dict(p, system, start, async_save),
                "precision": precision.value,
                "software": software,
                "png": png and str(png),
                "trace": str(trace),
            }
        )
    png_text = str(png) if png else "not drawn (pip install matplotlib)"
    return (
        f"{format_prediction(p, system, precision, software, start=start, async_save=async_save)}\n"
        f"timeline: {png_text} | trace: {trace} (open in https://ui.perfetto.dev)"
    )


@contextmanager
def progress_bar(desc: str) -> Iterator[Progress]:
    """A `Progress` callback drawing a bar on stderr (when it is a terminal)."""
    bar = tqdm(total=0, desc=desc, unit="layout", file=sys.stderr, disable=None)

    def progress(done: int, total: int, what: str) -> None:
        bar.total = total
        bar.set_postfix_str(what)
        bar.update(done - bar.n)

    try:
        yield progress
    finally:
        bar.close()


def option_dict(o: Option) -> dict:
    return {"summary": o.describe(), "config": to_dict(o.config), **prediction_dict(o.prediction)}


def compare_dict(c: Comparison) -> dict:
    option = option_dict(c.option) if c.option else None
    return {
        "source": c.source,
        "rank": c.rank,
        "of": c.total,
        "gain": c.gain,
        "problem": c.problem,
        "option": option,
    }


def plan_dict(result: PlanResult, top: int, mine: Comparison | None = None) -> dict:
    return {
        "compare": compare_dict(mine) if mine else None,
        "best": option_dict(result.best) if result.best else None,
        "recommended": result.recommended,
        "options": [option_dict(o) for o in result.options[:top]],
        "explanation": list(result.explanation),
        "micro_batch_equation_1_seconds": dict(result.micro_batch_costs),
        "rejected": [
            {"layout": r.layout, "reason": r.reason, "constraint": r.kind.name.lower()}
            for r in result.rejected
        ],
    }


def overrides(o: Option) -> str:
    """The command-line overrides that select this layout in `ptdp train`."""
    p, t, lay = o.config.parallel, o.config.train, o.prediction.layout
    cp = f"--parallel.cp {p.cp} --parallel.cp_comm {p.cp_comm.value} " if p.cp > 1 else ""
    cp += f"--parallel.ep {p.ep} " if p.ep > 1 else ""
    cp += f"--parallel.etp {p.etp} " if o.config.model.num_experts and p.etp != 1 else ""
    cp += "--parallel.moe_overlap true " if getattr(p, "moe_overlap", False) else ""
    split = ",".join(map(str, p.pipeline_layers))
    layers = f"--parallel.pipeline_layers {split} " if split else ""
    return (
        f"--parallel.tp {p.tp} {cp}--parallel.pp {p.pp} --parallel.vpp {p.vpp} {layers}"
        f"--parallel.zero {lay.zero} "
        f"--parallel.schedule {p.schedule.value} --parallel.recompute {p.recompute.value} "
        f"--parallel.sequence_parallel {str(p.sequence_parallel).lower()} "
        f"--train.micro_batch_size {t.micro_batch_size} --train.global_batch_size "
        f"{t.global_batch_size}"
    )


def _row(mark: str, o: Option) -> str:
    p = o.prediction
    return (
        f" {mark} | {o.describe()} | {p.iteration_seconds:.4g} | {p.model_tflops_per_device:.1f}"
        f" | {100 * p.mfu:.1f}% | {p.tflops_per_device:.1f} | {p.bubble_fraction:.3f} | "
        f"{p.peak_memory / GIB:.1f}"
    )


def format_comparison(c: Comparison, result: PlanResult) -> str:
    """One line: where the user's layout ranks and what the recommended one gains on it."""
    head = f"your layout ({c.source})"
    if c.option is None:
        return f"{head} {c.problem}"
    p = c.option.prediction
    what = (
        f"{head}: {c.option.describe()}: {p.iteration_seconds:.4g} s/step, "
        f"{p.model_tflops_per_device:.1f} model TFLOP/s per GPU, MFU {100 * p.mfu:.1f}%"
    )
    if c.problem:
        return f"{what}; it {c.problem}"
    count, best = c.total, result.recommended + 1
    if c.gain <= 0:
        return f"{what}: rank {c.rank} of {count}, as fast as the recommended layout (#{best})"
    return (
        f"{what}: rank {c.rank} of {count}; the recommended layout (#{best}) is predicted "
        f"{100 * c.gain:.1f}% faster ({1 + c.gain:.3f}x your throughput)"
    )


def format_plan(
    result: PlanResult, system: System, top: int, mine: Comparison | None = None
) -> str:
    """The ranking (model TFLOP/s and MFU first; executed FLOPs, which count recomputation,
    apart), the user's layout where compared, and why the recommended one."""
    if result.best is None:  # what binds, then the layouts refused
        head, *why = result.explanation
        more = len(result.rejected) - 20
        lines = [head, *(f"  - {line}" for line in why), "refused:"]
        lines += [f"  {r.layout}: {r.reason}" for r in result.rejected[:20]]
        lines += [f"  ... and {more} more (--json lists them all)"] if more > 0 else []
        text = "\n".join(lines)
        return text + (f"\n\n{format_comparison(mine, result)}" if mine else "")
    count = result.fitting
    precision = result.best.config.train.precision.value
    lines = [
        f"{count} layouts fit on {system.name} ({precision}); the fastest {min(top, count)}:",
        "    # | layout | s/step | model TFLOP/s/GPU | MFU | executed TFLOP/s/GPU | bubble | "
        "GiB/GPU   (* recommended, > yours)",
    ]
    shown = [
        (f"{'*' if i == result.recommended else ' '}{i + 1:2d}", o)
        for i, o in enumerate(result.options[:top])
    ]
    if result.recommended >= top:
        shown.append((f"*{result.recommended + 1:2d}", result.best))
    if mine is not None and mine.rank:
        at = sum(
            1
            for _, o in shown
            if o.prediction.iteration_seconds
            < mine.option.prediction.iteration_seconds * (1 - 1e-9)
        )
        shown.insert(at, (f">{mine.rank:2d}", mine.option))
    lines += [_row(mark, o) for mark, o in shown]
    if mine is not None:
        lines += ["", format_comparison(mine, result)]
    lines += ["", "why:"] + [f"  - {line}" for line in result.explanation]
    lines += ["", f"train with: {overrides(result.best)}"]
    return "\n".join(lines)
