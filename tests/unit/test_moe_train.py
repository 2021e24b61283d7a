"""Training a mixture-of-experts model in one process: the logged figures, the balancing
loss inside the logged loss, the bias update, and an exact resume with the biases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.train.run import train
from tests.helpers import tiny_config

MOE = {
    "num_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001,
    "moe_bias_update_rate": 0.01, "moe_shared_experts": 1, "moe_capacity_factor": 1.25,
}  # fmt: skip


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_figures_are_logged_and_the_biases_move(tiny_data: str, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    result = train(tiny_config(tiny_data, run, model=MOE, train={"steps": 2}))
    records = [r for r in _records(run) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert len(r["moe_load"]) == 2 and all(len(row) == 4 for row in r["moe_load"])
        assert all(sum(row) == pytest.approx(1.0) for row in r["moe_load"])
        assert r["moe_load_max_over_mean"] >= 1.0
        assert 0 < r["moe_aux_loss"] < r["loss"] and r["moe_z_loss"] > 0
        assert r["moe_dropped"] >= 0
    line = capsys.readouterr().out
    assert "| moe aux " in line and "| load max/mean " in line and "| dropped " in line
    model = ckpt.load_checkpoint(ckpt.find_checkpoint(run))["model"]
    biases = {k: v for k, v in model.items() if k.endswith("router.expert_bias")}
    assert sorted(biases) == ["layers.0.mlp.router.expert_bias", "layers.1.mlp.router.expert_bias"]
    # Two steps of +-0.01 or 0 each (an expert at the mean stays).
    assert any(bias.abs().max() > 0 for bias in biases.values())
    for bias in biases.values():
        steps = bias / 0.01
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 2
    assert set(result.losses) == {1, 2}


def test_resume_with_biases_is_bitwise_exact(tiny_data: str, tmp_path: Path) -> None:
    common = {"optim": {"decay_steps": 4}, "model": MOE}
    full = train(tiny_config(tiny_data, tmp_path / "full", train={"steps": 4}, **common))
    train(tiny_config(tiny_data, tmp_path / "split", train={"steps": 2}, **common))
    resumed = train(
        tiny_config(tiny_data, tmp_path / "split", train={"steps": 4}, **common), resume=True
    )
    assert resumed.start_step == 2
    for step in (3, 4):
        assert resumed.losses[step] == full.losses[step]  # bitwise, not approximately
    a = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "full"))["model"]
    b = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "split"))["model"]
    assert a.keys() == b.keys() and any(k.endswith("expert_bias") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    later = [r for r in _records(tmp_path / "split") if r.get("step") == 4][0]
    whole = [r for r in _records(tmp_path / "full") if r.get("step") == 4][0]
    assert later["moe_load"] == whole["moe_load"]


def test_generation_loads_the_biases(tiny_data: str, tmp_path: Path) -> None:
    from ptdp.checkpoint.partial import load_model_weights
    from ptdp.config.files import load_toml
    from ptdp.model.gpt import GPT
    from ptdp.parallel.comm import Group
    from ptdp.sample import sample_from_checkpoint

    run = tmp_path / "run"
    train(tiny_config(tiny_data, run, model=MOE, train={"steps": 2}))
    step_dir = ckpt.find_checkpoint(run)
    saved = ckpt.load_checkpoint(step_dir)["model"]
    model = GPT(load_toml(run / "config.toml").model)
    load_model_weights([model], step_dir, Group.single())
    for name, b in model.state_buffers().items():
        assert torch.equal(b, saved[name]), name
    texts = sample_from_checkpoint(run, "to be", max_new_tokens=8, num_samples=2, seed=3)
    assert len(texts) == 2 and all(t.startswith("to be") for t in texts)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_training(tiny_data: str, tmp_path: Path, precision: str) -> None:
    cfg = tiny_config(
        tiny_data, tmp_path / "run", model=MOE, train={"steps": 2, "precision": precision}
    )
    result = train(cfg)
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    assert all(r["moe_aux_loss"] > 0 for r in _records(tmp_path / "run") if "loss" in r)
