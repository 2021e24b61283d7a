"""Communication of the ZeRO levels in the performance model (their memory: `cost.zero_bytes`).

Per step and rank, in the ZeRO paper's units (Psi = the rank's parameters, m = microbatches
per step; a ring reduce-scatter or all-gather of Psi moves Psi, an all-reduce 2 Psi):

    0  all-reduce of the gradients after the last backward              2 Psi
    1  reduce-scatter of the gradients, then all-gather of the updated
       16-bit weights after the optimizer step                           2 Psi
    2  reduce-scatter per microbatch (the full gradient buffer is freed
       after each), all-gather after the optimizer step                  (m + 1) Psi
    3  per microbatch: all-gather of the weights for the forward, again
       for the backward, reduce-scatter of the gradients; nothing after
       the step (the next forward gathers)                               3 m Psi

ZeRO-3 keeping the gathered weights between a microbatch's forward and backward
(`parallel.zero3_reshard_after_forward = false`, read where the config has it; the default
re-gathers) moves 2 m Psi. Under pipelining every microbatch crosses every stage, so ZeRO-2
and 3 pay per microbatch what ZeRO-0 and 1 pay once per step.

Overlap (prefetch). ZeRO-3's gathers run one layer ahead of the compute and the
reduce-scatters one layer behind, so a stage pass of compute T and communication C over
L layers exposes C / L (the first gather, the last reduce-scatter) plus
(L - 1) / L max(0, C - T); over gloo (a CPU) all of C, as its threads move the bytes on
the cores the compute runs on (`Device.gloo`). The exposed seconds join the stage's F
(forward gathers), B (backward gathers) and W (reduce-scatters: the pass that makes the
gradients), so the pipeline replay places them per microbatch; levels 0 and 1 keep the
simulator's reduction after the last backward.

The ZeRO group is the dp cp ranks that reduce the gradients (tp apart; `cost.context`);
under expert parallelism the routed experts' state is sharded over their edp = tp cp dp /
(ep etp) ranks (etp ep apart; `cost.folding`), each group's collectives one after the other,
on `collectives.group_link` (at `Software.sharded_comm_efficiency` of its bandwidth: the paper's
DeepSpeed reached a tenth, `software.DEEPSPEED_2021`). Weights move in the training
precision's element size (the linear layers' weights 1 byte each under ZeRO-3's fp8
all-gather, `parallel.zero3_fp8_all_gather`), gradients at `Software.grad_reduce_bytes`.
"""

from __future__ import annotations

from dataclasses import replace

from ptdp.config.sections import RunConfig
from ptdp.perf.cost.collectives import gather_seconds, group_link
from ptdp.perf.cost.costs import Compute, Passes, sync_seconds
from ptdp.perf.cost.experts import reduction_groups
from ptdp.perf.cost.hardware import Link
from ptdp.perf.cost.parameters import expert_parameters_per_stage, parameters_per_stage
from ptdp.perf.cost.zero_bytes import fp8_gathered_weights, reshard_after_forward
from ptdp.rules.layout import Layout


def _sharded_link(c: Compute, size: int, stride: int) -> Link:
    """The group's link at the software's share of its bandwidth (module doc)."""
    ring = group_link(c.system, size, stride)
    return replace(ring, efficiency=ring.efficiency * c.software.sharded_comm_efficiency)


def exposed_seconds(comm: float, compute: float, layers: int) -> float:
    """Communication of a pass prefetched (or trailing) one layer: exposed part (module doc)."""
    layers = max(1, layers)
    return comm / layers + (layers - 1) / layers * max(0.0, comm - compute)


def step_traffic(zero: int, params: float, microbatches: int, *, kept: bool = False) -> float:
    """Elements one rank sends per step at ZeRO level `zero` for `params` parameters
    (ring collectives over a large group; the module doc's table)."""
    if zero <= 1:
        return 2.0 * params
    if zero == 2:
        return (microbatches + 1) * params
    return (2 if kept else 3) * microbatches * params


def sharded_passes(
    cfg: RunConfig, layout: Layout, c: Compute, passes: list[Passes]
) -> tuple[list[Passes], float]:
    """ZeRO-2/3's per-microbatch communication folded into each stage's F, B, W (module doc).

    Returns the new passes and the seconds on the wire per step on the busiest pipeline
    rank (exposed or not); levels 0 and 1 return `passes` unchanged and 0.
    """
    group = layout.dp * layout.cp
    if layout.zero < 2 or group == 1:
        return passes, 0.0
    split = (layout.pp, layout.vpp, layout.stage_layers, layout.ep, layout.etp)
    params = parameters_per_stage(cfg.model, layout.tp, *split)
    experts = expert_parameters_per_stage(cfg.model, layout.tp, *split)
    regather = reshard_after_forward(cfg)
    m = layout.num_microbatches
    out, wire = [], [0.0] * layout.pp
    for stage, (p, n, layers) in enumerate(zip(passes, params, layout.stage_layers)):
        reduce = gather = 0.0
        fp8 = fp8_gathered_weights(cfg, layout)
        for part, size, stride in reduction_groups(
            n, experts[stage], tp=layout.tp, dp_cp=group, ep=layout.ep, etp=layout.etp
        ):
            link = _sharded_link(c, size, stride)
            reduce += gather_seconds(
                c.software.grad_reduce_bytes * part, size, link, "reduce_scatter"
            )
            if layout.zero >= 3:  # the fp8 all-gather's weights 1 byte each (the dense group)
                moved = c.e * part - (c.e - 1) * min(part, fp8 * layers)
                gather += gather_seconds(moved, size, link)
                fp8 = 0
        again = gather if regather else 0.0
        if c.system.device.gloo:  # nothing hides (module doc)
            forward, backward = gather, again + reduce
        else:
            forward = exposed_seconds(gather, p.f, layers)
            backward = exposed_seconds(again + reduce, p.b + p.w, layers)
        if layout.zero >= 3:  # each layer's gathers and reduce-scatter are waited on
            forward += sync_seconds(layers, c)
            backward += sync_seconds((2 if regather else 1) * layers, c)
        else:  # ZeRO-2: the microbatch's gradients, reduce-scattered at once
            backward += sync_seconds(1, c)
        share = again / (again + reduce) if again + reduce else 0.0
        out.append(p + Passes(forward, backward * share, backward * (1 - share)))
        wire[layout.stages.rank(stage)] += m * (gather + again + reduce)
    return out, max(wire)
