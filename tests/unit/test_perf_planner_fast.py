"""The planner on the compiled dry-run engine against the same search on the interpreter it
replaced (tests/reference_dryrun.py): the same layouts in the same order, with every number
equal to the last bit, under ptdp's asynchronous transfers and Megatron-2021's blocking ones."""

from __future__ import annotations

from dataclasses import replace

import pytest

import ptdp.perf.simulate.replay as replay_module
import ptdp.perf.simulate.simulator as simulator
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_2021, PTDP
from ptdp.perf.plan.planner import PlanResult, plan
from ptdp.pipeline.actions import Kind
from ptdp.pipeline.dryrun import CommModel, DryRun, Program
from tests.reference_dryrun import reference_dry_run

A100 = load_system("a100-80gb")


def interpreted(plan, stages, cost, *, comms=CommModel.ASYNC, events=True) -> DryRun:
    """`dry_run` by the old interpreter, on the lowered plan a program stands for."""
    lowered = plan.plan if isinstance(plan, Program) else plan
    run = reference_dry_run(lowered, stages, cost, comms)
    final = {}
    for t in run.events:
        s = t.action.stage
        if t.action.kind in (Kind.BW, Kind.W) and (s not in final or t.end > final[s].end):
            final[s] = t
    return replace(run, finals=tuple(final[s] for s in sorted(final)))


def small(hidden: int) -> RunConfig:
    model = {"num_layers": 8, "hidden_size": hidden, "num_heads": 8, "seq_length": 256}
    return apply_updates(
        RunConfig(),
        {"model": {**model, "vocab_size": 1024}, "train": {"global_batch_size": 512}},
        "test",
    )


def numbers(result: PlanResult) -> list:
    rows = []
    for o in result.options:
        p = o.prediction
        events = [(e.rank, e.stage, e.mb, e.kind, e.start, e.end, e.lane) for e in p.events]
        rows.append((o.describe(), p.iteration_seconds, p.bubble_fraction, p.busy, events))
    return [rows, result.recommended, result.rejected, result.explanation]


CASES = [(16, 512), (8, 1024)]  # (GPUs, hidden): most layouts replayed in short, some in full


@pytest.mark.parametrize("gpus,hidden", CASES)
@pytest.mark.parametrize("software", [PTDP, MEGATRON_2021], ids=["ptdp", "megatron-2021"])
def test_the_planner_ranks_alike_on_both_engines(gpus, hidden, software, monkeypatch) -> None:
    short = []
    steady = simulator.replay_steady
    monkeypatch.setattr(
        simulator, "replay_steady", lambda *a, **k: short.append(steady(*a, **k)) or short[-1]
    )
    # prune=False: every layout that fits is replayed, so both engines run the whole search.
    fast = plan(small(hidden), gpus=gpus, system=A100, software=software, prune=False)
    assert len(fast.options) >= 15
    assert {o.config.parallel.schedule.value for o in fast.options} >= {"1f1b", "interleaved"}
    assert sum(run is not None for run in short) >= 5  # the steady-state path is exercised
    monkeypatch.setattr(replay_module, "dry_run", interpreted)
    slow = plan(small(hidden), gpus=gpus, system=A100, software=software, prune=False)
    assert numbers(fast) == numbers(slow)
