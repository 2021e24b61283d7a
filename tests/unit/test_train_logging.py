"""What the training log says: MFU against a device's peak, elapsed time and the ETA, and
the optional Weights & Biases logger (offline)."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

from ptdp.errors import ConfigError
from ptdp.rules.layout import validate
from ptdp.train.metrics import MetricsWriter
from ptdp.train.peak import resolve_peak
from ptdp.train.progress import format_duration
from ptdp.train.run import train
from ptdp.train.step.trainer import Trainer
from tests.helpers import tiny_config
from tests.wandb_offline import offline_env, offline_runs, read_run

PEAK_TFLOPS = 0.02  # an override a CPU can reach a few percent of


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_mfu_is_model_flops_over_the_peak_and_the_line_shows_elapsed_and_eta(
    tiny_data: str, tmp_path: Path, capsys
) -> None:
    # Full recomputation: TFLOP/s counts the recomputed forward, MFU does not.
    cfg = tiny_config(
        tiny_data,
        tmp_path / "run",
        train={"steps": 4, "peak_tflops": PEAK_TFLOPS},
        parallel={"recompute": "full"},
    )
    train(cfg)
    out = capsys.readouterr().out
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]

    # The paper's formulas by hand (GeLU 4h MLP, multi-head attention), batch B = 8 of
    # s = 32 tokens, l = 2, h = 32, V = 257 (the byte tokenizer's vocabulary).
    b, s, l, h, v = 8, 32, 2, 32, 257
    model_flops = 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    executed = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))  # equation (3)
    for r in records:
        assert r["mfu"] == pytest.approx(model_flops / r["step_time_s"] / (PEAK_TFLOPS * 1e12))
        assert r["tflops_per_device"] == pytest.approx(executed / r["step_time_s"] / 1e12)
        assert f"MFU {100 * r['mfu']:.1f}%" in out

    # ETA: the median of the step times so far times the steps left; elapsed covers them.
    for i, r in enumerate(records):
        median = statistics.median(x["step_time_s"] for x in records[: i + 1])
        assert r["eta_s"] == pytest.approx(median * (4 - r["step"]))
    assert records[-1]["eta_s"] == 0
    total = sum(r["step_time_s"] for r in records)
    assert records[-1]["elapsed_s"] >= total  # not a timing: elapsed spans every step
    assert [r["elapsed_s"] for r in records] == sorted(r["elapsed_s"] for r in records)
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 4
    assert all(re.search(r"\| elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d", x) for x in lines)
    assert lines[-1].endswith("ETA 0:00:00")
    assert "MFU against train.peak_tflops = 0.02 TFLOP/s per device" in out


def test_cpu_without_a_peak_logs_no_mfu_and_says_how_once(
    tiny_data: str, tmp_path: Path, capsys
) -> None:
    train(tiny_config(tiny_data, tmp_path / "run", train={"steps": 2}))
    out = capsys.readouterr().out
    assert out.count("--train.peak_tflops") == 1
    assert "MFU not logged: no known peak for a CPU" in out
    assert all(r["mfu"] is None for r in _records(tmp_path / "run"))  # null, not invented
    assert all("| MFU - |" in x for x in out.splitlines() if x.startswith("step "))


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.0),
        ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA A10", "bf16", 125.0),
        ("AMD Instinct MI300X", "bf16", 1307.4),
        ("NVIDIA GeForce RTX 4090", "bf16", None),  # not in the table: absent, no crash
        ("NVIDIA A10G", "bf16", None),  # not an A10
        ("Tesla V100-SXM2-32GB", "bf16", None),  # no bf16 tensor cores
        ("Tesla V100-SXM2-32GB", "fp16", 125.0),
    ],
)
def test_peak_by_device_name_and_precision(name: str, precision: str, tflops: float) -> None:
    peak = resolve_peak(0.0, name, precision)
    assert peak.flops == (None if tflops is None else pytest.approx(tflops * 1e12))
    if tflops is None:
        assert "--train.peak_tflops" in peak.message
    assert resolve_peak(123.0, name, precision).flops == 123e12  # the override wins


def test_peak_on_a_cpu_is_absent_unless_given() -> None:
    assert resolve_peak(0.0, None, "fp32").flops is None
    assert resolve_peak(0.5, None, "fp32").flops == 0.5e12


def test_durations_read_as_clock_times() -> None:
    assert format_duration(0) == "0:00:00"
    assert format_duration(59.6) == "0:01:00"
    assert format_duration(3661) == "1:01:01"
    assert format_duration(2 * 86400 + 3723) == "2d 01:02:03"


def test_logging_keys_are_checked(tiny_data: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.peak_tflops = -1.0 must be >= 0"):
        validate(tiny_config(tiny_data, tmp_path, train={"peak_tflops": -1}))
    with pytest.raises(ConfigError, match="set --train.wandb_project"):
        validate(tiny_config(tiny_data, tmp_path, train={"wandb_run_name": "x"}))


def test_wandb_missing_names_the_install(
    tiny_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"wandb_project": "p"})
    with pytest.raises(ConfigError, match="pip install wandb"):
        train(cfg)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match="pip install wandb"):
        MetricsWriter(tmp_path / "direct", False, wandb_project="p")


def test_wandb_offline_run_holds_the_metrics(
    tiny_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    wandb_dir = offline_env(monkeypatch, tmp_path)
    cfg = tiny_config(
        tiny_data,
        tmp_path / "run",
        train={
            "steps": 4,
            "eval_interval": 2,
            "eval_iters": 1,
            "peak_tflops": PEAK_TFLOPS,
            "wandb_project": "ptdp-test",
            "wandb_run_name": "tiny",
        },
    )
    result = train(cfg)
    (run_file,) = offline_runs(wandb_dir)
    run, history, exit_code = read_run(run_file)
    assert exit_code == 0  # finished, not failed
    assert (run.project, run.display_name) == ("ptdp-test", "tiny")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["train"]["peak_tflops"] == PEAK_TFLOPS  # the resolved config
    assert config["model"]["vocab_size"] == 257
    for r in _records(tmp_path / "run"):
        logged = history[r["step"]]
        assert logged["loss"] == pytest.approx(r["loss"])
        assert logged["mfu"] == pytest.approx(r["mfu"]) and r["mfu"] > 0
        assert logged["eta_s"] == pytest.approx(r["eta_s"])
    assert history[2]["val_loss"] == pytest.approx(result.val_losses[2])
    assert history[4]["val_loss"] == pytest.approx(result.val_losses[4])


def test_wandb_run_of_a_failed_training_is_marked_failed(
    tiny_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    wandb_dir = offline_env(monkeypatch, tmp_path)
    step = Trainer.train_step

    def fail_at_step_2(trainer: Trainer):
        if trainer.step == 1:
            raise RuntimeError("a step failed")
        return step(trainer)

    monkeypatch.setattr(Trainer, "train_step", fail_at_step_2)
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"steps": 4, "wandb_project": "p"})
    with pytest.raises(RuntimeError, match="a step failed"):
        train(cfg)
    (run_file,) = offline_runs(wandb_dir)
    _, history, exit_code = read_run(run_file)
    assert exit_code == 1
    assert list(history) == [1] and history[1]["loss"] > 5  # what was logged before it
