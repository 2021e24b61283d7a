"""benchmarks/pipeline/interleaving_gains.py --measure at a tiny size: ptdp's pp = 2 steps
under 1F1B and interleaved run for each m, each with its prediction, and the gains are their
ratios (the figures' own table is the unit test's: tests/unit/test_perf_megatron2021.py)."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.dist


def test_measured_and_predicted_gains_for_each_m(capsys) -> None:
    # Imported as a module of the repo so that the spawned ranks can unpickle its worker.
    bench = importlib.import_module("benchmarks.pipeline.interleaving_gains")
    argv = "--measure --tiny --calibration a100-80gb --steps 1 --microbatches 2 4".split()
    rows = bench.main(argv)
    assert [r["m"] for r in rows] == [2, 4]
    for r in rows:
        for key in ("1f1b_ms", "interleaved_ms", "1f1b_predicted_ms", "interleaved_predicted_ms"):
            assert r[key] > 0, (key, r)
        assert r["measured_gain"] == pytest.approx(r["1f1b_ms"] / r["interleaved_ms"] - 1)
        assert r["predicted_gain"] == pytest.approx(
            r["1f1b_predicted_ms"] / r["interleaved_predicted_ms"] - 1
        )
    # Twice the microbatches: more predicted time under both schedules.
    assert rows[1]["1f1b_predicted_ms"] > rows[0]["1f1b_predicted_ms"]
    assert rows[1]["interleaved_predicted_ms"] > rows[0]["interleaved_predicted_ms"]
    table = capsys.readouterr().out
    assert table.count("\n| 2 |") + table.count("\n| 4 |") == 2


def test_an_odd_microbatch_count_is_refused() -> None:
    bench = importlib.import_module("benchmarks.pipeline.interleaving_gains")
    with pytest.raises(SystemExit):
        bench.main("--measure --tiny --calibration a100-80gb --microbatches 3".split())
