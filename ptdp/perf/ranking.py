"""The planner's ranking: each candidate layout replayed, those that fit sorted by step time,
and the one to recommend among those the model cannot tell apart (`recommend`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ptdp.config import RunConfig
from ptdp.perf.costs import Software
from ptdp.perf.hardware import GIB, System
from ptdp.perf.reserve import fit
from ptdp.perf.search import Plans, Rejected
from ptdp.perf.simulator import Prediction, simulate

Progress = Callable[[int, int, str], None]
"""progress(done, total, what): called before each simulation."""


@dataclass(frozen=True)
class Option:
    """One simulated layout."""

    config: RunConfig
    prediction: Prediction

    def describe(self) -> str:
        p, lay = self.config.parallel, self.prediction.layout
        sp = " sp" if p.sequence_parallel else ""
        b = self.config.train.micro_batch_size
        cp = f" cp={lay.cp} {p.cp_comm.value}" if lay.cp > 1 else ""
        zero = f" zero={lay.zero}" if lay.zero else ""
        return (
            f"t={lay.tp}{sp}{cp} p={lay.pp} d={lay.dp}{zero} v={lay.vpp} b={b} "
            f"m={lay.num_microbatches} {p.schedule.value} recompute={p.recompute.value}"
        )


def simulate_all(
    candidates: list[RunConfig],
    gpus: int,
    system: System,
    software: Software,
    rejected: list[Rejected],
    progress: Progress | None,
    plans: Plans,
) -> list[Option]:
    """Each candidate replayed (`simulate`, without a timeline), in order; those that do not fit
    in memory go to `rejected`."""
    options = []
    for i, cfg in enumerate(candidates):
        layout = plans.layout(cfg, gpus)
        what = f"t={layout.tp} p={layout.pp} v={layout.vpp} b={cfg.train.micro_batch_size}"
        if progress is not None:
            progress(i, len(candidates), what)
        prediction = simulate(
            cfg, system, gpus, software=software, layout=layout, timeline=False, plans=plans
        )
        need, room = fit(prediction.memory, system.device)
        if need > room:
            rejected.append(Rejected(what, f"needs {need / GIB:.1f} GiB, {room / GIB:.1f} usable"))
            continue
        options.append(Option(cfg, prediction))
    if progress is not None:
        progress(len(candidates), len(candidates), "done")
    return options


def recommend(options: list[Option], tolerance: float) -> int:
    """Index of the layout to recommend among `options` (sorted fastest first).

    Layouts within `tolerance` of the fastest are equal as far as the model can tell;
    among them ZeRO-3 only if nothing else is close (its step rests on per-microbatch
    gathers reaching the ring model's bandwidth, which the paper's ZeRO-3 fell far short
    of: Table 2, `costs.DEEPSPEED_2021`), then the paper's takeaways: the smallest t * p
    (#2), then the largest t (#1), then the fastest.
    """
    fastest = options[0].prediction.iteration_seconds
    close = [
        i
        for i, o in enumerate(options)
        if o.prediction.iteration_seconds <= fastest * (1 + tolerance)
    ]

    def key(i: int) -> tuple[bool, int, int, float]:
        lay = options[i].prediction.layout
        return (lay.zero == 3, lay.tp * lay.pp, -lay.tp, options[i].prediction.iteration_seconds)

    return min(close, key=key)
