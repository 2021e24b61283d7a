"""Pipeline schedules, their lowering with comms, and the verifier (pure, no torch).

Grid: every schedule, pp in 1..8, m in {pp, 2pp, 4pp}, vpp in {1, 2, 4} where valid. Interleaved
includes pp = 1: one rank runs its vpp chunks back to back, which is valid if pointless, and its
bubble (pp - 1) / (vpp m) = 0 is still a useful check.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from ptdp.config.enums import Schedule
from ptdp.pipeline.actions import Action, Kind, Plan
from ptdp.pipeline.classic import gpipe, interleaved, interleaved_warmup, one_f_one_b
from ptdp.pipeline.lowering import add_comms
from ptdp.pipeline.placement import Placement, StageMap
from ptdp.pipeline.plan import build_plan
from ptdp.pipeline.report import layer_weighted_line
from ptdp.pipeline.schedules import SCHEDULES, build, check_args, in_flight_bound, theory_bubble
from ptdp.pipeline.verify import MARK, ScheduleError, format_table, verify
from ptdp.pipeline.zero_bubble import zb_h1, zb_h2, zb_v


def _grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for name in SCHEDULES:
        for pp in range(1, 9):
            for m in (pp, 2 * pp, 4 * pp):
                for vpp in (1, 2, 4):
                    try:
                        check_args(name, pp, m, vpp)
                    except ValueError:
                        continue
                    cases.append((name, pp, m, vpp))
    return cases


GRID = _grid()

# The papers' bubble fractions, bubble time / ideal time, at T_F = T_B = T_W (BW = 2), written
# out again here so that a wrong formula in the registry fails against them.
PAPER_BUBBLE = {
    "gpipe": lambda pp, m, vpp: (pp - 1) / m,  # Huang et al.
    "1f1b": lambda pp, m, vpp: (pp - 1) / m,  # Narayanan et al., section 2.2.1
    "interleaved": lambda pp, m, vpp: (pp - 1) / (vpp * m),  # section 2.2.2
    "zb-h1": lambda pp, m, vpp: (pp - 1) / (3 * m),  # Qi et al.: (pp - 1)(T_F + T_B - T_W)
    # Qi et al.'s (pp - 1)(T_F + T_B - 2 T_W) = 0 needs overlapping steps; within one step the
    # last rank waits pp - 1 for its first input (for m >= pp that is the whole bubble) and
    # rank 0 waits 2 pp - 1 for its first B, then runs m B's and m W's (for m < pp).
    "zb-h2": lambda pp, m, vpp: (pp - 1 if m >= pp else 2 * pp - 1 - m) / (3 * m),
    # 6m passes per rank; the last rank waits pp - 1 for its first input (m = pp, m >= 2 pp).
    "zb-v": lambda pp, m, vpp: (pp - 1) / (6 * m),
    # ZB-V's bound twice: each pair sends its forward's output only after its backward, and
    # at unit costs with free transfers the pair gains nothing for it.
    "dualpipev": lambda pp, m, vpp: (pp - 1) / (3 * m),
}


def _expected_peaks(name: str, pp: int, m: int) -> tuple[int, ...]:
    """Microbatches held from F until BW, or until W when split, per rank (m >= 1)."""
    most = {
        "gpipe": [m] * pp,
        "1f1b": [pp - r for r in range(pp)],  # warm-up pp - r - 1, then one more F
        "zb-h1": [pp] * pp,  # 1F1B's pp - r, plus the r W's rank r holds back
        "zb-h2": [2 * pp - 1] * pp,  # the W cap
        "zb-v": [2 * pp] * pp,  # (microbatch, chunk) pairs: pp whole stages, 1F1B's rank 0
    }[name]
    return tuple(min(held, m * (2 if name == "zb-v" else 1)) for held in most)


def test_grid_covers_every_schedule() -> None:
    assert set(SCHEDULES) == {s.value for s in Schedule} == set(PAPER_BUBBLE)
    assert Counter(name for name, *_ in GRID) == {
        "gpipe": 24,
        "1f1b": 24,
        "zb-h1": 24,
        "zb-h2": 24,
        "zb-v": 24,
        "interleaved": 48,
        "dualpipev": 16,  # m >= 2 pp only
    }


@pytest.mark.parametrize("name,pp,m,vpp", GRID)
def test_schedule_verifies_with_paper_bubble(name: str, pp: int, m: int, vpp: int) -> None:
    plan = build(name, pp, m, vpp)
    report = build_plan(name, pp, m, vpp).report
    theory = theory_bubble(name, pp, m, vpp)  # the registry's formula
    assert report.bubble_fraction == pytest.approx(theory)
    assert theory == pytest.approx(PAPER_BUBBLE[name](pp, m, vpp))
    assert report.busy == (m * vpp * 3,) * pp
    spec = SCHEDULES[name]
    if spec.pairs:  # a pair's sends wait for both passes, which only the lowering shows
        _check_pairs_backwards(plan, m * vpp)
        return
    # Comms take no time, so the compute-only dry run takes as long.
    assert verify(plan, SCHEDULES[name].stage_map(pp, vpp), m).makespan == report.makespan
    split = SCHEDULES[name].splits_backward
    for rank, actions in plan.items():
        kinds = Counter(a.kind for a in actions)
        backward = {Kind.B: m * vpp, Kind.W: m * vpp} if split else {Kind.BW: m * vpp}
        assert kinds == {Kind.F: m * vpp, **backward}
        assert {a.stage for a in actions} == set(SCHEDULES[name].stage_map(pp, vpp).stages_of(rank))


def _check_pairs_backwards(plan: Plan, passes: int) -> None:
    """DualPipeV: every chunk's microbatches once forward, once backward (fused or split)."""
    for actions in plan.values():
        kinds = Counter(a.kind for a in actions)
        assert kinds[Kind.F] == kinds[Kind.B] + kinds[Kind.BW] == passes
        assert kinds[Kind.W] == kinds[Kind.B] > 0


