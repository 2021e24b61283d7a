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
rank stops within T of a death. Under train.recovery = in_process a silent rank is failed
only after the second timeout, 2T: a rank frozen for less (SIGSTOP then SIGCONT) resumes,
its collective fails and it joins the in-process recovery (recovery.py); one silent for
longer is failed as above, and the run takes the restart path. Rank 0's thread also
watches the step time: a step longer than `train.straggler_factor` times the median logs
where every rank is.

This module holds the policy: the thread, what it concludes and when a rank exits. The
store's keys are `heartbeats.py`, the judgements on errors and failure records
`failures.py`, the straggler check `straggler.py`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

from ptdp.train.faults import heartbeats
from ptdp.train.faults.events import wall_ms
from ptdp.train.faults.failures import (
    PeerFailure,
    describe_failure,
    end_silent_rank,
    is_communication_error,
    summary,
    to_stderr,
)
from ptdp.train.faults.numerical import StopRequest
from ptdp.train.faults.straggler import StragglerCheck


@dataclass(frozen=True)
class WatchdogTimes:
    interval_s: float
    stale_s: float
    grace_s: float

    @classmethod
    def from_timeout(cls, timeout_s: float, *, in_process: bool = False) -> WatchdogTimes:
        """`in_process` (train.recovery = in_process): a silent rank is failed only after
        the second timeout, 2T, so a rank frozen for less rejoins the recovery."""
        return cls(
            interval_s=min(5.0, max(0.1, timeout_s / 60)),
            stale_s=2 * timeout_s if in_process else timeout_s / 4,
            grace_s=min(30.0, max(1.0, timeout_s / 10)),
        )


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
        in_process: bool = False,
    ) -> None:
        """`store_host` names who hosts `store` (LaunchEnv.store_host()), `restart` is
        torchrun's restart count; `store_on_rank0`: rank 0 hosts the store (launched without
        torchrun), so a lost store means rank 0 died. `on_failure` receives the failure
        record this rank wrote first (for RUN_DIR/events.jsonl). `in_process`: the run
        recovers in process (WatchdogTimes.from_timeout)."""
        self.store = heartbeats.run_store(store, rank, restart)
        self.rank, self.world_size = rank, world_size
        self.times = WatchdogTimes.from_timeout(timeout_s, in_process=in_process)
        self.stragglers = StragglerCheck(straggler_factor, timeout_s / 4)  # as under restart
        self.say = say or to_stderr
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
        heartbeats.write_who(self.store, self.rank)
        if self.store_on_rank0 and self.rank:  # rank 0 is named by pid and host if it dies
            try:  # it starts its watchdog at the same point of the run as this rank
                self._rank0 = heartbeats.wait_who(self.store, 0, self.times.stale_s)
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
            heartbeats.write_done(self.store, self.rank)
        except Exception:  # the store's host is gone; nobody is watching
            pass

    def begin_step(self, step: int) -> None:
        self.step = step
        self.stragglers.begin()

    def end_step(self) -> None:
        self.done = self.step
        self.stragglers.end()

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
                f"{where}: {summary(exc, 160)}"
            )
        finally:
            self._reporting = False

    def _failed(self, exc: BaseException, where: str) -> BaseException:
        if not is_communication_error(exc):
            self._claim({"how": "raised", "error": summary(exc), "where": where})
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
                    f"{summary(exc, 160)}"
                )
            if first is not None or time.monotonic() > deadline:
                break
            time.sleep(self.times.interval_s)
        self._claim({"how": "communication error", "error": summary(exc), "where": where})
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
        while heartbeats.released(self.store) < expected and time.monotonic() < deadline:
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
            self._rank0 = heartbeats.read_who(self.store, 0)
        first = self._first_failure()
        if first is not None:
            self._failure_seen(first)
        if self.watcher:
            self._scan()
        if self.rank == 0 and self.stragglers.factor > 0:
            report = self.stragglers.check(
                self.step, lambda: heartbeats.read_all_beats(self.store, self.world_size)
            )
            if report is not None:
                self.say(report)

    def _store_gone(self, error: Exception, limit: int = 160) -> str:
        """Why the store is unreachable. Launched without torchrun, rank 0 hosts it: rank 0
        has failed, and is named as any failed rank is (the last rank records it)."""
        lost = f"the launcher's key-value store is unreachable ({summary(error, limit)})"
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
            to_stderr(f"rank {self.rank}: could not record the failure: {summary(exc)}")

    def _write_heartbeat(self) -> None:
        self._beat += 1
        beat = {
            "beat": self._beat,
            "step": self.step,
            "action": self._action_text(),
            "waiting": self.waiting,
            "for_s": round(time.monotonic() - self.action_since, 1),
        }
        heartbeats.write_beat(self.store, self.rank, beat)

    def _where(self) -> str:
        return self._action_text() + (f" (waiting for {self.waiting})" if self.waiting else "")

    def _action_text(self) -> str:
        action = self.action
        return action if isinstance(action, str) else f"action {action}"

    def _first_failure(self) -> dict | None:
        """The first failure recorded, kept once read (the store may go away after)."""
        with self._scan_lock:
            if self._first is None:
                self._first = heartbeats.read_first(self.store)
                if self._first is not None:
                    self._release()
            return self._first

    def _release(self) -> None:
        """Count this rank, once, among those that need the store no more (they know the
        first failure, or have reported their own): rank 0 waits for them in _stopping."""
        if not self._released:
            self._released = True
            heartbeats.release(self.store)

    def _claim(self, record: dict, rank: int | None = None) -> None:
        """Write a failure; the first one written is the one every rank reports."""
        rank = self.rank if rank is None else rank
        who = heartbeats.read_who(self.store, rank)
        record = {"rank": rank, **who, "step": self.step, "done": self.done, **record}
        record.setdefault("fault_time", wall_ms())
        if heartbeats.claim_first(self.store, record):
            self._report(record)
        self._first_failure()  # counted as seen (it may be another rank's, written first)

    def _failure_seen(self, first: dict) -> None:
        now = time.monotonic()
        if self._failure_deadline is None:
            self._failure_deadline = now + self.times.grace_s
            end_silent_rank(first, self.rank)
        elif now > self._failure_deadline and not self._reporting:
            to_stderr(
                f"rank {self.rank}: {describe_failure(first)}. This rank was still blocked "
                f"{self.times.grace_s:.0f} s later at step {self.step} in {self._where()}; "
                "exiting"
            )
            self._stopping()
            self.exit_process(1)

    def _scan(self) -> None:
        """Watcher ranks: a rank whose heartbeat has not changed for stale_s has failed."""
        with self._scan_lock:  # the thread, and the main thread while it reports a failure
            self._scan_locked()

    def _scan_locked(self) -> None:
        now = time.monotonic()
        for r, beat in heartbeats.read_beats(self.store, self.world_size, self._seen):
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

    def _store_lost(self, exc: Exception) -> None:
        if self._stop.is_set():
            return
        if self._first is not None:  # rank 0 left after the failure was known: expected
            to_stderr(f"rank {self.rank}: {describe_failure(self._first)}; exiting")
            self.exit_process(1)
            return
        to_stderr(f"rank {self.rank}: {self._store_gone(exc)}. Exiting")
        self.exit_process(1)
