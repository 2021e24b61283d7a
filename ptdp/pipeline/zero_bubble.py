"""The zero-bubble pipeline schedules: the backward split into B (input gradient) and W (weights).

ZB-H1, ZB-H2 and ZB-V (Qi et al., arXiv 2401.10241, sections 3 and 6) as pure functions of
ints, each returning a compute-only `Plan` (registered, with their bubble formulas and
in-flight bounds, in `ptdp.pipeline.schedules.SCHEDULES`). W needs no neighbour, so it can
wait and fill the bubble: ZB-H1 keeps 1F1B's order of F and B (`ptdp.pipeline.classic`) and
defers W's; ZB-H2 and ZB-V are list schedules at unit costs. The layers make the split real
(`ptdp.parallel.wgrad`).

Letters: pp = pipeline ranks, m = microbatches per pipeline per step, r = pipeline rank (0
first). ZB-H1 and ZB-H2 hold one stage per rank; ZB-V's two chunks per rank sit in a V
(stages r and 2 pp - 1 - r; `ptdp.pipeline.placement`).

In flight: a microbatch holds its activations on a stage from its F until its W (B leaves the
graph, or the weight-gradient inputs, for W), which is how `verify` and
`ptdp.perf.cost.memory` count.
"""

from __future__ import annotations

from collections import deque

from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.classic import one_f_one_b_warmup
from ptdp.pipeline.placement import Placement, StageMap


def zb_h1(pp: int, m: int) -> Plan:
    """ZB-H1 (Qi et al., arXiv 2401.10241): 1F1B with the backward split into B and W.

    F and B run in 1F1B's order. W needs no neighbour, so it can wait: after each B, rank r
    runs the oldest pending W only if more than r are pending, and runs the r held back at
    the end. Counted until W, rank r holds 1F1B's pp - rank forwards plus those r W's: at most
    pp microbatches on every rank (min(pp, m), checked over pp <= 8, m <= 6 pp), where 1F1B
    holds pp - rank.

    Why r: the last microbatch's B still has r ranks to pass after it leaves rank r, so rank r
    would idle r slots at the end; its r deferred W's fill them (at T_F = T_B = T_W every rank
    then ends together). The bubble falls from 1F1B's (pp - 1)(T_F + T_B + T_W) to the
    paper's (pp - 1)(T_F + T_B - T_W) for m >= pp; with fewer microbatches the dependency chain
    through all stages is longer than that (the makespan is 3m + max(pp - 1, 2 pp - 1 - m),
    as for ZB-H2).
    """
    return {r: _zb_h1_rank(r, pp, m) for r in range(pp)}


