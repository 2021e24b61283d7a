"""`ptdp simulate` and `ptdp plan` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config import from_dict
from ptdp.layout import validate

ROOT = Path(__file__).resolve().parents[2]
TINY = """
[model]
num_layers = 4
hidden_size = 64
num_heads = 4
seq_length = 64
vocab_size = 128

[train]
precision = "bf16"
"""


def test_simulate_writes_timeline_and_trace(tmp_path: Path, capsys) -> None:
    args = [
        "simulate", "--config", str(ROOT / "configs" / "demo.toml"), "--device", "h100-sxm",
        "--out", str(tmp_path), "--json", "--model.vocab_size", "4096", "--parallel.pp", "2",
        "--parallel.tp=2", "--train.global_batch_size", "32",
    ]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["tp"] == 2 and out["layout"]["pp"] == 2
    assert out["layout"]["num_microbatches"] == 4  # 32 / (8 x dp 1)
    assert out["iteration_seconds"] > 0 and 0 < out["mfu"] < 1
    assert len(out["memory_gib"]) == 2
    assert Path(out["png"]).read_bytes()[:4] == b"\x89PNG"
    trace = json.loads(Path(out["trace"]).read_text())
    assert any(e.get("name", "").startswith("F s0") for e in trace["traceEvents"])


def test_simulate_text_and_errors(tmp_path: Path, capsys) -> None:
    demo = str(ROOT / "configs" / "demo.toml")
    assert main(["simulate", "--config", demo, "--out", str(tmp_path)]) == 2
    assert "vocab_size" in capsys.readouterr().err
    args = ["simulate", "--config", demo, "--out", str(tmp_path), "--model.vocab_size", "4096"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "predicted iteration" in text and "TFLOP/s per GPU" in text and "bubble" in text
    assert main([*args, "--device", "no-such-gpu"]) == 2


def test_plan_of_a_small_model_is_accepted(tmp_path: Path, capsys) -> None:
    model = tmp_path / "tiny.toml"
    model.write_text(TINY)
    args = ["plan", "--model", str(model), "--gpus", "8", "--device", "a100-80gb"]
    assert main([*args, "--global-batch", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = from_dict(out["best"]["config"])
    layout = validate(cfg, 8)  # what ptdp train would check before launch
    assert layout.tp * layout.pp * layout.dp == 8
    assert out["explanation"] and out["options"]
    assert main([*args, "--global-batch", "32", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "why:" in text and "train with: --parallel.tp" in text


def test_plan_of_a_preset(capsys) -> None:
    args = ["plan", "--model", "gpt-1.7b", "--gpus", "32", "--global-batch", "512"]
    assert main([*args, "--tp", "1", "--pp", "1", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["summary"].startswith("t=1 p=1 d=32")
    assert best["layout"]["dp"] == 32


@pytest.mark.parametrize("bad", [["--model", "gpt-2t"], ["--model", "gpt-1.7b", "--tp", "3"]])
def test_plan_errors(bad: list[str], capsys) -> None:
    code = main(["plan", *bad, "--gpus", "32", "--global-batch", "512"])
    assert code != 0
