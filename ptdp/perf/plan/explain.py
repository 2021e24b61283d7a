"""The planner's reasons for its recommendation, in the paper's terms (Narayanan et al.,
section 3 and takeaways 1-3): tensor parallelism inside a node, pipeline across nodes, the
micro-batch from equation (1), the schedule's bubble, and the runners-up.
"""

from __future__ import annotations

from ptdp.perf.cost.folding import Experts
from ptdp.perf.cost.hardware import GIB, System
from ptdp.perf.cost.host_memory import Start, applies, node_fit, ranks
from ptdp.perf.cost.reserve import fit
from ptdp.perf.plan.ranking import Option, Unranked, close_to_fastest
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.rules.layout import Layout
from ptdp.rules.zero import ZERO_LEVELS


def explain(
    options: list[Option],
    chosen: int,
    eq1: tuple[tuple[int, float], ...],
    system: System,
    tolerance: float,
    unranked: tuple[Unranked, ...] = (),
) -> list[str]:
    """Why this layout: each choice against the paper's guidelines and the runners-up.

    `options` are the fastest layouts that fit, fastest first, and `unranked` the others
    (`ptdp.perf.plan.ranking`): the fastest of each t among them is replayed."""
    best = options[chosen]
    lay, cfg, pred = best.prediction.layout, best.config, best.prediction
    overlap = getattr(cfg.parallel, "moe_overlap", False)
    node = system.gpus_per_node
    need, usable = (x / GIB for x in fit(pred.memory, system.device))
    lines = []
    by_t: dict[int, Option] = {}
    replayed = sorted(
        (u.option for u in unranked if u.option is not None),
        key=lambda o: o.prediction.iteration_seconds,
    )
    for o in [*options, *replayed]:
        by_t.setdefault(o.prediction.layout.tp, o)
    others = ", ".join(
        f"t={t}: {o.prediction.model_tflops_per_device:.0f}"
        for t, o in sorted(by_t.items())
        if t != lay.tp
    )
    inside = "equal to the GPUs per node" if lay.tp == node else f"inside one {node}-GPU node"
    what = (
        f"tensor parallel t={lay.tp}, {inside}: its all-reduces (2 forward, 2 backward per "
        f"layer) stay on {system.intra.name}"
        if lay.tp > 1
        else "no tensor parallelism (t=1): no all-reduces inside the layers"
    )
    lines.append(what + (f"; best model TFLOP/s per GPU with other t: {others}" if others else ""))
    span = lay.tp * lay.dp
    crosses = lay.pp > 1 and span >= node
    layouts = [o.prediction.layout for o in options] + [u.layout for u in unranked]
    sizes = _model_parallel_sizes(options, chosen, layouts, tolerance)
    lines.append(
        f"pipeline p={lay.pp}"
        + (
            f" across nodes (neighbouring stages {span} GPUs apart, over {system.inter.name})"
            if crosses
            else ""
        )
        + f": model-parallel size t*p = {lay.tp * lay.pp} ({sizes}); "
        f"peak memory {need:.1f} GiB of {usable:.1f} GiB usable after the reserve"
    )
    if eq1:
        table = ", ".join(f"b={b}: {s:.3g} s" for b, s in eq1)
        lines.append(
            f"micro-batch b={cfg.train.micro_batch_size} minimises equation (1) "
            f"(B/(d b) + p - 1)(t_f + t_b) among those that fit: {table}"
        )
    spec = SCHEDULES[cfg.parallel.schedule.value]
    formula = spec.bubble(lay.pp, lay.num_microbatches, lay.vpp)
    split = cfg.parallel.pipeline_layers  # given, or lighter ends (`ptdp.perf.plan.ends`)
    lines.append(
        f"schedule {cfg.parallel.schedule.value} v={lay.vpp}: m={lay.num_microbatches} "
        f"microbatches, simulated bubble {pred.bubble_fraction:.3f} (formula {spec.formula} = "
        f"{formula:.3f}); recompute={cfg.parallel.recompute.value} (the least that fits)"
        + (f"; stages of {','.join(map(str, lay.stage_layers))} layers" * bool(split))
    )
    lines.append(
        f"data parallel d={lay.dp}: {pred.dp_seconds:.3g} s of gradient reduction per step; "
        f"predicted {pred.iteration_seconds:.3g} s per step, {pred.model_tflops_per_device:.1f} "
        f"model TFLOP/s per GPU (MFU {100 * pred.mfu:.1f}%; executed with recomputation "
        f"{pred.tflops_per_device:.1f})"
    )
    if lay.cp > 1:
        where = "inside a node" if lay.tp * lay.cp <= node else "across nodes (ring on the network)"
        lines.append(
            f"context parallel cp={lay.cp} ({cfg.parallel.cp_comm.value}, the faster that fits), "
            f"{where}: each rank holds {cfg.model.seq_length // lay.cp} tokens of a sequence "
            f"and 1/{lay.cp} of its activations"
        )
    if lay.ep > 1:
        e = cfg.model.num_experts
        folded = Experts.of(lay.tp, lay.dp * lay.cp, lay.ep, lay.etp)
        split = f", each split over etp={lay.etp}" if lay.etp > 1 else ", each whole"
        hidden = " (overlapped with another microbatch)" if overlap else ""
        lines.append(
            f"expert parallel ep={lay.ep}: each rank holds {e // lay.ep} of a layer's {e} "
            f"experts{split}, their tokens sent and returned by all-to-all over ranks "
            f"{folded.ep_stride} apart ({1e3 * pred.ep_seconds:.3g} ms per MoE layer and "
            f"microbatch, F + B){hidden}; their gradients reduced over the {folded.edp} "
            "ranks holding the same experts"
        )
    if lay.zero:
        lines.append(
            f"ZeRO-{lay.zero} over d*cp = {lay.dp * lay.cp} ranks ({ZERO_LEVELS[lay.zero]}): "
            "a higher level only where it lets less recomputation fit"
        )
    if chosen:
        fastest = options[0]
        gain = pred.iteration_seconds / fastest.prediction.iteration_seconds - 1
        lines.append(
            f"{fastest.describe()} is predicted {100 * gain:.1f}% faster, within the model's "
            f"{100 * tolerance:.0f}% error on the paper's Table 1: the paper's takeaways "
            "(smallest t*p that fits, then tensor parallelism up to the node) decide"
        )
    return lines


