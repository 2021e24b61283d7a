"""scripts/gpu_check_report.py: the BENCHMARKS.md snippet from a GPU check's results folder
(here a folder written by hand as a CUDA run would leave it: no GPU is needed to read one)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _report_module():
    path = ROOT / "scripts" / "gpu_check_report.py"
    spec = importlib.util.spec_from_file_location("gpu_check_report", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_snippet_holds_the_memory_each_run_held_and_the_phases(tmp_path: Path) -> None:
    (tmp_path / "status.tsv").write_text("cuda-tests\tok (40s)\nmemory\tok (90s)\n")
    predicted = {"tokens_per_s": 50000.0, "memory_gib": 52.0, "reserve_gib": 0.7, "fits": True}
    row = {"model": "1.3b", "impl": "ptdp", "micro_batch": 8, "tokens_per_s": 48000.0}
    row |= {"tflops": 450.0, "mfu": 0.455, "peak_gib": 51.3, "predicted": predicted}
    row |= {"allocator_gib": 1.25, "context_gib": 0.5, "device_gib": 79.1}
    peer = {"model": "1.3b", "impl": "hf-gpt2", "micro_batch": 8, "tokens_per_s": 40000.0}
    peer |= {"tflops": 380.0, "mfu": 0.38, "peak_gib": 60.0, "predicted": None}
    (tmp_path / "mfu.json").write_text(json.dumps({"rows": [row, peer]}))
    count = {"static": 63.5, "activations": 3.1, "working": 2.3}
    phases = [
        {"model": "1.3b", "micro_batch": 8, "recompute": "none", "model_count": count}
        | {"steady": {"before": 64.0, "peak": 69.9, "reserved": 71.0}, "used": 71.6}
        | {"device": 79.1},
        {"model": "4b", "micro_batch": 4, "recompute": "full", "model_count": count}
        | {"out_of_memory": "step 1"},
    ]
    (tmp_path / "memory.json").write_text(json.dumps(phases))
    text = _report_module().report(tmp_path)
    assert (tmp_path / "BENCHMARKS-snippet.md").read_text() == text
    assert "| memory | ok (90s) | |" in text
    lines = text.splitlines()
    ptdp = next(line for line in lines if line.startswith("| 1.3b | ptdp |"))
    assert ptdp.endswith("| 51.3 | 50,000 | 52.0 | 1.25 + 0.50 = 1.75 (0.70) |")
    hf = next(line for line in lines if line.startswith("| 1.3b | hf-gpt2 |"))
    assert hf.endswith("| 60.0 |  |  |  |")
    steady = next(line for line in lines if line.startswith("| 1.3b (b 8, recompute none) |"))
    assert "| 64.00 (63.50) | 5.90 (5.40) | 71.00 | 71.60 of 79.10 |  |" in steady
    oom = next(line for line in lines if line.startswith("| 4b (b 4, recompute full) |"))
    assert oom.endswith("| step 1 |")


def test_a_folder_without_results_still_gives_a_table(tmp_path: Path) -> None:
    text = _report_module().report(tmp_path)
    assert "| calibration | not run | |" in text and "memory phases" not in text


def test_the_snippet_holds_the_moe_kernels_and_the_moe_model_beside_the_dense(tmp_path) -> None:
    layer = {"part": "layer", "layer": "e8-f4096-k2", "experts": 8, "ffn": 4096, "top_k": 2}
    layer |= {"tokens": 8192, "scope": "layer", "loop_over_grouped": None}
    loop = layer | {"kernel": "loop", "ms": 12.5, "expert_tflops": 300.0}
    fused = layer | {"kernel": "grouped", "ms": 10.0, "expert_tflops": 375.0}
    fused["loop_over_grouped"] = 1.25
    model = {"part": "model", "layers": 24, "hidden": 1024, "micro_batch": 8, "peak_gib": 21.04}
    model |= {"tokens_per_s": 150000.0, "tflops": 330.0, "mfu": 0.3337}
    dense = model | {"model": "dense", "num_experts": 0, "moe_ffn": 0, "top_k": 0}
    dense |= {"total_params": 354_871_296, "active_params": 354_871_296}
    moe = model | {"model": "moe", "num_experts": 8, "moe_ffn": 2048, "top_k": 2}
    moe |= {"total_params": 959_000_000, "active_params": 355_100_000, "mfu": None}
    skipped = {"layer": "tiny", "kernel": "grouped", "reason": "no CUDA"}
    data = {"rows": [loop, fused, dense, moe], "skipped": [skipped]}
    (tmp_path / "moe.json").write_text(json.dumps(data))
    lines = _report_module().report(tmp_path).splitlines()
    assert "| 8 x 4096, top-2; 8192 | layer | loop | 12.5 | 300 |  |" in lines
    assert "| 8 x 4096, top-2; 8192 | layer | grouped | 10 | 375 | 1.25 |" in lines
    assert "| tiny | | grouped | skipped: no CUDA | | |" in lines
    assert "| dense (24 x 1024) | 354.9M / 354.9M | 8 | 150,000 | 330 | 33.4% | 21.0 |" in lines
    moe_line = "| moe (24 x 1024, 8 x 2048 top-2) | 959.0M / 355.1M | 8 | 150,000 | 330 | n/a |"
    assert moe_line + " 21.0 |" in lines


def test_the_snippet_holds_every_implementation_and_precision_and_why_a_row_failed(
    tmp_path: Path,
) -> None:
    """mfu.json: one row per model, implementation and precision; a peer that could not run
    keeps its row with the error text. --suite: the test counts under the machine's torch."""
    shape = {"model": "1.3b", "arch": "llama", "layers": 24, "hidden": 2048, "heads": 16}
    done = shape | {"micro_batch": 8, "tokens_per_s": 40000.0, "tflops": 600.0, "mfu": 0.6}
    done |= {"peak_gib": 50.0, "predicted": None}
    rows = [
        done | {"impl": "ptdp", "precision": "bf16"},
        done | {"impl": "torchtitan", "precision": "bf16", "tokens_per_s": 32000.0},
        done | {"impl": "torchtitan", "precision": "fp8-rowwise", "tokens_per_s": 50000.0},
        shape
        | {"impl": "megatron-core", "precision": "fp8-rowwise"}
        | {"error": "Megatron-Core has no rowwise fp8 recipe | it has tensorwise"},
    ]
    (tmp_path / "mfu.json").write_text(json.dumps({"rows": rows}))
    suite = '<testsuites><testsuite tests="1200" failures="2" errors="1" skipped="40" '
    suite += 'time="201.5"/></testsuites>'
    (tmp_path / "suite.xml").write_text(suite)
    (tmp_path / "torch.txt").write_text("2.11.0+cu130 3.12.3\n")
    lines = _report_module().report(tmp_path).splitlines()
    assert "| 1.3b llama | ptdp | bf16 | 8 | 40,000 | 600 | 60.0% | 50.0 |  |  |  |" in lines
    assert "| 1.3b llama | torchtitan | fp8-rowwise | 8 | 50,000 |" in "\n".join(lines)
    failed = "| 1.3b llama | megatron-core | fp8-rowwise | failed: Megatron-Core has no rowwise "
    assert failed + "fp8 recipe / it has tensorwise | | | | | | | |" in lines
    assert "| torch 2.11.0+cu130, Python 3.12.3 | 1157 | 3 | 40 | 202 |" in lines
    assert "- 1.3b: ptdp / torchtitan tokens/s = 1.250" in lines  # the pair in bf16 only
    assert not any("fp8-rowwise: ptdp /" in line for line in lines)  # no ptdp fp8 row to pair


