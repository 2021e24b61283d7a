"""The performance model of multi-head latent attention (model.attention = mla): its FLOPs
are what the layer executes, its weights, GEMMs, cache, ring blocks and backward tensors are
its five linears' (`ptdp.config.shapes`), and plan and simulate take the DeepSeek-V3 family."""

from __future__ import annotations

import json
from dataclasses import astuple, replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ptdp.cli import main
from ptdp.config.enums import Precision
from ptdp.config.files import apply_updates
from ptdp.config.presets import MODEL_PRESETS, model_preset
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.config.shapes import Split, attention_linears
from ptdp.errors import ConfigError
from ptdp.model.gpt import GPT
from ptdp.perf.cost.context import kv_block_bytes
from ptdp.perf.cost.costs import Compute, Gemm, head_seconds, layer_gemms
from ptdp.perf.cost.flops import flops_per_token, layer_forward_flops_per_token
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.layer_bytes import layer_backward_bytes
from ptdp.perf.cost.memory import estimate_memory
from ptdp.perf.cost.parameters import (
    layer_parameters,
    linear_weights,
    mtp_parameters,
    parameters_per_rank,
)
from ptdp.perf.cost.software import PTDP
from ptdp.perf.plan.ends import best_ends
from ptdp.perf.simulate.pipeline_costs import compute_costs, layer_costs
from ptdp.rules.layout import validate

MLA = {
    "num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 8, "vocab_size": 64,
    "position_embedding": "rope", "normalization": "rmsnorm", "activation": "swiglu",
    "bias": False, "dropout": 0.0, "tie_embeddings": False, "ffn_hidden_size": 48,
    "make_vocab_size_divisible_by": 1, "attention": "mla", "q_lora_rank": 16,
    "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
}  # fmt: skip


def _model(**keys: object) -> ModelConfig:
    return apply_updates(RunConfig(), {"model": MLA | keys}, "test").model


@pytest.mark.parametrize(("q_lora", "mtp"), [(16, 0), (0, 0), (16, 2)])
def test_mla_flops_are_what_the_model_executes(q_lora: int, mtp: int) -> None:
    # PyTorch's FLOP counter over a forward and backward of the model (on CPU the attention
    # of unequal widths runs as batched GEMMs over the full s x s square, as the count takes
    # it), with two depths of multi-token prediction: each its projection, a layer and the
    # output layer again.
    cfg = _model(q_lora_rank=q_lora, mtp_depth=mtp)
    gpt, tokens = GPT(cfg).train(), torch.randint(0, 64, (2, 8))
    with FlopCounterMode(display=False) as forward:
        gpt(tokens, tokens)
    gemm, core = layer_forward_flops_per_token(cfg)
    logits, mtp_layer = 2 * 32 * 64, 2 * 64 * 32 + gemm + core
    assert forward.get_total_flops() == 16 * (
        2 * (gemm + core) + logits + mtp * (mtp_layer + logits)
    )
    with FlopCounterMode(display=False) as step:
        gpt(tokens, tokens).backward()
    assert step.get_total_flops() == 16 * flops_per_token(cfg)


def test_deepseek_v3_attention_by_hand() -> None:
    # DeepSeek-V3's attention: q_down 7168 -> 1536, q_up 1536 -> 128 x 192, kv_down
    # 7168 -> 512 + 64, kv_up 512 -> 128 x (128 + 128), proj 128 x 128 -> 7168, two latent
    # norms (1536, 512): 187,107,328 parameters a layer.
    m = model_preset("deepseek-v3")
    weights = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert sum(x.weights for x in attention_linears(m)) == weights
    assert weights + 1536 + 512 == 187_107_328
    dense = replace(m, num_experts=0)
    assert layer_parameters(dense) == weights + 1536 + 512 + 2 * 7168 + 3 * 7168 * 18432
    # Under tp = 8 the up- and output projections split, the down-projections stay whole.
    down = 7168 * 1536 + 7168 * 576
    assert linear_weights(dense, 8) == (weights - down + 3 * 7168 * 18432) // 8 + down
    # Attention FLOPs per token: 2 a weight, and scores (192) and values (128) per head
    # over the 4096-token square.
    gemm, core = layer_forward_flops_per_token(dense)
    assert gemm == 2 * weights + 6 * 7168 * 18432
    assert core == 2 * 4096 * 128 * (192 + 128)


