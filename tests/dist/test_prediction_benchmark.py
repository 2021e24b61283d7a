"""benchmarks/perf_model/prediction.py at a tiny size: every configuration trains on its ranks and
gets a positive prediction (the accuracy target lives in the benchmark, not here)."""

from __future__ import annotations

import importlib
import json
import statistics
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

GUARDED = {"cp2"}
"""Dimensions other engineers are building: skipped, with the reason, until validate and
the mesh take them (ZeRO-3 has landed: dp2-zero3 must run)."""


def test_every_case_trains_and_is_predicted(tmp_path: Path) -> None:
    # Imported as a module of the repo (not by load_benchmark's file path), so that the
    # spawned ranks can unpickle its worker.
    bench = importlib.import_module("benchmarks.perf_model.prediction")
    args = ["--tiny", "--calibration", "a100-80gb", "--warmup", "1", "--steps", "1"]
    result = bench.main([*args, "--out", str(tmp_path)])
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {c.name for c in bench.CASES}
    ran = [r for r in rows.values() if not r.get("skipped")]
    assert len(ran) >= 12
    assert {r["name"] for r in ran} >= {c.name for c in bench.CASES} - GUARDED
    for r in ran:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0, r
        assert len(r["times_ms"]) == 1
        # 1 warm-up step, then each timed step after `REWARM` untimed ones of its config
        assert r["steps_taken"] == 1 + 1 * (1 + bench.REWARM), r
        error = (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
        assert r["error"] == pytest.approx(error)
    for r in rows.values():
        if r.get("skipped"):
            assert r["name"] in GUARDED and r["skipped"], r
    written = json.loads((tmp_path / "prediction.json").read_text())
    assert written["rows"] == result["rows"]
    errors = [abs(r["error"]) for r in ran]
    assert written["median_abs_error"] == pytest.approx(statistics.median(errors))
    assert written["max_abs_error"] == pytest.approx(max(errors))
    table = (tmp_path / "prediction.md").read_text()
    assert all(f"| {name} |" in table for name in rows)
    # The wait cost sampled between the two-rank step rounds re-prices those rows only.
    spell = written["spell"]
    assert spell["collective_sync_us"] >= 0
    for r in ran:
        if r["world"] == 1:
            assert r["predicted_in_spell_ms"] == pytest.approx(r["predicted_ms"])
        assert r["error_in_spell"] == pytest.approx(
            r["predicted_in_spell_ms"] / r["measured_ms"] - 1
        )
    in_spell = [abs(r["error_in_spell"]) for r in ran]
    assert spell["median_abs_error"] == pytest.approx(statistics.median(in_spell))
    assert "with the steps' wait cost (collective_sync_us" in table
    trace = json.loads((tmp_path / "prediction_timeline.json").read_text())
    sources = {e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    for source in ("measured", "simulated"):  # both pipeline ranks of each
        assert {s.rsplit(" ", 1)[1] for s in sources if s.startswith(source)} == {"0", "1"}
