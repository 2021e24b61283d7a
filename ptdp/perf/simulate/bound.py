"""A proven lower bound on a layout's step time, from the simulator's own costs, without the
replay: what lets the planner skip the replays that could not change what it prints.

Letters: p pipeline ranks, m microbatches, f_s, b_s, w_s one microbatch's F, B, W on global
stage s (`pipeline_costs.pipeline_costs`, ZeRO-2/3's exposed collectives included), h_s^F the
activation's hop s -> s + 1 (wire, then the receiver's gather), h_s^B the gradient's s -> s - 1;
a hop between two stages of one rank (p = 1, ZB-V's turn) costs 0. Rank r's lowest stage is
s0 = r under both placements (looped: r, r + p, ...; V: r and 2p - 1 - r).

Whatever the order of a rank's list, a replay (`ptdp.pipeline.dryrun`) obeys three facts:

1. Rank r's first compute is an F of one of its stages (a B waits for its F, a W for its B,
   on the same rank), so it starts no earlier than the forward chain to s0,
   head_r = sum_{s < s0} (f_s + h_s^F).
2. A rank runs its list one action at a time, so the k-th action ends no earlier than
   head_r plus the durations of actions 1..k; in all, busy_r = m sum_{s on r} (f + b + w).
3. B(s, mb) waits for B(s + 1, mb) (plus the hop), so every F and B of rank r precedes its
   last B of stage s0, B(s0, mb*): only W's can follow it. After B(s0, mb*) ends, the
   gradient still crosses stages s0 - 1 .. 0, tail_r = sum_{s < s0} (b_s' + h_{s+1}^B) with
   b_s' = b_s (split) or b_s + w_s (fused BW), then W(0, mb*) (split: + w_0).

So the last gradient action of stage 0 ends no earlier than, for every rank r,
chain_r = head_r + busy_r - after_r + tail_r, where after_r is what rank r's list runs after
B(s0, mb*): nothing for the fused schedules, the deferred W's for the split ones (read off
the plan: for ZB-H1 the r + 1 W's it holds back on rank r). And rank r itself ends no earlier
than head_r + busy_r (plus, under blocking transfers, the wire time of every send it carries).

Per schedule family that reads:

- 1F1B and GPipe (fused, v = 1): chain_r = forward chain to r + busy_r + backward chain r -> 0;
  on the last rank exactly 1F1B's (p - 1)(f + b + hops) bubble at equal stages.
- interleaved (fused, v chunks, looped): the same with s0 = r (chunk 0): the chains cross
  r chunks, 1/v of a stage each, the (p - 1)/(v m) bubble.
- ZB-H1 and ZB-H2 (split, v = 1): the same chains, less the W's the plan runs after the last B,
  plus W(0) at the end of the chain.
- ZB-V (split, V placement): s0 = r, chains through r ranks each way, the turn in memory.
- `--software megatron-2021` (blocking transfers, fused, its own interleaved order): the fused
  bound depends on no order; each rank also carries its sends (R_r above).

The step adds the data-parallel reduction and what follows the pipeline (`step_seconds`).
Without overlap each rank reduces after its own end: + its stages' reduction seconds. With
overlap stage s's last bucket leaves after its last gradient action: rank 0 ends no earlier
than max_r chain_r + stage 0's last bucket; rank r no earlier than its last B(s0) (+ w_s0
when split) plus stage s0's last bucket. The bound is the largest of these plus
`step_seconds`, times 1 - `SLACK` (the replay sums in another order, and the planner's short
replay extends three replays that agree to 1e-9 per step).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptdp.config.sections import RunConfig
from ptdp.perf.cost.costs import Compute
from ptdp.perf.simulate.optimizer_step import step_seconds
from ptdp.perf.simulate.pipeline_costs import pipeline_costs
from ptdp.perf.simulate.reduction import overlaps_reduction, stage_reductions
from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.dryrun import PipelineCosts
from ptdp.pipeline.lowering import apart
from ptdp.pipeline.placement import StageMap
from ptdp.rules.layout import Layout

SLACK = 1e-6
"""Relative margin taken off the bound: far above the replay's rounding and the short replay's
tolerance (1e-9 of the makespan per extended step), far below the gaps it prunes by."""


@dataclass(frozen=True)
class PipelineBound:
    """Lower bounds, in seconds, on one replay of a plan (module doc), per pipeline rank."""

    chain: tuple[float, ...]
    """head_r + busy_r - after_r + tail_r: the end of stage 0's last gradient action."""
    own: tuple[float, ...]
    """head_r + busy_r (+ sends under blocking transfers): rank r's end."""
    lowest_grad: tuple[float, ...]
    """The end of the last gradient action of rank r's lowest stage."""

    @property
    def makespan(self) -> float:
        return max(max(self.chain), max(self.own))


