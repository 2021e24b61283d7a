"""Multi-head latent attention (`ptdp.model.latent_attention`) against a reference written
head by head and token by token from DeepSeek-V2's equations (arXiv 2405.04434, section
2.1.2-2.1.3): outputs and the gradients of the input and of every weight, with and without
the queries' latent, with plain rotary positions and with YaRN's softmax scale."""

from __future__ import annotations

import math

import pytest
import torch

from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.model.latent_attention import LATENT_NORM_EPS, LatentAttention
from ptdp.model.parts import TPContext
from ptdp.model.rope import Rotary, inverse_frequencies

HEADS, NOPE, ROPE, VALUE, LATENT, HIDDEN, SEQ = 3, 4, 6, 5, 7, 16, 5


def _model(**keys: object) -> ModelConfig:
    model = {
        "num_layers": 1, "hidden_size": HIDDEN, "num_heads": HEADS, "seq_length": SEQ,
        "vocab_size": 32, "position_embedding": "rope", "normalization": "rmsnorm",
        "activation": "swiglu", "bias": False, "dropout": 0.0, "attention": "mla",
        "kv_lora_rank": LATENT, "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE, "v_head_dim": VALUE, "rope_theta": 100.0,
    } | keys  # fmt: skip
    return apply_updates(RunConfig(), {"model": model}, "test").model


def _rms(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean() + LATENT_NORM_EPS) * gain


def _rotate(x: torch.Tensor, position: int, freq: torch.Tensor, factor: float) -> torch.Tensor:
    """RoPE on one vector of r features: feature k and k + r/2 turned by position * freq[k]
    (ptdp's layout of the pairs; the importer permutes DeepSeek's interleaved ones)."""
    half = x.shape[0] // 2
    out = torch.empty_like(x)
    for k in range(half):
        c, s = math.cos(position * freq[k]), math.sin(position * freq[k])
        out[k] = x[k] * c - x[k + half] * s
        out[k + half] = x[k + half] * c + x[k] * s
    return out * factor


def _reference(
    x: torch.Tensor, w: dict[str, torch.Tensor], cfg: ModelConfig, scale: float, factor: float
) -> torch.Tensor:
    """u_t = W_O [o_t,1; ...; o_t,n] for each token t of x [s, h] (one sequence), head i's
    o_t,i = sum_j<=t softmax_j(q_t,i . k_j,i * scale) v_j,i with

        c_Q = RMSNorm(W_DQ h_t)              (h_t itself when q_lora_rank = 0)
        [q^C_t,i; q^R_t,i] = W_UQ,i c_Q      q^R rotated by t
        [c_KV; k^R_t] = W_DKV h_t            k^R rotated by t, the same for every head
        [k^C_t,i; v_t,i] = W_UKV,i RMSNorm(c_KV)
        q_t,i = [q^C; q^R],  k_t,i = [k^C; k^R]
    """
    freq = inverse_frequencies(cfg).tolist()
    p, r, dv = NOPE, ROPE, VALUE
    queries, keys, values = [], [], []
    for t in range(x.shape[0]):
        h = x[t]
        c_q = _rms(w["q_down"] @ h, w["q_norm"]) if "q_down" in w else h
        down = w["kv_down"] @ h
        c_kv, k_rope = _rms(down[:LATENT], w["kv_norm"]), _rotate(down[LATENT:], t, freq, factor)
        q_t, k_t, v_t = [], [], []
        for i in range(HEADS):
            q = w["q_up"][i * (p + r) : (i + 1) * (p + r)] @ c_q
            q_t.append(torch.cat([q[:p], _rotate(q[p:], t, freq, factor)]))
            kv = w["kv_up"][i * (p + dv) : (i + 1) * (p + dv)] @ c_kv
            k_t.append(torch.cat([kv[:p], k_rope]))
            v_t.append(kv[p:])
        queries.append(q_t)
        keys.append(k_t)
        values.append(v_t)
    out = []
    for t in range(x.shape[0]):
        heads = []
        for i in range(HEADS):
            logits = torch.stack([queries[t][i] @ keys[j][i] * scale for j in range(t + 1)])
            weights = torch.softmax(logits, 0)
            heads.append(sum(weights[j] * values[j][i] for j in range(t + 1)))
        out.append(w["proj"] @ torch.cat(heads))
    return torch.stack(out)


CASES = {
    "q-latent": ({"q_lora_rank": 8}, 1 / math.sqrt(NOPE + ROPE), 1.0),
    "no-q-latent": ({"q_lora_rank": 0}, 1 / math.sqrt(NOPE + ROPE), 1.0),
    # YaRN with mscale = mscale_all_dim = 1: the rotated features unscaled, the softmax
    # scale times m^2 = (0.1 ln 40 + 1)^2, as DeepSeek-V3 publishes it.
    "yarn": (
        {"q_lora_rank": 8, "rope_scaling": "yarn", "rope_scaling_factor": 40.0}
        | {"rope_original_max_positions": 4, "rope_mscale": 1.0, "rope_mscale_all_dim": 1.0},
        (0.1 * math.log(40.0) + 1) ** 2 / math.sqrt(NOPE + ROPE),
        1.0,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_latent_attention_is_the_papers_equations(case: str) -> None:
    keys, scale, factor = CASES[case]
    cfg = _model(**keys)
    torch.manual_seed(0)
    layer = LatentAttention(cfg, TPContext(), recompute_core=False).double()
    for weight in layer.parameters():  # norms' gains away from 1, so they are tested
        torch.nn.init.normal_(weight, 0.0, 0.4)
    rotary = Rotary.from_config(cfg).double()
    x = torch.randn(SEQ, 2, HIDDEN, dtype=torch.float64, requires_grad=True)
    out = layer(x, rotary)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert (layer.q_down is None) == (cfg.q_lora_rank == 0)

    names = ("q_down", "q_norm", "q_up", "kv_down", "kv_norm", "kv_up", "proj")
    mine = {n: getattr(layer, n).weight for n in names if getattr(layer, n) is not None}
    theirs = {n: w.detach().clone().requires_grad_() for n, w in mine.items()}
    x_ref = x.detach().clone().requires_grad_()
    close = {"rtol": 1e-6, "atol": 1e-7}  # float64 but for ptdp's fp32 cos/sin tables
    for b in range(2):  # each sequence of the batch on its own
        ref = _reference(x_ref[:, b], theirs, cfg, scale, factor)
        torch.testing.assert_close(out[:, b].detach(), ref.detach(), **close)
        ref.backward(grad[:, b])
    torch.testing.assert_close(x.grad, x_ref.grad, **close)
    for name, weight in mine.items():
        torch.testing.assert_close(weight.grad, theirs[name].grad, **close, msg=name)
