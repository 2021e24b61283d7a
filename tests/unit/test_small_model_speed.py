"""benchmarks/speed/small_model_speed.py and benchmarks/pipeline/split_backward.py at a tiny
size on a CPU: every mode is a row (measured, or skipped with the reason), the figures are
consistent with each other, and the JSON files hold what was printed. Their GPU figures
are measured by scripts/gpu-check.sh, not here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ptdp.perf.calibrate.wgrad_cost import SPLIT_CHUNK, split_chunk
from tests.helpers import load_benchmark


def test_every_mode_is_a_row_measured_or_refused_with_its_reason(tmp_path: Path) -> None:
    bench = load_benchmark("speed/small_model_speed")
    out = tmp_path / "speed.json"
    argv = ["--device", "cpu", "--models", "tiny", "--steps", "2", "--warmup", "1"]
    rows = bench.main([*argv, "--vocab", "256", "--json", str(out), "--profile", str(tmp_path)])
    # The profiled row's trace and operator table (on a GPU: the 1.3B step's, by kernel).
    assert (tmp_path / "trace_tiny_eager.json.gz").stat().st_size > 0
    assert "aten::mm" in (tmp_path / "top_tiny_eager.txt").read_text()
    assert sorted(p.name for p in tmp_path.glob("t*_tiny_*")) == [
        "top_tiny_eager.txt",
        "trace_tiny_eager.json.gz",
    ]  # skipped modes profile nothing
    assert json.loads(out.read_text())["rows"] == rows
    assert [r["mode"] for r in rows] == list(bench.MODES)
    eager, *rest = rows
    tokens = 4 * 64 * 2  # micro-batch, sequence, steps
    assert eager["tokens_per_s"] == pytest.approx(tokens / eager["seconds"])
    assert math.isfinite(eager["last_loss"]) and eager["last_loss"] > 0
    reasons = {r["mode"]: r["skipped"] for r in rest}
    assert reasons == {
        "fused-adamw": "ptdp asks for fused AdamW on CUDA only (foreach on a CPU)",
        "compile": "compile on a CPU is slow to build; pass --compile-on-cpu",
        "cuda-graphs": "CUDA graphs need a CUDA device",
    }


def test_the_split_backward_benchmark_writes_its_ratios(tmp_path: Path) -> None:
    bench = load_benchmark("pipeline/split_backward")
    out = tmp_path / "split.json"
    argv = ["--hidden", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "1"]
    rows = bench.main([*argv, "--rounds", "1", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["dtype"] == "fp32" and saved["layers"] == 1
    (row,) = rows
    assert row["hidden"] == 32 and row["split_over_fused"] > 0 and 0 < row["w_share"] < 1
    # The 1.3B layer: the benchmark's preset and what `ptdp calibrate` times on a GPU.
    big = load_benchmark("speed/mfu").MODELS["1.3b"]
    preset = bench.PRESETS["1.3b"]
    assert (preset["hidden"], preset["heads"], preset["seq"]) == ([big.hidden], big.heads, big.seq)
    gpu = split_chunk(torch.device("cuda"))
    assert [gpu[k] for k in ("hidden_size", "num_heads", "seq_length")] == [2048, 16, 2048]
    assert (big.hidden, big.heads, big.seq) == (2048, 16, 2048)
    assert split_chunk(torch.device("cpu")) == SPLIT_CHUNK