def test_mla_gemms_split_as_the_layer_does() -> None:
    cfg = _model()
    split = {x.name: x.split for x in attention_linears(cfg)}
    assert split == {
        "q_down": Split.NONE, "q_up": Split.COLUMN, "kv_down": Split.NONE,
        "kv_up": Split.COLUMN, "proj": Split.ROW,
    }  # fmt: skip
    tokens = 2 * 8
    # tp = 2: the up-projections' outputs and the projection's input halve; under sequence
    # parallelism the down-projections run on the rank's half of the tokens.
    gemms = layer_gemms(cfg, 2, 2, sequence_parallel=True)
    assert gemms[:5] == [
        Gemm(tokens // 2, 16, 32), Gemm(tokens, 4 * 12 // 2, 16),
        Gemm(tokens // 2, 12 + 4, 32), Gemm(tokens, 4 * 14 // 2, 12),
        Gemm(tokens, 32, 4 * 6 // 2),
    ]  # fmt: skip
    assert layer_gemms(cfg, 2, 2)[0] == Gemm(tokens, 16, 32)  # every token, without sp


def test_mla_ring_blocks_and_backward_tensors_take_both_widths() -> None:
    # The ring sends each head's key (p + r = 12) and value (dv = 6), the heads split over t.
    cfg = _model()
    assert kv_block_bytes(cfg, micro_batch=1, tp=2, cp=2, e=2) == 4 * (4 // 2) * (12 + 6) * 2
    # Attention's dQ, dK (12 a head), dV and dO (6 a head) against the MLP's 48 (1 + 2):
    # the larger is the layer backward's peak beside dY and dX [n, h].
    n, fp32 = 8, Precision.FP32
    assert layer_backward_bytes(cfg, micro_batch=1, precision=fp32) == 4 * n * (2 * 32 + 144)
    wide = _model(v_head_dim=20)  # values wider: attention's 4 x (12 + 12 + 20 + 20) = 256
    assert layer_backward_bytes(wide, micro_batch=1, precision=fp32) == 4 * n * (2 * 32 + 256)


def test_float8_widths_of_each_mla_linear_are_checked() -> None:
    # kv_down's outputs c + r = 16 + 4 = 20 are no multiple of 16: refused, naming it.
    model = MLA | {"hidden_size": 64, "kv_lora_rank": 16, "qk_rope_head_dim": 4}
    model |= {"ffn_hidden_size": 64, "make_vocab_size_divisible_by": 16}
    model |= {"q_lora_rank": 32, "qk_nope_head_dim": 12, "v_head_dim": 16}
    train = {"precision": "fp8", "micro_batch_size": 2, "global_batch_size": 2}
    cfg = apply_updates(RunConfig(), {"model": model, "train": train}, "test")
    with pytest.raises(ConfigError) as refused:
        validate(cfg, 1)
    assert "MLA's kv_down output features per tensor-parallel rank (= 20)" in str(refused.value)
    assert "MLA's q_up" not in str(refused.value)  # 32 -> 4 x 16: multiples of 16
    fits = replace(cfg, model=replace(cfg.model, qk_rope_head_dim=16, qk_nope_head_dim=16))
    validate(fits, 1)


@pytest.mark.parametrize(("name", "batch"), [("deepseek-v3", 15360), ("kimi-k2", 16384)])
def test_plan_lays_out_the_deepseek_family(name: str, batch: int, capsys) -> None:
    # The published batches (DeepSeek-V3's 15360 sequences, Kimi K2's 67M tokens) on 1024
    # H100s, tensor parallelism fixed at 4 so that the search stays short.
    argv = ["plan", "--model", name, "--gpus", "1024", "--device", "h100-sxm", "--json"]
    assert main(argv + ["--global-batch", str(batch), "--tp", "4", "--pp", "1"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    layout = best["layout"]
    assert best["fits"] and best["need_gib"] <= best["capacity_gib"] == 79.6
    assert layout["tp"] * layout["pp"] * layout["dp"] == 1024 and layout["ep"] > 1
    # The weights it holds are the preset's, per rank: bf16 copies of the attention's and
    # dense layers' shares, 2 bytes each, and e / ep routed experts a layer.
    held = parameters_per_rank(model_preset(name), 4, 1, ep=layout["ep"], etp=1)[0]
    assert best["limiting_memory_gib"]["params"] == pytest.approx(2 * held / 2**30)


def test_mtp_sits_on_the_last_stage_in_time_and_memory() -> None:
    # Two depths of multi-token prediction on a dense MLA model, pp = 2: the last stage does
    # two layers and two heads more, and holds their activations; the first is unchanged.
    def run(mtp: int) -> RunConfig:
        sections = {"model": MLA | {"num_layers": 4, "mtp_depth": mtp}, "parallel": {"pp": 2}}
        sections["train"] = {"micro_batch_size": 1, "global_batch_size": 4, "precision": "bf16"}
        return apply_updates(RunConfig(), sections, "test")

    system = load_system("h100-sxm")
    c = Compute(system, Precision.BF16, PTDP)
    plain, mtp = run(0), run(2)
    layout = validate(plain, 2, gpus=True)
    before, after = compute_costs(plain, layout, c), compute_costs(mtp, layout, c)
    layer = layer_costs(plain, layout, c)
    head = head_seconds(plain.model, micro_batch=1, tp=1, c=c, compiled=False)
    assert after[0] == before[0]
    for got, want in zip(astuple(after[-1]), astuple(before[-1] + (layer + head).times(2))):
        assert got == pytest.approx(want, rel=1e-12)
    (first, last), (first2, last2) = estimate_memory(plain, 2), estimate_memory(mtp, 2)
    assert first2.activations == first.activations and last2.activations > last.activations
    assert last2.params - last.params == 2 * (
        mtp_parameters(mtp.model) + mtp.model.padded_vocab_size() * 32
    )  # bf16: the modules and the copy of the embedding


def test_the_planner_lightens_the_last_stage_for_mtp() -> None:
    # Llama 3 8B on pp = 4 (t = 8): each depth of multi-token prediction adds about a layer
    # to the last stage, and the lighter-ends search moves layers off it in step.
    c = Compute(load_system("h100-sxm"), Precision.BF16, PTDP)
    last = []
    for mtp in (0, 1, 2, 4):
        model = dict(MODEL_PRESETS["llama3-8b"], mtp_depth=mtp)
        sections = {"model": model, "parallel": {"pp": 4, "tp": 8}}
        sections["train"] = {"micro_batch_size": 1, "global_batch_size": 64}
        split = best_ends(apply_updates(RunConfig(), sections, "test"), 32, c)
        assert split is not None and sum(split) == 32
        last.append(split[-1])
    assert last == sorted(last, reverse=True) and last[0] - last[-1] >= 4
