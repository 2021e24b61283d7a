"""Generation with the KV cache against recomputing the whole context at each step."""

from __future__ import annotations

import pytest
import torch

from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.model.generate import generate, next_logits
from ptdp.model.gpt import GPT
from ptdp.model.kv_cache import KVCache
from tests.helpers import LLAMA

MLA = {
    "attention": "mla", "q_lora_rank": 12, "kv_lora_rank": 10, "qk_nope_head_dim": 6,
    "qk_rope_head_dim": 4, "v_head_dim": 5, "num_query_groups": 0,
}  # fmt: skip
FAMILIES = [
    pytest.param({}, id="gpt2"),
    pytest.param(LLAMA, id="llama"),
    pytest.param({**LLAMA, "num_query_groups": 1}, id="mqa"),
    # A window shorter than the prefill and the chunk: the cache path must mask it too.
    pytest.param({**LLAMA, "sliding_window": 3}, id="mistral-window"),
    pytest.param({**LLAMA, "qkv_bias": True, "rope_scaling": "llama3"}, id="qwen2-llama3"),
    # Latent attention: the cache holds the normalised latent and the rotary key, and the
    # cached path absorbs the key/value up-projection (queries and values of two widths),
    # once with compressed queries under YaRN and once without (DeepSeek-V2-Lite).
    pytest.param({**LLAMA, **MLA, "rope_scaling": "yarn"}, id="mla-yarn"),
    pytest.param({**LLAMA, **MLA, "q_lora_rank": 0, "sliding_window": 3}, id="mla-lite-window"),
]


def model_cfg(**kw) -> ModelConfig:
    base = {"num_layers": 3, "hidden_size": 32, "num_heads": 4, "seq_length": 16, "vocab_size": 50}
    return apply_updates(RunConfig(), {"model": {**base, **kw}}, "test").model


@pytest.mark.parametrize("options", FAMILIES)
def test_cached_logits_equal_recomputed(options: dict) -> None:
    model = GPT(model_cfg(**options), seed=3).eval()
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    cache = KVCache(16)
    with torch.no_grad():
        # Prefill 5, then one token at a time, then a 3-token chunk (the masked path).
        for start, end in [(0, 5)] + [(t, t + 1) for t in range(5, 13)] + [(13, 16)]:
            cached = model(tokens[:, start:end], cache=cache)
            full = model(tokens[:, :end])[:, start:end]
            torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
            assert cache.length == end
        with pytest.raises(ValueError, match="holds 16 positions"):
            model(tokens[:, :1], cache=cache)


@pytest.mark.parametrize("options", FAMILIES)
def test_greedy_generation_with_cache_equals_without(options: dict) -> None:
    model = GPT(model_cfg(**options), seed=5)
    prompt = torch.randint(0, 50, (3, 4), generator=torch.Generator().manual_seed(1))
    # 20 new tokens outgrow the 16-token context: the cache covers the first 12 steps.
    plain = generate(model, prompt, 20, temperature=0, use_cache=False)
    cached = generate(model, prompt, 20, temperature=0)
    assert torch.equal(cached, plain)
    top1 = generate(model, prompt, 20, temperature=1.0, top_k=1, generator=torch.Generator())
    assert torch.equal(top1, plain)


def test_each_step_logits_match_and_cache_stays_small() -> None:
    model = GPT(model_cfg(**LLAMA), seed=2).eval()
    tokens = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(4))
    cache = KVCache(16)
    with torch.no_grad():
        for _ in range(13):
            cached = next_logits(model, tokens, cache)
            torch.testing.assert_close(cached, model(tokens)[:, -1], rtol=0, atol=1e-5)
            tokens = torch.cat([tokens, cached.argmax(-1, keepdim=True)], dim=1)
    # Grouped-query attention caches the 2 key/value groups, not the 4 query heads.
    cfg = model.cfg
    assert cache.nbytes() == cfg.num_layers * 2 * (2 * 2 * 16 * cfg.head_dim) * 4


def test_generation_leaves_multi_token_prediction_out() -> None:
    # Weights are initialised by name, so the model with two MTP depths has the same main
    # weights as the one without: it must generate the same tokens, the modules unused.
    plain = GPT(model_cfg(**{**LLAMA, **MLA}), seed=3)
    mtp = GPT(model_cfg(**{**LLAMA, **MLA, "mtp_depth": 2}), seed=3)
    assert sum("mtp." in name for name, _ in mtp.named_parameters()) > 0
    prompt = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(2))
    want = generate(plain, prompt, 8, temperature=0)
    assert torch.equal(generate(mtp, prompt, 8, temperature=0), want)
    assert torch.equal(generate(mtp, prompt, 8, temperature=0, use_cache=False), want)
