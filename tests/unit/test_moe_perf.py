"""The performance model of mixture-of-experts layers: training FLOPs of the active
experts; simulate and plan's compute and memory of the MoE blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ptdp.config import Activation, ModelConfig, Normalization, PositionEmbedding, Recompute
from ptdp.perf.cost.flops import flops_per_iteration, flops_per_token, model_flops_per_iteration
from ptdp.presets import model_preset

TINY = ModelConfig(
    num_layers=3,
    hidden_size=16,
    num_heads=2,
    num_query_groups=1,
    ffn_hidden_size=40,
    vocab_size=50,
    seq_length=8,
    activation=Activation.SWIGLU,
    position_embedding=PositionEmbedding.ROPE,
    normalization=Normalization.RMSNORM,
    bias=False,
    tie_embeddings=False,
    num_experts=4,
    moe_top_k=2,
    moe_ffn_hidden_size=12,
    moe_shared_experts=1,
    moe_shared_ffn_hidden_size=20,
    moe_first_dense_layers=1,
)
"""One dense layer, then two MoE layers."""


def test_moe_flops_count_the_active_experts_by_hand() -> None:
    h, s, v = 16, 8, 50
    attention = 2 * h * (h + 2 * 8) + 2 * h * h  # QKV (one group of 8-wide heads), projection
    core = 4 * s * h
    dense = attention + 6 * h * 40  # SwiGLU: gate, up and down of width 40
    moe = attention + 2 * h * 4 + 6 * h * (2 * 12 + 20)  # router, 2 routed, shared of 20
    logits = 2 * h * v
    forward = dense + core + 2 * (moe + core)
    assert flops_per_token(TINY) == 3 * forward + 3 * logits
    full = 3 * forward + forward + 3 * logits  # full recomputation: the layers' forward again
    assert flops_per_token(TINY, Recompute.FULL) == full
    assert flops_per_token(TINY, Recompute.SELECTIVE) == 3 * forward + 3 * core + 3 * logits
    assert model_flops_per_iteration(TINY, 4) == 4 * s * (3 * forward + 3 * logits)


def test_moe_flops_are_those_of_the_active_parameters() -> None:
    # Per token, a GEMM costs 2 FLOPs a weight: the MLP part of Mixtral's count is
    # 6 x 2 x (the active MLP parameters), router included.
    mixtral = model_preset("mixtral-8x7b")
    dense = replace(mixtral, num_experts=0, moe_top_k=2, moe_ffn_hidden_size=0)
    dense = replace(dense, moe_softmax_after_topk=False, moe_aux_loss_coeff=0.0)
    extra = flops_per_token(mixtral) - flops_per_token(dense)
    h, f, layers = 4096, 14336, 32
    assert extra == 3 * layers * (2 * h * 8 + (2 - 1) * 6 * h * f)
    # A dense model is the same whatever the MoE keys would be.
    llama = model_preset("llama3-8b")
    assert flops_per_iteration(llama, 8) == flops_per_iteration(replace(llama, num_experts=0), 8)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3-moe"])
def test_moe_presets_cost_less_than_their_total(name: str) -> None:
    # The active count per token is far under what all the experts would cost.
    cfg = model_preset(name)
    everyone = replace(cfg, moe_top_k=cfg.num_experts)
    assert flops_per_token(cfg) < 0.25 * flops_per_token(everyone)
