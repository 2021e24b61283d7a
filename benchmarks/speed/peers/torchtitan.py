"""TorchTitan's Llama 3 (torchtitan.models.llama3) at ptdp's shape, with TorchTitan's own
recommended settings: each TransformerBlock compiled (fullgraph), FlexAttention with its
causal block mask on CUDA (CPU: its SDPA module, since FlexAttention has no backward on
CPU), fused QKV, and fp8 through its torchao Float8Linear converter (the output layer left
in bf16, as TorchTitan's fp8 recipes do). Llama only: TorchTitan has no GPT-2."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from . import PeerShape, PeerUnavailable, refuse_fp8_off_cuda

FP8_SKIP = ["lm_head"]
"""Linears TorchTitan's fp8 recipes keep in bf16 (`float8.filter_fqns`)."""


def titan_dims(shape: PeerShape, device_type: str) -> dict:
    """The numbers TorchTitan's Llama3Model.Config gets for this shape (pure: tested without
    TorchTitan installed)."""
    if shape.arch != "llama":
        raise PeerUnavailable(
            "TorchTitan has no GPT-2 (learned positions, LayerNorm, GELU): "
            "compare with --arch llama"
        )
    if shape.hidden % shape.heads:
        raise PeerUnavailable(f"hidden {shape.hidden} is not a multiple of heads {shape.heads}")
    return {
        "dim": shape.hidden,
        "n_layers": shape.layers,
        "n_heads": shape.heads,
        "head_dim": shape.hidden // shape.heads,
        "hidden_dim": shape.ffn,
        "vocab_size": shape.vocab,
        "max_seq_len": shape.seq,
        "rope_theta": shape.rope_theta,
        "attention": "flex" if device_type == "cuda" else "sdpa",
        "fuse_qkv": True,
        "fp8_recipe": shape.fp8_recipe,
        "fp8_skip": FP8_SKIP if shape.fp8_recipe else [],
    }


def _config(d: dict):
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        ScaledDotProductAttention,
    )
    from torchtitan.models.common.config_utils import (
        get_attention_config,
        make_ffn_config,
        make_gqa_config,
    )
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    h = d["dim"]
    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    ones = {"weight": nn.init.ones_}
    attention = (
        ScaledDotProductAttention.Config()
        if d["attention"] == "sdpa"
        else get_attention_config(d["attention"])
    )
    rope = ComplexRoPE.Config(
        dim=d["head_dim"], max_seq_len=d["max_seq_len"], theta=d["rope_theta"]
    )
    block = partial(
        Llama3TransformerBlock.Config,
        attention_norm=RMSNorm.Config(normalized_shape=h, param_init=ones),
        ffn_norm=RMSNorm.Config(normalized_shape=h, param_init=ones),
    )
    layers = [
        block(
            attention=make_gqa_config(
                dim=h,
                n_heads=d["n_heads"],
                wqkv_param_init=linear,
                wo_param_init=linear,
                inner_attention=attention,
                fuse_qkv=d["fuse_qkv"],
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=h, hidden_dim=d["hidden_dim"], w1_param_init=linear, w2w3_param_init=linear
            ),
        )
        for _ in range(d["n_layers"])
    ]
    v = d["vocab_size"]
    return Llama3Model.Config(
        dim=h,
        vocab_size=v,
        tok_embeddings=Embedding.Config(num_embeddings=v, embedding_dim=h, param_init=linear),
        norm=RMSNorm.Config(normalized_shape=h, param_init=ones),
        lm_head=Linear.Config(in_features=h, out_features=v, param_init=linear),
        layers=layers,
    )


def _fp8(config, d: dict, compile: bool):
    from torchtitan.components.quantization import Float8LinearConverter

    fp8 = Float8LinearConverter.Config(
        recipe_name=d["fp8_recipe"], filter_fqns=d["fp8_skip"], model_compile_enabled=compile
    )
    return Float8LinearConverter(fp8).convert(config)


class _Logits(nn.Module):
    """Token ids -> logits, with the attention mask TorchTitan's trainer would build (one
    document per sequence: plain causal)."""

    def __init__(self, inner: nn.Module, flex: bool) -> None:
        super().__init__()
        self.inner, self.flex = inner, flex

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if not self.flex:
            return self.inner(idx)
        positions = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
        return self.inner(idx, attention_masks=self.inner.get_attention_masks(positions))


def build(shape: PeerShape, device: torch.device, compile: bool) -> nn.Module:
    d = titan_dims(shape, device.type)
    refuse_fp8_off_cuda("torchtitan", shape, device)
    try:
        config = _config(d)
    except ImportError as e:
        raise PeerUnavailable(
            f"torchtitan is not importable ({e}); scripts/fetch-peers.sh fetches its wheels"
        ) from e
    if d["fp8_recipe"]:
        config = _fp8(config, d, compile)
    with torch.device(device):
        model = config.build()
        model.init_states()
    if compile:  # TorchTitan's apply_compile: each block on its own, the rest eager
        for block in model.layers.values():
            block.compile(fullgraph=True)
    return _Logits(model, flex=d["attention"] != "sdpa")