@pytest.mark.parametrize("name,pp,m,vpp", GRID)
def test_peak_in_flight(name: str, pp: int, m: int, vpp: int) -> None:
    peaks = build_plan(name, pp, m, vpp).report.peak_in_flight
    if name == "gpipe":
        assert peaks == (m,) * pp
    elif name == "dualpipev":  # DualPipeV's PP + 1 (its paper's count), in chunks
        assert peaks == (2 * pp + 1,) * pp == tuple(in_flight_bound(name, pp, m, vpp))
    elif name in ("1f1b", "zb-h1", "zb-h2", "zb-v"):
        assert peaks == _expected_peaks(name, pp, m)
        assert peaks == tuple(min(b, m * vpp) for b in in_flight_bound(name, pp, m, vpp))
    else:  # reported only; one more than the warm-up, whose F is still in flight
        assert peaks == tuple(
            min(interleaved_warmup(r, pp, m, vpp) + 1, m * vpp) for r in range(pp)
        )


@pytest.mark.parametrize("pp,m,vpp", [c[1:] for c in GRID if c[0] == "interleaved"])
def test_interleaved_warmup_matches_megatron(pp: int, m: int, vpp: int) -> None:
    for rank, actions in interleaved(pp, m, vpp).items():
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, m * vpp)
        assert interleaved_warmup(rank, pp, m, vpp) == warmup
        # The warm-up forwards, then the steady phase opens with one more F before its BW.
        first_backward = next(i for i, a in enumerate(actions) if a.kind is Kind.BW)
        assert first_backward == min(warmup + 1, m * vpp)


def test_interleaved_order_pp2_vpp2() -> None:
    # Microbatches go in groups of pp through chunk 0, then chunk 1; backwards chunk 1 first.
    assert [str(a) for a in interleaved(2, 4, 2)[1]] == (
        "1F0 1F1 3F0 3BW0 3F1 3BW1 1F2 1BW0 1F3 1BW1 3F2 3BW2 3F3 3BW3 1BW2 1BW3".split()
    )


