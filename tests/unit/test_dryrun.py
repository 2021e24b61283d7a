"""The dry-run engine shared by the verifier and the simulator (pure, no torch).

Unit costs reproduce `verify` under every comm model for every schedule; a hand-timed ZB-V
run shows the turn between two stages of one rank costing no transfer; a deadlock names
what each stuck rank waits for.
"""

from __future__ import annotations

import pytest

from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.classic import one_f_one_b
from ptdp.pipeline.dryrun import CommModel, PipelineCosts, Wait
from ptdp.pipeline.dryrun_engine import dry_run
from ptdp.pipeline.lowering import add_comms
from ptdp.pipeline.placement import Placement, StageMap
from ptdp.pipeline.plan import build_plan
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.pipeline.verify import UNIT_COST

CASES = [
    (name, pp, max(m, SCHEDULES[name].min_microbatches(pp)), SCHEDULES[name].chunks or 2)
    for name in SCHEDULES
    for pp in (1, 2, 3, 4)
    for m in (pp, 2 * pp)
    if name != "dualpipev" or m == 2 * pp  # m >= 2 pp: the same case once
]


def _plan(text: dict[int, str]) -> Plan:
    return {rank: [Action.parse(a) for a in line.split()] for rank, line in text.items()}


@pytest.mark.parametrize(("name", "pp", "m", "vpp"), CASES)
def test_unit_costs_are_the_verifiers_report(name: str, pp: int, m: int, vpp: int) -> None:
    plan = build_plan(name, pp, m, vpp)
    report = plan.report
    # A pair's transfers wait for both its passes, which only the lowering says.
    plans = (plan.lowered,) if SCHEDULES[name].pairs else (plan.compute, plan.lowered)
    for comms in CommModel:  # free transfers: how they occupy a rank does not matter
        for actions in plans:
            run = dry_run(actions, plan.stages, lambda a: UNIT_COST[a.kind], comms=comms)
            assert not run.stuck
            assert (run.makespan, run.busy, run.span) == (report.makespan, report.busy, report.span)
            costs = PipelineCosts.unit(pp * vpp)  # the costs object gives the same
            assert dry_run(actions, plan.stages, costs, comms=comms).makespan == report.makespan


def test_zb_v_turn_is_direct_and_free() -> None:
    # pp = 2 in a V: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2. F = B = W = 1 and
    # every transfer 0.5. Microbatch 0 goes 0F [0, 1], wire [1, 1.5], 1F [1.5, 2.5], then
    # 2F right after on rank 1 (the turn: no transfer), wire [3.5, 4], 3F [4, 5], 3B [5, 6],
    # wire [6, 6.5], 2B [6.5, 7.5], 1B [7.5, 8.5] (turn), wire [8.5, 9], 0B [9, 10], 0W.
    stages = StageMap(2, 2, Placement.V)
    compute = _plan({0: "0F0 3F0 3B0 3W0 0B0 0W0", 1: "1F0 2F0 2B0 1B0 2W0 1W0"})
    lowered = add_comms(compute, stages)
    assert Action.parse("2RECV_F0") not in lowered[1]  # the turn has no transfer action
    half = (0.5,) * 4
    run = dry_run(lowered, stages, PipelineCosts((1.0,) * 4, (1.0,) * 4, (1.0,) * 4, half, half))
    start = {t.action: t.start for t in run.events if not t.is_transfer}
    assert [start[Action.parse(a)] for a in ("1F0", "2F0", "3F0", "2B0", "1B0", "0B0")] == [
        1.5,
        2.5,
        4.0,
        6.5,
        7.5,
        9.0,
    ]
    wires = sorted((t.start, t.end, str(t.action)) for t in run.events if t.is_transfer)
    assert wires == [
        (1.0, 1.5, "0SEND_F0"),
        (3.5, 4.0, "2SEND_F0"),
        (6.0, 6.5, "3SEND_B0"),
        (8.5, 9.0, "1SEND_B0"),
    ]
    assert run.makespan == 11.0 and run.end == (11.0, 10.5)
    assert run.busy == (6.0, 6.0) and run.span == (11.0, 9.0)


