"""Autoregressive sampling from a trained GPT (temperature, top-k, top-p).

With the KV cache (the default) the prompt is run once (prefill) and then each step
feeds only the newest token, its attention reading the cached keys and values of the
earlier positions. Once the text outgrows the model's context (`seq_length`), each step
recomputes the last `seq_length` tokens, as generation without the cache always does,
since every position then moves. (`ptdp generate` cuts a prompt longer than the context
to its last `seq_length` tokens first, with a note: `ptdp.sample.fit_prompt`.) The model
may be a tensor-parallel one (built with `tp=`): its logits are gathered over the group,
and every rank draws the same tokens when all pass generators seeded alike.
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
        nxt = pick_next(logits, temperature, top_k, top_p, generator).to(tokens.device)
        tokens = torch.cat([tokens, nxt], dim=1)
        if stop_token is not None and bool((nxt == stop_token).all()):
            break
    return tokens


def pick_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The next token [b, 1] from fp32 logits [b, v]: the argmax at temperature 0, else a
    draw from the filtered distribution (on the CPU, so a CPU generator drives it)."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True)
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator)


def step_input(
    tokens: torch.Tensor, window: int, cache: KVCache | None
) -> tuple[torch.Tensor, KVCache | None]:
    """What the model reads this step and with which cache: only the tokens the cache lacks
    (all of them at first, then one), or, without a cache or once the text outgrows the
    context `window`, the last `window` tokens recomputed without one."""
    if cache is None or tokens.shape[1] > window:
        return tokens[:, -window:], None
    return tokens[:, cache.length :], cache


def next_logits(model: GPT, tokens: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """fp32 logits [b, v] of the token after tokens [b, t]."""
    inputs, cache = step_input(tokens, model.cfg.seq_length, cache)
    return model(inputs, cache=cache)[:, -1, :].float()
