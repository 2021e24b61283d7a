"""`ptdp inspect`: what a checkpoint holds, and clear errors for a missing or damaged one."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ptdp import checkpoint as ckpt
from ptdp.cli import main
from ptdp.model.gpt import GPT, count_parameters
from ptdp.train.run import train
from tests.helpers import tiny_config


def test_inspect_run_and_step_dirs(tiny_data: str, tmp_path: Path, capsys) -> None:
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"steps": 2})
    train(cfg)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    step_dir = ckpt.find_checkpoint(tmp_path / "run")
    assert f"checkpoint: {step_dir}" in out
    assert "step: 2 (16 samples)" in out
    assert "tokenizer: tokenizer.json (bytes, present in" in out
    assert "  num_layers = 2" in out and "  hidden_size = 32" in out
    assert "tp=1 pp=1" in out
    state = ckpt.load_checkpoint(step_dir)["model"]
    w = state["layers.0.attn.qkv.weight"]
    assert re.search(rf"\n  layers\.0\.attn\.qkv\.weight +{w.shape[0]}x{w.shape[1]} +float32 ", out)
    params = sum(t.numel() for t in state.values())
    assert params == count_parameters(GPT(ckpt.load_config(step_dir).model))
    assert f"{len(state)} tensors, {params:,} parameters" in out
    assert "with state exp_avg, exp_avg_sq; step 2;" in out
    assert "group 0: lr=" in out and "weight_decay=0.1" in out
    # A step directory gives the same report.
    assert main(["inspect", str(step_dir)]) == 0
    assert capsys.readouterr().out == out


def test_inspect_errors_without_traceback(tiny_data: str, tmp_path: Path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptdp inspect: error: no checkpoint found at")
    assert "Traceback" not in err
    train(tiny_config(tiny_data, tmp_path / "run", train={"steps": 1}))
    shard = next(ckpt.find_checkpoint(tmp_path / "run").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["inspect", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "ptdp inspect: error: checkpoint file" in err and str(shard) in err
    assert "Traceback" not in err


def test_inspect_without_tokenizer_or_optimizer(tiny_data: str, tmp_path: Path, capsys) -> None:
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"steps": 1})
    train(cfg)
    step_dir = ckpt.find_checkpoint(tmp_path / "run")
    state = ckpt.load_checkpoint(step_dir)
    state["tokenizer"], state["optimizer"] = "", {"state": {}, "param_groups": []}
    torch.save(state, step_dir / "state.pt")
    assert main(["inspect", str(step_dir)]) == 0
    out = capsys.readouterr().out
    assert "tokenizer: none recorded" in out
    assert "optimizer:\n  none" in out