def pipeline_bound(
    compute: Plan, stages: StageMap, m: int, costs: PipelineCosts, *, blocking: bool = False
) -> PipelineBound:
    """Lower bounds on the replay of `compute` (its `add_comms` lowering, or any other order of
    the same passes when fused) under `costs` (module doc, facts 1-3)."""
    n, pp = stages.stages, stages.pp
    f, b, w = costs.forward, costs.backward_input, costs.backward_weight
    below, above = apart(stages)
    recv_f = costs.receive_forward or (0.0,) * n
    recv_b = costs.receive_backward or (0.0,) * n
    send_f = [costs.send_forward[s] if above[s] else 0.0 for s in range(n)]
    send_b = [costs.send_backward[s] if below[s] else 0.0 for s in range(n)]
    hop_f = [send_f[s] + recv_f[s] if above[s] else 0.0 for s in range(n)]
    hop_b = [send_b[s] + recv_b[s] if below[s] else 0.0 for s in range(n)]
    split = any(a.kind is Kind.W for a in compute[0])
    back = [b[s] if split else b[s] + w[s] for s in range(n)]
    chain, own, lowest = [], [], []
    for r in range(pp):
        mine = stages.stages_of(r)
        s0 = min(mine)
        head = sum(f[s] + hop_f[s] for s in range(s0))
        tail = sum(back[s] + hop_b[s + 1] for s in range(s0)) + (w[0] if split else 0.0)
        busy = m * sum(f[s] + b[s] + w[s] for s in mine)
        after = _after_last_backward(compute[r], s0, costs) if split else 0.0
        sends = m * sum(send_f[s] + send_b[s] for s in mine)  # each holds the rank (blocking)
        chain.append(head + busy - after + tail)
        own.append(head + busy + (sends if blocking else 0.0))
        lowest.append(head + busy - after + (w[s0] if split else 0.0))
    return PipelineBound(tuple(chain), tuple(own), tuple(lowest))


def _after_last_backward(actions: list[Action], s0: int, costs: PipelineCosts) -> float:
    """Seconds of the actions a rank's list runs after its last B of stage `s0` (W's only,
    fact 3), read from the end of the list."""
    seconds = 0.0
    for a in reversed(actions):
        if a.kind is Kind.B and a.stage == s0:
            return seconds
        seconds += costs.duration(a)
    raise ValueError(f"stage {s0} has no B on its rank")


def step_lower_bound(cfg: RunConfig, layout: Layout, c: Compute) -> float:
    """A lower bound on `simulate(cfg, ...).iteration_seconds` for this layout (module doc),
    without replaying it: the costs, the memory model's plan (`layout.pipeline`, for the W's a
    split schedule defers) and the reduction and step terms the simulator adds."""
    costs = pipeline_costs(cfg, layout, c)
    compute, m = layout.pipeline.compute, layout.num_microbatches
    run = pipeline_bound(compute, layout.stages, m, costs, blocking=c.software.blocking_p2p)
    reductions = stage_reductions(cfg, layout, c)
    stages = layout.stages
    ends = list(run.own)
    if overlaps_reduction(cfg, c):
        ends.append(max(run.chain) + reductions[0][1])
        for r in range(layout.pp):
            ends.append(run.lowest_grad[r] + reductions[min(stages.stages_of(r))][1])
    else:
        total = [0.0] * layout.pp
        for s, (seconds, _) in enumerate(reductions):
            total[stages.rank(s)] += seconds
        ends.append(max(run.chain) + total[0])
        ends += [end + extra for end, extra in zip(run.own, total)]
    return (max(ends) + step_seconds(cfg, layout, c, costs)) * (1 - SLACK)
