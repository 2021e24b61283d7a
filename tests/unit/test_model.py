"""The reference GPT: layout-independent init, causality, attention math, options."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from ptdp.config.enums import Recompute
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.model.generate import filter_logits, generate
from ptdp.model.gpt import GPT, Rotary, count_parameters
from ptdp.model.rope import inverse_frequencies, llama3_scaled, yarn_attention_factor
from ptdp.perf.cost.flops import paper_parameter_count
from tests.helpers import LLAMA


def model_cfg(**kw) -> ModelConfig:
    base = {"num_layers": 3, "hidden_size": 32, "num_heads": 4, "seq_length": 16, "vocab_size": 50}
    return apply_updates(RunConfig(), {"model": {**base, **kw}}, "test").model


MISTRAL = {**LLAMA, "sliding_window": 5}  # shorter than the 16-token sequence
QWEN2 = {**LLAMA, "qkv_bias": True, "rope_theta": 1e6}
FAMILIES = [
    pytest.param({}, id="gpt2"),
    pytest.param(LLAMA, id="llama"),
    pytest.param(MISTRAL, id="mistral"),
    pytest.param(QWEN2, id="qwen2"),
]


@pytest.mark.parametrize("options", FAMILIES)
def test_init_does_not_depend_on_layout(options: dict) -> None:
    cfg = model_cfg(**options)
    full = GPT(cfg, seed=7)
    middle = GPT(cfg, seed=7, layers=range(1, 2), has_embedding=False, has_head=False)
    full_params = dict(full.named_parameters())
    for name, param in middle.named_parameters():
        assert torch.equal(param, full_params[name]), name
    assert all(n.startswith("layers.1.") for n, _ in middle.named_parameters())
    other = GPT(cfg, seed=8)
    assert not torch.equal(other.layers["0"].attn.qkv.weight, full.layers["0"].attn.qkv.weight)


def test_residual_projections_are_scaled() -> None:
    cfg = model_cfg(num_layers=8, hidden_size=64, ffn_hidden_size=1024)
    model = GPT(cfg)
    std_fc1 = model.layers["0"].mlp.fc1.weight.std().item()
    std_fc2 = model.layers["0"].mlp.fc2.weight.std().item()
    assert std_fc1 == pytest.approx(0.02, rel=0.05)
    assert std_fc2 == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


@pytest.mark.parametrize("options", FAMILIES)
def test_causal(options: dict) -> None:
    model = GPT(model_cfg(**options))
    tokens = torch.randint(0, 50, (2, 16))
    changed = tokens.clone()
    changed[:, 9:] = (changed[:, 9:] + 1) % 50
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :9], b[:, :9], rtol=0, atol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def naive_attention(attn, x: torch.Tensor, rotary: Rotary | None) -> torch.Tensor:
    """Per-head loops, explicit mask: an independent statement of the attention math."""
    s, b, h = x.shape
    n, g, d = attn.num_heads, attn.groups, attn.head_dim
    qkv = x @ attn.qkv.weight.t() + (attn.qkv.bias if attn.qkv.bias is not None else 0)
    per_group = qkv.view(s, b, g, n // g + 2, d)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    mask = (j <= i) & ((i - j < attn.window) if attn.window else True)
    heads = []
    for head in range(n):
        group, slot = divmod(head, n // g)
        q = per_group[:, :, group, slot].transpose(0, 1)  # [b, s, d]
        k = per_group[:, :, group, -2].transpose(0, 1)
        v = per_group[:, :, group, -1].transpose(0, 1)
        if rotary is not None:
            q, k = rotary(q[:, None])[:, 0], rotary(k[:, None])[:, 0]
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v)  # [b, s, d]
    out = torch.cat(heads, dim=-1).transpose(0, 1)  # [s, b, h]
    return attn.proj(out)


@pytest.mark.parametrize("options", FAMILIES + [pytest.param({"num_query_groups": 1}, id="mqa")])
def test_attention_matches_naive(options: dict) -> None:
    cfg = model_cfg(**options)
    model = GPT(cfg)
    x = torch.randn(16, 3, 32)
    layer = model.layers["0"]
    torch.testing.assert_close(
        layer.attn(x, model.rotary),
        naive_attention(layer.attn, x, model.rotary),
        rtol=1e-5,
        atol=1e-6,
    )


def test_sliding_window_limits_what_each_position_reads() -> None:
    # Each layer reaches 4 positions further back: after 3 layers, position p reads
    # p - 12 .. p, so changing token 2 leaves positions >= 15 alone and changes 14.
    model = GPT(model_cfg(**MISTRAL))
    tokens = torch.randint(0, 50, (2, 16))
    changed = tokens.clone()
    changed[:, 2] = (changed[:, 2] + 1) % 50
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, 15:], b[:, 15:], rtol=0, atol=0)
    assert not torch.allclose(a[:, 2:15], b[:, 2:15])
    assert not torch.allclose(a[:, 14], b[:, 14])  # exactly 3 x (5 - 1) = 12 positions back
    # A window as long as the sequence is plain causal attention.
    full = GPT(model_cfg(**LLAMA))
    long = GPT(model_cfg(**{**LLAMA, "sliding_window": 16}))
    torch.testing.assert_close(full(tokens), long(tokens), rtol=0, atol=0)


def test_llama3_rope_scaling_bands() -> None:
    plain = model_cfg(**LLAMA, rope_theta=500.0, num_heads=2)  # head size 16: 8 frequencies
    cfg = apply_updates(
        RunConfig(model=plain),
        {"model": {"rope_scaling": "llama3", "rope_original_max_positions": 64}},
        "test",
    ).model
    w, scaled = inverse_frequencies(plain), inverse_frequencies(cfg)
    wavelength = 2 * math.pi / w
    high, low = wavelength < 64 / 4, wavelength > 64 / 1
    assert high.any() and low.any() and (~high & ~low).any()  # every band is exercised
    torch.testing.assert_close(scaled[high], w[high], rtol=0, atol=0)
    torch.testing.assert_close(scaled[low], w[low] / 8, rtol=1e-12, atol=0)
    mid = ~high & ~low
    assert ((scaled[mid] < w[mid]) & (scaled[mid] > w[mid] / 8)).all()
    # Continuous at both edges of the band: no jump in frequency.
    edges = torch.tensor([2 * math.pi / 16, 2 * math.pi / 64], dtype=torch.float64)
    s = llama3_scaled(edges, factor=8, low_freq_factor=1, high_freq_factor=4, original_positions=64)
    torch.testing.assert_close(s, torch.stack([edges[0], edges[1] / 8]), rtol=1e-12, atol=0)
    a, b = GPT(plain, seed=1), GPT(cfg, seed=1)
    tokens = torch.randint(0, 50, (1, 16))
    assert not torch.allclose(a(tokens), b(tokens))  # the scaled rotation reaches the logits


def test_yarn_rope_scaling_ramp_and_attention_factor() -> None:
    """Head size 16, theta 500, original context 64: pairs turning over 4 times in 64
    positions are kept, under once are slowed by the factor, a linear ramp in the pair
    index between; the tables are scaled by 0.1 ln(factor) + 1 (or the mscale ratio)."""
    plain = model_cfg(**LLAMA, rope_theta=500.0, num_heads=2)
    yarn = {"rope_scaling": "yarn", "rope_original_max_positions": 64, "rope_scaling_factor": 4.0}
    yarn |= {"rope_beta_fast": 4.0}
    cfg = apply_updates(RunConfig(model=plain), {"model": yarn}, "test").model
    w, scaled = inverse_frequencies(plain), inverse_frequencies(cfg)
    turns = 64 * w / (2 * math.pi)
    fast, slow = turns > 4, turns < 1
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    torch.testing.assert_close(scaled[fast], w[fast], rtol=0, atol=0)
    torch.testing.assert_close(scaled[slow], w[slow] / 4, rtol=1e-12, atol=0)
    mid = ~fast & ~slow
    assert ((scaled[mid] <= w[mid]) & (scaled[mid] >= w[mid] / 4)).all()
    assert yarn_attention_factor(plain) == 1.0
    assert yarn_attention_factor(cfg) == pytest.approx(0.1 * math.log(4) + 1)
    both = replace(cfg, rope_mscale=1.0, rope_mscale_all_dim=1.0)
    assert yarn_attention_factor(both) == 1.0  # DeepSeek-V3's: the scale goes to softmax
    table = Rotary.from_config(cfg)
    torch.testing.assert_close(
        table.cos.square() + table.sin.square(),
        torch.full_like(table.cos, yarn_attention_factor(cfg) ** 2),
    )


def test_rotary_is_relative() -> None:
    rot = Rotary(8, 32, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(m: int, n: int) -> float:
        qs = q.expand(1, 1, 32, 8)
        ks = k.expand(1, 1, 32, 8)
        return float(rot(qs)[0, 0, m] @ rot(ks)[0, 0, n])

    assert score(10, 7) == pytest.approx(score(5, 2), rel=1e-5)
    assert score(10, 7) != pytest.approx(score(10, 2), rel=1e-3)


@pytest.mark.parametrize("options", FAMILIES)
@pytest.mark.parametrize("mode", [Recompute.SELECTIVE, Recompute.FULL])
def test_recompute_gives_same_gradients(options: dict, mode: Recompute) -> None:
    cfg = model_cfg(**options)
    tokens = torch.randint(0, 50, (2, 17))
    grads = []
    for recompute in (Recompute.NONE, mode):
        model = GPT(cfg, recompute=recompute)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_parameter_count_matches_paper_equation_2() -> None:
    cfg = model_cfg(num_layers=4, hidden_size=64, num_heads=4, seq_length=32, vocab_size=100)
    # Equation (2) counts everything but the final norm's 2h parameters.
    assert count_parameters(GPT(cfg)) == round(paper_parameter_count(4, 64, 100, 32)) + 2 * 64


def test_llama_options_change_the_structure() -> None:
    cfg = model_cfg(**LLAMA)
    model = GPT(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert "output.weight" in names and "position.weight" not in names
    assert not any(n.endswith("bias") for n in names)
    assert model.layers["0"].attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)  # 4 q + 2x(k, v)
    assert model.layers["0"].mlp.fc1.weight.shape == (2 * cfg.ffn_size, 32)
    assert cfg.ffn_size == 128  # 8h/3 = 85, rounded up to a multiple of 64
    tied = GPT(model_cfg())
    assert tied.output_weight() is tied.embedding.weight


def test_qkv_bias_is_the_only_bias() -> None:
    model = GPT(model_cfg(**QWEN2))
    biases = {n for n, _ in model.named_parameters() if n.endswith("bias")}
    assert biases == {f"layers.{i}.attn.qkv.bias" for i in range(3)}


def test_filter_logits() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[True, False, False, True]]
    probs = logits.softmax(-1)[0]  # 0.032, 0.644, 0.237, 0.087
    kept = ~torch.isinf(filter_logits(logits, top_p=0.7))
    assert kept.tolist() == [[False, True, True, False]]
    assert probs[1] < 0.7 < probs[1] + probs[2]


def test_generate_greedy_is_deterministic() -> None:
    model = GPT(model_cfg())
    start = torch.tensor([[1, 2, 3]])
    a = generate(model, start, 20, temperature=0)
    b = generate(model, start, 20, temperature=0)
    assert a.shape == (1, 23) and torch.equal(a, b) and torch.equal(a[:, :3], start)


@pytest.mark.parametrize("options", FAMILIES)
@pytest.mark.parametrize("mode", [Recompute.NONE, Recompute.FULL])
def test_stage_output_storage_can_be_freed_before_backward(options: dict, mode: Recompute):
    """The pipeline runtime frees a sent stage output's storage and later runs backward
    from it: the backward must not need the output's values."""
    cfg = model_cfg(**options)
    tokens = torch.randint(0, 50, (2, 16))
    grad = torch.randn(16, 2, 32)
    results = []
    for free in (False, True):
        chunk = GPT(cfg, recompute=mode, layers=range(0, 2), has_head=False)
        out = chunk(tokens)
        if free:
            out.untyped_storage().resize_(0)
        torch.autograd.backward(out, grad)
        results.append([p.grad.clone() for p in chunk.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