@pytest.mark.parametrize("pp,m", [(pp, m) for pp in range(1, 9) for m in (pp, 2 * pp, 4 * pp)])
def test_zb_h1_bubble_is_a_third_of_1f1b(pp: int, m: int) -> None:
    zb = verify(zb_h1(pp, m), StageMap(pp), m)
    ofob = verify(one_f_one_b(pp, m), StageMap(pp), m)
    assert zb.makespan == 3 * m + (pp - 1)  # ideal + (pp - 1)(T_F + T_B - T_W)
    assert ofob.makespan == 3 * m + 3 * (pp - 1)  # ideal + (pp - 1)(T_F + T_B + T_W)
    # Held until W: rank r's r deferred W's add to 1F1B's pp - r.
    assert zb.peak_in_flight == (min(pp, m),) * pp
    assert ofob.peak_in_flight == tuple(min(pp - r, m) for r in range(pp))
    # Same F/B order as 1F1B, with BW split.
    for rank in range(pp):
        ours = [a for a in zb_h1(pp, m)[rank] if a.kind is not Kind.W]
        theirs = one_f_one_b(pp, m)[rank]
        assert [(a.stage, a.mb) for a in ours] == [(a.stage, a.mb) for a in theirs]


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 1), (4, 3), (8, 5)])
def test_fewer_microbatches_than_ranks(pp: int, m: int) -> None:
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        report = build_plan(name, pp, m).report
        assert report.busy == (m * 3,) * pp
        assert report.peak_in_flight == _expected_peaks(name, pp, m)
    for name in ("zb-h1", "zb-h2"):  # rank 0: its first B at 2 pp - 1, then m B's and m W's
        assert build_plan(name, pp, m).report.makespan == 2 * pp - 1 + 2 * m


ZB_H2_CASES = [(pp, m) for pp in range(1, 9) for m in sorted({1, 2, pp, pp + 1, 2 * pp, 4 * pp})]


@pytest.mark.parametrize("pp,m", ZB_H2_CASES)
def test_zb_h2_bubble_span_and_memory(pp: int, m: int) -> None:
    plan = build_plan("zb-h2", pp, m)
    report = plan.report  # verified against the registry's in-flight bound
    assert report.bubble_fraction == pytest.approx(theory_bubble("zb-h2", pp, m))
    assert report.bubble_fraction == pytest.approx(PAPER_BUBBLE["zb-h2"](pp, m, 1))
    assert report.makespan == verify(zb_h1(pp, m), StageMap(pp), m).makespan  # both at the floor
    assert report.busy == (3 * m,) * pp
    assert report.peak_in_flight == (min(2 * pp - 1, m),) * pp
    if m >= 2 * pp - 1:  # the parallelogram: no rank idles between its first and last pass
        assert report.span == (3 * m,) * pp
    for rank, actions in zb_h2(pp, m).items():
        first_b = next(i for i, a in enumerate(actions) if a.kind is Kind.B)
        assert first_b == min(2 * (pp - rank) - 1, m)  # the paper's warm-up
        for kind in (Kind.F, Kind.B, Kind.W):  # each kind in microbatch order
            assert [a.mb for a in actions if a.kind is kind] == list(range(m))


def test_zb_h2_order_pp2() -> None:
    # Rank 0 warms up with 2 pp - 1 = 3 forwards; rank 1 defers its W's into the tail.
    assert " ".join(map(str, zb_h2(2, 3)[0])) == "0F0 0F1 0F2 0B0 0W0 0B1 0W1 0B2 0W2"
    assert " ".join(map(str, zb_h2(2, 3)[1])) == "1F0 1B0 1F1 1B1 1F2 1B2 1W0 1W1 1W2"


def test_one_f_one_b_phases() -> None:
    assert " ".join(map(str, one_f_one_b(3, 4)[0])) == "0F0 0F1 0F2 0BW0 0F3 0BW1 0BW2 0BW3"
    assert " ".join(map(str, gpipe(2, 2)[1])) == "1F0 1F1 1BW0 1BW1"