def test_only_the_peers_and_what_this_python_lacks_are_installed() -> None:
    pins = ["torchtitan==0.3.0", "pytest==1.0", "no-such-package-here==0.1", ""]
    chosen = _report_module().peer_pins(pins, peers=("torchtitan",))
    assert chosen == ["torchtitan==0.3.0", "no-such-package-here==0.1"]  # pytest: kept as is


def test_gpu_check_runs_only_the_parts_asked_for(tmp_path: Path) -> None:
    """PTDP_GPU_CHECK_PARTS picks parts, the rest named as left out; --suite runs the test
    suite alone (here out of time at once: a 20 s budget)."""
    import os
    import subprocess

    def check(out: Path, *argv: str, **env: str) -> dict[str, str]:
        env = dict(os.environ, PTDP_GPU_CHECK_OUT=str(out), PYTHON=sys.executable, **env)
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu-check.sh"), *argv],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        lines = (out / "status.tsv").read_text().splitlines()
        return dict(line.split("\t") for line in lines)

    status = check(tmp_path / "a", PTDP_GPU_CHECK_PARTS="none", PTDP_GPU_CHECK_QUICK="1")
    assert status["calibrate"] == "skipped: not in PTDP_GPU_CHECK_PARTS=none", status
    assert (tmp_path / "a" / "torch.txt").read_text().split()[0] == __import__("torch").__version__
    status = check(tmp_path / "b", "--suite", PTDP_GPU_CHECK_BUDGET_S="20")
    assert status["suite"].startswith("skipped: out of time"), status
    assert "calibrate" not in status and "demo" not in status, status
