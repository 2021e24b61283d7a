"""`--model NAME` presets of published models: exact parameter counts, and train, simulate
and plan start from them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from ptdp.cli import main
from ptdp.config.enums import Activation, AttentionKind, RopeScaling
from ptdp.config.presets import MODEL_PRESETS, model_preset
from ptdp.config.sections import ModelConfig
from ptdp.model.gpt import GPT, count_parameters
from ptdp.parallel.comm import Group
from ptdp.perf.cost.flops import flops_per_token, layer_forward_flops_per_token
from ptdp.perf.cost.parameters import (
    layer_parameters,
    model_size,
    parameters_per_stage,
    tensors_per_stage,
)
from ptdp.perf.validate.paper import model_config

PUBLISHED = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "qwen2.5-7b": 7_615_616_512,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
}
"""Parameters of the released checkpoints (the sum of their safetensors shapes; the model
cards round them to 8.03B, 70.6B, 405B, 7.61B, 7.24B and 46.7B)."""

ROUNDED = {
    "mixtral-8x7b": ("46.7", "12.9"),
    "qwen3-30b-a3b": ("30.5", "3.3"),
    "qwen3-235b-a22b": ("235", "22"),
    "deepseek-v3": ("671", "37"),
    "kimi-k2": ("1.0T", "32"),
    "deepseek-v2-lite": ("15.7", "2.4"),
}
"""Total and active parameters in billions (T: trillions) as the model cards and papers
give them."""


def _unpublished_active(name: str) -> int:
    """Parameters a publisher's active count leaves out (the presets' doc): DeepSeek-V2-Lite's
    2.4B does not count the embedding."""
    m = model_preset(name)
    return m.vocab_size * m.hidden_size if name == "deepseek-v2-lite" else 0


def test_every_preset_has_its_published_size() -> None:
    assert PUBLISHED.keys() | ROUNDED.keys() == MODEL_PRESETS.keys()
    for name, published in PUBLISHED.items():
        model = model_preset(name)
        assert sum(parameters_per_stage(model)) == published, name
        assert model_size(model).total == published, name


@pytest.mark.parametrize("name", ROUNDED)
def test_moe_presets_have_their_published_total_and_active(name: str) -> None:
    size = model_size(model_preset(name))
    counts = (size.total, size.active - _unpublished_active(name))
    for ours, published in zip(counts, ROUNDED[name]):
        scale = 1e12 if published.endswith("T") else 1e9
        published = published.removesuffix("T")
        unit = 10.0 ** -len(published.partition(".")[2])  # the last digit they print
        assert abs(ours / scale - float(published)) < unit, (name, ours, published)
    assert sum(parameters_per_stage(model_preset(name))) == size.total


def test_qwen3_presets_count_their_128_wide_heads_and_qk_norms() -> None:
    # Qwen3-30B-A3B: 32 query heads and 4 key/value heads of 128 in a 2048-wide model, so
    # QKV [2048, 32*128 + 2*4*128], the projection [32*128, 2048], two gains of 128.
    m = model_preset("qwen3-30b-a3b")
    assert (m.head_dim, m.qk_norm, m.num_heads * m.head_dim) == (128, True, 4096)
    attention = 2048 * (4096 + 1024) + 4096 * 2048 + 2 * 128
    dense = replace(m, num_experts=0, ffn_hidden_size=8)
    norms, mlp = 2 * 2048, 3 * 2048 * 8
    assert layer_parameters(dense, 1) == attention + norms + mlp
    # Its attention FLOPs per token: QKV and projection 2 x weights, scores and values
    # 2 s (a d) each.
    gemm, core = layer_forward_flops_per_token(dense)
    assert (gemm - 2 * mlp, core) == (2 * (attention - 2 * 128), 4 * 4096 * 4096)


def test_active_parameters_are_the_top_k_experts() -> None:
    cfg = replace(model_preset("mixtral-8x7b"), num_layers=2)
    expert = 3 * 4096 * 14336
    size = model_size(cfg)
    assert size.total - size.active == 2 * (8 - 2) * expert
    dense = model_preset("mistral-7b")
    assert model_size(dense).active == model_size(dense).total


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
    if cfg.is_mla:
        cfg = _small_latents(cfg, min(cfg.q_lora_rank, 16))
    if cfg.num_experts:  # a first dense layer where the family has them, then MoE layers
        first = min(cfg.moe_first_dense_layers, 1)
        cfg = replace(cfg, num_layers=3, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32)
        cfg = replace(cfg, moe_first_dense_layers=first)
    assert sum(parameters_per_stage(cfg)) == count_parameters(GPT(cfg))
    two = Group(None, 2, 0)  # GPT builds its shards only: no collective runs
    rank0 = GPT(cfg, tp=two, etp=two)  # experts split like the MLP (etp = tp)
    assert parameters_per_stage(cfg, tp=2)[0] == count_parameters(rank0, full=False)
    folded = GPT(cfg, tp=two)  # experts whole on each tensor rank (etp = 1)
    assert parameters_per_stage(cfg, tp=2, etp=1)[0] == count_parameters(folded, full=False)


def _small_latents(cfg: ModelConfig, q_lora: int) -> ModelConfig:
    """Multi-head latent attention of a tiny width (the presets' own mla with no groups)."""
    return replace(
        cfg, num_query_groups=0, q_lora_rank=q_lora, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
    )  # fmt: skip


@pytest.mark.parametrize("attention", ["mha", "mla", "mla-no-q-lora", "mla-mtp"])
@pytest.mark.parametrize("bias", [False, True])
def test_an_moe_count_is_the_models_own(bias: bool, attention: str) -> None:
    # Biases on the experts and the shared MLP (and MLA's down- and output projections),
    # GeLU and SwiGLU, every other layer MoE; MLA with and without the queries' latent, and
    # with two depths of multi-token prediction (MoE layers as the last; on the last stage
    # with its copy of the embedding).
    act = "gelu" if bias else "swiglu"
    cfg = replace(
        model_preset("deepseek-v3"), attention=AttentionKind.MHA,
        num_layers=4, hidden_size=64, num_heads=4, num_query_groups=2, ffn_hidden_size=96,
        vocab_size=100, make_vocab_size_divisible_by=1, seq_length=16, bias=bias,
        num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_shared_ffn_hidden_size=48,
        moe_first_dense_layers=1, moe_layer_freq=2, activation=Activation(act),
    )  # fmt: skip
    if attention != "mha":
        mla = replace(cfg, attention=AttentionKind.MLA)
        cfg = _small_latents(mla, 0 if attention == "mla-no-q-lora" else 16)
        cfg = replace(cfg, mtp_depth=2 if attention == "mla-mtp" else 0)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert sum(parameters_per_stage(cfg)) == count_parameters(GPT(cfg))
    assert model_size(cfg).total == count_parameters(GPT(cfg))
    two = Group(None, 2, 0)
    rank0 = GPT(cfg, tp=two, etp=two)
    assert parameters_per_stage(cfg, tp=2)[0] == count_parameters(rank0, full=False)
    folded = GPT(cfg, tp=two)
    assert parameters_per_stage(cfg, tp=2, etp=1)[0] == count_parameters(folded, full=False)
    stages = (
        GPT(cfg, layers=range(0, 2), has_embedding=True, has_head=False),
        GPT(cfg, layers=range(2, 4), has_embedding=False, has_head=True),
    )
    held = [count_parameters(s, full=False) for s in stages]
    assert parameters_per_stage(cfg, 1, 2) == held
    tensors = [len(list(s.parameters())) for s in stages]
    assert tensors_per_stage(cfg, 2) == tensors


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
