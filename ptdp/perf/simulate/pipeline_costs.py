"""What one microbatch costs on each pipeline stage: the durations the replay is given.

Per global stage, the F, B and W seconds of its layers (`layer_costs`: a rank's s/cp tokens
and its exposed K/V transfers under context parallelism, `ptdp.perf.cost.context`; a
mixture-of-experts layer at its own cost, its all-to-alls under expert parallelism included,
`ptdp.perf.cost.experts`), the embedding on the first stage and the head on the last
(`compute_costs`), ZeRO-2 and 3's exposed collectives (`ptdp.perf.cost.zero`) and the
gradients' accumulation (`stage_costs`); and each boundary transfer between neighbouring
stages, on the wire and in the receivers' all-gather. `pipeline_costs` puts them together as
the `PipelineCosts` that `ptdp.perf.simulate.replay` replays, where a zero-bubble schedule's
W pays what its split backward costs beyond the fused one (`Device.split_backward_ratio`: it
reads its operands back after B). The planner reads `stage_costs` and `layer_costs` without
a replay.
"""

from __future__ import annotations

from ptdp.config.enums import Precision
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.collectives import gather_seconds, group_link
from ptdp.perf.cost.context import local_model
from ptdp.perf.cost.context_costs import cp_layer_seconds
from ptdp.perf.cost.costs import (
    Compute,
    Passes,
    accumulation_seconds,
    embedding_seconds,
    head_seconds,
    sync_seconds,
)
from ptdp.perf.cost.experts import ep_comm_seconds, overlapped
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.moe import moe_layers_per_stage
from ptdp.perf.cost.parameters import parameters_per_stage, tensors_per_stage
from ptdp.perf.cost.zero import sharded_passes
from ptdp.pipeline.dryrun import PipelineCosts
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.rules.layout import Layout


def layer_costs(cfg: RunConfig, layout: Layout, c: Compute, moe: bool = False) -> Passes:
    """F, B, W seconds of one layer and microbatch on one rank (its s/cp tokens under cp);
    `moe`: a mixture-of-experts layer (`ptdp.perf.cost.moe`), its all-to-alls under expert
    parallelism included (`ptdp.perf.cost.experts`)."""
    par = cfg.parallel
    passes = cp_layer_seconds(
        cfg.model,
        micro_batch=cfg.train.micro_batch_size,
        tp=layout.tp,
        sequence_parallel=par.sequence_parallel,
        recompute=par.recompute,
        c=c,
        cp=layout.cp,
        comm=par.cp_comm,
        moe=moe,
        ep=layout.ep if moe else 1,
        etp=layout.etp if moe else None,
    )
    if not moe:
        return passes
    a2a = ep_passes(cfg, layout, c)
    if getattr(par, "moe_overlap", False) or c.software.moe_a2a_overlap:  # paired passes
        a2a = overlapped(a2a, passes, c.software.moe_overlap_fraction)
    return passes + a2a


def ep_passes(cfg: RunConfig, layout: Layout, c: Compute) -> Passes:
    """One MoE layer's all-to-alls, one microbatch (`experts.ep_comm_seconds`)."""
    return ep_comm_seconds(
        local_model(cfg.model, layout.cp),
        micro_batch=cfg.train.micro_batch_size,
        tp=layout.tp,
        ep=layout.ep,
        recompute=cfg.parallel.recompute,
        c=c,
        etp=layout.etp,
    )