def test_zb_h1_defers_rank_w_passes() -> None:
    # Rank r holds r W's back, so the last rank's steady state is F B, then F B W.
    assert " ".join(map(str, zb_h1(2, 3)[1])) == "1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2"
    assert " ".join(map(str, zb_h1(2, 3)[0])) == "0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2"


def test_stage_placement() -> None:
    looped = StageMap(4, 3)
    assert looped.stages_of(1) == [1, 5, 9]
    assert [looped.rank(s) for s in (0, 3, 4, 9)] == [0, 3, 0, 1]
    v = StageMap(4, 2, Placement.V)
    assert [v.rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.stages_of(0) == [0, 7] and v.stages_of(3) == [3, 4]
    assert v.same_rank(3, 4) and not v.same_rank(2, 3)
    assert v.neighbours(0) == {1} and v.neighbours(3) == {2} and looped.neighbours(3) == {2, 0}
    with pytest.raises(ValueError, match="set parallel.vpp = 2"):
        StageMap(4, 3, Placement.V)


def test_zb_v_turn_and_loss_stay_on_their_rank() -> None:
    # The V: stage pp-1 hands its output to stage pp on the same rank, with no transfer, and
    # the loss (the last stage) is on rank 0 beside the embedding.
    plan = build_plan("zb-v", 2, 4, 2)
    comms = {f"{a.stage}{a.kind.value}" for a in plan.lowered[1] if a.kind.is_comm}
    assert comms == {"1RECV_F", "2SEND_F", "2RECV_B", "1SEND_B"}  # no 1SEND_F, no 2RECV_F
    assert {a.stage for a in plan.compute[0]} == {0, 3}
    assert plan.stages.rank(plan.stages.last) == 0


@pytest.mark.parametrize("pp", range(2, 9))
def test_zb_v_reaches_the_bound_from_two_pp_microbatches(pp: int) -> None:
    # Makespan 6m + pp - 1, the floor set by the last rank's first input, for every
    # m >= 2 pp, with pp whole stages (2 pp chunks) in flight per rank, 1F1B's rank-0 peak.
    for m in range(2 * pp, 6 * pp + 1):
        report = build_plan("zb-v", pp, m, 2).report
        assert report.makespan == 6 * m + pp - 1, (pp, m)
        assert max(report.peak_in_flight) <= 2 * pp
    for m in range(1, 2 * pp):  # fewer: the floor or above, never below
        assert build_plan("zb-v", pp, m, 2).report.makespan >= 6 * m + pp - 1


def test_zb_v_halves_zb_h1_bubble_at_1f1b_memory() -> None:
    for pp, m in ((4, 8), (8, 16)):
        zbv, zbh1 = build_plan("zb-v", pp, m, 2).report, build_plan("zb-h1", pp, m).report
        ofob = build_plan("1f1b", pp, m).report
        assert zbv.bubble_fraction == pytest.approx(zbh1.bubble_fraction / 2)
        # Chunks are half a stage: 2 pp chunks hold what 1F1B's rank 0 holds (pp stages).
        assert max(zbv.peak_in_flight) / 2 == max(ofob.peak_in_flight)
    assert zb_v(2, 2) == build("zb-v", 2, 2, 2)


def test_add_comms() -> None:
    plan = add_comms(one_f_one_b(2, 2), StageMap(2))
    assert " ".join(map(str, plan[0])) == ("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0BW0 0RECV_B1 0BW1")
    assert " ".join(map(str, plan[1])) == ("1RECV_F0 1F0 1BW0 1SEND_B0 1RECV_F1 1F1 1BW1 1SEND_B1")
    # One rank: every transfer stays in memory.
    assert add_comms(interleaved(1, 2, 2), StageMap(1, 2)) == interleaved(1, 2, 2)
    # Interleaved: the last rank sends to rank 0's next chunk.
    assert Action(Kind.SEND_F, 1, 0) in add_comms(interleaved(2, 2, 2), StageMap(2, 2))[1]


@pytest.mark.parametrize(
    "text", ["0F0", "12BW3", "2SEND_F5", "0RECV_F1", "7SEND_B0", "3RECV_B10", "1B2", "1W2"]
)
def test_action_round_trip(text: str) -> None:
    assert str(Action.parse(text)) == text


def test_action_parse_errors() -> None:
    assert Action.parse("2SEND_F5") == Action(Kind.SEND_F, 2, 5)
    with pytest.raises(ValueError, match="unknown action kind 'X'"):
        Action.parse("1X2")
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("F1")


@pytest.mark.parametrize(
    "name,pp,m,vpp,fix",
    [
        ("interleaved", 4, 6, 2, "multiple of pp = 4; use m = 4 or 8"),
        ("interleaved", 4, 3, 2, "use m = 4"),
        ("interleaved", 4, 8, 1, "set vpp >= 2 or use the 1f1b schedule"),
        ("1f1b", 4, 8, 2, "set vpp = 1 or use the interleaved schedule"),
        ("zb-h1", 0, 8, 1, "pp = 0 pipeline ranks must be >= 1"),
        ("gpipe", 2, 0, 1, "m = 0 microbatches must be >= 1"),
        ("zb-h3", 2, 2, 1, "choose one of gpipe, 1f1b, interleaved, zb-h1, zb-h2"),
    ],
)
def test_invalid_arguments(name: str, pp: int, m: int, vpp: int, fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        build(name, pp, m, vpp)


def test_planning_does_not_import_torch() -> None:
    # Plans are functions of ints (STYLE principle 3), so `ptdp schedule` runs without torch.
    code = "import sys, ptdp.pipeline.verify; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_records() -> None:
    # One record per schedule: the chunk rule, the in-flight bound and the backward split
    # that check_args, in_flight_bound and the tests above read from it.
    assert [n for n, s in SCHEDULES.items() if s.interleaved] == ["interleaved"]
    split = ["zb-h1", "zb-h2", "zb-v", "dualpipev"]
    assert [n for n, s in SCHEDULES.items() if s.splits_backward] == split
    assert [n for n, s in SCHEDULES.items() if s.placement is Placement.V] == ["zb-v", "dualpipev"]
    assert [n for n, s in SCHEDULES.items() if s.chunks == 2] == ["zb-v", "dualpipev"]
    assert [n for n, s in SCHEDULES.items() if s.can_pair] == ["1f1b", "dualpipev"]
    assert [n for n, s in SCHEDULES.items() if s.in_flight_bound is None] == ["interleaved"]
    assert SCHEDULES["zb-h1"].formula == "(p-1)/(3m)" and all(s.doc for s in SCHEDULES.values())
    assert theory_bubble("interleaved", 4, 8, 2) == 3 / 16
    with pytest.raises(ValueError, match="multiple of pp = 4"):
        theory_bubble("interleaved", 4, 6, 2)


def test_config_enum_selects_a_schedule() -> None:
    assert build(Schedule.ZB_H1, 2, 2) == zb_h1(2, 2)
    assert build(Schedule.ZB_H2, 3, 5) == zb_h2(3, 5)
    assert build(Schedule.ZB_V, 3, 5, 2) == zb_v(3, 5)
    assert in_flight_bound("zb-v", 3, 5, 2) == [6, 6, 6]
    with pytest.raises(ValueError, match="runs 2 model chunks per rank but vpp = 1; set vpp = 2"):
        build("zb-v", 3, 5)
    assert in_flight_bound("zb-h1", 3, 5) == [3, 3, 3]
    assert in_flight_bound("zb-h2", 3, 5) == [5, 5, 5]
    assert in_flight_bound("gpipe", 3, 5) == [5, 5, 5]
    assert in_flight_bound("interleaved", 2, 2, 2) is None


# Hand-broken plans: each mutation of a valid plan and what the error must say.


def _swap(plan: Plan, rank: int, x: str, y: str) -> Plan:
    actions = [str(a) for a in plan[rank]]
    i, j = actions.index(x), actions.index(y)
    plan[rank][i], plan[rank][j] = plan[rank][j], plan[rank][i]
    return plan


def _drop(plan: Plan, rank: int, text: str) -> Plan:
    plan[rank].remove(Action.parse(text))
    return plan


def _move_first(plan: Plan, rank: int, text: str) -> Plan:
    _drop(plan, rank, text)
    plan[rank].insert(0, Action.parse(text))
    return plan


def _move_before(plan: Plan, rank: int, text: str, anchor: str) -> Plan:
    _drop(plan, rank, text)
    plan[rank].insert(plan[rank].index(Action.parse(anchor)), Action.parse(text))
    return plan


def _lowered(name: str, pp: int, m: int, vpp: int = 1) -> Plan:
    return add_comms(build(name, pp, m, vpp), SCHEDULES[name].stage_map(pp, vpp))


BROKEN = {
    "F order across stages, one rank": (
        lambda: _swap(interleaved(1, 2, 2), 0, "0F0", "1F0"),
        (1, 2, 2),
        "1F0 at rank 0 step 0 runs before 0F0 (step 1), which it needs first "
        "(the forward of the previous stage)",
    ),
    "F order across stages, two ranks": (
        lambda: _swap(interleaved(2, 2, 2), 0, "0F0", "2F0"),
        (2, 2, 2),
        "deadlock",
    ),
    "missing RECV": (
        lambda: _drop(_lowered("1f1b", 2, 4), 1, "1RECV_F2"),
        (2, 1, 4),
        "1F2 at rank 1 step 8 needs 1RECV_F2 (the RECV_F of its input), which is missing",
    ),
    "unmatched SEND": (
        lambda: _drop(_lowered("1f1b", 2, 4), 0, "0RECV_B3"),
        (2, 1, 4),
        "0BW3 at rank 0 step 14 needs 0RECV_B3",
    ),
    "W before its B": (
        lambda: _swap(zb_h1(3, 6), 2, "2B0", "2W0"),
        (3, 1, 6),
        "2W0 at rank 2 step 1 runs before 2B0 (step 6), which it needs first (its B)",
    ),
    "W before its B, same microbatch": (
        lambda: _swap(zb_h1(1, 2), 0, "0B1", "0W1"),
        (1, 1, 2),
        "0W1 at rank 0 step 4 runs before 0B1 (step 5), which it needs first (its B)",
    ),
    "deadlock": (
        lambda: _move_first(_lowered("1f1b", 2, 2), 0, "0RECV_B0"),
        (2, 1, 2),
        "deadlock",
    ),
    "receive order": (
        lambda: _move_before(_lowered("1f1b", 3, 3), 1, "1RECV_F2", "1RECV_F1"),
        (3, 1, 3),
        "receives from rank 0 out of send order",
    ),
    "duplicate": (
        lambda: {**gpipe(2, 2), 1: [*gpipe(2, 2)[1], Action.parse("1F0")]},
        (2, 1, 2),
        "1F0 runs twice",
    ),
    "wrong rank": (
        lambda: _drop({**gpipe(2, 1), 0: [*gpipe(2, 1)[0], Action.parse("1W0")]}, 0, "0BW0"),
        (2, 1, 1),
        "1W0 runs on rank 0, but stage 1 is on rank 1",
    ),
    "missing backward": (
        lambda: _drop(gpipe(2, 2), 1, "1BW1"),
        (2, 1, 2),
        "stage 1 microbatch 1 has no backward",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_plan_is_rejected(case: str) -> None:
    mutate, (pp, vpp, m), problem = BROKEN[case]
    with pytest.raises(ScheduleError) as error:
        verify(mutate(), StageMap(pp, vpp), m)
    message = str(error.value)
    assert problem in message
    assert MARK in message and "| rank 0" in message


def test_deadlock_names_each_wait() -> None:
    plan = _move_first(_lowered("1f1b", 2, 2), 0, "0RECV_B0")
    with pytest.raises(ScheduleError) as error:
        verify(plan, StageMap(2), 2)
    message = str(error.value)
    assert "rank 0 step 0: 0RECV_B0 waits for 1SEND_B0 (the matching SEND_B) at rank 1 step 3" in (
        message
    )
    assert "rank 1 step 0: 1RECV_F0 waits for 0SEND_F0" in message
    assert message.count(MARK) == 2


def test_in_flight_bound_is_enforced() -> None:
    with pytest.raises(ScheduleError, match="rank 0 holds 5 activations at step 4"):
        verify(gpipe(4, 8), StageMap(4), 8, max_in_flight=in_flight_bound("1f1b", 4, 8))


def test_format_table() -> None:
    table = format_table(one_f_one_b(2, 2))
    assert table.splitlines() == [
        "step | rank 0 | rank 1",
        "0    | 0F0    | 1F0",
        "1    | 0F1    | 1BW0",
        "2    | 0BW0   | 1F1",
        "3    | 0BW1   | 1BW1",
    ]
    marked = format_table(gpipe(2, 20), marks=[(1, 20)], context=1).splitlines()
    assert marked[1].startswith("...") and marked[-1].startswith("...")
    assert marked[3] == "20   | 0BW0   | 1BW0 <<"
    assert len(marked) == 6


def test_cli_prints_the_table_and_the_bubble(capsys) -> None:
    from ptdp.cli import main

    def schedule(m: int) -> int:
        args = "schedule --schedule interleaved --pp 4 --vpp 2 --microbatches"
        return main([*args.split(), str(m)])

    assert schedule(8) == 0
    out = capsys.readouterr().out
    assert "bubble 0.1875 (theory 0.1875)" in out and "0SEND_F0" in out
    assert schedule(6) == 2
    assert "multiple of pp = 4" in capsys.readouterr().err


def test_layer_weighted_replay_of_stages_without_layers() -> None:
    # 24 layers over 8 stages, an output layer and loss costing 3 layers: the even split
    # leaves the last stage at 6, stages 0 and 7 without layers (the embedding alone, the
    # loss alone) bring the busiest stage to 4.
    plan = build_plan("1f1b", 8, 16)
    even = layer_weighted_line(plan, (3,) * 8, (1, 3))
    ends = layer_weighted_line(plan, (0, 4, 4, 4, 4, 4, 4, 0), (1, 3))
    assert "stage costs 4,3,3,3,3,3,3,6 " in even and "stage costs 1,4,4,4,4,4,4,3 " in ends
    assert "work per rank: busiest 288, mean 168" in even  # 16 microbatches x 3 passes x 6
    assert "work per rank: busiest 192, mean 168" in ends
    makespan = [int(line.split("makespan ")[1].split()[0]) for line in (even, ends)]
    assert makespan == [354, 261]
    # At unit costs (one layer a stage, the ends free) the replay is the verifier's.
    for name, pp, vpp in (("1f1b", 4, 1), ("interleaved", 2, 2), ("zb-v", 2, 2)):
        plan = build_plan(name, pp, 2 * pp, vpp)
        line = layer_weighted_line(plan, (1,) * (pp * vpp), (0, 0))
        assert f"makespan {plan.report.makespan} " in line, name
    with pytest.raises(ValueError, match="gives stage 1 no layer; only the first and the last"):
        layer_weighted_line(build_plan("1f1b", 4, 8), (1, 0, 3, 0), (1, 1))
    with pytest.raises(ValueError, match="has 3 entries for 4 stages"):
        layer_weighted_line(build_plan("1f1b", 4, 8), (0, 3, 0), (1, 1))


def test_cli_replays_a_split_of_layers(capsys) -> None:
    from ptdp.cli import main

    args = "schedule --schedule zb-v --pp 2 --microbatches 4 --no-comms --layers 0,2,2,0"
    assert main(args.split()) == 0
    out = capsys.readouterr().out
    assert "zb-v: pp=2 vpp=2" in out and "layers 0,2,2,0 | stage costs 1,2,2,1 " in out
    assert main([*args.split(), "--end-costs", "1"]) == 2
    assert "--end-costs takes two numbers" in capsys.readouterr().err
    assert main([*args.split()[:-1], "0,4"]) == 2
    assert "--layers 0,4 has 2 entries for 4 stages" in capsys.readouterr().err
    assert main([*args.split()[:-1], "0,x"]) == 2
    assert "--layers 0,x: give comma-separated numbers" in capsys.readouterr().err
