"""Autoregressive sampling from a trained GPT (temperature, top-k, top-p).

Recomputes the (cropped) context at each step; a KV cache comes with parallel
generation later. Good enough to see what a small model has learned.
"""

from __future__ import annotations

import torch

from ptdp.model.gpt import GPT


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits [b, v] outside the top-k set and outside the top-p nucleus with -inf."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (always keep the first).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate(
    model: GPT,
    tokens: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_token: int | None = None,
) -> torch.Tensor:
    """Extend tokens [b, t] by up to max_new_tokens; temperature 0 means greedy."""
    model.eval()
    window = model.cfg.seq_length
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -window:])[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = filter_logits(logits / temperature, top_k, top_p)
            probs = logits.softmax(-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(tokens.device)
        tokens = torch.cat([tokens, nxt], dim=1)
        if stop_token is not None and bool((nxt == stop_token).all()):
            break
    return tokens
