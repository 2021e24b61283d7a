"""RUN_DIR/events.jsonl: what happened to a run besides its metrics, one JSON object a line.

- `failure`: the rank that failed first, how (raised, no heartbeat, the store's host
  gone), its error, the step in progress, `done` (the steps completed: a failure during
  the save of step k comes after k), `time` (when it was recorded) and `fault_time`
  (when it happened: for a silent rank, its last heartbeat);
- `checkpoint`: a save of step `step` into `checkpoint`, and `stall_s`, the seconds the
  training thread spent in it (`background`: the write went on in a thread,
  train.async_save; it is published at the next save or at the end);
- `interrupted`: the run stopped for SIGINT/SIGTERM after saving (a preemption notice);
- `rollback`: a non-finite step under `train.on_nan = rollback`: the bad step, the step
  restored and the completed steps lost (their batches are skipped);
- `recovery`: a fault recovered in process (train.recovery = in_process): the step
  replayed, its `cause` and `rank` (the first rank whose own fault it was, else the
  lowest), `tries`, `fault_time` (the first rank's detection) and the seconds from it to
  the next completed step; `recovery_fallback`: in-process recovery gave up (`reason`: a
  repeating fault, an update already begun, a rank absent) and the restart path follows;
- `resume` / `restart`: a run continued from a checkpoint, by `--resume` or by a launcher
  restart (torchrun --max-restarts, a SLURM requeue): the checkpoint and its step, the
  cause read from the previous failure, steps lost, the layout change, the seconds
  from the fault to the restarted run's first step, and (`set_aside`) the later
  checkpoints a rollback moved aside (ptdp/checkpoint/retention.py).

One rank writes each record, in one `write` to a file opened for appending (O_APPEND), so
records of several processes do not interleave; a record a full disk cannot hold is cut
back off (ptdp/files.py). The next start reads them back to tell a
restart why it happened.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ptdp.files import append_line

EVENTS = "events.jsonl"
ENDINGS = ("failure", "interrupted")
"""Events that end a run."""
BEGINNINGS = ("resume", "restart")
"""Events a continued run writes after its first step."""


def wall_ms(seconds: float | None = None) -> float:
    """A wall-clock time (now by default) in ms, rounded down: a recorded fault time never
    lies after the moment it is recorded."""
    return math.floor(1000 * (time.time() if seconds is None else seconds)) / 1000


def append_event(run_dir: str | Path, event: str, **fields: Any) -> dict[str, Any]:
    """Append one record (with the wall-clock `time`, unless given) and return it."""
    record = {"event": event, "time": round(time.time(), 3), **fields}
    path = Path(run_dir) / EVENTS
    path.parent.mkdir(parents=True, exist_ok=True)
    append_line(path, json.dumps(record))  # a full disk: an OutputError, no partial line
    return record


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record of the run directory; a line cut short by a crash is left out."""
    path = Path(run_dir) / EVENTS
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def previous_ending(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failure or interruption that ended the previous run: the last one recorded
    after the last resume or restart (None if that run left no record)."""
    for record in reversed(events):
        if record.get("event") in ENDINGS:
            return record
        if record.get("event") in BEGINNINGS:
            return None
    return None
