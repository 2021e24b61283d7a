"""benchmarks/perf_model/prediction.py refuses step counts it cannot time, before it calibrates or
spawns anything, naming the flag and the least it takes."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark


@pytest.mark.parametrize(
    ("flag", "value", "least"), [("--rewarm", "-1", 0), ("--warmup", "-2", 0), ("--steps", "0", 1)]
)
def test_bad_step_counts_are_refused(flag: str, value: str, least: int, capsys) -> None:
    bench = load_benchmark("perf_model/prediction")
    with pytest.raises(SystemExit):
        bench.main([flag, value])
    assert f"{flag} must be at least {least}, not {value}" in capsys.readouterr().err
