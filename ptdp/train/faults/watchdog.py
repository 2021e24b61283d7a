"""When a rank dies or falls behind: every rank stops soon after any rank fails, with a
message naming the rank that failed first, and a slow step says where each rank is.

How. Each rank runs a thread that writes a heartbeat (a counter, the step, the current
action) into the launcher's key-value store (the store the process group was created
with) every `interval_s`. Two watcher ranks, 0 and the last, read every heartbeat; one
that stops changing for `stale_s` marks its rank as failed: it was killed (SIGKILL, the
kernel's out-of-memory killer), or it froze, or its machine went away. A rank that raises
an error writes that error. The first failure written wins (`store.add` orders them).

Every rank's thread also reads the failure key. Once it is set, a rank whose main thread
has not stopped within `grace_s` (blocked in a collective or a pipeline receive that will
never complete) prints why and exits with status 1, so no rank is left blocked. A silent
rank on the same host is SIGKILLed, since a frozen process cannot exit by itself.

A communication error is not a failure of its own: a rank whose collective breaks
because a peer died waits (at most `stale_s`) for the failed rank to be named and reports
that. Timings all derive from `train.collective_timeout_s` (T): heartbeat every T/60
(0.1 to 5 s), a silent rank is failed after T/4, a blocked rank exits T/10 later, so every
rank stops within T of a death. Rank 0's thread also watches the step time: a step longer
than `train.straggler_factor` times the median logs where every rank is.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ptdp.errors import PtdpError
from ptdp.train.faults.events import wall_ms
from ptdp.train.faults.numerical import StopRequest

STEP_WINDOW = 20
"""Completed steps whose median a running step is compared with."""
MIN_STEPS = 3
"""Steps timed before the straggler check starts (the first ones compile and warm up)."""
_COMM_ERROR_MARKS = ("gloo/", "Connection reset", "Connection closed", "Timed out", "NCCL")


class PeerFailure(PtdpError):
    """Another rank failed first; this rank stopped because of it."""


@dataclass(frozen=True)
class WatchdogTimes:
    interval_s: float
    stale_s: float
    grace_s: float

    @classmethod
    def from_timeout(cls, timeout_s: float) -> WatchdogTimes:
        return cls(
            interval_s=min(5.0, max(0.1, timeout_s / 60)),
            stale_s=timeout_s / 4,
            grace_s=min(30.0, max(1.0, timeout_s / 10)),
        )


def is_communication_error(exc: BaseException) -> bool:
    """A collective or receive that broke (a peer died, a timeout), not a fault of here."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_ERROR_MARKS)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _summary(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


