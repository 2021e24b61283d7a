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

Each part has its own module: the stages' durations and transfers that the replay is given
(`pipeline_costs`), the replay (`replay`; under blocking transfers an interleaved layout in
the 2021 code's own order, `megatron2021`), the gradient reduction (`reduction`) and the end
of the step (`optimizer_step`). This one holds the `Prediction`, the checks a config must
pass first, and `simulate`, which ties the parts together; host memory per rank is
`ptdp.perf.cost.host_memory`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import astuple, dataclass

from ptdp.config.enums import Recompute
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.context_costs import cp_comm_seconds
from ptdp.perf.cost.costs import Compute, Passes
from ptdp.perf.cost.flops import flops_per_iteration, utilisation
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.host_memory import HostMemory, host_memory
from ptdp.perf.cost.memory import MemoryEstimate, estimate_memory
from ptdp.perf.cost.reserve import with_reserve
from ptdp.perf.cost.software import PTDP, Software
from ptdp.perf.cost.switches import run_software
from ptdp.perf.cost.zero import sharded_passes
from ptdp.perf.simulate.megatron2021 import megatron_2021_interleaved
from ptdp.perf.simulate.optimizer_step import step_seconds
from ptdp.perf.simulate.pipeline_costs import (
    compute_costs,
    ep_passes,
    layer_costs,
    pipeline_costs,
    receive_seconds,
    transfer_seconds,
)
from ptdp.perf.simulate.reduction import reduce_gradients
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
    host: tuple[HostMemory, ...] = ()
    """Host memory per rank of each pipeline rank: starting, resuming, saving
    (`ptdp.perf.cost.host_memory`)."""

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
        discards_outputs=software.discards_outputs,
        layout=layout,
        gloo_sends=system.device.gloo,  # a CPU's pipeline holds its sends until the step ends
    )
    return tuple(with_reserve(memory, cfg, layout, system))


PlanSource = Callable[..., PipelinePlan]
"""(schedule, pp, m, vpp, paired=) -> the plan: `build_plan`, or the planner's cache of it
(`paired`: `parallel.moe_overlap`'s variant)."""


def _replay(
    layout: Layout, costs: PipelineCosts, blocking: bool, timeline: bool, plans: PlanSource
) -> PipelineRun:
    """The replay of the layout's plan (under blocking transfers an interleaved one in the
    2021 code's order, `megatron_order`); without `timeline`, from its steady state where
    the schedule has one (ZB-V's list schedule is replayed in full)."""
    spec, pp, vpp = SCHEDULES[layout.schedule], layout.pp, layout.vpp
    megatron = blocking and megatron_order(layout)
    # each m's plan compiled once for the dry-run engine, or the 2021 code's own order
    paired = layout.moe_overlap
    source = lambda m: plans(layout.schedule, pp, m, vpp, paired=paired).program  # noqa: E731
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
    ends, dp_totals, dp_events = reduce_gradients(cfg, layout, c, run)
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
        ep_seconds=sum(astuple(ep_passes(cfg, layout, c))) if cfg.model.num_experts else 0.0,
        host=host_memory(cfg, layout),
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
