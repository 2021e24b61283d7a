"""The pipeline benchmarks' pure parts: synthetic stage costs, ideal replays (ZB-V's V
included), per-chunk costs from measured events, and compute timing without input waits."""

from __future__ import annotations

import types

import pytest
import torch

from ptdp.perf.simulate.replay import PipelineCosts
from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.plan import build_plan
from ptdp.pipeline.timeline import Event
from tests.helpers import load_benchmark


@pytest.mark.parametrize("m", [4, 8])
def test_every_synthetic_plan_replays_as_verify(m: int) -> None:
    """`planned` raises unless ptdp.perf.simulate.replay's unit-cost makespan is verify's; ZB-V's
    turn (stage 3 to 4 on rank 3) has no transfer, which the benchmark's old replay could not
    run."""
    bench = load_benchmark("pipeline/pipeline_efficiency")
    for name, v, _ in bench.PAIRS:
        plan = bench.planned(name, v, m)
        assert plan.stages.stages == bench.PP * v
    one, half = bench.Costs(1.0, 1.0, 1.0), bench.Costs(0.5, 0.5, 0.5)  # per rank: 3 per mb
    bubble = {"1f1b": 3, "zb-h1": 1, "interleaved": 1.5}  # times (p - 1): the papers' formulas
    for name, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
        ideal = bench.ideal(name, v, m, half if v == 2 else one)
        assert ideal == pytest.approx(3 * m + bubble[name] * (bench.PP - 1)), name
    if m >= 2 * bench.PP:  # ZB-V's V beats ZB-H1 once every rank has a full warm-up
        assert bench.ideal("zb-v", 2, m, half) < bench.ideal("zb-h1", 1, m, one)


def test_synthetic_costs_and_v_chunks() -> None:
    bench = load_benchmark("pipeline/pipeline_efficiency")
    costs = bench.Costs(0.01, 0.02, 0.03).pipeline(8)
    assert costs.duration(Action(Kind.B, 0, 0)) == pytest.approx(0.02)
    assert costs.duration(Action(Kind.W, 0, 0)) == pytest.approx(0.03)
    assert costs.duration(Action(Kind.BW, 5, 1)) == pytest.approx(0.05)
    assert costs.duration(Action(Kind.F, 7, 1)) == pytest.approx(0.01)
    stages = build_plan("zb-v", bench.PP, 8, 2).stages
    chunks = bench.make_chunks(0, stages, bench.Costs(0.0, 0.0, 0.0))
    assert sorted(chunks) == [0, 7] and chunks[0].embed is not None and chunks[7].embed is None
    assert sorted(bench.make_chunks(3, stages, bench.Costs(0.0, 0.0, 0.0))) == [3, 4]


def test_measured_costs_are_per_chunk_medians() -> None:
    real = load_benchmark("pipeline/pipeline_real")
    plan = build_plan("zb-h1", 2, 4)
    events = [Event(0, 0, mb, "F", 0.0, t) for mb, t in enumerate((1.0, 5.0, 2.0))]
    events += [Event(1, 1, 0, "B", 0.0, 3.0), Event(1, 1, 0, "W", 0.0, 4.0)]
    costs = real.measured_costs(plan, events)
    assert costs == PipelineCosts((2.0, 0.0), (0.0, 3.0), (0.0, 4.0), (0.0, 0.0), (0.0, 0.0))
    fused = real.measured_costs(build_plan("1f1b", 2, 4), [Event(0, 0, 0, "BW", 1.0, 7.0)])
    assert fused.backward_input == (6.0, 0.0) and fused.backward_weight == (0.0, 0.0)


def test_compute_clock_leaves_out_the_wait_for_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fixed clock (action starts at 10, waits 10 to 10.2, ends at 10.25) the event
    holds the compute after the wait: 0.05 s, whatever the machine's load."""
    bench = load_benchmark("pipeline/pipeline_real")
    reads = iter([10.0, 10.0, 10.2, 10.25])
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: next(reads)))
    clock = bench.ComputeClock(rank=1)
    clock.recording = True
    with clock.around_action(Action(Kind.F, 1, 0)):
        with clock.around_wait("the activation"):
            pass
    (event,) = clock.events
    assert (event.rank, event.stage, event.kind) == (1, 1, "F")
    assert event.seconds == pytest.approx(0.05)


def test_synthetic_stage_defers_its_weight_gradient_to_w(monkeypatch: pytest.MonkeyPatch) -> None:
    """ptdp's B leaves the weight path's sleep and gradient to W; a fused backward sleeps
    both paths and gives the same gradients."""
    bench = load_benchmark("pipeline/pipeline_efficiency")
    stage = bench.SleepStage(bench.Costs(0.0, 0.0, 0.05), first=True)
    x = torch.full(bench.SHAPE, 2.0)
    stage(x).sum().backward()
    fused = (stage.weight.grad.clone(), stage.embed.grad.clone())
    stage.weight.grad = stage.embed.grad = None
    out = stage(x)
    slept: list[float] = []
    monkeypatch.setattr(bench, "_sleep", slept.append)  # the sleeps each side asks for
    with stage.wgrad.deferring((0, 0)):
        grads = torch.autograd.grad(out.sum(), [stage.embed, stage.weight], allow_unused=True)
    assert slept == [0.0]  # B slept T_B only, not T_W
    assert grads[1] is None and torch.equal(grads[0], fused[1])
    slept.clear()
    ((param, grad),) = stage.wgrad.flush((0, 0))
    assert slept == [0.05] and param is stage.weight  # W sleeps T_W
    assert torch.equal(grad, fused[0])
