"""DualPipeV and paired 1F1B (`parallel.moe_overlap`): plans, lowering, verifier, refusals.

Pure (no torch): the plans are functions of ints, the refusals come from `validate` before
any process group.
"""

from __future__ import annotations

import pytest

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.classic import one_f_one_b
from ptdp.pipeline.lowering import add_comms
from ptdp.pipeline.paired import dualpipev, one_f_one_b_paired, pairs
from ptdp.pipeline.placement import Placement, StageMap
from ptdp.pipeline.plan import build_plan
from ptdp.pipeline.report import schedule_report
from ptdp.pipeline.schedules import build, check_args, in_flight_bound, theory_bubble
from ptdp.pipeline.verify import ScheduleError, verify
from ptdp.rules.layout import validate

DUALPIPEV = [(pp, m) for pp in range(1, 9) for m in sorted({2 * pp, 2 * pp + 1, 3 * pp, 5 * pp})]


@pytest.mark.parametrize("pp,m", DUALPIPEV)
def test_dualpipev_verifies_with_its_bubble_and_memory(pp: int, m: int) -> None:
    plan = build_plan("dualpipev", pp, m, 2)
    assert (plan.vpp, plan.placement) == (2, Placement.V)  # ZB-V's V, vpp implied
    report = plan.report  # the lowered plan, verified under its in-flight bound
    assert report.bubble_fraction == pytest.approx(theory_bubble("dualpipev", pp, m, 2))
    assert report.makespan == 6 * m + 2 * (pp - 1)
    assert (
        report.peak_in_flight == (2 * pp + 1,) * pp == tuple(in_flight_bound("dualpipev", pp, m, 2))
    )
    # Compute-only (transfers at once, not after the pair) it meets ZB-V's bound.
    assert verify(plan.compute, plan.stages, m).makespan == 6 * m + pp - 1


@pytest.mark.parametrize("pp,m", DUALPIPEV)
def test_dualpipev_pairs_forward_and_backward_of_other_chunks(pp: int, m: int) -> None:
    plan = dualpipev(pp, m)
    stages = StageMap(pp, 2, Placement.V)
    for rank, actions in plan.items():
        found = pairs(actions)
        # The steady state: two pairs a step (one on the last rank's first), and phase 5's.
        steady = m - 2 * pp + rank + 1
        assert len(found) == 2 * steady - (rank == pp - 1) + (pp - rank - 1)
        for i, j in found:
            f, b = actions[i], actions[j]
            assert j == i + 1 and f.kind is Kind.F and b.kind is Kind.BW
            assert stages.chunk(f.stage) != stages.chunk(b.stage)  # F0 with B1, F1 with B0
        # Both chunks' passes in microbatch order, as DualPipeV counts them.
        for stage in stages.stages_of(rank):
            for kinds in ({Kind.F}, {Kind.B, Kind.BW}):
                mbs = [a.mb for a in actions if a.stage == stage and a.kind in kinds]
                assert mbs == list(range(m))


def test_dualpipev_rank_lists_pp2() -> None:
    # Rank 0 holds stages 0 and 3 (the loss), rank 1 stages 1 and 2 (the turn, in memory).
    plan = dualpipev(2, 4)
    assert " ".join(map(str, plan[0])) == (
        "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3~ 3BW1~ 3F2~ 0BW0~ 3BW2 3F3~ 0BW1~ 3BW3 0B2 0W2 0B3 0W3"
    )
    assert " ".join(map(str, plan[1])) == (
        "1F0 2F0 1F1 2F1 1F2 2BW0 2F2~ 1BW0~ 1F3~ 2BW1~ 2F3~ 1BW1~ 2BW2 1BW2 2B3 1B3 2W3 1W3"
    )


def test_pair_lowering_receives_both_then_sends_both() -> None:
    lowered = add_comms(dualpipev(2, 4), StageMap(2, 2, Placement.V))
    rank1 = " ".join(map(str, lowered[1]))
    # The pair (2F2, 1BW0): 2F2's input is 1F2's output (same rank, no receive), 1BW0's
    # gradient comes from rank 0; 2F2's output goes to rank 0 and 1BW0's input gradient
    # to rank 0, both after the two passes.
    assert "2RECV_B0 2BW0 2F2~ 1BW0~ 2SEND_F2 1SEND_B0 " in rank1
    assert "1RECV_F3 2RECV_B1 1F3~ 2BW1~ 2F3~ 1BW1~ 2SEND_F3 1SEND_B1" in rank1
    rank0 = " ".join(map(str, lowered[0]))
    assert "3RECV_F2 0RECV_B0 3F2~ 0BW0~ 3BW2 3SEND_B2" in rank0


