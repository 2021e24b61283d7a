"""The planner's short replay (`replay_steady`) against the full replay, on random cases."""

from __future__ import annotations

import random

import pytest

from ptdp.perf.simulate.replay import PipelineCosts, PipelineRun, replay, replay_steady
from ptdp.pipeline.plan import build_plan
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.pipeline.timeline import Event


def random_case(rng: random.Random) -> tuple[str, int, int, int, PipelineCosts, bool]:
    name = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"])
    pp = rng.randint(2, 6)
    vpp = rng.randint(2, 3) if name == "interleaved" else 1
    period = pp if name == "interleaved" else 1
    m = period * rng.randint(-(-(14 * pp) // period), -(-(20 * pp) // period))
    stages = pp * vpp
    forward = [rng.uniform(0.5, 1.5) for _ in range(stages)]
    forward[0] += rng.uniform(0, 0.5)  # embedding
    forward[-1] += rng.uniform(0, 1.5)  # head
    hop = [rng.choice([0.0, rng.uniform(0.001, 0.3)]) for _ in range(stages)]
    costs = PipelineCosts(
        tuple(forward),
        tuple(f * rng.uniform(1.0, 2.2) for f in forward),
        tuple(f * rng.uniform(0.3, 1.0) for f in forward),
        tuple(hop),
        tuple([0.0] + hop[:-1]),
    )
    return name, pp, m, vpp, costs, rng.random() < 0.3


def gradient_finals(run: PipelineRun) -> dict[int, Event]:
    """Per stage, its BW or W that ends last, from the full timeline."""
    final: dict[int, Event] = {}
    for e in run.events:
        if e.kind in ("BW", "W") and (e.stage not in final or e.end > final[e.stage].end):
            final[e.stage] = e
    return final


CASES = [random_case(random.Random(seed)) for seed in range(30)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-p{c[1]}-m{c[2]}-v{c[3]}")
def test_short_replay_equals_the_full_replay(case) -> None:
    name, pp, m, vpp, costs, blocking = case
    stages = SCHEDULES[name].stage_map(pp, vpp)
    full = replay(build_plan(name, pp, m, vpp).lowered, stages, costs, blocking=blocking)
    short = short_replay(case)
    if short is None:  # no steady state within 2/3 of m: the simulator replays in full
        return
    assert not short.complete and full.complete
    assert short.makespan == pytest.approx(full.makespan, rel=1e-9)
    assert short.rank_end == pytest.approx(full.rank_end, rel=1e-9)
    assert short.busy == pytest.approx(full.busy, rel=1e-9)
    assert short.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-6, abs=1e-12)
    finals = gradient_finals(full)
    assert [(e.stage, e.rank, e.kind, e.mb) for e in short.events] == [
        (s, finals[s].rank, finals[s].kind, finals[s].mb) for s in sorted(finals)
    ]
    for e in short.events:
        assert (e.start, e.end) == pytest.approx((finals[e.stage].start, finals[e.stage].end))


def short_replay(case) -> PipelineRun | None:
    name, pp, m, vpp, costs, blocking = case
    stages = SCHEDULES[name].stage_map(pp, vpp)
    period = pp if SCHEDULES[name].interleaved else 1
    plan_for = lambda k: build_plan(name, pp, k, vpp).lowered  # noqa: E731
    return replay_steady(plan_for, stages, m, costs, period=period, blocking=blocking)


def test_most_cases_take_the_short_replay() -> None:
    assert sum(short_replay(case) is not None for case in CASES) >= 0.8 * len(CASES)


def test_too_few_microbatches_fall_back() -> None:
    costs = PipelineCosts.unit(4)
    stages = SCHEDULES["1f1b"].stage_map(4, 1)
    plan_for = lambda k: build_plan("1f1b", 4, k, 1).lowered  # noqa: E731
    assert replay_steady(plan_for, stages, 8, costs) is None
