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
    below, above = apart(stages)
    lowered: Plan = {}
    for r, actions in plan.items():
        out: list[Action] = []
        held: list[Action] = []  # the first pass's sends, while its pair is open
        second = False  # `a` closes a pair
        for i, a in enumerate(actions):
            first = a.paired and not second and i + 1 < len(actions) and actions[i + 1].paired
            if first:  # both receives before the pair
                out += _receive(a, below, above) + _receive(actions[i + 1], below, above)
            elif not second:
                out += _receive(a, below, above)
            out.append(a)
            held += _send(a, below, above)
            if not first:  # both sends after the pair
                out += held
                held = []
            second = first
        lowered[r] = out
    return lowered


def _receive(a: Action, below: list[bool], above: list[bool]) -> list[Action]:
    """The receive that brings compute action `a` its input from another rank, if any."""
    if a.kind is Kind.F:
        return [Action(Kind.RECV_F, a.stage, a.mb)] if below[a.stage] else []
    if a.kind is Kind.B or a.kind is Kind.BW:
        return [Action(Kind.RECV_B, a.stage, a.mb)] if above[a.stage] else []
    return []


def _send(a: Action, below: list[bool], above: list[bool]) -> list[Action]:
    """The send that carries compute action `a`'s result to another rank, if any."""
    if a.kind is Kind.F:
        return [Action(Kind.SEND_F, a.stage, a.mb)] if above[a.stage] else []
    if a.kind is Kind.B or a.kind is Kind.BW:
        return [Action(Kind.SEND_B, a.stage, a.mb)] if below[a.stage] else []
    return []


def apart(stages: StageMap) -> tuple[list[bool], list[bool]]:
    """Per stage: whether its input comes from another rank (`add_comms` puts a RECV_F before
    its F and a SEND_B after its B), and whether its output goes to another rank (SEND_F after
    F, RECV_B before B). Neighbours on one rank (pp == 1, ZB-V's turn) pass in memory."""
    last, rank = stages.last, [stages.rank(s) for s in range(stages.stages)]
    below = [s > 0 and rank[s - 1] != rank[s] for s in range(stages.stages)]
    above = [s < last and rank[s + 1] != rank[s] for s in range(stages.stages)]
    return below, above
