"""Timelines of pipeline ranks: the timed actions (`Event`) and the runtime's recorder.

`TimelineRecorder.around_action` is the runtime's `around_action` hook
(`PipelineRuntime(around_action=recorder.around_action)`): it stamps each compute action
with `time.perf_counter`. `ptdp.perf.simulate.simulator` produces the same `Event`s from its
replay, so a measured and a simulated iteration can be written to one trace or drawn one
above the other (`ptdp.perf.simulate.plot`). Pure: no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass

from ptdp.pipeline.actions import Action


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
