"""Elapsed time and the estimated time to the last step, for the training log.

The ETA is the median of the recent step times (each log interval's training time over its
steps; evaluation and checkpoint saves left out) times the steps left: the median ignores
a slow first interval (compilation, warm-up) and the odd hiccup.
"""

from __future__ import annotations

import statistics
import time
from collections import deque


class Progress:
    """Wall time since training began in this process and the ETA to `total_steps`."""

    def __init__(self, total_steps: int, window: int = 20) -> None:
        self.total_steps = total_steps
        self.start = time.perf_counter()
        self._step_times: deque[float] = deque(maxlen=window)

    def update(self, step: int, step_time: float) -> dict[str, float]:
        """Record a log interval's seconds per step at `step`; the record's elapsed_s and
        eta_s."""
        self._step_times.append(step_time)
        eta = statistics.median(self._step_times) * max(self.total_steps - step, 0)
        return {"elapsed_s": time.perf_counter() - self.start, "eta_s": eta}


def format_duration(seconds: float) -> str:
    """H:MM:SS, with days in front past 24 hours ("1d 02:03:04")."""
    whole = int(round(seconds))
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours}:{minutes:02d}:{secs:02d}"