@pytest.mark.parametrize(
    "pp,m", [(pp, m) for pp in range(1, 9) for m in (1, 2, pp, 2 * pp, 4 * pp)]
)
def test_paired_1f1b_keeps_1f1b_bubble_and_backward_order(pp: int, m: int) -> None:
    plan = build_plan("1f1b", pp, m, paired=True)
    plain = build_plan("1f1b", pp, m)
    assert plan.report.bubble_fraction == pytest.approx(plain.report.bubble_fraction)
    assert plan.report.bubble_fraction == pytest.approx(theory_bubble("1f1b", pp, m))
    bound = [2 * (pp - r) for r in range(pp)]
    assert in_flight_bound("1f1b", pp, m, paired=True) == bound
    assert plan.report.peak_in_flight == tuple(min(b, m) for b in bound)
    for r in range(pp):
        backwards = [a for a in plan.compute[r] if a.kind is Kind.BW]
        assert backwards == [a for a in one_f_one_b(pp, m)[r] if a.kind is Kind.BW]
        for i, j in pairs(plan.compute[r]):
            f, b = plan.compute[r][i], plan.compute[r][j]
            assert (f.kind, b.kind, j) == (Kind.F, Kind.BW, i + 1) and f.mb > b.mb


def test_paired_1f1b_without_pipeline() -> None:
    # pp = 1: the forward of microbatch i + 1 paired with the backward of microbatch i.
    assert " ".join(map(str, one_f_one_b_paired(1, 4)[0])) == (
        "0F0 0F1~ 0BW0~ 0F2~ 0BW1~ 0F3~ 0BW2~ 0BW3"
    )
    assert build("1f1b", 1, 4, paired=True) == one_f_one_b_paired(1, 4)


def test_paired_action_text_round_trips() -> None:
    a = Action.parse("3F2~")
    assert a.paired and str(a) == "3F2~" and a == Action(Kind.F, 3, 2)
    assert not Action.parse("3F2").paired


def _break(plan: dict, rank: int, index: int, **change) -> dict:
    a = plan[rank][index]
    plan[rank][index] = Action(change.get("kind", a.kind), a.stage, a.mb, change["paired"])
    return plan


@pytest.mark.parametrize(
    "mutate,message",
    [
        # 0F0 0F1~ 0BW0~ 0F2~ 0BW1~ 0F3~ 0BW2~ 0BW3
        (lambda p: _break(p, 0, 0, paired=True), "0F0~ and 0F1~ on rank 0: a pair is one F and "),
        (lambda p: _break(p, 0, 6, paired=False), "0F3~ at rank 0 step 5 is paired with nothing"),
        (lambda p: _break(p, 0, 7, paired=True), "0BW3~ at rank 0 step 7 is paired with nothing"),
    ],
)
def test_verifier_refuses_broken_pairs(mutate, message: str) -> None:
    plan = mutate(one_f_one_b_paired(1, 4))
    with pytest.raises(ScheduleError, match=message):
        verify(plan, StageMap(1), 4)


def test_verifier_refuses_compute_inside_a_pair() -> None:
    plan = one_f_one_b_paired(1, 4)
    actions = plan[0]  # 0F0 0F1~ 0BW0~ ...: move 0F0 inside the first pair
    plan[0] = [actions[1], actions[0], *actions[2:]]
    with pytest.raises(ScheduleError, match="are a pair but 0F0 runs between them"):
        verify(plan, StageMap(1), 4)


