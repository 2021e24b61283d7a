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
