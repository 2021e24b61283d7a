"""benchmarks/fault_tolerance/chaos.py's seeded fault schedule, and the pure parts of its
in-process mode (benchmarks/fault_tolerance/recovery.py: schedule, report, ratio); the
harness itself runs in tests/dist/test_chaos.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.fault_tolerance import recovery
from benchmarks.fault_tolerance.chaos import KINDS, make_schedule


def test_the_schedule_has_each_kind_once_at_steps_it_can_fire() -> None:
    faults = make_schedule(7, 450, 50, 10, KINDS, 4)
    assert sorted(f.kind for f in faults) == sorted(KINDS)
    steps = [f.step for f in faults]
    assert steps == sorted(set(steps)) and 0 < steps[0] and steps[-1] < 450
    for i, f in enumerate(faults):  # about one every 50 steps
        assert abs(f.step - 50 * (i + 1)) <= 50 // 4 + 10, f
        assert 0 <= f.rank < 4
    by_kind = {f.kind: f for f in faults}
    assert by_kind["save"].step % 10 == 0  # fires while that step's checkpoint is written
    assert by_kind["truncate"].step > 2 * 10  # an older checkpoint remains
    assert make_schedule(7, 450, 50, 10, KINDS, 4) == faults  # seeded
    assert make_schedule(8, 450, 50, 10, KINDS, 4) != faults


def test_a_schedule_that_does_not_fit_the_steps_is_refused() -> None:
    with pytest.raises(SystemExit, match="need more than 300 steps; raise --steps"):
        make_schedule(0, 300, 50, 10, KINDS, 4)


def test_in_process_schedule_is_one_fault_per_interval_seeded() -> None:
    faults = recovery.schedule(60, 12, list(recovery.KINDS), 0)
    assert [f["kind"] for f in faults] == ["raise", "comm", "nan", "stop"]
    for i, f in enumerate(faults):  # strictly inside its interval, on one of 4 ranks
        assert 12 * i + 2 <= f["step"] <= 12 * i + 12 and 0 <= f["rank"] < 4, f
    assert recovery.schedule(60, 12, list(recovery.KINDS), 0) == faults
    assert recovery.schedule(60, 12, list(recovery.KINDS), 1) != faults


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_in_process_report_reads_detection_recovery_and_steps_lost(tmp_path: Path) -> None:
    """A fake run: fault 0 recovered in process, fault 1 restarted, fault 2 never fired."""
    faults = [{"kind": k, "rank": 1, "step": s} for k, s in (("raise", 3), ("stop", 7), ("nan", 9))]
    _write(tmp_path / "run/metrics.jsonl", [{"step": s, "step_time_s": 0.5} for s in range(1, 11)])
    _write(
        tmp_path / "run/events.jsonl",
        [
            {"event": "recovery", "time": 106.0, "fault_time": 104.0, "step": 3},
            {"event": "failure", "time": 201.5, "rank": 1},
            {"event": "restart", "time": 210.0, "steps_lost": 5},
        ],
    )
    (tmp_path / "marks").mkdir()
    (tmp_path / "marks/0").write_text("100.0")
    (tmp_path / "marks/1").write_text("200.0")
    out = recovery.report(tmp_path, faults)
    assert out["useful_s"] == 5.0 and out["steps"] == 10
    got = [(r["handled_by"], r["detection_s"], r["fault_to_next_step_s"], r["steps_lost"])
           for r in out["faults"]]  # fmt: skip
    assert got == [("recovery", 4.0, 6.0, 0), ("restart", 1.5, 10.0, 5), (None, None, None, None)]
    assert [r["fired"] for r in out["faults"]] == [True, True, False]


def test_ratio_of_the_modes_effective_training_time() -> None:
    both = {"in_process": {"effective_ratio": 0.3}, "restart": {"effective_ratio": 0.2}}
    assert recovery.ratio(both) == 1.5
    assert recovery.ratio({"in_process": {"effective_ratio": 0.3}}) is None
