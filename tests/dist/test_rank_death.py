"""A rank that dies, raises, freezes or lags, in a real 4-process launch (issue 9).

Each test starts `ptdp train` through benchmarks/fault_tolerance/failures.py's driver,
once under torchrun and otherwise by hand with torchrun's variables set (as `srun` would:
no launcher tears the other ranks down, so ptdp's own watchdog must). The driver fires one
fault on one rank in the middle of a step; the test asserts how long every other process
took to exit after it and what they said.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.fault_tolerance.failures import TIMEOUT_S, launch, train_args
from ptdp.config.files import resolve
from ptdp.train.faults.events import read_events
from ptdp.train.run import train

pytestmark = pytest.mark.dist


def _assert_named(text: str, rank: int, error: str) -> None:
    assert f"rank {rank} (pid" in text and "failed first" in text, text[-3000:]
    assert error in text, text[-3000:]


def test_sigkill_of_one_rank_under_torchrun(tiny_data: str, tmp_path: Path) -> None:
    """tp=2, pp=2: rank 2 is killed in the middle of step 4; torchrun exits non-zero within
    the timeout and the surviving ranks name rank 2 and why (no heartbeat). `--resume`
    continues from the last complete checkpoint (step 2), losing only step 3, and its
    losses equal one process trained without interruption."""
    args = train_args(tiny_data, 2, 2, 6, save_interval=2)
    run = launch(tmp_path, args, "kill:2:4", torchrun=True)
    try:
        exited = run.wait(limit_s=120)
        assert exited, run.output(0)[-3000:]
        assert run.procs[0].returncode != 0
        assert exited[0] - run.fault_at() < TIMEOUT_S
        _assert_named(run.output(0), 2, "no heartbeat")
    finally:
        run.kill_all()
    again = launch(tmp_path, [*args, "--resume"], "none")
    try:
        assert len(again.wait(limit_s=120)) == 4
        assert [p.returncode for p in again.procs] == [0] * 4, again.output(0)[-3000:]
        assert "step_00000002 at step 2" in again.output(0)
    finally:
        again.kill_all()
    _assert_matches_one_process(args, run.run_dir, tmp_path / "one")


def test_exception_on_one_rank_stops_the_others(tiny_data: str, tmp_path: Path) -> None:
    """Launched by hand (no launcher to tear down the others): rank 1 raises mid-step;
    ranks 0, 2, 3 exit non-zero within the timeout naming rank 1 and its error."""
    run = launch(tmp_path, train_args(tiny_data, 2, 2, 60), "raise:1:4")
    try:
        exited = run.wait(limit_s=120)
        assert len(exited) == 4, [run.output(i)[-2000:] for i in range(4)]
        fault_at = run.fault_at()
        for r in range(4):
            assert run.procs[r].returncode != 0, run.output(r)[-2000:]
            assert exited[r] - fault_at < TIMEOUT_S, (r, exited[r] - fault_at)
        assert "RuntimeError: injected fault on rank 1" in run.output(1)
        for r in (0, 2, 3):
            _assert_named(run.output(r), 1, "RuntimeError: injected fault on rank 1")
    finally:
        run.kill_all()


def test_frozen_rank_is_named_and_nobody_stays_blocked(tiny_data: str, tmp_path: Path) -> None:
    """Rank 2 freezes (SIGSTOP) mid-step: its peers stay blocked in collectives that never
    fail on their own. The watchdog names rank 2, a peer on its host SIGKILLs it (frozen,
    it cannot exit by itself), and every rank exits within the timeout."""
    run = launch(tmp_path, train_args(tiny_data, 2, 2, 60), "stop:2:4")
    try:
        exited = run.wait(limit_s=120)
        assert len(exited) == 4, [run.output(i)[-2000:] for i in range(4)]
        fault_at = run.fault_at()
        for r in range(4):
            assert run.procs[r].returncode != 0
            assert exited[r] - fault_at < TIMEOUT_S, (r, exited[r] - fault_at)
        for r in (0, 1, 3):
            _assert_named(run.output(r), 2, "no heartbeat")
        assert run.procs[2].returncode == -9  # SIGKILLed by a peer
        said = "".join(run.output(r) for r in (0, 1, 3))
        assert "sent SIGKILL to rank 2 (pid" in said, said[-3000:]
    finally:
        run.kill_all()


def test_straggler_is_reported_and_the_run_finishes(tiny_data: str, tmp_path: Path) -> None:
    """pp=4: rank 2 takes 4 s in one backward of step 6; rank 0 logs that step 6 is slow,
    that rank 2 is behind, and what each rank is doing; the run then completes."""
    args = train_args(tiny_data, 1, 4, 8, straggler_factor=3)
    run = launch(tmp_path, args, "slow:2:6:4")
    try:
        exited = run.wait(limit_s=150)
        assert len(exited) == 4, [run.output(i)[-2000:] for i in range(4)]
        assert all(p.returncode == 0 for p in run.procs), run.output(0)[-3000:]
        log = run.output(0)
        assert "watchdog: step 6 has run" in log and "behind: rank 2\n" in log, log[-3000:]
        report = log[log.index("watchdog: step 6") :].splitlines()[1:5]
        assert [line.split(":")[0].strip() for line in report] == [f"rank {r}" for r in range(4)]
        assert "waiting for the gradient" in report[1]  # rank 1 waits on rank 2
        assert "action 2B" in report[2]
    finally:
        run.kill_all()


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_nan_on_one_rank_stop_and_rollback(tiny_data: str, tmp_path: Path) -> None:
    """A NaN in rank 1's copy of one gradient at step 4 (tp=2, pp=2): with on_nan = stop
    every rank stops with the error naming the last good checkpoint; with rollback every
    rank reloads step 3's checkpoint, skips batch 4, records it in events.jsonl and
    finishes."""
    stop_args = train_args(tiny_data, 2, 2, 6, save_interval=3, on_nan="stop")
    stop = launch(tmp_path / "stop", stop_args, "nan:1:4")
    try:
        assert len(stop.wait(limit_s=120)) == 4
        for r in range(4):
            assert stop.procs[r].returncode == 2, stop.output(r)[-2000:]
            assert "non-finite loss" in stop.output(r) and "step_00000003" in stop.output(r)
    finally:
        stop.kill_all()
    back_args = train_args(tiny_data, 2, 2, 6, save_interval=3, on_nan="rollback")
    back = launch(tmp_path / "rollback", back_args, "nan:1:4")
    try:
        assert len(back.wait(limit_s=120)) == 4
        assert [p.returncode for p in back.procs] == [0] * 4, back.output(0)[-3000:]
        assert "rolled back to" in back.output(0)
        (rollback,) = [e for e in read_events(back.run_dir) if e["event"] == "rollback"]
        assert (rollback["step"], rollback["restored"], rollback["steps_lost"]) == (4, 3, 0)
        losses = _losses(back.run_dir)
        assert sorted(losses) == [1, 2, 3, 5, 6]  # step 4's batch is skipped
        assert all(v == v for v in losses.values())  # no NaN logged
        stopped = _losses(stop.run_dir)
        assert [losses[s] for s in (1, 2, 3)] == [stopped[s] for s in (1, 2, 3)]
    finally:
        back.kill_all()


def test_sigterm_to_every_rank_saves_and_resume_matches(tiny_data: str, tmp_path: Path) -> None:
    """A scheduler's SIGTERM reaches all 4 ranks mid-step 4: the step finishes, a
    checkpoint is saved, every rank exits 143; `--resume` finishes the run, and its losses
    equal one process trained without interruption."""
    args = train_args(tiny_data, 2, 2, 6)
    run = launch(tmp_path / "first", args, "term:0:4")
    try:
        assert len(run.wait(limit_s=120)) == 4
        assert [p.returncode for p in run.procs] == [143] * 4, run.output(0)[-3000:]
        assert "interrupted by SIGTERM at step 4" in run.output(0)
    finally:
        run.kill_all()
    again = launch(tmp_path / "first", [*args, "--resume"], "none")
    try:
        assert len(again.wait(limit_s=120)) == 4
        assert [p.returncode for p in again.procs] == [0] * 4, again.output(0)[-3000:]
        assert "resumed from" in again.output(0)
    finally:
        again.kill_all()
    _assert_matches_one_process(args, run.run_dir, tmp_path / "one")


def _assert_matches_one_process(args: list[str], run_dir: Path, one_dir: Path) -> None:
    """The last logged loss of each step (a resumed run logs some steps again) equals the
    loss of one process trained on the same config without interruption."""
    cfg = resolve(None, [*args, "--parallel.tp", "1", "--parallel.pp", "1"])
    reference = train(replace(cfg, train=replace(cfg.train, run_dir=str(one_dir)))).losses
    losses = _losses(run_dir)
    assert sorted(losses) == sorted(reference) == list(range(1, cfg.train.steps + 1))
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
