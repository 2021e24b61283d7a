"""The training log of a multi-rank run: MFU is per device (the job's model FLOP/s over
the world size, over one device's peak), and only rank 0 logs to Weights & Biases."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import train
from tests.dist.harness import run_ranks
from tests.helpers import tiny_config
from tests.wandb_offline import offline_env, offline_runs, read_run

pytestmark = pytest.mark.dist

PEAK_TFLOPS = 0.02


def _check_run(rank: int, world_size: int, data: str, run_dir: str, wandb: bool) -> None:
    train_section = {"steps": 3, "micro_batch_size": 2, "peak_tflops": PEAK_TFLOPS}
    if wandb:
        train_section |= {"wandb_project": "ptdp-dist", "wandb_run_name": "dp2"}
    cfg = tiny_config(data, Path(run_dir), train=train_section, parallel={"dp": 2})
    train(cfg, env=LaunchEnv(rank, world_size, rank))


def test_mfu_is_per_device_and_rank_0_alone_logs_to_wandb(
    tiny_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = importlib.util.find_spec("wandb") is not None  # the MFU check runs without it
    wandb_dir = offline_env(monkeypatch, tmp_path)  # the spawned ranks inherit it
    run_ranks(_check_run, 2, tiny_data, str(tmp_path / "run"), wandb)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    # The paper's model FLOPs by hand: B = 8, s = 32, l = 2, h = 32, V = 257; two devices.
    b, s, l, h, v = 8, 32, 2, 32, 257
    model_flops = 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    for r in records:
        per_device = model_flops / r["step_time_s"] / 2
        assert r["mfu"] == pytest.approx(per_device / (PEAK_TFLOPS * 1e12))
        assert r["tflops_per_device"] == pytest.approx(per_device / 1e12)  # no recomputation
    if wandb:
        (run_file,) = offline_runs(wandb_dir)  # one run: rank 1 made none
        run, history, exit_code = read_run(run_file)
        assert exit_code == 0
        assert run.display_name == "dp2"
        assert [history[r["step"]]["mfu"] for r in records] == pytest.approx(
            [r["mfu"] for r in records]
        )
