"""Predicts a training step by replaying the schedule's own action lists with a cost model.

`simulate` builds the costs for a config on a `System` (`ptdp.perf.cost.costs`), replays one
pipeline (all data-parallel replicas and tensor ranks run the same timeline), adds the
data-parallel gradient reduction (overlapped with each chunk's last backward, or after
the step; ZeRO-2 and 3 per microbatch, `ptdp.perf.cost.zero`) and the optimizer step, and
reports iteration time, the paper's bubble (bubble time / ideal time), TFLOP/s per
device, memory and the per-rank timeline. Context parallelism (`ptdp.perf.cost.context`): a
rank computes its s/cp tokens and 1/cp of the causal attention, plus the exposed K/V
transfers. A zero-bubble schedule's W pays what its split backward costs beyond the fused
one (`Device.split_backward_ratio`: it reads its operands back after B). Expert
parallelism (`ptdp.perf.cost.experts`): an MoE layer's rank computes its e / ep experts'
rows and waits on its four all-to-alls; its routed experts' gradients are reduced over
their edp ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import astuple, dataclass

from ptdp.config.enums import Precision, Recompute
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.collectives import all_reduce_seconds, gather_seconds, group_link
from ptdp.perf.cost.context import local_model
from ptdp.perf.cost.context_costs import cp_comm_seconds, cp_layer_seconds
from ptdp.perf.cost.costs import (
    Compute,
    Passes,
    accumulation_seconds,
    embedding_seconds,
    head_seconds,
    sync_seconds,
)
from ptdp.perf.cost.experts import ep_comm_seconds, reduction_groups
from ptdp.perf.cost.flops import flops_per_iteration, utilisation
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.kernels import Call
from ptdp.perf.cost.memory import MemoryEstimate, estimate_memory
from ptdp.perf.cost.moe import moe_layers_per_stage
from ptdp.perf.cost.parameters import (
    expert_parameters_per_rank,
    expert_parameters_per_stage,
    parameters_per_rank,
    parameters_per_stage,
    tensors_per_rank,
    tensors_per_stage,
)
from ptdp.perf.cost.reserve import with_reserve
from ptdp.perf.cost.software import PTDP, Software
from ptdp.perf.cost.switches import run_software
from ptdp.perf.cost.zero import sharded_passes
from ptdp.perf.simulate.megatron2021 import megatron_2021_interleaved
from ptdp.perf.simulate.replay import PipelineCosts, PipelineRun, replay, replay_steady
from ptdp.pipeline.placement import Placement
from ptdp.pipeline.plan import PipelinePlan, build_plan
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.pipeline.timeline import Event
from ptdp.rules.layout import Layout, validate

__all__ = ["PipelineCosts", "PipelineRun", "Prediction", "replay", "simulate"]


@dataclass(frozen=True)
class Prediction:
    """Predicted step of one config on one system."""

    layout: Layout
    iteration_seconds: float
    pipeline_seconds: float
    """From the first forward to the last backward (no reduction, no optimizer)."""
    bubble_fraction: float
    tflops_per_device: float
    """FLOPs executed (recomputation included; the paper's equation (3) under full
    recomputation) per second per device, in TFLOP/s."""
    model_tflops_per_device: float
    """Model FLOPs (no recomputation) per second per device."""
    mfu: float
    hfu: float
    tokens_per_second: float
    memory: tuple[MemoryEstimate, ...]
    busy: tuple[float, ...]
    """Per pipeline rank: seconds computing."""
    layer: Passes
    """One layer, one microbatch: F, B, W seconds (tensor-parallel communication included);
    of a model with mixture-of-experts layers, an MoE layer."""
    p2p_seconds: float
    """One boundary transfer (forward direction, first stage's)."""
    dp_seconds: float
    """Data-parallel communication per rank (all of it, exposed or not): the gradient
    reduction, and ZeRO-2/3's per-microbatch reduce-scatters and ZeRO-3's gathers."""
    optimizer_seconds: float
    events: tuple[Event, ...]
    device_memory: float
    """Bytes of one device's memory (`Device.memory_bytes`): what `fits` holds each rank's
    count and reserve against."""
    cp_seconds: tuple[float, float] = (0.0, 0.0)
    """Context parallelism, one layer and microbatch, forward + backward: seconds of K/V
    transfers on the wire and the part of them exposed (not hidden behind attention)."""
    ep_seconds: float = 0.0
    """Expert parallelism, one MoE layer and microbatch, forward + backward: seconds of its
    all-to-alls (dispatch and combine each way, none hidden; in `layer` too)."""

    @property
    def idle(self) -> tuple[float, ...]:
        return tuple(self.iteration_seconds - b for b in self.busy)

    @property
    def peak_memory(self) -> float:
        return max(m.total for m in self.memory)

    @property
    def limiting(self) -> MemoryEstimate:
        """The pipeline rank nearest its limit: the most memory with its reserve (as in
        `reserve.fit`)."""
        return max(self.memory, key=lambda m: m.total + m.reserved)

    @property
    def fits(self) -> bool:
        """Whether every pipeline rank's count fits beside its reserve (`reserve.fit`)."""
        m = self.limiting
        return m.total <= self.device_memory - m.reserved

    @property
    def over_by(self) -> float:
        """Bytes the limiting rank needs beyond the device's memory; 0 where it fits."""
        m = self.limiting
        return 0.0 if self.fits else m.total + m.reserved - self.device_memory


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
    )
    return passes + (_ep_passes(cfg, layout, c) if moe else Passes())


