"""In-process recovery (train.recovery = in_process): a fault every process survives costs
the step in flight, not a restart.

A rank whose step raises (its own error, a collective that timed out or broke, a
non-finite step under on_nan = retry) joins an agreement in the launcher's key-value
store, never in the process groups, which may be broken. Keys are under a prefix per run
and per recovery (`n`), so a later recovery never reads an earlier one's keys: each rank
adds itself to `arrived` and writes what it saw; the last to arrive writes the verdict.
A rank blocked in a collective on the faulty rank joins once that collective times out
(train.collective_timeout_s; nothing here aborts a blocked call from another thread,
so the timeout is the detection time). A rank that has not joined within a second
timeout (twice the collective timeout: it died, or is frozen) turns the verdict into a
fall back to the restart path, as does a step replayed MAX_TRIES times (a deterministic
error, a real NaN) or a fault after the optimizer update began (its weights changed;
the ranks may be at different steps).

Recovering, each rank destroys its process groups, creates the default group again over
a fresh prefix of the same store (the mesh's groups follow, built as at start) and builds
its Trainer again over them, moving into it the old one's state held in memory: weights,
masters, AdamW moments, loss scale, step and RNG. Nothing is copied on the healthy path:
the optimizer update is the only in-place change of the weights and it comes last, so a
fault before it leaves the start-of-step state in place; per step only the RNG state
(a few KiB: CPU and device generators) is kept.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ptdp.errors import PtdpError
from ptdp.train.faults.events import append_event
from ptdp.train.faults.failures import summary
from ptdp.train.faults.numerical import NumericalFault

if TYPE_CHECKING:
    from ptdp.train.step.trainer import Trainer

MAX_TRIES = 2
"""Replays of one step before a fault counts as repeating (deterministic) and falls back."""


SECONDARY = ("communication error", "collective timeout")
"""Causes a rank may see because another rank failed, least secondary first: the fault
named is the first rank's that is not, if any."""


def _order(cause: str) -> int:
    return 1 + SECONDARY.index(cause) if cause in SECONDARY else 0


class RecoveryFallback(PtdpError):
    """In-process recovery gave up; the run ends as without it, for the launcher's restart."""


def cause_of(exc: BaseException) -> str:
    """The kind of fault, for events.jsonl."""
    if isinstance(exc, NumericalFault):
        return "non-finite step"
    text = str(exc)
    if "imed out" in text or "timeout" in text.lower():
        return "collective timeout"
    if isinstance(exc, dist.DistError) or "gloo" in text or "Connection" in text:
        return "communication error"
    return "exception"


