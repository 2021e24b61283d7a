"""The watchdog's records in the launcher's key-value store, in one place: what each key
holds, who writes it and how it is read. The watchdog (`watchdog.py`) decides when to write
and what to conclude; these functions take the store on every call, since the watchdog
may find it gone at any time.

Keys, under a prefix of their own per run in a process group and per torchrun restart
(`run_store`), each value JSON:
- `who/<rank>`: the rank's host and pid, written at start (to name it if it dies);
- `hb/<rank>`: its heartbeat, rewritten every interval: a counter (`beat`), the `step`, the
  `action` and what it is `waiting` for, and for how long (`for_s`); `{"done": true}` once
  the rank's run has ended, so that watchers stop expecting it;
- `failures`: a counter; the rank whose `add` makes it 1 writes `first`, the failure
  every rank reports (rank, host, pid, how, error, where, step, done, fault_time);
- `released`: a counter of the ranks that need the store no more (rank 0 waits on it
  when it hosts the store).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Container
from datetime import timedelta

import torch.distributed as dist


def run_store(store: dist.Store, rank: int, restart: int) -> dist.Store:
    """The keys of this run: the n-th run in this process group (counted on every rank)
    of torchrun restart `restart`, so that an earlier run's failure is not read again."""
    run = store.add(f"ptdp/watchdog/{restart}/runs/{rank}", 1)
    return dist.PrefixStore(f"ptdp/watchdog/{restart}/{run}/", store)


def write_who(store: dist.Store, rank: int) -> None:
    """This process's host and pid, as rank `rank`."""
    who = {"host": socket.gethostname(), "pid": os.getpid()}
    store.set(f"who/{rank}", json.dumps(who))


def read_who(store: dist.Store, rank: int) -> dict:
    """Rank `rank`'s host and pid, or {} if not written yet."""
    key = f"who/{rank}"
    return json.loads(store.get(key)) if store.check([key]) else {}


def wait_who(store: dist.Store, rank: int, timeout_s: float) -> dict:
    """Rank `rank`'s host and pid, waiting at most `timeout_s` (raises after)."""
    store.wait([f"who/{rank}"], timedelta(seconds=timeout_s))
    return read_who(store, rank)


def write_beat(store: dist.Store, rank: int, beat: dict) -> None:
    store.set(f"hb/{rank}", json.dumps(beat))


def write_done(store: dist.Store, rank: int) -> None:
    """Rank `rank`'s run has ended: no heartbeats from it from now on."""
    write_beat(store, rank, {"done": True})


def read_beats(store: dist.Store, world_size: int, known: Container[int]) -> list[tuple[int, str]]:
    """(rank, heartbeat as written) of every rank that has written one; a rank in `known`
    has (no check for its key)."""
    keys = [f"hb/{r}" for r in range(world_size)]
    present = [r for r, k in enumerate(keys) if r in known or store.check([k])]
    raw = store.multi_get([keys[r] for r in present])
    return [(r, value.decode()) for r, value in zip(present, raw)]


def read_all_beats(store: dist.Store, world_size: int) -> list[dict]:
    """Every rank's heartbeat, in rank order (each has written one)."""
    keys = [f"hb/{r}" for r in range(world_size)]
    return [json.loads(b) for b in store.multi_get(keys)]


def claim_first(store: dist.Store, record: dict) -> bool:
    """Write `record` as the first failure unless another was counted before; True if
    this one is the first."""
    if store.add("failures", 1) == 1:
        store.set("first", json.dumps(record))
        return True
    return False


def read_first(store: dist.Store) -> dict | None:
    """The first failure recorded, or None."""
    return json.loads(store.get("first")) if store.check(["first"]) else None


def release(store: dist.Store) -> None:
    """Count the caller among the ranks that need the store no more (call once a rank)."""
    store.add("released", 1)


def released(store: dist.Store) -> int:
    """How many ranks need the store no more."""
    return store.add("released", 0)