def compute_costs(cfg: RunConfig, layout: Layout, c: Compute) -> list[Passes]:
    """F, B, W seconds of one microbatch through each global stage, without ZeRO-2/3's
    communication or the gradients' accumulation (`stage_costs` has both)."""
    b, tp = cfg.train.micro_batch_size, layout.tp
    model = local_model(cfg.model, layout.cp)
    layer = layer_costs(cfg, layout, c)
    stages = layout.pp * layout.vpp
    split = layout.stage_layers or (model.num_layers // stages,) * stages
    passes = [layer.times(n) for n in split]
    moe = layer_costs(cfg, layout, c, moe=True) if model.num_experts else layer
    if model.num_experts:  # MoE layers at their own cost
        counts = moe_layers_per_stage(model, split)
        passes = [layer.times(n - m) + moe.times(m) for n, m in zip(split, counts)]
    passes[0] += embedding_seconds(model, micro_batch=b, tp=tp, c=c)
    head = head_seconds(
        model,
        micro_batch=b,
        tp=tp,
        c=c,
        compiled=cfg.train.compile,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )
    passes[-1] += head
    if model.mtp_depth:  # each depth: a layer of the last layer's kind and the head again
        last = moe if model.is_moe_layer(model.num_layers - 1) else layer
        passes[-1] += (last + head).times(model.mtp_depth)
    return passes


def accumulation(cfg: RunConfig, layout: Layout, c: Compute) -> list[float]:
    """Per global stage: one microbatch's weight gradients added into the gradient buffers
    as autograd writes them (`costs.accumulation_seconds`), a part of W."""
    model, stages = cfg.model, layout.pp * layout.vpp
    params = parameters_per_stage(
        model, layout.tp, layout.pp, layout.vpp, layout.stage_layers, layout.ep, layout.etp
    )
    tensors = tensors_per_stage(model, stages, layout.stage_layers)
    return [accumulation_seconds(n, k, c) for n, k in zip(params, tensors)]


def _accumulated(passes: list[Passes], seconds: list[float]) -> list[Passes]:
    return [p + Passes(0.0, 0.0, a) for p, a in zip(passes, seconds)]


def stage_costs(cfg: RunConfig, layout: Layout, c: Compute) -> list[Passes]:
    """F, B, W seconds of one microbatch through each global stage, ZeRO-2/3's exposed
    communication and the gradients' accumulation included."""
    passes = sharded_passes(cfg, layout, c, compute_costs(cfg, layout, c))[0]
    return _accumulated(passes, accumulation(cfg, layout, c))


def transfer_seconds(cfg: RunConfig, layout: Layout, system: System, sender: int) -> float:
    """Pipeline rank `sender` to its neighbour, on the wire: network across nodes, NVLink
    within one. With scatter/gather (or sequence parallelism) each of the t tensor ranks
    sends 1/t of the boundary tensor over its own card (the paper's section 4.1)."""
    t, span = layout.tp, layout.tp * layout.cp * layout.dp  # GPUs between neighbouring stages
    b, m = cfg.train.micro_batch_size, local_model(cfg.model, layout.cp)
    nbytes = b * m.seq_length * m.hidden_size * (4 if cfg.train.precision is Precision.FP32 else 2)
    stages = layout.stages
    a, z = stages.rank(sender) * span, stages.rank(sender + 1) * span
    link = system.intra if system.node_of(a) == system.node_of(z) else system.inter
    split = t > 1 and (cfg.parallel.sequence_parallel or cfg.parallel.scatter_gather)
    return link.transfer_seconds(nbytes / t if split else nbytes)


def receive_seconds(cfg: RunConfig, layout: Layout, system: System) -> float:
    """The receivers' all-gather of a scattered boundary tensor over NVLink (scatter/gather
    without sequence parallelism): the receiving rank's work, not the sender's."""
    t, m = layout.tp, local_model(cfg.model, layout.cp)
    if t == 1 or cfg.parallel.sequence_parallel or not cfg.parallel.scatter_gather:
        return 0.0
    e = 4 if cfg.train.precision is Precision.FP32 else 2
    nbytes = cfg.train.micro_batch_size * m.seq_length * m.hidden_size * e
    return gather_seconds(nbytes, t, group_link(system, t, 1))


def pipeline_costs(cfg: RunConfig, layout: Layout, c: Compute) -> PipelineCosts:
    passes = sharded_passes(cfg, layout, c, compute_costs(cfg, layout, c))[0]
    split = SCHEDULES[cfg.parallel.schedule.value].splits_backward
    if split and cfg.train.compile:
        # Compiled layers keep autograd's fused linear backward (ptdp/parallel/wgrad.py):
        # their weight-gradient GEMMs run in B, and W only adds the gradients in.
        passes = [Passes(p.f, p.b + p.w, 0.0) for p in passes]
    elif split:  # what the split costs beyond the fused backward, paid in W (module doc)
        extra = c.system.device.split_backward_ratio - 1.0
        passes = [Passes(p.f, p.b, p.w + extra * (p.b + p.w)) for p in passes]
    # the accumulation after the split's extra: W adds each gradient in as a fused backward does
    passes = _accumulated(passes, accumulation(cfg, layout, c))
    stages = len(passes)
    # The receiver waits on each transfer: the wire, then its resynchronisation (CPUs).
    hop = [transfer_seconds(cfg, layout, c.system, s) + sync_seconds(1, c) for s in range(stages)]
    gather = receive_seconds(cfg, layout, c.system)
    return PipelineCosts(
        tuple(p.f for p in passes),
        tuple(p.b for p in passes),
        tuple(p.w for p in passes),
        tuple(hop),
        tuple([0.0] + hop[: stages - 1]),  # gradient s -> s-1 crosses the same link as s-1 -> s
        (gather,) * stages,
        (0.0,) + (gather,) * (stages - 1),
    )
