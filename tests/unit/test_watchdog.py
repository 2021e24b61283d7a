"""The watchdog's logic with two ranks in one process sharing a HashStore (no launch):
who is named when a rank goes silent or raises, who waits, who is forced out."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from ptdp.parallel.env import LaunchEnv
from ptdp.train.faults.failures import PeerFailure
from ptdp.train.faults.watchdog import Watchdog, WatchdogTimes

LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
    "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_JOB_ID",
    "SLURMD_NODENAME",
)  # fmt: skip
GLOO_ERROR = RuntimeError(
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:1234"
)


def _pair(
    timeout_s: float = 2.0, store_host: str = "rank 0"
) -> tuple[Watchdog, Watchdog, list[tuple[int, int]]]:
    store, exits = dist.HashStore(), []
    dogs = [
        Watchdog(
            store,
            r,
            2,
            timeout_s,
            exit_process=lambda code, r=r: exits.append((r, code)),
            store_host=store_host,
        )
        for r in range(2)
    ]
    return dogs[0], dogs[1], exits


def test_times_follow_the_collective_timeout() -> None:
    assert WatchdogTimes.from_timeout(300) == WatchdogTimes(5.0, 75.0, 30.0)
    assert WatchdogTimes.from_timeout(12) == WatchdogTimes(0.2, 3.0, 1.2)
    assert WatchdogTimes.from_timeout(1) == WatchdogTimes(0.1, 0.25, 1.0)
    assert WatchdogTimes.from_timeout(12, in_process=True) == WatchdogTimes(0.2, 24.0, 1.2)


def test_a_silent_rank_is_named_and_blocked_ranks_are_forced_out() -> None:
    """Rank 1 stops beating (as SIGKILL or SIGSTOP would); rank 0 (a watcher) names it
    after stale_s, reports it when its own collective fails, and a rank still blocked
    after grace_s is made to exit."""
    zero, one, exits = _pair(timeout_s=2.0)  # interval 0.1, stale 0.5, grace 1.0
    zero.start()
    one.start()
    one.begin_step(3)
    with one.doing("action 1F2"):
        time.sleep(0.3)
        one._stop.set()  # frozen: no more heartbeats, and no "done"
        one._thread.join()
    try:
        error = zero.failed(GLOO_ERROR)
        assert isinstance(error, PeerFailure)
        text = str(error)
        assert "rank 1 (pid" in text and "failed first" in text and "no heartbeat" in text
        assert "step 3 in action 1F2" in text and "Connection closed by peer" in text
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:  # the thread's forced exit
            time.sleep(0.05)
        assert exits == [(0, 1)]
    finally:
        zero.close()


def test_the_rank_that_raised_is_named_by_the_others() -> None:
    zero, one, exits = _pair()
    zero.start()
    one.start()
    try:
        with one.doing("optimizer step"):
            try:
                raise ValueError("a bug in the optimizer")
            except ValueError as exc:
                assert one.failed(exc) is exc  # its own error propagates unchanged
        error = zero.failed(GLOO_ERROR)
        assert isinstance(error, PeerFailure)
        assert "rank 1 (pid" in str(error) and "in optimizer step: ValueError: a bug" in str(error)
    finally:
        one.close()
        zero.close()
    assert exits == []  # both reported before grace_s


def test_a_finished_rank_is_not_a_failure() -> None:
    zero, one, exits = _pair(timeout_s=1.0)  # stale after 0.25 s
    zero.start()
    one.start()
    one.close()  # done: no heartbeats from now on
    time.sleep(0.8)
    assert zero._first_failure() is None
    zero.close()
    assert exits == []


class _GoneStore:
    """A store whose host has died: every call fails as a TCPStore's would."""

    def __getattr__(self, name: str):
        def fail(*args, **kwargs):
            raise dist.DistStoreError("Connection reset by peer")

        return fail


@pytest.mark.parametrize(
    ("environ", "host"),
    [
        ({}, "rank 0 at 10.0.0.7:29500"),  # by hand
        ({"TORCHELASTIC_RUN_ID": "job"}, "the torchrun agent at 10.0.0.7:29500 (the first node)"),
        (  # srun alone: the address from the node list, the port from the job id
            {
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2",
                "SLURM_JOB_NODELIST": "n[07-08]",
                "SLURM_JOB_ID": "42",
            },
            "rank 0 at n07:15042",
        ),
    ],
    ids=["by-hand", "torchrun", "srun"],
)
def test_a_lost_store_names_its_host(monkeypatch, environ: dict[str, str], host: str) -> None:
    for name in (*LAUNCH_VARS, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if "SLURM_PROCID" not in environ:
        environ = {**environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
        environ |= {"MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", "")  # no scontrol: our own node-list parser
    _, one, exits = _pair(store_host=LaunchEnv.from_environ().store_host())
    one.store = _GoneStore()
    error = one.failed(GLOO_ERROR)
    assert isinstance(error, PeerFailure)
    text = str(error)
    assert "key-value store is unreachable" in text and f"{host}, which hosts it" in text
    assert "This rank (1) stopped" in text and "Connection closed by peer" in text
    assert exits == []


def test_a_lost_store_hosted_by_rank0_names_rank0_as_failed() -> None:
    """Launched without torchrun, rank 0 hosts the store: when it is gone, the last rank
    names rank 0 as the rank that failed first (pid, host, last step) and records it."""
    store, records = dist.HashStore(), []
    dogs = [
        Watchdog(
            store, r, 2, 2.0, exit_process=lambda code: None, store_host="rank 0 at h:1",
            store_on_rank0=True, on_failure=records.append,
        )
        for r in range(2)
    ]  # fmt: skip
    zero, one = dogs
    zero.begin_step(5)
    zero.start()
    one.start()
    try:
        deadline = time.monotonic() + 5
        while not (one._rank0 and 0 in one._seen) and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 1's thread has read rank 0's identity and heartbeat
        one._stop.set()
        one._thread.join()
        one.store = _GoneStore()
        one.begin_step(5)
        text = str(one.failed(GLOO_ERROR))
    finally:
        zero.close()
    assert "rank 0 (pid" in text and "failed first, last heard from at step 5" in text, text
    assert "store is unreachable" in text and "rank 0 at h:1" in text
    assert "This rank (1) stopped at step 5" in text
    assert [(r["rank"], r["how"], r["step"]) for r in records] == [(0, "store lost", 5)]
    assert records[0]["fault_time"] <= time.time()


def test_a_failure_while_a_step_is_saved_counts_that_step_as_done() -> None:
    """The record says how many steps were complete: a failure inside step 4 after step 3
    ended, and one while step 3's checkpoint is written, both have done = 3 (the step in
    progress reads 4 and 3), so a restart counts step 3 among the steps lost."""
    records: list[dict] = []
    dog = Watchdog(dist.HashStore(), 0, 1, 2.0, exit_process=lambda code: None)
    dog.on_failure = records.append
    dog.start()
    try:
        dog.begin_step(3)
        dog.end_step()
        with dog.doing("checkpoint save"):
            dog.failed(RuntimeError("disk gone"))
    finally:
        dog.close()
    assert (records[0]["step"], records[0]["done"]) == (3, 3), records
    assert "checkpoint save" in records[0]["where"]
