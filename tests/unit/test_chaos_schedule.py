"""benchmarks/chaos.py's seeded fault schedule (the harness itself runs in
tests/dist/test_chaos.py)."""

from __future__ import annotations

import pytest

from benchmarks.chaos import KINDS, make_schedule


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