def test_deadlock_names_each_wait() -> None:
    # 1F1B, pp = 2, m = 2 with rank 0's first gradient receive moved to the front: under the
    # verifier's model that RECV holds rank 0 before it has sent anything, so both ranks wait
    # on each other; ptdp's runtime posts the receive and goes on.
    stages = StageMap(2)
    plan = add_comms(one_f_one_b(2, 2), stages)
    plan[0].remove(Action.parse("0RECV_B0"))
    plan[0].insert(0, Action.parse("0RECV_B0"))
    run = dry_run(plan, stages, lambda a: UNIT_COST[a.kind], comms=CommModel.RECV_BLOCKS)
    assert run.stuck == (
        Wait(0, 0, Action.parse("0RECV_B0"), Action.parse("1SEND_B0")),
        Wait(1, 0, Action.parse("1RECV_F0"), Action.parse("0SEND_F0")),
    )
    assert str(run.stuck[0]) == "rank 0 step 0: 0RECV_B0 waits for 1SEND_B0"
    assert not dry_run(plan, stages, lambda a: UNIT_COST[a.kind]).stuck  # CommModel.ASYNC
    # Compute only: a wait names the fused BW the plan runs, on whichever rank it is.
    crossed = _plan({0: "0F0 0BW0 0F1 0BW1", 1: "1F1 1F0 1BW0 1BW1"})
    run = dry_run(crossed, stages, lambda a: UNIT_COST[a.kind])
    assert [(w.rank, w.step, str(w.action), str(w.waits_for)) for w in run.stuck] == [
        (0, 1, "0BW0", "1BW0"),
        (1, 0, "1F1", "0F1"),
    ]
    # A RECV placed after the compute that needs it: that compute waits for the RECV on its
    # own rank, and the rank waiting for its answer for the SEND that never happens.
    lowered = add_comms(one_f_one_b(2, 1), stages)
    lowered[1].remove(Action.parse("1RECV_F0"))
    lowered[1].append(Action.parse("1RECV_F0"))
    run = dry_run(lowered, stages, lambda a: UNIT_COST[a.kind])
    assert [str(w) for w in run.stuck] == [
        "rank 0 step 3: 0BW0 waits for 1SEND_B0",
        "rank 1 step 0: 1F0 waits for 1RECV_F0",
    ]


def test_blocking_sender_carries_its_transfer() -> None:
    # pp = 2, m = 1, F = 1, BW = 2, transfers 0.5: blocking, rank 0 is held by its send
    # until 1.5; async, it is free at 1. The makespans agree (rank 0 waits for BW anyway).
    stages = StageMap(2)
    plan = add_comms(one_f_one_b(2, 1), stages)
    costs = PipelineCosts((1.0, 1.0), (2.0, 2.0), (0.0, 0.0), (0.5, 0.5), (0.5, 0.5))
    blocking = dry_run(plan, stages, costs, comms=CommModel.BLOCKING)
    asynchronous = dry_run(plan, stages, costs)
    assert blocking.makespan == asynchronous.makespan == 7.0  # 1 + .5 + 1 + 2 + .5 + 2
    sends = [t for t in blocking.events if t.action == Action.parse("0SEND_F0")]
    assert [(t.start, t.end) for t in sends] == [(1.0, 1.5)]
    assert [t.start for t in blocking.events if t.action.kind is Kind.F] == [0.0, 1.5]


def test_plan_ranks_must_match_the_stage_map() -> None:
    with pytest.raises(ValueError, match=r"plan has ranks \[0\]; pp = 2 needs 0..1"):
        dry_run({0: []}, StageMap(2), lambda a: 1.0)


def test_messages_share_their_ranks_cards() -> None:
    """A rank's outgoing messages leave, and its incoming ones arrive, one at a time, whatever
    neighbour and direction. Interleaving (pp = 3, v = 2, m = 3, F = 1, B = 2) with transfers
    of 3, longer than a chunk's forward: activations and gradients would overlap on a rank's
    card; queued, the step takes 62 instead of 60 (two private channels per neighbour)."""
    plan = build_plan("interleaved", 3, 3, 2)
    costs = PipelineCosts((1.0,) * 6, (2.0,) * 6, (0.0,) * 6, (3.0,) * 6, (3.0,) * 6)
    run = dry_run(plan.lowered, plan.stages, costs)
    transfers = [t for t in run.events if t.is_transfer]
    for rank in range(3):
        for side in ("out", "in"):
            mine = sorted(
                (t.start, t.end)
                for t in transfers
                if (t.rank if side == "out" else _receiver(t, plan.stages)) == rank
            )
            assert all(end <= start for (_, end), (start, _) in zip(mine, mine[1:]))
    assert run.makespan == 62.0


def _receiver(t, stages: StageMap) -> int:  # noqa: ANN001 - a Timed transfer
    step = 1 if t.action.kind is Kind.SEND_F else -1
    return stages.rank(t.action.stage + step)


def test_receiver_work_holds_neither_sender_nor_channel() -> None:
    """Scatter/gather: the receivers all-gather the arrived pieces (0.25 here) after the
    wire (0.5). Blocking, the sender is held for the wire only; the consumer waits for
    both: 1 + .5 + .25 + 1 + 2 + .5 + .25 + 2 = 7.5."""
    stages = StageMap(2)
    plan = add_comms(one_f_one_b(2, 1), stages)
    costs = PipelineCosts(
        (1.0, 1.0), (2.0, 2.0), (0.0, 0.0), (0.5, 0.5), (0.5, 0.5), (0.25, 0.25), (0.0, 0.25)
    )
    for comms in (CommModel.BLOCKING, CommModel.ASYNC):
        run = dry_run(plan, stages, costs, comms=comms)
        assert run.makespan == 7.5
        assert [t.start for t in run.events if t.action.kind is Kind.F] == [0.0, 1.75]
    two = add_comms(one_f_one_b(2, 2), stages)
    blocking = dry_run(two, stages, costs, comms=CommModel.BLOCKING)
    forwards = [(t.rank, t.start) for t in blocking.events if t.action.kind is Kind.F]
    assert (0, 1.5) in forwards  # rank 0's second forward: its send held it until 1.5
    assert costs.receive(Action.parse("0SEND_F0")) == 0.25
    assert PipelineCosts.unit(2).receive(Action.parse("1SEND_B0")) == 0.0
