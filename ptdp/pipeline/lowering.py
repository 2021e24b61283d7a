"""The one lowering pass: a compute-only plan given its sends and receives between ranks.

`add_comms` turns a builder's plan (`ptdp.pipeline.schedules.build`) into the lists that the
runtime executes and `verify` checks. `apart` says which neighbouring stages sit on
different ranks; the dry run (`ptdp.pipeline.dryrun`) and the simulator's lower bound read it
to treat a compute-only plan as its lowering without building it. Pure: no torch import.
"""

from __future__ import annotations

from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.placement import StageMap


def add_comms(plan: Plan, stages: StageMap) -> Plan:
    """Lower a compute-only plan: add the sends and receives between neighbouring stages.

    RECV_F goes right before each F of a stage > 0 and SEND_F right after each F of a stage
    below the last; RECV_B/SEND_B do the same around each B or BW. Transfers whose two stages
    share a rank (pp == 1, or ZB-V's turn from stage pp - 1 to pp) stay in memory and get no
    action. Receives are placed as late as possible and sends as early as possible, so a rank
    blocks only when it must. A pair (`Action.paired`: two adjacent compute actions) is
    lowered as one: both receives, both passes, both sends, as DualPipe does, so that neither
    pass waits for a transfer between them.
    """
    apart_below, apart_above = apart(stages)

    def before(a: Action) -> list[Action]:
        if a.kind is Kind.F and apart_below[a.stage]:
            return [Action(Kind.RECV_F, a.stage, a.mb)]
        if a.kind in (Kind.B, Kind.BW) and apart_above[a.stage]:
            return [Action(Kind.RECV_B, a.stage, a.mb)]
        return []

    def after(a: Action) -> list[Action]:
        if a.kind is Kind.F and apart_above[a.stage]:
            return [Action(Kind.SEND_F, a.stage, a.mb)]
        if a.kind in (Kind.B, Kind.BW) and apart_below[a.stage]:
            return [Action(Kind.SEND_B, a.stage, a.mb)]
        return []

    lowered: Plan = {}
    for r, actions in plan.items():
        out: list[Action] = []
        i = 0
        while i < len(actions):
            a = actions[i]
            paired = a.paired and i + 1 < len(actions) and actions[i + 1].paired
            group = actions[i : i + 2] if paired else [a]
            for x in group:
                out += before(x)
            out += group
            for x in group:
                out += after(x)
            i += len(group)
        lowered[r] = out
    return lowered


def apart(stages: StageMap) -> tuple[list[bool], list[bool]]:
    """Per stage: whether its input comes from another rank (`add_comms` puts a RECV_F before
    its F and a SEND_B after its B), and whether its output goes to another rank (SEND_F after
    F, RECV_B before B). Neighbours on one rank (pp == 1, ZB-V's turn) pass in memory."""
    last, rank = stages.last, [stages.rank(s) for s in range(stages.stages)]
    below = [s > 0 and rank[s - 1] != rank[s] for s in range(stages.stages)]
    above = [s < last and rank[s + 1] != rank[s] for s in range(stages.stages)]
    return below, above
