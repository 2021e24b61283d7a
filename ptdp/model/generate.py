"""Autoregressive sampling from a trained GPT (temperature, top-k, top-p).

With the KV cache (the default) the prompt is run once (prefill) and then each step
feeds only the newest token, its attention reading the cached keys and values of the
earlier positions. Once the text outgrows the model's context (`seq_length`), each step
recomputes the last `seq_length` tokens, as generation without the cache always does,
since every position then moves. The model may be a tensor-parallel one (built with
`tp=`): its logits are gathered over the group, and every rank draws the same tokens
when all pass generators seeded alike.
"""

from __future__ import annotations

import torch

from ptdp.model.gpt import GPT
from ptdp.model.kv_cache import KVCache


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
    use_cache: bool = True,
) -> torch.Tensor:
    """Extend tokens [b, t] by up to max_new_tokens; temperature 0 means greedy."""
    model.eval()
    cache = KVCache(model.cfg.seq_length) if use_cache else None
    for _ in range(max_new_tokens):
        logits = next_logits(model, tokens, cache)
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


def next_logits(model: GPT, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """fp32 logits [b, v] of the token after tokens [b, t], feeding the model only the
    tokens the cache lacks (all of them at first, then one per step)."""
    window = model.cfg.seq_length
    if cache is None or tokens.shape[1] > window:
        return model(tokens[:, -window:])[:, -1, :].float()
    return model(tokens[:, cache.length :], cache=cache)[:, -1, :].float()
