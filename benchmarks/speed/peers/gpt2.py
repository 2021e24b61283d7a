"""The GPT-2 peers: Hugging Face `GPT2LMHeadModel` (SDPA attention) and a GPT written here in
plain PyTorch, both compiled whole when asked, as nanoGPT does. GPT-2 only, bf16 only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import PeerShape, PeerUnavailable


def _check(name: str, shape: PeerShape) -> None:
    if shape.arch != "gpt":
        raise PeerUnavailable(f"{name} is a GPT-2 (learned positions, LayerNorm, GELU) only")
    if shape.fp8_recipe is not None:
        raise PeerUnavailable(f"{name} has no fp8 training (a hand-written bf16 loop)")


class _Block(nn.Module):
    """Pre-norm GPT-2 block in plain PyTorch (the hand-written peer)."""

    def __init__(self, h: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.out = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.up, self.down = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2 (learned positions, tied output layer), returns logits [b, s, v]."""

    def __init__(self, shape: PeerShape) -> None:
        super().__init__()
        h = shape.hidden
        self.tokens, self.positions = nn.Embedding(shape.vocab, h), nn.Embedding(shape.seq, h)
        self.blocks = nn.ModuleList(_Block(h, shape.heads, shape.ffn) for _ in range(shape.layers))
        self.ln = nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.tokens.weight)


class _Logits(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=idx).logits


def build_plain_gpt(shape: PeerShape, device: torch.device, compile: bool) -> nn.Module:
    _check("plain-gpt", shape)
    model = PlainGPT(shape).to(device)
    return torch.compile(model) if compile else model


def build_hf_gpt2(shape: PeerShape, device: torch.device, compile: bool) -> nn.Module:
    _check("hf-gpt2", shape)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:
        raise PeerUnavailable(
            f"transformers is not installed ({e}): pip install transformers"
        ) from e
    config = GPT2Config(
        vocab_size=shape.vocab,
        n_positions=shape.seq,
        n_embd=shape.hidden,
        n_layer=shape.layers,
        n_head=shape.heads,
        n_inner=shape.ffn,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=shape.vocab - 1,
        eos_token_id=shape.vocab - 1,
    )
    config._attn_implementation = "sdpa"
    model = _Logits(GPT2LMHeadModel(config)).to(device)
    return torch.compile(model) if compile else model
