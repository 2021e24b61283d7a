"""benchmarks/pipeline/pipeline_real.py at a tiny size (2 ranks, demo width, s 16, micro-batch 1):
every schedule's steps run and are timed, every compute action is recorded once per
measured step, and the ideal replay and the zb-v timeline come out."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from ptdp.pipeline.actions import Kind

pytestmark = pytest.mark.dist


def test_tiny_real_chunk_benchmark(tmp_path: Path, capsys) -> None:
    png = tmp_path / "zb_v.png"
    argv = f"--seq 16 --micro-batch 1 --ms 2 4 --iters 2 --warmup 1 --png {png}"
    # Imported as a module of the repo (not by load_benchmark's file path), so that the
    # spawned ranks can unpickle its worker.
    results = importlib.import_module("benchmarks.pipeline.pipeline_real").main(argv.split())
    printed = capsys.readouterr().out
    names = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v")
    assert [(r["schedule"], r["m"]) for r in results] == [(n, m) for n in names for m in (2, 4)]
    for r in results:
        plan, costs, run = r["plan"], r["costs"], r["ideal"]
        compute = [a for acts in plan.compute.values() for a in acts]
        assert len(r["events"]) == 2 * len(compute)  # each action once per measured step
        assert len(r["last"]) == len(compute)
        assert len(r["times"]) == 2 and r["measured"] > 0
        assert plan.stages.stages == (4 if r["schedule"] == "zb-v" else 2)
        assert all(t > 0 for t in costs.forward + costs.backward_input)
        split = any(a.kind is Kind.W for a in compute)
        assert all((w > 0) == split for w in costs.backward_weight)
        assert run.ideal <= run.makespan  # the busiest rank's compute bounds the replay
        assert 0.3 < r["measured"] / run.makespan < 20  # same compute, measured vs replayed
        assert 0.3 < r["per_step"] < 20 and len(r["steps"]) == 2
    assert "m=4: zb-h1 / 1f1b step time" in printed and "target <= 0.92" in printed
    assert "| zb-v | 4 |" in printed
    assert png.stat().st_size > 10_000
