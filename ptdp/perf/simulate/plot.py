"""Timelines of pipeline ranks, measured or simulated, as Chrome traces and PNG charts.

The events are `ptdp.pipeline.timeline.Event`s: recorded by the runtime's `TimelineRecorder`
or produced by the simulator's replay. A trace holds one process per source and rank (in
Perfetto or chrome://tracing); a chart draws the sources one above the other.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ptdp.pipeline.timeline import Event, normalised

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