def host_memory_line(best: Option, system: System, start: Start, refused: int) -> list[str]:
    """The recommended layout's fullest node in host memory (`ptdp.perf.cost.host_memory`)
    and how many layouts host memory refused; nothing on a CPU or where the node's host
    memory is not given."""
    if not applies(system) or system.host_memory_bytes is None or not best.prediction.host:
        return []
    pred, async_save = best.prediction, best.config.train.async_save
    fit = node_fit(pred.host, pred.layout, system, start, async_save)
    more = f"; {refused} layouts refused for host memory" if refused else ""
    return [
        f"host memory (--start {start.value}): {fit.phase} needs {fit.per_rank / GIB:.1f} GiB "
        f"per rank, {ranks(fit.ranks)} per node = {fit.need / GIB:.1f} GiB of the node's "
        f"{(fit.usable or 0.0) / GIB:.0f} GiB usable{more}"
    ]


def _model_parallel_sizes(
    options: list[Option], chosen: int, layouts: list[Layout], tolerance: float
) -> str:
    """The smallest t*p that fits, and, where the choice is larger, that it is the smallest
    the recommendation could take (`ranking.recommend`: within `tolerance`, ZeRO-3 last)."""
    plain = [x.tp * x.pp for x in layouts if x.zero != 3]
    sharded = [x.tp * x.pp for x in layouts if x.zero == 3]
    parts = [str(min(plain))] if plain else []
    if sharded and (not plain or min(sharded) < min(plain)):
        parts.append(f"{min(sharded)} with ZeRO-3")
    text = "smallest that fits: " + ", ".join(parts)
    lay = options[chosen].prediction.layout
    if lay.tp * lay.pp > min(sharded if lay.zero == 3 else plain):
        close = [options[i].prediction.layout for i in close_to_fastest(options, tolerance)]
        aside = lay.zero != 3 and any(x.zero == 3 for x in close)
        text += f"; the smallest within the model's {100 * tolerance:.0f}% of the fastest step" + (
            " without ZeRO-3" if aside else ""
        )
    return text