class InProcessRecovery:
    """One rank's side of the agreement and the rebuild (see the module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        self.world, self.rank = trainer.env.world_size, trainer.env.rank
        self.timeout_s = trainer.cfg.train.collective_timeout_s
        self.backend = dist.get_backend() if self.world > 1 else "gloo"
        store = c10d._get_default_store() if self.world > 1 else dist.HashStore()
        self.base = store
        run = store.add(f"ptdp/recovery/runs/{self.rank}", 1)  # the n-th run of this group
        self.prefix = f"ptdp/recovery/{trainer.env.restart}/{run}"
        self.count = 0
        self.tries: dict[int, int] = {}
        self.rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.started = 0.0  # perf_counter at the start of the step in flight
        self.pending: dict | None = None  # a recovery whose next completed step is awaited

    def begin_step(self, trainer: Trainer) -> None:
        """Keep what the step changes besides the update: the RNG states (dropout)."""
        cuda = trainer.device.type == "cuda"
        self.started = time.perf_counter()
        self.rng = torch.get_rng_state(), torch.cuda.get_rng_state(trainer.device) if cuda else None
        trainer.update_started = False

    def recover(self, trainer: Trainer, exc: BaseException) -> Trainer:
        """Agree, rebuild and return the Trainer to replay the step with; raises
        RecoveryFallback when the verdict is the restart path."""
        fault_wall = time.time()
        step = trainer.step + 1
        self.count += 1
        tries = self.tries[step] = self.tries.get(step, 0) + 1
        store = dist.PrefixStore(f"{self.prefix}/{self.count}/", self.base)
        applied = trainer.update_started and not isinstance(exc, NumericalFault)
        mine = {"rank": self.rank, "cause": cause_of(exc), "error": summary(exc, 200),
                "step": step, "applied": applied, "time": fault_wall}  # fmt: skip
        store.set(f"rank/{self.rank}", json.dumps(mine))
        if store.add("arrived", 1) == self.world:
            store.compare_set("verdict", "", self._verdict(store, tries))
        verdict = self._wait_verdict(store)
        records = self._records(store)
        first = min(records, key=lambda r: (_order(r["cause"]), r["rank"]))
        if verdict != "recover":
            if self.rank == min(r["rank"] for r in records):
                append_event(
                    trainer.run_dir, "recovery_fallback", step=step, tries=tries,
                    reason=verdict, cause=first["cause"], rank=first["rank"],
                    error=first["error"],
                )  # fmt: skip
            trainer.say(f"in-process recovery of step {step} gave up: {verdict}; restart path")
            raise RecoveryFallback(
                f"step {step}: {first['cause']} on rank {first['rank']} ({first['error']}); "
                f"in-process recovery gave up: {verdict}"
            ) from exc
        new = self._rebuild(trainer, store)
        self.pending = {
            "step": step, "tries": tries, "cause": first["cause"], "rank": first["rank"],
            "error": first["error"], "fault_time": round(min(r["time"] for r in records), 3),
        }  # fmt: skip
        return new

    def step_done(self, trainer: Trainer) -> None:
        """After a completed step: record the recovery that led to it, if any."""
        if self.pending is None:
            return
        rec, self.pending = self.pending, None
        seconds = round(time.time() - rec["fault_time"], 3)  # the first rank's detection
        self.tries.pop(rec["step"], None)
        if trainer.is_main:
            append_event(trainer.run_dir, "recovery", **rec, seconds_to_next_step=seconds)
        trainer.say(
            f"step {rec['step']} recovered in process ({rec['cause']} on rank {rec['rank']}, "
            f"try {rec['tries']}): {seconds:.1f} s from the fault to the next completed step"
        )

    # ------------------------------------------------------------------ the agreement

    def _verdict(self, store: dist.Store, tries: int) -> str:
        records = self._records(store)
        if any(r["applied"] for r in records):
            ranks = [r["rank"] for r in records if r["applied"]]
            return f"the optimizer update had begun on ranks {ranks} (its state is not kept)"
        steps = sorted({r["step"] for r in records})
        if len(steps) > 1:  # one rank was past its update already: the states differ
            return f"the ranks were at different steps {steps}"
        if tries > MAX_TRIES:
            return f"the fault repeated on the same step {MAX_TRIES + 1} times"
        return "recover"

    def _wait_verdict(self, store: dist.Store) -> str:
        """The verdict, or, after the second timeout, a fall back naming the absent ranks."""
        deadline = time.monotonic() + 2 * self.timeout_s
        # Polled: a blocking store.wait holds the GIL, and the watchdog's heartbeats stop.
        while not store.check(["verdict"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not store.check(["verdict"]):  # the second timeout passed
            here = sorted(r["rank"] for r in self._records(store))
            absent = [r for r in range(self.world) if r not in here]
            why = f"ranks {absent} did not join within {2 * self.timeout_s:g} s (dead or frozen)"
            store.compare_set("verdict", "", why)
        return store.get("verdict").decode()

    def _records(self, store: dist.Store) -> list[dict]:
        keys = [f"rank/{r}" for r in range(self.world)]
        present = [k for k in keys if store.check([k])]
        return [json.loads(v) for v in store.multi_get(present)] if present else []

    # ------------------------------------------------------------------ the rebuild

    def _rebuild(self, old: Trainer, store: dist.Store) -> Trainer:
        """New process groups over the same mesh and a Trainer over them, holding the old
        one's start-of-step state (moved, not copied from disk)."""
        if self.world > 1:
            dist.destroy_process_group()  # every group; a blocked peer's call has timed out
            dist.init_process_group(
                self.backend, store=dist.PrefixStore("pg/", store), rank=self.rank,
                world_size=self.world, timeout=timedelta(seconds=self.timeout_s),
            )  # fmt: skip
        new = type(old)(old.cfg, old.layout, old.env, old.data)
        new.watchdog, new.owns_process_group = old.watchdog, old.owns_process_group
        if new.watchdog and new.pipeline:  # built before the watchdog was handed over
            new.pipeline.hooks = replace(
                new.pipeline.hooks, around_action=new.around, around_wait=new.watchdog.waiting_for
            )
        move_state(old, new)
        new.step = old.step
        torch.set_rng_state(self.rng[0])
        if self.rng[1] is not None:
            torch.cuda.set_rng_state(self.rng[1], new.device)
        return new


@torch.no_grad()
def move_state(old: Trainer, new: Trainer) -> None:
    """Weights, masters, AdamW state, loss scale and counters from `old` into `new` (the
    same layout on the same rank, so their pieces pair up one to one)."""
    if not old.grads.shard_params:  # ZeRO-3 keeps only the shards, moved with the pieces
        for a, b in zip(old.model.parameters(), new.model.parameters(), strict=True):
            b.copy_(a)
    for a, b in zip(old.model.buffers(), new.model.buffers(), strict=True):
        b.copy_(a)
    state = old.optimizer.inner.state
    for a, b in zip(old.optimizer.pieces, new.optimizer.pieces, strict=True):
        b.master.copy_(a.master)
        b.stored().copy_(a.stored())
        if a.master in state:
            new.optimizer.inner.state[b.master] = state[a.master]  # moments: moved
    if old.scaler:
        new.scaler.__dict__.update(old.scaler.__dict__)
    new.faults.skipped, new.faults.recent = old.faults.skipped, old.faults.recent
    new.faults.stop, new.faults.signum = old.faults.stop, old.faults.signum  # its handlers