def _ep_passes(cfg: RunConfig, layout: Layout, c: Compute) -> Passes:
    """One MoE layer's all-to-alls, one microbatch (`experts.ep_comm_seconds`)."""
    return ep_comm_seconds(
        local_model(cfg.model, layout.cp),
        micro_batch=cfg.train.micro_batch_size,
        tp=layout.tp,
        ep=layout.ep,
        recompute=cfg.parallel.recompute,
        c=c,
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
    if model.num_experts:  # MoE layers at their own cost
        moe = layer_costs(cfg, layout, c, moe=True)
        counts = moe_layers_per_stage(model, split)
        passes = [layer.times(n - m) + moe.times(m) for n, m in zip(split, counts)]
    passes[0] += embedding_seconds(model, micro_batch=b, tp=tp, c=c)
    passes[-1] += head_seconds(
        model,
        micro_batch=b,
        tp=tp,
        c=c,
        compiled=cfg.train.compile,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )
    return passes


def accumulation(cfg: RunConfig, layout: Layout, c: Compute) -> list[float]:
    """Per global stage: one microbatch's weight gradients added into the gradient buffers
    as autograd writes them (`costs.accumulation_seconds`), a part of W."""
    model, stages = cfg.model, layout.pp * layout.vpp
    params = parameters_per_stage(
        model, layout.tp, layout.pp, layout.vpp, layout.stage_layers, layout.ep
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
    its last backward ends under overlap: the last bucket's share). See `_reduce_gradients`.
    Under expert parallelism the routed experts' gradients go over their edp group
    (`experts.reduction_groups`), after the rest."""
    model, par, d, t = cfg.model, cfg.parallel, layout.dp * layout.cp, layout.tp
    split = (layout.pp, layout.vpp, layout.stage_layers, layout.ep)
    params = parameters_per_stage(model, t, *split)
    experts = expert_parameters_per_stage(model, t, *split)
    bucket = par.bucket_mb * 2**20
    tied_copies = model.tie_embeddings and layout.pp * layout.vpp > 1
    out = []
    for stage, (count, routed) in enumerate(zip(params, experts)):
        nbytes = float(c.software.grad_reduce_bytes * count)
        seconds = 0.0  # ZeRO-2 and 3: per microbatch, in the passes
        for n, size, stride in reduction_groups(count, routed, tp=t, dp_cp=d, ep=layout.ep):
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


def _reduce_gradients(
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
    split = (layout.pp, layout.vpp, layout.stage_layers, layout.stages.placement, layout.ep)
    counts = parameters_per_rank(cfg.model, layout.tp, *split)
    busiest = max(range(layout.pp), key=lambda r: counts[r])
    per_rank = counts[busiest]
    routed = expert_parameters_per_rank(cfg.model, layout.tp, *split)[busiest]
    fp32 = cfg.train.precision is Precision.FP32
    group = layout.dp * layout.cp
    shard = group if layout.shards_optimizer else 1
    groups = reduction_groups(per_rank, routed, tp=layout.tp, dp_cp=group, ep=layout.ep)
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


def predicted_memory(
    cfg: RunConfig, layout: Layout, system: System, software: Software, world_size: int
) -> tuple[MemoryEstimate, ...]:
    """`Prediction.memory`: the memory model's bytes per pipeline rank with their reserve; no
    replay needed (the planner decides fit with it before replaying)."""
    memory = estimate_memory(
        cfg,
        world_size,
        fused_attention=software.fused_attention,
        autocast_norms=software.autocast_norms,
        native_gqa=software.native_gqa,
        fused_swiglu=software.fused_swiglu,
        gemm_accumulates=software.accumulation_bytes == 0,
        math_kernel=software.math_kernel,
        layout=layout,
        gloo_sends=system.device.gloo,  # a CPU's pipeline holds its sends until the step ends
    )
    return tuple(with_reserve(memory, cfg, layout, system))


PlanSource = Callable[[str, int, int, int], PipelinePlan]
"""(schedule, pp, m, vpp) -> the plan: `build_plan`, or the planner's cache of it."""


def _replay(
    layout: Layout, costs: PipelineCosts, blocking: bool, timeline: bool, plans: PlanSource
) -> PipelineRun:
    """The replay of the layout's plan (under blocking transfers an interleaved one in the
    2021 code's order, `megatron_order`); without `timeline`, from its steady state where
    the schedule has one (ZB-V's list schedule is replayed in full)."""
    spec, pp, vpp = SCHEDULES[layout.schedule], layout.pp, layout.vpp
    megatron = blocking and megatron_order(layout)
    # each m's plan compiled once for the dry-run engine, or the 2021 code's own order
    source = lambda m: plans(layout.schedule, pp, m, vpp).program  # noqa: E731
    if megatron:
        source = functools.partial(megatron_2021_interleaved, layout.stages)
    if not timeline and layout.schedule != "zb-v":
        run = replay_steady(
            source,
            layout.stages,
            layout.num_microbatches,
            costs,
            period=pp if spec.interleaved else 1,
            blocking=blocking,
        )
        if run is not None:
            return run
    plan = source(layout.num_microbatches) if megatron else layout.pipeline.program
    return replay(plan, layout.stages, costs, blocking=blocking, timeline=timeline)


def megatron_order(layout: Layout) -> bool:
    """Under blocking transfers (the 2021 code) an interleaved layout replays the 2021 code's
    own order of passes and exchanges (`ptdp.perf.simulate.megatron2021`), which differs from
    ptdp's."""
    return (
        layout.schedule == "interleaved"
        and layout.pp > 1
        and layout.stages.placement is Placement.LOOPED
        and layout.vpp > 1
        and layout.num_microbatches % layout.pp == 0
    )


def require_vocab(cfg: RunConfig) -> None:
    """The performance model needs the vocabulary size, which training may take from the data."""
    if cfg.model.vocab_size <= 0:
        raise ConfigError(
            "model.vocab_size = 0 (taken from the data when training); the performance model "
            "needs it: pass --model.vocab_size N"
        )


def require_software(cfg: RunConfig, software: Software) -> None:
    """Refuse what the modelled software did not have (`--software megatron-2021`)."""
    if software.sequence_parallel:
        return
    why = "the modelled software (--software megatron-2021) had no {} (added in 2022); set {}"
    if cfg.parallel.sequence_parallel:
        raise ConfigError(why.format("sequence parallelism", "--parallel.sequence_parallel false"))
    if cfg.parallel.recompute is Recompute.SELECTIVE:
        raise ConfigError(
            why.format("selective recomputation", "--parallel.recompute full or none")
        )


def default_world_size(cfg: RunConfig) -> int:
    """tp * cp * pp * dp, with dp = 1 where the config leaves it to the world size (dp = 0)."""
    p = cfg.parallel
    return p.tp * p.cp * p.pp * max(p.dp, 1)


def simulate(
    cfg: RunConfig,
    system: System,
    world_size: int,
    *,
    software: Software = PTDP,
    layout: Layout | None = None,
    timeline: bool = True,
    plans: PlanSource = build_plan,
) -> Prediction:
    """Predict one training step of `cfg` on `world_size` devices of `system`.

    `layout` is `validate(cfg, world_size)` if the caller has it (with its built plan).
    `timeline=False` (the planner) replays the steady state in short (`replay_steady`) where
    the schedule allows: the same numbers, but `events` only each stage's last gradient
    action and the reduction; `plans` builds (or looks up) the shorter plans it replays.
    """
    require_vocab(cfg)
    require_software(cfg, software)
    software = run_software(cfg, software, system)  # train.cuda_graphs, attention_backend
    layout = layout or validate(cfg, world_size, gpus=True)
    c = Compute(system, cfg.train.precision, software)
    pp = layout.pp
    costs = pipeline_costs(cfg, layout, c)
    run = _replay(layout, costs, software.blocking_p2p, timeline, plans)
    ends, dp_totals, dp_events = _reduce_gradients(cfg, layout, c, run)
    step = step_seconds(cfg, layout, c, costs)
    sharded = sharded_passes(cfg, layout, c, compute_costs(cfg, layout, c))[1]
    iteration = max(ends) + step
    opt_events = [Event(r, 0, 0, "OPT", max(ends), iteration, "dp") for r in range(pp)]
    batch = cfg.train.global_batch_size
    executed = flops_per_iteration(cfg.model, batch, cfg.parallel.recompute)
    model_flops = flops_per_iteration(cfg.model, batch, Recompute.NONE)
    peak = c.peak  # the 16-bit rate under fp8: MFU as the training log reports it
    memory = predicted_memory(cfg, layout, system, software, world_size)
    layer = layer_costs(cfg, layout, c, moe=cfg.model.num_experts > 0)
    return Prediction(
        layout=layout,
        iteration_seconds=iteration,
        pipeline_seconds=run.makespan,
        bubble_fraction=run.bubble_fraction,
        tflops_per_device=executed / iteration / world_size / 1e12,
        model_tflops_per_device=model_flops / iteration / world_size / 1e12,
        mfu=utilisation(model_flops, iteration, world_size, peak),
        hfu=utilisation(executed, iteration, world_size, peak),
        tokens_per_second=batch * cfg.model.seq_length / iteration,
        memory=memory,
        busy=run.busy,
        layer=layer,
        p2p_seconds=(
            transfer_seconds(cfg, layout, system, 0) + receive_seconds(cfg, layout, system)
            if pp > 1
            else 0.0
        ),
        dp_seconds=max(dp_totals) + sharded,
        optimizer_seconds=step,
        events=run.events + tuple(dp_events) + tuple(opt_events),
        device_memory=system.device.memory_bytes,
        cp_seconds=_cp_seconds(cfg, layout, c),
        ep_seconds=sum(astuple(_ep_passes(cfg, layout, c))) if cfg.model.num_experts else 0.0,
    )


def _cp_seconds(cfg: RunConfig, layout: Layout, c: Compute) -> tuple[float, float]:
    """`Prediction.cp_seconds`: (on the wire, exposed) per layer and microbatch, F + B."""
    wire, exposed = cp_comm_seconds(
        cfg.model,
        micro_batch=cfg.train.micro_batch_size,
        tp=layout.tp,
        cp=layout.cp,
        comm=cfg.parallel.cp_comm,
        c=c,
    )
    return wire.f + wire.b, exposed.f + exposed.b
