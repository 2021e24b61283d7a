"""The end of a simulated step: what follows the last gradient reduction, outside the pipeline.

The step's scalar all-reduces (the loss, the gradient norm, the fault flags:
`step_reductions`) and the AdamW step on the busiest rank, its state streamed once through
memory, with ZeRO-1 and 2's all-gather of the updated weights (`optimizer_seconds`);
`step_seconds` is both, the gather hidden under the least forward work of a pipeline rank
where the software overlaps it.
"""

from __future__ import annotations

from ptdp.config.enums import Precision
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.collectives import gather_seconds, group_link
from ptdp.perf.cost.costs import Compute, sync_seconds
from ptdp.perf.cost.experts import reduction_groups
from ptdp.perf.cost.kernels import Call
from ptdp.perf.cost.parameters import (
    expert_parameters_per_rank,
    parameters_per_rank,
    tensors_per_rank,
)
from ptdp.perf.simulate.reduction import buckets
from ptdp.pipeline.dryrun import PipelineCosts
from ptdp.rules.layout import Layout


def optimizer_seconds(
    cfg: RunConfig, layout: Layout, c: Compute, hidden_under: float = 0.0
) -> float:
    """AdamW step on the busiest rank: streaming its state once through HBM.

    Per local parameter 8 B (gradient-norm read, gradient zeroing) plus, per parameter of
    this rank's optimizer shard, 28 B (fp32: read weight, gradient, 2 moments; write
    weight, 2 moments) or 30 B (16-bit: fp32 master in place of the weight, plus writing
    the 16-bit copy); ZeRO-1 and 2 then all-gather the updated weights (ZeRO-3 gathers them
    in the next forward). Shards are over the dp x cp ranks, the routed experts' over their
    edp ranks under expert parallelism (`experts.reduction_groups`). A file that measured the step's
    own overhead (`optimizer_overhead`, CPUs) adds it per step and per parameter tensor.
    """
    split = (layout.pp, layout.vpp, layout.stage_layers, layout.stages.placement)
    split += (layout.ep, layout.etp)
    counts = parameters_per_rank(cfg.model, layout.tp, *split)
    busiest = max(range(layout.pp), key=lambda r: counts[r])
    per_rank = counts[busiest]
    routed = expert_parameters_per_rank(cfg.model, layout.tp, *split)[busiest]
    fp32 = cfg.train.precision is Precision.FP32
    group = layout.dp * layout.cp
    shard = group if layout.shards_optimizer else 1
    groups = reduction_groups(
        per_rank, routed, tp=layout.tp, dp_cp=group, ep=layout.ep, etp=layout.etp
    )
    state = 28 if fp32 else 30
    step = Call("adamw", sum(n * state / (size if shard > 1 else 1) for n, size, _ in groups))
    seconds = step.seconds(c.system.device) + Call("add", 8 * per_rank).seconds(c.system.device)
    fixed, per_tensor = c.system.device.optimizer_overhead
    if fixed or per_tensor:  # a CPU's per-tensor loops (the shard's pieces under ZeRO)
        kw = dict(layers=layout.stage_layers, placement=layout.stages.placement)
        tensors = max(tensors_per_rank(cfg.model, layout.pp, layout.vpp, **kw))
        seconds += fixed + per_tensor * -(-tensors // shard)
    if layout.shards_optimizer and layout.zero < 3:
        gather = sum(
            gather_seconds(n * (4 if fp32 else 2), size, group_link(c.system, size, stride))
            for n, size, stride in groups
        )
        # each bucket waited on, the first right after AdamW
        gather += sync_seconds(buckets(per_rank, cfg.parallel.bucket_mb), c, 1)
        if c.software.overlap_param_gather:
            gather = max(0.0, gather - hidden_under)
        seconds += gather
    return seconds


def step_reductions(layout: Layout, c: Compute) -> float:
    """The step's scalar all-reduces, one after another between the last gradient and the
    update: the loss over pp and over dp x cp (ptdp/train/step/trainer.py), the gradient
    norm over tp, pp and, with a sharded optimizer, dp (ptdp/train/step/optim.py), and the
    fault flags over the world (ptdp/train/faults/numerical.py). A few bytes each (a tree
    or a low-latency protocol, not the ring's steps): each pays its group's latency and, on
    CPUs, the ranks' resynchronisation."""
    t, cp, dp, pp = layout.tp, layout.cp, layout.dp, layout.pp
    groups = [(pp, t * cp * dp), (dp * cp, t), (t, 1), (pp, t * cp * dp), (t * cp * dp * pp, 1)]
    if layout.shards_optimizer:
        groups.append((dp, t * cp))
    calls = [(n, stride) for n, stride in groups if n > 1]
    wire = sum(group_link(c.system, n, stride).latency for n, stride in calls)
    return wire + sync_seconds(len(calls), c, min(1, len(calls)))  # back to back


def step_seconds(cfg: RunConfig, layout: Layout, c: Compute, costs: PipelineCosts) -> float:
    """What follows the last gradient reduction, outside the pipeline: the step's scalar
    all-reduces and the optimizer (its weight gather hidden under the least forward work a
    pipeline rank does for one microbatch, where the software overlaps it)."""
    first_forward = min(
        sum(f for stage, f in enumerate(costs.forward) if layout.stages.rank(stage) == r)
        for r in range(layout.pp)
    )
    return step_reductions(layout, c) + optimizer_seconds(cfg, layout, c, first_forward)
