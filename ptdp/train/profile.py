"""`train.profile_timeline`: the last step's per-rank timeline, measured and predicted.

Every rank of the first tensor/data-parallel replica records its compute actions (the
runtime's `around_action` hook); at the end of the run rank 0 writes them as a Chrome
trace (`timeline.json`, open in https://ui.perfetto.dev) and a PNG, above a prediction of
the same step: `ptdp.perf.simulate.simulator` on a GPU the performance model knows, otherwise the
schedule replayed with each stage's measured action times and free transfers, so the gap
between the two is what communication and waiting cost.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from ptdp.config.sections import RunConfig
from ptdp.perf.cost.hardware_file import system_for_device_name
from ptdp.perf.simulate.plot import plot_timelines, write_chrome_trace
from ptdp.perf.simulate.replay import PipelineCosts, replay
from ptdp.perf.simulate.simulator import simulate
from ptdp.pipeline.timeline import Event
from ptdp.rules.layout import Layout


def _median(events: Sequence[Event], kind: str, stage: int) -> float | None:
    times = [e.seconds for e in events if e.kind == kind and e.stage == stage]
    return statistics.median(times) if times else None


def replay_at_measured_costs(layout: Layout, events: Sequence[Event]) -> list[Event]:
    """The schedule in simulated time with each stage's median measured F, B and W."""
    stages = layout.pp * layout.vpp
    forward, back_input, back_weight = [], [], []
    for s in range(stages):
        f = _median(events, "F", s) or 0.0
        bw = _median(events, "BW", s)
        b, w = _median(events, "B", s), _median(events, "W", s)
        if b is None or w is None:  # a full backward: split it evenly, as verify does
            b = w = (bw or 0.0) / 2
        forward.append(f)
        back_input.append(b)
        back_weight.append(w)
    zeros = (0.0,) * stages
    costs = PipelineCosts(tuple(forward), tuple(back_input), tuple(back_weight), zeros, zeros)
    plan = layout.pipeline
    return list(replay(plan.lowered, plan.stages, costs).events)


def predicted(
    cfg: RunConfig, layout: Layout, events: Sequence[Event], device: torch.device
) -> tuple[str, list[Event]]:
    if device.type == "cuda":
        system = system_for_device_name(torch.cuda.get_device_name(device))
        if system is not None:
            return f"simulated ({system.name})", list(
                simulate(cfg, system, layout.world_size).events
            )
    return "schedule at measured action times", replay_at_measured_costs(layout, events)


def write_timeline(
    run_dir: Path, cfg: RunConfig, layout: Layout, events: list[Event], device: torch.device
) -> tuple[Path, Path]:
    name, other = predicted(cfg, layout, events, device)
    sources = {"measured": events, name: other}
    title = f"{layout.describe()} | schedule {layout.schedule} | last training step"
    trace = write_chrome_trace(run_dir / "timeline.json", sources)
    return trace, plot_timelines(run_dir / "timeline.png", sources, title=title)
