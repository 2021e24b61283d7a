"""`ptdp convert` across layouts: a tp=2 x pp=2 run exports like any other (checkpoints
are full-state), and an imported model fine-tunes in tp=2 x pp=2 with the losses of one
process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.config.files import apply_updates, load_toml
from ptdp.convert.hf import export_hf, import_hf
from ptdp.parallel.env import LaunchEnv
from ptdp.sample import load_model
from ptdp.train.run import train
from tests.dist.harness import run_ranks
from tests.helpers import LLAMA, tiny_config

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install .[hf])")

TP2_PP2 = {"tp": 2, "pp": 2}
STEPS = {"micro_batch_size": 2, "global_batch_size": 8, "device": "cpu", "progress": False}


def _train_original(rank: int, world_size: int, data: str, run_dir: str) -> None:
    cfg = tiny_config(
        data,
        Path(run_dir),
        parallel=TP2_PP2,
        model={**LLAMA, "num_layers": 4},
        train={**STEPS, "steps": 2},
    )
    train(cfg, env=LaunchEnv(rank, world_size, rank))


def _fine_tune(rank: int, world_size: int, data: str, run_dir: str, parallel: dict) -> None:
    updates = {
        "data": {"path": data, "valid_fraction": 0.1},
        "parallel": parallel,
        "optim": {"lr": 3e-3, "warmup_steps": 1, "eps": 1e-6},
        "train": {**STEPS, "steps": 2, "log_interval": 1, "eval_interval": 0},
    }
    cfg = apply_updates(load_toml(Path(run_dir) / "config.toml"), updates, "a test")
    result = train(cfg, env=LaunchEnv(rank, world_size, rank), resume=True)
    if rank == 0:
        (Path(run_dir) / "losses.json").write_text(json.dumps(result.losses))


def test_tp2_pp2_run_exports_and_fine_tunes(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_train_original, 4, tiny_data, str(tmp_path / "orig"))
    export_hf(tmp_path / "orig", tmp_path / "hf")
    ours = load_model(ckpt.find_checkpoint(tmp_path / "orig")).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() < 1e-4

    for name in ("single", "tp2-pp2"):
        import_hf(tmp_path / "hf", tmp_path / name)
    _fine_tune(0, 1, tiny_data, str(tmp_path / "single"), {})
    run_ranks(_fine_tune, 4, tiny_data, str(tmp_path / "tp2-pp2"), TP2_PP2)
    single, parallel = (
        json.loads((tmp_path / name / "losses.json").read_text()) for name in ("single", "tp2-pp2")
    )
    assert single.keys() == parallel.keys() == {"1", "2"}
    for step in single:
        assert parallel[step] == pytest.approx(single[step], rel=1e-5)
