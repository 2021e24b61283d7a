"""`--model NAME` presets of published models: exact parameter counts, and train, simulate
and plan start from them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config import RopeScaling
from ptdp.model.gpt import GPT, count_parameters
from ptdp.parallel.comm import Group
from ptdp.perf.cost.flops import flops_per_token
from ptdp.perf.cost.parameters import parameters_per_stage
from ptdp.perf.validate.paper import model_config
from ptdp.presets import MODEL_PRESETS, model_preset

PUBLISHED = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_241_732_096,
}
"""Parameters of the released checkpoints (the sum of their safetensors shapes; the model
cards round them to 8.03B, 70.6B, 405B, 7.61B and 7.24B)."""


def test_every_preset_has_its_published_size() -> None:
    assert PUBLISHED.keys() == MODEL_PRESETS.keys()
    for name, published in PUBLISHED.items():
        model = model_preset(name)
        assert sum(parameters_per_stage(model)) == published, name


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_the_count_is_the_models_own(name: str) -> None:
    # The same family options on a small shape: the perf model's count is what GPT builds,
    # at tp = 1 and, per rank, at tp = 2 (QKV bias split with the heads).
    cfg = replace(
        model_preset(name),
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        vocab_size=100,
        make_vocab_size_divisible_by=1,  # count the vocabulary unpadded
        seq_length=16,
        sliding_window=min(model_preset(name).sliding_window, 8),
    )
    assert sum(parameters_per_stage(cfg)) == count_parameters(GPT(cfg))
    rank0 = GPT(cfg, tp=Group(None, 2, 0))  # builds its shards only: no collective runs
    assert parameters_per_stage(cfg, tp=2)[0] == count_parameters(rank0, full=False)


def test_presets_carry_their_family_options() -> None:
    assert model_preset("llama3.1-405b").rope_scaling is RopeScaling.LLAMA3
    assert model_preset("llama3-8b").rope_scaling is RopeScaling.NONE
    assert model_preset("qwen2.5-7b").qkv_bias and not model_preset("qwen2.5-7b").bias
    assert model_preset("mistral-7b").sliding_window == 4096
    cfg = model_config("mistral-7b")
    assert cfg.train.precision.value == "bf16" and cfg.model == model_preset("mistral-7b")
    # The window shortens the attention FLOPs: 8192-token sequences read 4096 keys.
    full = replace(cfg.model, sliding_window=0)
    layers, h = cfg.model.num_layers, cfg.model.hidden_size
    assert flops_per_token(full) - flops_per_token(cfg.model) == 3 * layers * 4 * 4096 * h


def test_simulate_and_plan_start_from_a_published_model(tmp_path: Path, capsys) -> None:
    args = ["simulate", "--model", "qwen2.5-7b", "--parallel.tp", "4", "--parallel.pp", "2"]
    batch = ["--train.global_batch_size", "64", "--train.micro_batch_size", "1"]
    assert main([*args, *batch, "--out", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["world_size"] == 8
    args = ["plan", "--model", "mistral-7b", "--gpus", "8", "--global-batch", "64"]
    assert main([*args, "--tp", "8", "--pp", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["layout"]["tp"] == 8


def test_train_starts_from_a_published_model(tiny_data: str, capsys) -> None:
    args = ["train", "--model", "llama3.1-8b", "--model.seq_length", "256"]
    layout = ["--parallel.tp", "8", "--dry-run", "--world-size", "8"]
    assert main([*args, "--data.path", tiny_data, *layout]) == 0
    out = capsys.readouterr().out
    assert 'rope_scaling = "llama3"' in out and "vocab_size = 128256" in out
    assert "num_layers = 32" in out and "tp=8" in out
    assert main(["train", "--model", "gpt-2t", "--dry-run"]) == 2
    assert "unknown model 'gpt-2t'" in capsys.readouterr().err