class Watchdog:
    """One rank's heartbeat thread and failure record (see the module docstring)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        straggler_factor: float = 0.0,
        say: Callable[[str], None] | None = None,
        exit_process: Callable[[int], None] = os._exit,
        store_host: str = "rank 0",
        restart: int = 0,
        store_on_rank0: bool = False,
        on_failure: Callable[[dict], None] | None = None,
    ) -> None:
        """`store_host` names who hosts `store` (LaunchEnv.store_host()), `restart` is
        torchrun's restart count; `store_on_rank0`: rank 0 hosts the store (launched without
        torchrun), so a lost store means rank 0 died. `on_failure` receives the failure
        record this rank wrote first (for RUN_DIR/events.jsonl)."""
        # Keys of their own for each run in this process group (the n-th on every rank)
        # and each torchrun restart, so that an earlier run's failure is not read again.
        run = store.add(f"ptdp/watchdog/{restart}/runs/{rank}", 1)
        self.store = dist.PrefixStore(f"ptdp/watchdog/{restart}/{run}/", store)
        self.rank, self.world_size = rank, world_size
        self.times = WatchdogTimes.from_timeout(timeout_s)
        self.straggler_factor = straggler_factor
        self.say = say or _stderr
        self.exit_process = exit_process
        self.store_host = store_host
        self.store_on_rank0 = store_on_rank0
        self.on_failure = on_failure
        self._rank0: dict = {}  # rank 0's pid and host, once read (named if it dies)
        self._rank0_reported = False
        self.watcher = rank in (0, world_size - 1)
        self.step = 0
        """The step in progress, or the last one while the rank saves or evaluates."""
        self.done = 0
        """Steps this rank completed (a failure during a save loses the step saved too)."""
        self.action: object = "starting"
        self.waiting = ""
        self.action_since = time.monotonic()
        self._step_started: float | None = None
        self._step_times: deque[float] = deque(maxlen=STEP_WINDOW)
        self._straggler_reported = -1
        self._straggler_marks: tuple[int, list[int], float] | None = None
        self._beat = 0
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (heartbeat, when it changed)
        self._failure_deadline: float | None = None
        self._first: dict | None = None
        self._released = False
        self._reporting = False
        self._stop = threading.Event()
        self._scan_lock = threading.RLock()
        self._thread = threading.Thread(target=self._loop, name="ptdp-watchdog", daemon=True)

    # ------------------------------------------------------------------ main thread

    def start(self) -> Watchdog:
        who = {"host": socket.gethostname(), "pid": os.getpid()}
        self.store.set(f"who/{self.rank}", json.dumps(who))
        if self.store_on_rank0 and self.rank:  # rank 0 is named by pid and host if it dies
            try:  # it starts its watchdog at the same point of the run as this rank
                self.store.wait(["who/0"], timedelta(seconds=self.times.stale_s))
                self._rank0 = self._who(0)
            except Exception:  # not there in time: named without them
                pass
        self._write_heartbeat()
        self._thread.start()
        return self

    def close(self) -> None:
        """The run ended (well, or with its failure recorded): stop the thread; watchers
        stop expecting heartbeats from this rank."""
        self._stop.set()
        self._thread.join(timeout=2 * self.times.interval_s + 1)
        try:
            self.store.set(f"hb/{self.rank}", json.dumps({"done": True}))
        except Exception:  # the store's host is gone; nobody is watching
            pass

    def begin_step(self, step: int) -> None:
        self.step, self._step_started = step, time.monotonic()

    def end_step(self) -> None:
        self.done = self.step
        if self._step_started is not None:
            self._step_times.append(time.monotonic() - self._step_started)
        self._step_started = None

    @contextmanager
    def doing(self, action: object) -> Iterator[None]:
        """Marks what this rank is doing: a phase of the step (a string) or a pipeline
        action (shown as "action 1F2")."""
        previous = self.action
        self.action, self.action_since = action, time.monotonic()  # text made when read
        yield  # an exception leaves the failing action in place, for the report
        self.action = previous

    @contextmanager
    def waiting_for(self, what: str) -> Iterator[None]:
        self.waiting = what
        yield
        self.waiting = ""

    def failed(self, exc: BaseException) -> BaseException:
        """This rank's run raised `exc`: record it, or name the rank that failed first.
        Returns the exception to raise (a PeerFailure when another rank failed first)."""
        if isinstance(exc, PeerFailure):
            return exc
        where = f"at step {self.step} in {self._where()}"
        self._reporting = True  # not blocked: its waits here are bounded
        try:  # the launcher's SIGTERM to the other ranks waits until the report is out
            with StopRequest():
                return self._failed(exc, where)
        except Exception as store_error:
            return PeerFailure(
                f"{self._store_gone(store_error, 120)}. This rank ({self.rank}) stopped "
                f"{where}: {_summary(exc, 160)}"
            )
        finally:
            self._reporting = False

    def _failed(self, exc: BaseException, where: str) -> BaseException:
        if not is_communication_error(exc):
            self._claim({"how": "raised", "error": _summary(exc), "where": where})
            self._stopping()
            return exc
        deadline = time.monotonic() + self.times.stale_s + 4 * self.times.interval_s
        while True:
            first = self._first_failure()
            if first is None:  # the watcher ranks may be gone already (torchrun stops them)
                self._scan()
                first = self._first_failure()
            if first is not None and first["rank"] != self.rank:
                self._stopping()
                return PeerFailure(
                    f"{describe_failure(first)}. This rank ({self.rank}) stopped {where}: "
                    f"{_summary(exc, 160)}"
                )
            if first is not None or time.monotonic() > deadline:
                break
            time.sleep(self.times.interval_s)
        self._claim({"how": "communication error", "error": _summary(exc), "where": where})
        self._stopping()
        return exc

    def _stopping(self) -> None:
        """Rank 0 waits (at most stale_s) until every live rank has read the failure:
        launched without torchrun, it hosts the store they read it from."""
        self._release()
        if self.rank != 0:
            return
        first = self._first_failure() or {}
        expected = self.world_size - (first.get("how") == "no heartbeat")
        deadline = time.monotonic() + self.times.stale_s
        while self.store.add("released", 0) < expected and time.monotonic() < deadline:
            time.sleep(self.times.interval_s)

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while not self._stop.wait(self.times.interval_s):
            try:
                self._tick()
            except Exception as exc:  # the store is gone: the launcher's host died
                self._store_lost(exc)

    def _tick(self) -> None:
        self._write_heartbeat()
        if self.store_on_rank0 and not self._rank0 and self.rank:
            self._rank0 = self._who(0)
        first = self._first_failure()
        if first is not None:
            self._failure_seen(first)
        if self.watcher:
            self._scan()
        if self.rank == 0 and self.straggler_factor > 0:
            self._check_straggler()

    def _store_gone(self, error: Exception, limit: int = 160) -> str:
        """Why the store is unreachable. Launched without torchrun, rank 0 hosts it: rank 0
        has failed, and is named as any failed rank is (the last rank records it)."""
        lost = f"the launcher's key-value store is unreachable ({_summary(error, limit)})"
        if not self.store_on_rank0 or self.rank == 0:
            return f"{lost}; {self.store_host}, which hosts it, has probably failed"
        seen = self._seen.get(0)
        last = json.loads(seen[0]) if seen else {}
        where = (
            f"last heard from at step {last['step']} in {last['action']}"
            if "step" in last
            else f"at step {self.step} or before"  # every step ends with a collective
        )
        first = {
            "rank": 0,
            **self._rank0,
            "how": "store lost",
            "where": where,
            "error": f"{lost}: the process hosting it ({self.store_host}) was killed or its "
            "machine went away",
            "step": self.step,
            "done": self.done,
            "fault_time": wall_ms(time.time() - (time.monotonic() - seen[1])) if seen else None,
        }
        if self.rank == self.world_size - 1 and not self._rank0_reported:
            self._rank0_reported = True
            self._report(first)
        return describe_failure(first)

    def _report(self, record: dict) -> None:
        """Hand the failure this rank recorded first to on_failure (never raises)."""
        if self.on_failure is None:
            return
        try:
            self.on_failure(record)
        except Exception as exc:  # the report matters less than the exit
            _stderr(f"rank {self.rank}: could not record the failure: {_summary(exc)}")

    def _write_heartbeat(self) -> None:
        self._beat += 1
        beat = {
            "beat": self._beat,
            "step": self.step,
            "action": self._action_text(),
            "waiting": self.waiting,
            "for_s": round(time.monotonic() - self.action_since, 1),
        }
        self.store.set(f"hb/{self.rank}", json.dumps(beat))

    def _where(self) -> str:
        return self._action_text() + (f" (waiting for {self.waiting})" if self.waiting else "")

    def _action_text(self) -> str:
        action = self.action
        return action if isinstance(action, str) else f"action {action}"

    def _first_failure(self) -> dict | None:
        """The first failure recorded, kept once read (the store may go away after)."""
        with self._scan_lock:
            if self._first is None and self.store.check(["first"]):
                self._first = json.loads(self.store.get("first"))
                self._release()
            return self._first

    def _release(self) -> None:
        """Count this rank, once, among those that need the store no more (they know the
        first failure, or have reported their own): rank 0 waits for them in _stopping."""
        if not self._released:
            self._released = True
            self.store.add("released", 1)

    def _claim(self, record: dict, rank: int | None = None) -> None:
        """Write a failure; the first one written is the one every rank reports."""
        rank = self.rank if rank is None else rank
        record = {"rank": rank, **self._who(rank), "step": self.step, "done": self.done, **record}
        record.setdefault("fault_time", wall_ms())
        if self.store.add("failures", 1) == 1:
            self.store.set("first", json.dumps(record))
            self._report(record)
        self._first_failure()  # counted as seen (it may be another rank's, written first)

    def _who(self, rank: int) -> dict:
        key = f"who/{rank}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else {}

    def _failure_seen(self, first: dict) -> None:
        now = time.monotonic()
        if self._failure_deadline is None:
            self._failure_deadline = now + self.times.grace_s
            self._end_silent_rank(first)
        elif now > self._failure_deadline and not self._reporting:
            _stderr(
                f"rank {self.rank}: {describe_failure(first)}. This rank was still blocked "
                f"{self.times.grace_s:.0f} s later at step {self.step} in {self._where()}; "
                "exiting"
            )
            self._stopping()
            self.exit_process(1)

    def _end_silent_rank(self, first: dict) -> None:
        """A silent rank on this host is SIGKILLed: if it is frozen (SIGSTOP, a hung
        process) it cannot act on its launcher's SIGTERM, and torchrun would wait 30 s
        before its own SIGKILL and the restart. A rank that is gone is left alone."""
        pid, mine = first.get("pid"), first.get("host") == socket.gethostname()
        if first.get("how") != "no heartbeat" or not mine or pid in (None, os.getpid()):
            return  # (several ranks in one process: tests)
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"  # no /proc: kill answers whether it exists
        if state in ("Z", "X"):  # dead already, not yet reaped by its launcher
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        _stderr(
            f"rank {self.rank}: sent SIGKILL to rank {first['rank']} (pid {pid}), silent on "
            "this host, so that its launcher sees it exit"
        )

    def _scan(self) -> None:
        """Watcher ranks: a rank whose heartbeat has not changed for stale_s has failed."""
        with self._scan_lock:  # the thread, and the main thread while it reports a failure
            self._scan_locked()

    def _scan_locked(self) -> None:
        now = time.monotonic()
        keys = [f"hb/{r}" for r in range(self.world_size)]
        present = [r for r, k in enumerate(keys) if r in self._seen or self.store.check([k])]
        for r, raw in zip(present, self.store.multi_get([keys[r] for r in present])):
            beat = raw.decode()
            if r not in self._seen or self._seen[r][0] != beat:
                self._seen[r] = (beat, now)
        for r, (beat, changed) in self._seen.items():
            last = json.loads(beat)
            if r == self.rank or last.get("done") or now - changed < self.times.stale_s:
                continue
            if self._first_failure() is None:
                self._claim(
                    {
                        "how": "no heartbeat",
                        "error": (
                            f"no heartbeat for {now - changed:.1f} s: the process was killed "
                            "(SIGKILL, out of host memory), froze, or its machine went away"
                        ),
                        "where": f"last heard from at step {last['step']} in {last['action']}",
                        "fault_time": wall_ms(time.time() - (now - changed)),
                    },
                    rank=r,
                )
            return

    def _check_straggler(self) -> None:
        """Once a step has run straggler_factor x the median, note every rank's heartbeat
        counter; report on the first tick at which every live rank has written a newer one
        (so no rank is described as it was before the slow step), or after stale_s."""
        started, step = self._step_started, self.step
        if started is None or len(self._step_times) < MIN_STEPS:
            return
        if self._straggler_reported == step:
            return
        median = statistics.median(self._step_times)
        elapsed = time.monotonic() - started
        if elapsed < self.straggler_factor * median:
            return
        keys = [f"hb/{r}" for r in range(self.world_size)]
        beats = [json.loads(b) for b in self.store.multi_get(keys)]
        if self._straggler_marks is None or self._straggler_marks[0] != step:
            self._straggler_marks = (step, [b.get("beat", 0) for b in beats], elapsed)
            return
        _, marks, crossed = self._straggler_marks
        fresh = all(b.get("done") or b["beat"] > m for b, m in zip(beats, marks))
        if fresh or elapsed - crossed > self.times.stale_s:
            self._straggler_reported = step
            self.say(straggler_report(step, elapsed, median, beats))

    def _store_lost(self, exc: Exception) -> None:
        if self._stop.is_set():
            return
        if self._first is not None:  # rank 0 left after the failure was known: expected
            _stderr(f"rank {self.rank}: {describe_failure(self._first)}; exiting")
            self.exit_process(1)
            return
        _stderr(f"rank {self.rank}: {self._store_gone(exc)}. Exiting")
        self.exit_process(1)


def describe_failure(first: dict) -> str:
    """One line naming the rank that failed first, where it was and its error."""
    who = f" (pid {first['pid']} on {first['host']})" if "pid" in first else ""
    return f"rank {first['rank']}{who} failed first, {first['where']}: {first['error']}"


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