@pytest.mark.parametrize(
    "args,fix",
    [
        (
            ("dualpipev", 4, 7, 2),
            "needs at least 2 \\* pp = 8 microbatches with pp = 4, got m = 7; use m = 8 or more",
        ),
        (("dualpipev", 2, 8, 1), "runs 2 model chunks per rank but vpp = 1; set vpp = 2"),
        (("dualpipev", 2, 8, 3), "set vpp = 2"),
    ],
)
def test_dualpipev_argument_refusals(args: tuple, fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        check_args(*args)


def test_paired_variant_only_where_there_is_one() -> None:
    with pytest.raises(
        ValueError,
        match="'zb-v' has no variant with paired forwards and "
        "backwards; use one of 1f1b, dualpipev",
    ):
        build("zb-v", 2, 8, 2, paired=True)
    assert build("dualpipev", 2, 4, 2, paired=True) == dualpipev(2, 4)  # pairs anyway


def _validate(updates: dict, world: int) -> str:
    with pytest.raises(ConfigError) as info:
        validate(apply_updates(RunConfig(), updates, "test"), world)
    return str(info.value)


MOE = {"num_experts": 4, "moe_top_k": 2}


@pytest.mark.parametrize(
    "updates,world,message",
    [
        (  # too few microbatches: 4 per step, DualPipeV at pp = 4 needs 8
            {
                "parallel": {"pp": 4, "vpp": 2, "schedule": "dualpipev"},
                "model": {"num_layers": 8},
                "train": {"global_batch_size": 4, "micro_batch_size": 1},
            },
            4,
            "parallel.schedule = dualpipev needs at least 2 * pp = 8 microbatches per step with "
            "parallel.pp = 4, got 4 (global_batch_size / (micro_batch_size * dp)); e.g. "
            "--train.global_batch_size 8",
        ),
        (  # a V of 2 pp = 4 stages over 4 layers, split 2,2 in two entries
            {"parallel": {"pp": 2, "vpp": 2, "schedule": "dualpipev", "pipeline_layers": [2, 2]}},
            2,
            "parallel.pipeline_layers = 2,2 has 2 entries but pp*vpp = 2*2 = 4 stages need one "
            "each",
        ),
        (  # 6 layers over 2 pp = 4 stages
            {"parallel": {"pp": 2, "vpp": 2, "schedule": "dualpipev"}, "model": {"num_layers": 6}},
            2,
            "model.num_layers = 6 is not divisible by pp*vpp = 2*2",
        ),
        (
            {"parallel": {"pp": 2, "schedule": "dualpipev"}},
            2,
            "parallel.schedule = dualpipev runs 2 model chunks per rank (parallel.vpp = 2), got "
            "parallel.vpp = 1",
        ),
        (
            {"parallel": {"moe_overlap": True}},
            1,
            "parallel.moe_overlap = true overlaps the expert-parallel all-to-all of a "
            "mixture-of-experts model, but model.num_experts = 0 (a dense model); set "
            "--parallel.moe_overlap false",
        ),
        (
            {"parallel": {"moe_overlap": True, "pp": 2, "schedule": "zb-h1"}, "model": MOE},
            2,
            "it is allowed with parallel.pp = 1 or parallel.schedule 1f1b or dualpipev",
        ),
    ],
)
def test_validate_refuses_before_process_groups(updates: dict, world: int, message: str) -> None:
    assert message in _validate(updates, world)


def test_validate_accepts_dualpipev_and_moe_overlap() -> None:
    par = {"pp": 2, "vpp": 2, "schedule": "dualpipev"}
    train = {"global_batch_size": 4, "micro_batch_size": 1}
    layout = validate(apply_updates(RunConfig(), {"parallel": par, "train": train}, "t"), 2)
    assert layout.pipeline.report.peak_in_flight == (5, 5)
    overlap = {"parallel": {"pp": 2, "moe_overlap": True}, "model": MOE, "train": train}
    layout = validate(apply_updates(RunConfig(), overlap, "t"), 2)
    assert layout.moe_overlap and any(a.paired for a in layout.pipeline.compute[0])
    one = {"parallel": {"moe_overlap": True}, "model": MOE}
    assert validate(apply_updates(RunConfig(), one, "t"), 1).moe_overlap


def test_schedule_report_shows_the_pairs() -> None:
    text = schedule_report("dualpipev", 2, 4)
    assert "0F3~" in text and "3BW1~" in text
    assert "dualpipev: pp=2 vpp=2 microbatches=4 | unit-cost makespan 26 (ideal 24)" in text
    assert "(theory 0.0833)" in text


def test_the_simulator_replays_the_paired_plans() -> None:
    from ptdp.perf.cost.hardware_file import load_system
    from ptdp.perf.simulate.replay import PipelineCosts, replay
    from ptdp.perf.simulate.simulator import simulate
    from tests.helpers import PERF_MODEL

    # At unit costs the replay is the verifier's dry run, pairs and all.
    for name, paired in (("dualpipev", False), ("1f1b", True)):
        plan = build_plan(name, 4, 8, 2 if name == "dualpipev" else 1, paired=paired)
        run = replay(plan.lowered, plan.stages, PipelineCosts.unit(plan.stages.stages))
        assert run.makespan == plan.report.makespan
    system = load_system("a100-80gb")
    train = {"micro_batch_size": 1, "global_batch_size": 16}
    for parallel, model in (
        ({"pp": 4, "vpp": 2, "schedule": "dualpipev"}, PERF_MODEL),
        ({"pp": 4, "moe_overlap": True}, PERF_MODEL | MOE),
    ):
        updates = {"model": model, "parallel": parallel, "train": train}
        prediction = simulate(apply_updates(RunConfig(), updates, "t"), system, 4)
        assert prediction.layout.pipeline.compute[0][-1].kind in (Kind.W, Kind.BW)
        assert prediction.pipeline_seconds > 0


def test_ptdp_schedule_command(capsys) -> None:
    from ptdp.cli import main

    args = ["schedule", "--parallel.schedule", "dualpipev", "--pp", "4", "--microbatches", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "dualpipev: pp=4 vpp=2 microbatches=8 | unit-cost makespan 54 (ideal 48)" in out
    assert "0SEND_F" in out and "~" in out
    assert main([*args[:-1], "7"]) == 2
    assert "use m = 8 or more" in capsys.readouterr().err
    paired = ["schedule", "--pp", "2", "--microbatches", "4", "--moe-overlap", "--no-comms"]
    assert main(paired) == 0
    assert "1f1b (paired): pp=2" in capsys.readouterr().out
