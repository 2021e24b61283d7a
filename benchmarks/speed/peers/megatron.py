"""Megatron-Core's GPTModel at ptdp's shape, on one GPU (world 1, its parallel state
initialised): the Transformer-Engine layer spec where Transformer Engine imports, else its
local (plain PyTorch) spec. GPT-2 or Llama layers from the same model class; fp8 only
through Transformer Engine (tensorwise: its current-scaling recipe; it has no rowwise one).
CUDA only: its rotary embedding and RNG tracker call torch.cuda."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from . import PeerShape, PeerUnavailable, refuse_fp8_off_cuda

FP8_RECIPES = {"tensorwise": "tensorwise"}
"""fp8 recipe names of this benchmark -> Megatron-Core's `fp8_recipe`."""


def mcore_kwargs(shape: PeerShape, te: bool) -> tuple[dict, dict]:
    """(TransformerConfig keywords, GPTModel keywords) for this shape, the activation named
    rather than given (pure: tested without Megatron-Core installed)."""
    llama = shape.arch == "llama"
    config = {
        "num_layers": shape.layers,
        "hidden_size": shape.hidden,
        "num_attention_heads": shape.heads,
        "ffn_hidden_size": shape.ffn,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "normalization": "RMSNorm" if llama else "LayerNorm",
        "gated_linear_unit": llama,
        "activation": "silu" if llama else "gelu",
        "add_bias_linear": not llama,
        "bias_activation_fusion": False,
        "params_dtype": torch.float32,  # fp32 weights under bf16 autocast, as every peer
    }
    if recipe := shape.fp8_recipe:
        if not te:
            raise PeerUnavailable("Megatron-Core trains fp8 through Transformer Engine only")
        if recipe not in FP8_RECIPES:
            raise PeerUnavailable(
                f"Megatron-Core has no {recipe} fp8 recipe (it has {', '.join(FP8_RECIPES)})"
            )
        config |= {"fp8": "hybrid", "fp8_recipe": FP8_RECIPES[recipe]}
    model = {
        "vocab_size": shape.vocab,
        "max_sequence_length": shape.seq,
        "position_embedding_type": "rope" if llama else "learned_absolute",
        "share_embeddings_and_output_weights": not llama,
    }
    if llama:
        model["rotary_base"] = int(shape.rope_theta)
    return config, model


def _has_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # noqa: BLE001 -- any failure to load means the local spec
        return False
    return True


def _parallel_state(device: torch.device) -> None:
    """World 1 and Megatron-Core's model-parallel groups of size 1, once per process."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


class _Logits(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
        return self.inner(idx, positions, None)  # causal mask: the layer spec's own


def build(shape: PeerShape, device: torch.device, compile: bool) -> nn.Module:
    """Megatron-Core is not compiled (it does not use torch.compile; its fusions are its
    kernels'), whatever `compile` says."""
    if device.type != "cuda":
        raise PeerUnavailable(
            "Megatron-Core runs on CUDA only (its rotary embedding and RNG tracker call torch.cuda)"
        )
    refuse_fp8_off_cuda("megatron-core", shape, device)
    te = _has_te()
    config_kw, model_kw = mcore_kwargs(shape, te)
    try:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs as specs
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as e:
        raise PeerUnavailable(
            f"megatron-core is not importable ({e}); scripts/fetch-peers.sh fetches its wheel"
        ) from e
    _parallel_state(device)
    activation = {"silu": F.silu, "gelu": F.gelu}[config_kw.pop("activation")]
    config = TransformerConfig(**config_kw, activation_func=activation)
    if te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = specs.get_gpt_layer_local_spec(normalization=config_kw["normalization"])
    model = GPTModel(config=config, transformer_layer_spec=spec, **model_kw)
    return _Logits(model.to(device))
