"""The compiled dry-run engine against the interpreter it replaced (tests/reference_dryrun.py).

Every schedule, random costs and link mixes, each comm model, compute-only and lowered plans,
and plans that deadlock (lowered by `add_comms`, itself checked against its old form): the
same events in the same order with the same times (exactly, not to a tolerance), makespan,
busy, span, ends and stuck ranks. A program compiled once gives the same under other costs,
and so does one compiled from the compute-only plan as `add_comms` lowers it
(`PipelinePlan.program`); `events=False` keeps everything else, and `finals` are each
stage's last gradient action of the full event list.
"""

from __future__ import annotations

import random

import pytest

from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.classic import one_f_one_b
from ptdp.pipeline.dryrun import CommModel, DryRun, PipelineCosts, program
from ptdp.pipeline.dryrun_engine import dry_run
from ptdp.pipeline.lowering import add_comms
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.plan import build_plan
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.pipeline.verify import UNIT_COST
from tests.reference_dryrun import reference_add_comms, reference_dry_run


def random_costs(rng: random.Random, stages: int) -> PipelineCosts:
    forward = [rng.uniform(0.5, 1.5) for _ in range(stages)]
    hop = [rng.choice([0.0, rng.uniform(0.001, 0.6)]) for _ in range(stages)]
    gather = rng.choice([(), tuple(rng.uniform(0, 0.2) for _ in range(stages))])
    return PipelineCosts(
        tuple(forward),
        tuple(f * rng.uniform(1.0, 2.2) for f in forward),
        tuple(f * rng.uniform(0.0, 1.0) for f in forward),
        tuple(hop),
        tuple([0.0] + hop[:-1]),
        gather,
        gather and (0.0,) + gather[1:],
    )


def cases() -> list[tuple[str, int, int, int, int]]:
    out = []
    for seed in range(36):
        rng = random.Random(seed)
        name = list(SCHEDULES)[seed % len(SCHEDULES)]
        chunks = SCHEDULES[name].chunks
        vpp = rng.randint(2, 3) if chunks is None else chunks
        pp = rng.randint(1, 5)
        m = pp * rng.randint(1, 4) if name in ("interleaved", "zb-v") else rng.randint(1, 3 * pp)
        least = pp if name == "interleaved" else SCHEDULES[name].min_microbatches(pp)
        out.append((name, pp, max(m, least), vpp, seed))
    return out


def same(fast: DryRun, slow: DryRun) -> None:
    assert fast.events == slow.events  # frozen dataclasses: equal kinds, ranks and exact times
    assert (fast.makespan, fast.busy, fast.span, fast.end) == (
        slow.makespan,
        slow.busy,
        slow.span,
        slow.end,
    )
    assert fast.stuck == slow.stuck


def gradient_finals(run: DryRun) -> tuple:
    final = {}
    for t in run.events:
        if t.action.kind in (Kind.BW, Kind.W):
            s = t.action.stage
            if s not in final or t.end > final[s].end:
                final[s] = t
    return tuple(final[s] for s in sorted(final))


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}-v{c[3]}-{c[4]}")
def test_compiled_engine_equals_the_interpreter(case) -> None:
    name, pp, m, vpp, seed = case
    rng = random.Random(seed)
    plan = build_plan(name, pp, m, vpp)
    stages = plan.stages
    assert plan.lowered == reference_add_comms(plan.compute, stages)
    compiled = program(plan.lowered, stages)
    for comms in CommModel:
        costs = random_costs(rng, pp * vpp)  # compiled from the compute plan, as add_comms lowers
        assert dry_run(plan.program, stages, costs, comms=comms) == dry_run(
            compiled, stages, costs, comms=comms
        )
        for actions in (plan.compute, plan.lowered):
            unit = lambda a: UNIT_COST[a.kind]  # noqa: E731
            same(
                dry_run(actions, stages, unit, comms=comms),
                reference_dry_run(actions, stages, unit, comms),
            )
        for _ in range(2):
            costs = random_costs(rng, pp * vpp)
            fast = dry_run(compiled, stages, costs, comms=comms)
            same(fast, reference_dry_run(plan.lowered, stages, costs, comms))
            assert fast.finals == gradient_finals(fast)
            quiet = dry_run(compiled, stages, costs, comms=comms, events=False)
            assert quiet.events == ()
            assert (quiet.makespan, quiet.busy, quiet.end, quiet.finals) == (
                fast.makespan,
                fast.busy,
                fast.end,
                fast.finals,
            )


def test_deadlocks_are_reported_alike() -> None:
    stages = StageMap(2)
    compute = one_f_one_b(2, 2)
    lowered = add_comms(compute, stages)
    crossed = {r: list(actions) for r, actions in lowered.items()}
    # Rank 1 never sends its gradients; in the other plan it never receives microbatch 1.
    crossed[1] = [a for a in crossed[1] if a.kind is not Kind.SEND_B]
    missing = {0: lowered[0], 1: [a for a in lowered[1] if a != Action(Kind.RECV_F, 1, 1)]}
    unit = lambda a: UNIT_COST[a.kind]  # noqa: E731
    for plan in (crossed, missing):
        for comms in CommModel:
            fast = dry_run(plan, stages, unit, comms=comms)
            same(fast, reference_dry_run(plan, stages, unit, comms))
    assert dry_run(crossed, stages, unit, comms=CommModel.RECV_BLOCKS).stuck


def test_a_program_runs_only_with_its_stage_map() -> None:
    plan = build_plan("1f1b", 2, 4)
    with pytest.raises(ValueError, match="compiled for"):
        dry_run(program(plan.lowered, plan.stages), StageMap(2, 2), PipelineCosts.unit(4))