def _zb_h1_rank(rank: int, pp: int, m: int) -> list[Action]:
    pending: deque[int] = deque()  # microbatches whose B ran and whose W has not

    def backward(mb: int) -> list[Action]:
        pending.append(mb)
        done = [Action(Kind.B, rank, mb)]
        if len(pending) > rank:
            done.append(Action(Kind.W, rank, pending.popleft()))
        return done

    warmup = one_f_one_b_warmup(rank, pp, m)
    actions = [Action(Kind.F, rank, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        actions += [Action(Kind.F, rank, warmup + i), *backward(i)]
    for mb in range(m - warmup, m):
        actions += backward(mb)
    return actions + [Action(Kind.W, rank, mb) for mb in pending]


def zb_h2(pp: int, m: int) -> Plan:
    """ZB-H2 (Qi et al., arXiv 2401.10241, section 3): ZB-H1 with up to 2 pp - 1 in flight.

    Built by list scheduling at T_F = T_B = T_W = 1: at each time unit every rank runs, first
    that can, its next B whose output gradient has arrived, its next F whose input has arrived
    while fewer than 2 pp - 1 microbatches are in flight (F run, W not), or its oldest pending
    W; otherwise it waits. Rank r's warm-up is then the paper's 2(pp - r) - 1 forwards, which
    fill the time until microbatch 0's B comes back, and the W's deferred past the last B make
    the tail a parallelogram: for m >= 2 pp - 1 every rank computes without a gap from its
    first action to its last (`ScheduleReport.span` = 3m), the paper's zero bubble.

    That gap-free span is zero bubble only for overlapping steps (the paper bypasses the
    optimizer's synchronisation to get them; ptdp's step synchronises). Within one step the
    last rank cannot start before pp - 1 forwards reach it, and rank 0's first B cannot start
    before 2 pp - 1 (microbatch 0 through pp F's and pp - 1 B's), after which it has m B's and
    m W's left. So the makespan is at least 3m + max(pp - 1, 2 pp - 1 - m), which ZB-H1 and
    ZB-H2 both reach: the verifier's bubble is max(pp - 1, 2 pp - 1 - m) / (3m) for both,
    (pp - 1) / (3m) for m >= pp. Other costs separate them: replayed, ZB-H2's makespan exceeds
    m (T_F + T_B + T_W) by (pp - 1) max(T_F, T_F + T_B - 2 T_W), ZB-H1's by (pp - 1)
    max(T_F, T_F + T_B - T_W) (the paper's formulas, floored by the last rank's wait), so
    ZB-H2 wins when T_B > T_W. It pays with min(2 pp - 1, m) microbatches in flight on every
    rank against ZB-H1's min(pp, m) (checked over pp <= 8, m <= 6 pp).
    """
    limit = 2 * pp - 1
    plan: Plan = {r: [] for r in range(pp)}
    f_done = [[-1] * m for _ in range(pp)]  # time each F ends; -1: not run yet
    b_done = [[-1] * m for _ in range(pp)]
    done = {kind: [0] * pp for kind in (Kind.F, Kind.B, Kind.W)}  # passes run per rank
    t = 0
    done_f, done_b, done_w = done[Kind.F], done[Kind.B], done[Kind.W]
    while any(w < m for w in done_w):
        ran = []  # decided on the state at time t, applied after every rank has chosen
        for r in range(pp):
            f, b, w = done_f[r], done_b[r], done_w[r]
            if b < f and 0 <= f_done[r][b] <= t and (r == pp - 1 or 0 <= b_done[r + 1][b] <= t):
                ran.append(Action(Kind.B, r, b))
            elif f < m and f - w < limit and (r == 0 or 0 <= f_done[r - 1][f] <= t):
                ran.append(Action(Kind.F, r, f))
            elif w < b:
                ran.append(Action(Kind.W, r, w))
        for a in ran:
            plan[a.stage].append(a)
            done[a.kind][a.stage] += 1
            if a.kind is not Kind.W:
                (f_done if a.kind is Kind.F else b_done)[a.stage][a.mb] = t + 1
        t += 1
        assert t <= 3 * m + 2 * pp, "zb_h2 list scheduling stalled"  # makespan <= 3m + 2pp - 1
    return plan


_ZB_V_POLICIES = (("B0", "F1", "F0", "B1", "W", 1), ("F1", "F0", "B0", "B1", "W", 0))
"""(preference order, admission slack) of the list schedules `zb_v` tries; between them they
reach the (pp - 1) / (6m) bubble for every m >= 2 pp, pp <= 8 (searched over all 240 orders
and slacks; no single order does)."""


def zb_v(pp: int, m: int) -> Plan:
    """ZB-V (Qi et al., arXiv 2401.10241, section 6): two chunks per rank placed in a V.

    Rank r holds stages r (chunk 0) and 2 pp - 1 - r (chunk 1), so a microbatch goes down the
    ranks and back up, its loss on rank 0, and the first and last stage share a rank. Built
    by list scheduling at unit costs (F = B = W = 1 per chunk): at each time unit every rank
    runs the first pass it can, in one of `_ZB_V_POLICIES`' orders, where a chunk-0 F (a new
    microbatch on this rank) is admitted only while fewer than 2 pp - slack chunk activations
    are held and a chunk-1 F while fewer than 2 pp; the builder keeps the policy with the
    shortest makespan. 2 pp chunk activations are pp whole stages: 1F1B's peak on rank 0,
    now on every rank.

    Each rank has 6m passes; the last rank cannot start before pp - 1 forwards reach it, so
    the makespan is at least 6m + pp - 1 and the bubble at least (pp - 1) / (6m), half ZB-H1's
    (pp - 1) / (3m) at the same memory as 1F1B; the verifier's dry run meets that bound for
    m >= 2 pp (checked for pp <= 8, m <= 6 pp). With fewer microbatches the chain of one
    microbatch through all 2 pp stages and back dominates.
    """
    plans = [_zb_v_list_schedule(pp, m, order, slack) for *order, slack in _ZB_V_POLICIES]
    return min(plans, key=lambda timed: timed[1])[0]


def _zb_v_list_schedule(pp: int, m: int, order: list[str], slack: int) -> tuple[Plan, int]:
    """One list schedule of `zb_v` at unit costs; returns it and its makespan."""
    stages, limit = StageMap(pp, 2, Placement.V), 2 * pp
    f_done: dict[tuple[int, int], int] = {}  # (stage, mb) -> end of its F
    b_done: dict[tuple[int, int], int] = {}
    runs = {kind: [0] * (2 * pp) for kind in (Kind.F, Kind.B)}  # passes run per stage
    pending: list[deque[Action]] = [deque() for _ in range(pp)]  # B run, W not
    held = [0] * pp
    plan: Plan = {r: [] for r in range(pp)}
    never = 1 << 30
    held_by = [stages.stages_of(r) for r in range(pp)]  # rank -> its stages, chunk order
    last, runs_f, runs_b = stages.last, runs[Kind.F], runs[Kind.B]
    passes = [(name[0], 0 if name == "W" else int(name[1])) for name in order]

    def next_pass(r: int, t: int) -> Action | None:
        for kind, chunk in passes:
            if kind == "W":
                if pending[r]:
                    return pending[r][0]
                continue
            s = held_by[r][chunk]
            if kind == "B":
                b = runs_b[s]
                after_next = s == last or b_done.get((s + 1, b), never) <= t
                if b < runs_f[s] and f_done[(s, b)] <= t and after_next:
                    return Action(Kind.B, s, b)
            else:
                f = runs_f[s]
                room = held[r] + (slack if chunk == 0 else 0) < limit
                if f < m and room and (s == 0 or f_done.get((s - 1, f), never) <= t):
                    return Action(Kind.F, s, f)
        return None

    t = 0
    while any(pending) or any(n < m for n in runs[Kind.B]):
        chosen = [(r, next_pass(r, t)) for r in range(pp)]  # all decide on the state at t
        for r, a in chosen:
            if a is None:
                continue
            plan[r].append(a)
            if a.kind is Kind.W:
                pending[r].popleft()
                held[r] -= 1
                continue
            runs[a.kind][a.stage] += 1
            (f_done if a.kind is Kind.F else b_done)[(a.stage, a.mb)] = t + 1
            if a.kind is Kind.F:
                held[r] += 1
            else:
                pending[r].append(Action(Kind.W, a.stage, a.mb))
        t += 1
        assert t <= 6 * m + 4 * pp * pp, "zb_v list scheduling stalled"
    return plan, t
