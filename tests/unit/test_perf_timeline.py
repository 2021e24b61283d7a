"""Timelines: the runtime's around_action hook records, traces and charts are written."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.simulate.plot import chrome_trace, plot_timelines, write_chrome_trace
from ptdp.perf.simulate.simulator import simulate
from ptdp.perf.validate.paper import README_GPT3, paper_run
from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.runtime import PipelineRuntime
from ptdp.pipeline.schedules import build
from ptdp.pipeline.timeline import Event, TimelineRecorder, from_dicts, normalised, to_dicts


class FakeClock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


def test_recorder_stamps_each_action() -> None:
    syncs = []
    rec = TimelineRecorder(rank=3, clock=FakeClock(), sync=lambda: syncs.append(1))
    with rec.around_action(Action(Kind.F, 6, 2)):
        pass
    with rec.around_action(Action(Kind.BW, 6, 2)):
        pass
    assert rec.events == [
        Event(3, 6, 2, "F", 10.5, 11.0),
        Event(3, 6, 2, "BW", 11.5, 12.0),
    ]
    assert [e.start for e in normalised(rec.events)] == [0.0, 1.0]
    assert len(syncs) == 4  # before and after each action
    assert from_dicts(to_dicts(rec.events)) == rec.events
    rec.clear()
    assert rec.events == []


def test_recorder_as_the_runtime_hook() -> None:
    # One stage (pp = 1): the runtime runs F and BW of each microbatch, no transfers.
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    data = torch.randn(3, 2, 4)

    def forward_step(stage: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
        return layer(data[mb]).pow(2).mean()

    rec = TimelineRecorder(rank=0)
    runtime = PipelineRuntime(
        chunks={0: layer},
        forward_step=forward_step,
        p2p=None,  # never used without SEND/RECV actions
        stages=StageMap(1),
        around_action=rec.around_action,
    )
    actions = build("1f1b", 1, 3)[0]
    losses = runtime.run(actions)
    assert len(losses) == 3
    assert [(e.kind, e.mb) for e in rec.events] == [(a.kind.value, a.mb) for a in actions]
    assert all(e.end >= e.start for e in rec.events)
    assert all(a.end <= b.start for a, b in zip(rec.events, rec.events[1:]))


def test_trace_and_chart_of_measured_and_simulated(tmp_path: Path) -> None:
    measured = [Event(r, r, mb, "F", mb + r, mb + r + 0.8) for r in range(2) for mb in range(3)]
    cfg = paper_run(README_GPT3, micro_batch=1, vpp=1)
    simulated = simulate(cfg, load_system("a100-80gb"), README_GPT3.gpus).events
    sources = {"measured": measured, "simulated": simulated}
    trace = chrome_trace(sources)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"measured rank 0", "simulated rank 15", "compute", "p2p", "dp"} <= names
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(measured) + len(simulated)
    first = min(spans, key=lambda e: (e["pid"], e["ts"]))
    assert first["ts"] == 0.0 and first["dur"] == 0.8e6  # microseconds from the first event
    path = write_chrome_trace(tmp_path / "t" / "trace.json", sources)
    assert json.loads(path.read_text())["traceEvents"]
    png = plot_timelines(tmp_path / "timeline.png", sources, title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
