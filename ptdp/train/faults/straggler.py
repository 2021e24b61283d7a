"""Rank 0's straggler check: a step that runs `train.straggler_factor` times longer than
the median step logs where every rank is and names the ranks behind. Apart from the
watchdog (`watchdog.py`), whose thread runs it, because it only reads heartbeats and logs:
it never fails or stops a run.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

STEP_WINDOW = 20
"""Completed steps whose median a running step is compared with."""
MIN_STEPS = 3
"""Steps timed before the straggler check starts (the first ones compile and warm up)."""


class StragglerCheck:
    """Step times (set by the main thread) and the check of the running step (the thread)."""

    def __init__(self, factor: float, stale_s: float) -> None:
        self.factor = factor
        self.stale_s = stale_s
        self.started: float | None = None
        """When the running step started (monotonic), None between steps."""
        self.times: deque[float] = deque(maxlen=STEP_WINDOW)
        self._reported = -1
        self._marks: tuple[int, list[int], float] | None = None

    def begin(self) -> None:
        self.started = time.monotonic()

    def end(self) -> None:
        if self.started is not None:
            self.times.append(time.monotonic() - self.started)
        self.started = None

    def check(self, step: int, read_beats: Callable[[], list[dict]]) -> str | None:
        """Once step `step` has run factor x the median, note every rank's heartbeat
        counter; report on the first check at which every live rank has written a newer
        one (so no rank is described as it was before the slow step), or after stale_s.
        `read_beats` reads every rank's heartbeat (only once the step is slow)."""
        started = self.started
        if started is None or len(self.times) < MIN_STEPS:
            return None
        if self._reported == step:
            return None
        median = statistics.median(self.times)
        elapsed = time.monotonic() - started
        if elapsed < self.factor * median:
            return None
        beats = read_beats()
        if self._marks is None or self._marks[0] != step:
            self._marks = (step, [b.get("beat", 0) for b in beats], elapsed)
            return None
        _, marks, crossed = self._marks
        fresh = all(b.get("done") or b["beat"] > m for b, m in zip(beats, marks))
        if fresh or elapsed - crossed > self.stale_s:
            self._reported = step
            return straggler_report(step, elapsed, median, beats)
        return None


def straggler_report(step: int, elapsed: float, median: float, beats: list[dict]) -> str:
    """Where each rank is during a slow step, and which ranks are behind: those at the
    lowest step, and among them the ones not waiting for a peer (the others wait on them)."""
    live = {r: b for r, b in enumerate(beats) if not b.get("done")}
    low = min(b["step"] for b in live.values())
    behind = [r for r, b in live.items() if b["step"] == low]
    busy = [r for r in behind if not live[r]["waiting"]]
    if busy and len(busy) < len(live):
        behind = busy
    lines = [
        f"watchdog: step {step} has run {elapsed:.1f} s, {elapsed / median:.1f} x the median "
        f"{median:.2f} s; behind: rank{'s' if len(behind) > 1 else ''} "
        + ", ".join(str(r) for r in behind)
    ]
    for r, b in live.items():
        waiting = f", waiting for {b['waiting']}" if b["waiting"] else ""
        lines.append(f"  rank {r}: step {b['step']}, {b['action']} for {b['for_s']:.1f} s{waiting}")
    return "\n".join(lines)
