"""The performance model of mixture-of-experts layers: training FLOPs of the active
experts; simulate and plan's compute and memory of the MoE blocks."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest

from ptdp.cli import main
from ptdp.config.enums import Activation, Normalization, PositionEmbedding, Precision, Recompute
from ptdp.config.files import apply_updates
from ptdp.config.presets import MODEL_PRESETS, model_preset
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.perf.cost.costs import Gemm, layer_gemms
from ptdp.perf.cost.flops import flops_per_iteration, flops_per_token, model_flops_per_iteration
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.layer_bytes import head_activation_bytes, layer_activation_bytes
from ptdp.perf.cost.memory import estimate_memory
from ptdp.perf.cost.moe import dense_equivalent
from ptdp.perf.cost.parameters import model_size
from ptdp.perf.cost.software import PTDP
from ptdp.perf.simulate.simulator import simulate

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


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "kimi-k2", "deepseek-v2-lite"])
def test_moe_presets_cost_less_than_their_total(name: str) -> None:
    # The active count per token is far under what all the experts would cost.
    cfg = model_preset(name)
    everyone = replace(cfg, moe_top_k=cfg.num_experts)
    assert flops_per_token(cfg) < 0.25 * flops_per_token(everyone)


def _run(tp: int = 1, **model: object) -> RunConfig:
    """TINY in a bf16 run of one microbatch per step on tp ranks, its experts split like the
    dense layers (etp = tp)."""
    keys = {f.name: getattr(TINY, f.name) for f in fields(TINY)}
    keys = {k: getattr(v, "value", v) for k, v in keys.items()}
    keys |= {"make_vocab_size_divisible_by": 1} | model
    sections = {"model": keys, "parallel": {"tp": tp, "etp": tp}}
    sections["train"] = {"global_batch_size": 1, "micro_batch_size": 1, "precision": "bf16"}
    return apply_updates(RunConfig(), sections, "test")


def test_moe_model_state_per_rank_by_hand() -> None:
    # h 16, two key/value groups of 8: QKV 16 x 48, projection 16 x 16; SwiGLU MLPs.
    attention, norms = 16 * 48 + 16 * 16, 2 * 16
    dense_mlp = 3 * 16 * 40
    router, experts, shared = 4 * 16, 4 * 3 * 16 * 12, 3 * 16 * 20  # every expert held
    ends = 50 * 16 + 50 * 16 + 16  # embedding, output layer, final norm
    whole = attention + norms + dense_mlp + 2 * (attention + norms + router + experts + shared)
    cfg = _run(tp=2, num_query_groups=2)
    assert whole + ends == 13_360 == model_size(cfg.model).total
    # tp = 2: attention and MLP weights split, norms and the router replicated.
    split = attention // 2 + norms + dense_mlp // 2
    split += 2 * (attention // 2 + norms + router + experts // 2 + shared // 2)
    per_rank = split + ends // 2 + 8  # the vocabulary split, the final norm whole (16)
    assert per_rank == 6_800
    (rank,) = estimate_memory(cfg, 2)
    assert (rank.params, rank.grads, rank.optimizer) == (2 * 6_800, 4 * 6_800, 12 * 6_800)


def test_moe_activations_by_hand() -> None:
    # Per MoE layer and microbatch of 8 tokens, beside attention and the shared MLP (width
    # 20) counted as a dense layer's: of the t k = 16 routed rows, the permuted rows and the
    # combine's expert outputs [16, h] (bf16), SwiGLU's gate, up, silu and product [16, 4 x
    # 12] (bf16) and the combine's fp32 weights [16]; the router's two fp32 [t, e] scores.
    assert dense_equivalent(TINY).ffn_size == 44 and dense_equivalent(TINY).num_experts == 0
    extra = 16 * (2 * 16 * 2 + 4 * 12 * 2 + 4) + 2 * 4 * 8 * 4
    assert extra == 2_880
    kw = dict(micro_batch=1, precision=Precision.BF16)
    moe = layer_activation_bytes(TINY, moe=True, **kw)
    shared = replace(TINY, num_experts=0, ffn_hidden_size=20)
    assert moe - layer_activation_bytes(shared, **kw) == extra
    assert layer_activation_bytes(TINY, moe=True, recompute=Recompute.FULL, **kw) == (
        layer_activation_bytes(shared, recompute=Recompute.FULL, **kw)
    )
    # Folded (etp = 1 at tp = 2): a rank routes its s/t tokens, whole experts.
    half = layer_activation_bytes(TINY, moe=True, tp=2, etp=1, **kw)
    assert half - layer_activation_bytes(shared, tp=2, **kw) == extra / 2
    cfg = _run()
    (rank,) = estimate_memory(cfg, 1, autocast_norms=False)
    dense = layer_activation_bytes(TINY, **kw)
    assert rank.activations - rank.in_flight * (dense + 2 * moe) == pytest.approx(
        head_activation_bytes(TINY, micro_batch=1, precision=Precision.BF16)
    )


def test_moe_expert_gemms_scale_with_the_load_imbalance() -> None:
    tokens = 2 * 8
    gemms = layer_gemms(TINY, 2, 1, moe=True)
    rows = tokens * 2 // 4  # t k / e per expert under a perfect balance
    assert gemms[2] == Gemm(tokens, 4, 16)  # the router
    assert gemms[3:5] == [Gemm(rows, 24, 16, 4), Gemm(rows, 16, 12, 4)]
    assert gemms[5:] == [Gemm(tokens, 40, 16), Gemm(tokens, 16, 20)]  # shared experts
    busy = layer_gemms(TINY, 2, 1, moe=True, load=1.5)
    assert busy[3].m == busy[4].m == 12 and busy[:3] + busy[5:] == gemms[:3] + gemms[5:]
    assert layer_gemms(TINY, 2, 1) == layer_gemms(dense_equivalent(TINY), 2, 1)[:2] + [
        Gemm(tokens, 80, 16),
        Gemm(tokens, 16, 40),
    ]


def test_simulate_and_plan_take_an_moe_preset(tmp_path, capsys) -> None:
    system = load_system("h100-sxm")
    over = {"tp": 8, "etp": 8, "pp": 4, "sequence_parallel": True}
    cfg = apply_updates(
        RunConfig(),
        {
            "model": MODEL_PRESETS["mixtral-8x7b"] | {"seq_length": 4096},
            "parallel": over,
            "train": {"global_batch_size": 256, "micro_batch_size": 1, "precision": "bf16"},
        },
        "test",
    )
    fast = simulate(cfg, system, 64, timeline=False)
    # Every rank holds every expert: the whole model's weights over t p ranks.
    total = sum(m.params for m in fast.memory) / 2 * 8  # bf16, tensor ranks
    assert total == pytest.approx(model_size(cfg.model).total, rel=1e-3)
    assert 0.15 < fast.mfu < 0.6
    slow = simulate(cfg, system, 64, timeline=False, software=replace(PTDP, moe_load_imbalance=2))
    assert slow.layer.f > fast.layer.f and slow.iteration_seconds > fast.iteration_seconds
    assert slow.memory == fast.memory
    args = ["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--device", "h100-sxm"]
    assert main([*args, "--global-batch", "512", "--tp", "8", "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["layout"]["tp"] == 8


def test_simulate_takes_the_load_imbalance(tmp_path, capsys) -> None:
    args = ["simulate", "--model", "mixtral-8x7b", "--gpus", "64", "--device", "h100-sxm"]
    args += ["--parallel.tp", "8", "--parallel.pp", "4", "--model.seq_length", "4096"]
    args += ["--train.global_batch_size", "64", "--train.micro_batch_size", "1"]
    args += ["--out", str(tmp_path), "--json"]
    seconds = []
    for load in ("1", "1.5"):
        assert main([*args, "--moe-load-imbalance", load]) == 0
        seconds.append(json.loads(capsys.readouterr().out)["iteration_seconds"])
    assert seconds[1] > seconds[0]
    for bad in ("0.5", "inf", "nan"):
        assert main([*args, "--moe-load-imbalance", bad]) == 2
        assert "--moe-load-imbalance" in (err := capsys.readouterr().err), bad
        assert "must be" in err and ">= 1" in err, err
