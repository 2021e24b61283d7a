"""The data-parallel gradient reduction of a simulated step, beside or after the pipeline.

Per global stage, the seconds of reducing its gradients over the dp x cp ranks (tp apart),
the routed experts' over their edp ranks under expert parallelism
(`ptdp.perf.cost.experts`), the tied embeddings first summed between the first and the last
stage, and the last bucket's share of it (`stage_reductions`); then, on the replayed
timeline, when each rank's reduction ends (`reduce_gradients`): overlapped with each
chunk's last backward where the config and the software have it (`overlaps_reduction`),
else after the step. ZeRO-2 and 3 reduce-scatter per microbatch inside the passes instead
(`ptdp.perf.cost.zero`).
"""

from __future__ import annotations

import math

from ptdp.config.sections import RunConfig
from ptdp.perf.cost.collectives import all_reduce_seconds, gather_seconds, group_link
from ptdp.perf.cost.costs import Compute, sync_seconds
from ptdp.perf.cost.experts import reduction_groups
from ptdp.perf.cost.parameters import expert_parameters_per_stage, parameters_per_stage
from ptdp.perf.simulate.replay import PipelineRun
from ptdp.pipeline.timeline import Event
from ptdp.rules.layout import Layout


def _final_gradients(run: PipelineRun, pp: int) -> list[list[tuple[float, float, int]]]:
    """Per rank: (start, end, stage) of each stage's last gradient-producing action."""
    final: dict[int, Event] = {}
    for e in run.events:
        if (
            e.lane == "compute"
            and e.kind in ("BW", "W")
            and (e.stage not in final or e.end > final[e.stage].end)
        ):
            final[e.stage] = e
    out: list[list[tuple[float, float, int]]] = [[] for _ in range(pp)]
    for stage, e in final.items():
        out[e.rank].append((e.start, e.end, stage))
    return [sorted(x) for x in out]


def overlaps_reduction(cfg: RunConfig, c: Compute) -> bool:
    """Whether the gradient reduction overlaps the backward (the config's, where the software
    has it). Over gloo it hides nothing: its threads move the bytes on the cores the
    backward runs on (BENCHMARKS.md: two ranks on two vCPUs took 55.8 ms a step with the
    reduction after the backward, 57.9 ms with it overlapped)."""
    if c.system.device.gloo:
        return False
    if c.software.overlap_needs_pp1 and cfg.parallel.pp > 1:
        return False
    return cfg.parallel.overlap_grad_reduce and c.software.overlap_grad_reduce


def buckets(params: float, bucket_mb: float) -> int:
    """How many buckets (`ptdp.parallel.buckets`, `bucket_mb` MiB of fp32 elements each)
    `params` parameters fill: the reduction and the distributed optimizer's gather wait on
    each."""
    return max(1, math.ceil(4 * params / (bucket_mb * 2**20)))


def stage_reductions(cfg: RunConfig, layout: Layout, c: Compute) -> list[tuple[float, float]]:
    """Per global stage: (seconds of its data-parallel gradient reduction, the part left after
    its last backward ends under overlap: the last bucket's share). See `reduce_gradients`.
    Under expert parallelism the routed experts' gradients go over their edp group
    (`experts.reduction_groups`), after the rest."""
    model, par, d, t = cfg.model, cfg.parallel, layout.dp * layout.cp, layout.tp
    split = (layout.pp, layout.vpp, layout.stage_layers, layout.ep, layout.etp)
    params = parameters_per_stage(model, t, *split)
    experts = expert_parameters_per_stage(model, t, *split)
    bucket = par.bucket_mb * 2**20
    tied_copies = model.tie_embeddings and layout.pp * layout.vpp > 1
    out = []
    for stage, (count, routed) in enumerate(zip(params, experts)):
        nbytes = float(c.software.grad_reduce_bytes * count)
        seconds = 0.0  # ZeRO-2 and 3: per microbatch, in the passes
        groups = reduction_groups(count, routed, tp=t, dp_cp=d, ep=layout.ep, etp=layout.etp)
        for n, size, stride in groups:
            part, link = float(c.software.grad_reduce_bytes * n), group_link(c.system, size, stride)
            if layout.shards_optimizer and not layout.shards_grads:
                seconds += gather_seconds(part, size, link, "reduce_scatter")
            elif not layout.shards_grads:
                seconds += all_reduce_seconds(part, size, link)
        if seconds and d > 1:  # `finish` waits on each bucket, the first right after compute
            seconds += sync_seconds(buckets(count, par.bucket_mb), c, 1)
        if tied_copies and stage in (0, layout.pp * layout.vpp - 1):
            tied = 4.0 * model.padded_vocab_size(t) // t * model.hidden_size
            seconds += all_reduce_seconds(tied, 2, c.system.inter)
        out.append((seconds, seconds * min(1.0, bucket / max(nbytes, 1.0))))
    return out


def reduce_gradients(
    cfg: RunConfig, layout: Layout, c: Compute, run: PipelineRun
) -> tuple[list[float], list[float], list[Event]]:
    """Data-parallel gradient reduction per rank: (end time, seconds, events).

    With overlap (the config's, where the software has it) each stage's buckets start
    reducing as its last backward starts and the last bucket leaves when that backward
    ends; without, all of it follows the step.
    Tied embeddings are first summed between the first and last stage (a deferred bucket).
    The group is dp x cp ranks, tp apart; ZeRO-2 and 3 reduce-scatter per microbatch inside
    the passes instead (`ptdp.perf.cost.zero`), leaving only the tied embeddings here.
    """
    overlap = overlaps_reduction(cfg, c)
    reductions = stage_reductions(cfg, layout, c)
    ends, totals, events = [], [], []
    for rank, finals in enumerate(_final_gradients(run, layout.pp)):
        free, total = (0.0 if overlap else run.rank_end[rank]), 0.0
        for start, end, stage in finals:
            seconds, last_bucket = reductions[stage]
            if seconds == 0.0:
                continue
            begin = max(free, start) if overlap else free
            finish = begin + seconds
            if overlap:
                finish = max(finish, end + last_bucket)
            events.append(Event(rank, stage, 0, "DP", finish - seconds, finish, "dp"))
            free, total = finish, total + seconds
        ends.append(max(free, run.rank_end[rank]))
        totals.append(total)
    return ends, totals, events
