"""`ptdp simulate` and `ptdp plan` from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config.files import from_dict
from ptdp.rules.layout import validate

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


def test_plan_takes_config_keys_like_train(tmp_path: Path, capsys) -> None:
    # One vocabulary: --config and --section.key overrides as in `ptdp train`, the old
    # spellings (--tp, --micro-batch, --global-batch) standing for the same keys.
    model = tmp_path / "tiny.toml"
    model.write_text(TINY)

    def run(*args: str) -> dict:
        assert main(["plan", "--gpus", "8", "--json", "--top", "50", *args]) == 0
        return json.loads(capsys.readouterr().out)

    keys = "--parallel.tp 2 --train.micro_batch_size=2 --train.global_batch_size 32"
    new = run("--config", str(model), *keys.split(), "--parallel.sequence_parallel", "false")
    flags = "--tp 2 --micro-batch 2 --global-batch 32 --sequence-parallel off"
    old = run("--model", str(model), *flags.split())
    assert new == old and new["options"]
    for option in new["options"]:  # pinned: t = 2, b = 2, no sequence parallelism
        par, train = option["config"]["parallel"], option["config"]["train"]
        assert (par["tp"], par["sequence_parallel"], train["micro_batch_size"]) == (2, False, 2)
    assert {o["config"]["parallel"]["pp"] for o in new["options"]} == {1, 2, 4}  # searched
    searched = run("--config", str(model), "--train.global_batch_size", "32")
    assert {o["config"]["parallel"]["tp"] for o in searched["options"]} == {1, 2, 4}


def test_simulate_starts_from_a_preset(tmp_path: Path, capsys) -> None:
    # Preset < --config < overrides, as `ptdp.config.files.resolve` orders them.
    toml = tmp_path / "layout.toml"
    toml.write_text("[parallel]\ntp = 8\npp = 4\n[train]\nglobal_batch_size = 64\n")
    args = ["simulate", "--model", "gpt-7.5b", "--config", str(toml), "--parallel.pp", "2"]
    assert main([*args, "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["layout"]["tp"], out["layout"]["pp"], out["layout"]["world_size"]) == (8, 2, 16)
    assert out["layout"]["num_microbatches"] == 8  # 64 / (b = 8 x d = 1)


def test_simulate_zero_levels(tmp_path: Path, capsys) -> None:
    """--parallel.zero N: ZeRO-2 keeps 1/d of the gradients (and ZeRO-1's optimizer share),
    ZeRO-3 1/d of the weights too, plus the layers it gathers."""
    base = ["simulate", "--model", "gpt-7.5b", "--parallel.tp", "8", "--gpus", "32"]
    base += ["--train.global_batch_size", "64"]
    memory = {}
    for zero in (0, 1, 2, 3):
        args = [*base, "--parallel.zero", str(zero), "--out", str(tmp_path), "--json"]
        assert main(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["layout"]["zero"] == zero
        memory[zero] = out["memory_gib"][0]
    z0, z1, z2 = memory[0], memory[1], memory[2]
    assert z1["optimizer"] == pytest.approx(z0["optimizer"] / 4) == z2["optimizer"]  # d = 4
    assert z1["grads"] == z0["grads"] == pytest.approx(4 * z2["grads"])
    assert z2["grad_buckets"] > 0 == z1["grad_buckets"]
    assert z2["total"] < z1["total"] < z0["total"]
    z3 = memory[3]
    assert z3["params"] == pytest.approx(z2["params"] / 4) and z3["gathered"] > 0 == z2["gathered"]
    assert z3["optimizer"] == z2["optimizer"] and z3["grads"] == z2["grads"]


@pytest.mark.parametrize(
    "bad,message",
    [
        (["--model", "gpt-2t"], "unknown model 'gpt-2t'; use a preset"),
        (["--model", "gpt-1.7b", "--parallel.dp", "2"], "fix --parallel.tp and --parallel.pp"),
        (["--model", "gpt-1.7b", "--parallel.tpp", "2"], "did you mean 'tp'"),
        (["--config", str(ROOT / "configs" / "demo.toml")], "pass --model.vocab_size N"),
        (
            [
                "--model",
                "gpt-1.7b",
                "--parallel.tp",
                "8",
                "--parallel.cp",
                "2",
                "--parallel.pp",
                "4",
            ],
            "--parallel.pp 4: t*cp*p = 64 does not divide --gpus 32",
        ),
        (["--model", "gpt-1.7b", "--parallel.cp", "3"], "--parallel.cp 3: it does not divide"),
        (["--model", "gpt-1.7b", "--parallel.tp", "-2"], "a size must be 1 or more, or 0 to"),
        (["--model", "gpt-1.7b", "--parallel.zero", "5"], "--parallel.zero 5 is not a ZeRO level"),
    ],
)
def test_plan_errors(bad: list[str], message: str, capsys) -> None:
    assert main(["plan", *bad, "--gpus", "32", "--global-batch", "512"]) == 2
    assert message in capsys.readouterr().err


def test_plan_exit_codes(capsys) -> None:
    assert main(["plan", "--model", "gpt-1.7b", "--gpus", "32"]) == 2  # no global batch
    assert "needs --train.global_batch_size B (or --global-batch B)" in capsys.readouterr().err
    fixed = "plan --model gpt-1.7b --gpus 32 --global-batch 512 --tp 3"
    assert main(fixed.split()) == 2  # refused before the search: t = 3 does not divide 32
    assert "--parallel.tp 3: it does not divide --gpus 32" in capsys.readouterr().err
    fixed = "plan --model gpt-1t --gpus 8 --global-batch 8 --tp 8"
    assert main(fixed.split()) == 1  # searched, and nothing fits in memory
    assert "no layout fits" in capsys.readouterr().out
