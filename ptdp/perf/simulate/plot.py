"""Timelines of pipeline ranks, measured or simulated, as Chrome traces and PNG charts.

`TimelineRecorder.around_action` is the runtime's `around_action` hook
(`PipelineRuntime(around_action=recorder.around_action)`): it stamps each compute action
with `time.perf_counter`. `ptdp.perf.simulate.simulator` produces the same `Event`s from its replay,
so a measured and a simulated iteration can be written to one trace (one process per
source and rank, in Perfetto or chrome://tracing) or drawn one above the other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from ptdp.pipeline.actions import Action

COLOURS = {
    "F": "#4c78a8",
    "B": "#e45756",
    "BW": "#e45756",
    "W": "#54a24b",
    "SEND_F": "#bab0ac",
    "SEND_B": "#bab0ac",
    "DP": "#f58518",
    "OPT": "#b279a2",
}


@dataclass(frozen=True)
class Event:
    """One timed action of one pipeline rank (seconds; compute, transfer, reduction, step)."""

    rank: int
    stage: int
    mb: int
    kind: str
    """An action kind ("F", "B", "W", "BW", "SEND_F", ...), "DP" or "OPT"."""
    start: float
    end: float
    lane: str = "compute"
    """Which row of the rank: "compute", "p2p" or "dp"."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


class TimelineRecorder:
    """Records the compute actions one rank runs; pass `around_action` to the runtime.

    Without `sync` the hook only reads the clock. On a GPU an action's kernels run
    asynchronously, so pass `sync=torch.cuda.synchronize` to time device work (it
    serialises host and device, so use it for a profiled step, not every step); on CPU
    the wall time is the compute time.
    """

    def __init__(
        self,
        rank: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        sync: Callable[[], object] | None = None,
    ) -> None:
        self.rank = rank
        self.clock = clock
        self.sync = sync
        self.events: list[Event] = []

    def around_action(self, action: Action) -> AbstractContextManager[None]:
        """Context manager timing `action` (the runtime's around_action signature)."""
        return self._timed(action)

    @contextmanager
    def _timed(self, action: Action) -> Iterator[None]:
        if self.sync is not None:
            self.sync()
        start = self.clock()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            kind = action.kind.value
            self.events.append(Event(self.rank, action.stage, action.mb, kind, start, self.clock()))

    def clear(self) -> None:
        """Forget recorded events (e.g. after a warm-up step)."""
        self.events = []


def normalised(events: Sequence[Event]) -> list[Event]:
    """The events shifted so that the earliest starts at 0."""
    if not events:
        return []
    t0 = min(e.start for e in events)
    return [Event(e.rank, e.stage, e.mb, e.kind, e.start - t0, e.end - t0, e.lane) for e in events]


def to_dicts(events: Sequence[Event]) -> list[dict]:
    """Plain dicts (for JSON, or gathering events of several ranks)."""
    return [asdict(e) for e in events]


def from_dicts(rows: Sequence[dict]) -> list[Event]:
    return [Event(**row) for row in rows]


def chrome_trace(sources: dict[str, Sequence[Event]]) -> dict:
    """Trace Event Format: one process per (source, rank), one thread per lane, times in µs."""
    trace: list[dict] = []
    lanes = {"compute": 0, "p2p": 1, "dp": 2}
    for index, (source, events) in enumerate(sources.items()):
        ranks = sorted({e.rank for e in events})
        for rank in ranks:
            pid = index * 10_000 + rank
            name = f"{source} rank {rank}"
            trace.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            for lane, tid in lanes.items():
                meta = {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid}
                trace.append({**meta, "args": {"name": lane}})
        for e in normalised(events):
            trace.append(
                {
                    "name": f"{e.kind} s{e.stage} mb{e.mb}",
                    "cat": e.kind,
                    "ph": "X",
                    "pid": index * 10_000 + e.rank,
                    "tid": lanes.get(e.lane, 3),
                    "ts": e.start * 1e6,
                    "dur": max(e.seconds, 0.0) * 1e6,
                    "args": {"stage": e.stage, "mb": e.mb},
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, sources: dict[str, Sequence[Event]]) -> Path:
    """Write `chrome_trace(sources)` as JSON; open it in https://ui.perfetto.dev."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(sources)))
    return path


def plot_timelines(
    path: str | Path, sources: dict[str, Sequence[Event]], *, title: str = ""
) -> Path:
    """One Gantt chart per source (e.g. "measured", "simulated"), stacked, as a PNG.

    Rows are pipeline ranks; compute actions fill the row, transfers and data-parallel
    reductions are thin bars under it. Labels are "stage.mb" where they fit (and there
    are not too many of them).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = max((len({e.rank for e in ev}) for ev in sources.values()), default=1)
    fig, axes = plt.subplots(
        len(sources), 1, figsize=(14, 0.6 + (0.45 * ranks + 1.0) * len(sources)), squeeze=False
    )
    for ax, (name, events) in zip(axes[:, 0], sources.items()):
        events = normalised(events)
        span = max((e.end for e in events), default=1.0) or 1.0
        unit, scale = ("s", 1.0) if span >= 2 else ("ms", 1e3)
        bars: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
        for e in events:  # one broken_barh per (rank, lane, kind): fast for 100k events
            bars.setdefault((e.rank, e.lane, e.kind), []).append(
                (e.start * scale, e.seconds * scale)
            )
        for (rank, lane, kind), spans in bars.items():
            y, height = (-rank - 0.4, 0.8) if lane == "compute" else (-rank - 0.55, 0.12)
            ax.broken_barh(
                spans,
                (y, height),
                facecolors=COLOURS.get(kind, "#999999"),
                edgecolor="white" if lane == "compute" and len(events) < 2000 else "none",
                linewidth=0.3,
            )
        labelled = [e for e in events if e.lane == "compute" and e.seconds / span > 0.012]
        for e in labelled if len(labelled) < 400 else []:
            ax.text(
                (e.start + e.seconds / 2) * scale,
                -e.rank,
                f"{e.stage}.{e.mb}",
                ha="center",
                va="center",
                fontsize=5,
                color="white",
            )
        ax.set_xlim(0, span * scale)
        ranks_here = sorted({e.rank for e in events})
        ax.set_yticks([-r for r in ranks_here], [f"rank {r}" for r in ranks_here])
        ax.set_xlabel(f"time ({unit})")
        ax.set_title(name, fontsize=9, loc="left")
    kinds = [k for k in COLOURS if any(e.kind == k for ev in sources.values() for e in ev)]
    handles = [Patch(color=COLOURS[k], label=k) for k in dict.fromkeys(kinds)]
    if handles:
        axes[0, 0].legend(
            handles=handles,
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            fontsize=6,
            ncol=len(handles),
            frameon=False,
        )
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97 if title else 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
