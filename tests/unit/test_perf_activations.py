"""Activation memory: Korthikanti et al.'s formula, and what our layer really saves.

Shapes of the measured layer: s = 32, b = 2, h = 64, a = 4 heads (d = 16), f = 4h.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ptdp.config.enums import Recompute
from ptdp.config.sections import ModelConfig
from ptdp.model.gpt import GPT, TPContext, TransformerLayer
from ptdp.perf.cost.activations import (
    Kernels,
    activation_bytes_per_layer,
    paper_terms,
    ptdp_terms,
    record_saved_tensors,
)

# The paper's 22B configuration (Table 3): s = 2048, b = 4, h = 6144, a = 64, t = 8.
P22 = {"seq": 2048, "micro_batch": 4, "hidden": 6144, "heads": 64}
SBH = 2048 * 4 * 6144  # 50_331_648


@pytest.mark.parametrize(
    "tp,sp,recompute,expected",
    [
        # s b h (34 + 5 a s / h) = 34 sbh + 5 a s^2 b
        (1, False, "none", 34 * SBH + 5 * 64 * 2048**2 * 4),
        # s b h (10 + 24/t + 5 a s / (h t))
        (8, False, "none", 10 * SBH + 24 * SBH // 8 + 5 * 64 * 2048**2 * 4 // 8),
        # s b h (34/t + 5 a s / (h t))
        (8, True, "none", 34 * SBH // 8 + 5 * 64 * 2048**2 * 4 // 8),
        # s b h (10 + 24/t)
        (8, False, "selective", 10 * SBH + 24 * SBH // 8),
        # s b h 34/t
        (8, True, "selective", 34 * SBH // 8),
        # 2 s b h
        (8, False, "full", 2 * SBH),
        (1, False, "full", 2 * SBH),
    ],
)
def test_formula_is_the_papers_table(tp: int, sp: bool, recompute: str, expected: int) -> None:
    got = activation_bytes_per_layer(**P22, tp=tp, sequence_parallel=sp, recompute=recompute)
    assert got == expected


def test_formula_hand_values() -> None:
    """The same rows written out as numbers (computed by hand from the table)."""
    rows = {
        (1, False, "none"): 7_079_985_152,
        (8, False, "none"): 1_325_400_064,
        (8, True, "none"): 884_998_144,
        (8, False, "selective"): 654_311_424,
        (8, True, "selective"): 213_909_504,
        (8, False, "full"): 100_663_296,
    }
    for (tp, sp, mode), value in rows.items():
        assert activation_bytes_per_layer(**P22, tp=tp, sequence_parallel=sp, recompute=mode) == (
            value
        )


def test_components_are_the_papers() -> None:
    """Attention 11sbh + 5as^2b, MLP 19sbh, layer norms 4sbh (16-bit, t = 1)."""
    terms = {t.key: t.bytes for t in paper_terms(**P22)}
    attention = ("qkv_input", "qkv", "proj_input", "attn_mask")
    scores = ("softmax", "score_mask", "score_dropout")
    assert sum(terms[k] for k in attention) == 11 * SBH
    assert sum(terms[k] for k in scores) == 5 * 64 * 2048**2 * 4
    assert sum(terms[k] for k in ("fc1_input", "gelu_input", "fc2_input", "mlp_mask")) == 19 * SBH
    assert terms["norm_inputs"] == 4 * SBH


@pytest.mark.parametrize("heads,hidden,saving", [(96, 12288, 0.70), (128, 20480, 0.65)])
def test_selective_saves_70_and_65_percent(heads: int, hidden: int, saving: float) -> None:
    """GPT-3 (5as/h = 80) and MT-NLG (64): selective saves 70% and 65% (Section 5)."""
    shape = {"seq": 2048, "micro_batch": 1, "hidden": hidden, "heads": heads, "tp": 8}
    none = activation_bytes_per_layer(**shape, sequence_parallel=True)
    selective = activation_bytes_per_layer(**shape, sequence_parallel=True, recompute="selective")
    assert round(1 - selective / none, 2) == saving


def test_generalised_formula() -> None:
    s, b, h, a = 128, 2, 64, 4
    sbh, scores = s * b * h, a * s * s * b
    shape = {"seq": s, "micro_batch": b, "hidden": h, "heads": a}
    # fp32 activations, masks still one byte: 2 x (34 - 2) + 2 for the sbh terms.
    fp32 = activation_bytes_per_layer(**shape, bytes_per_element=4)
    assert fp32 == 66 * sbh + 9 * scores
    # No dropout: no masks, and the softmax output is the only s x s tensor.
    assert activation_bytes_per_layer(**shape, dropout=False) == 32 * sbh + 2 * scores
    # A 2h MLP: the two inner tensors halve (8 + 8 -> 4 + 4 bytes per sbh).
    assert activation_bytes_per_layer(**shape, ffn_hidden=2 * h) == 26 * sbh + 5 * scores
    # The enum works as well as its value; full recompute under SP keeps the input slice.
    enum = activation_bytes_per_layer(**shape, recompute=Recompute.SELECTIVE)
    assert enum == activation_bytes_per_layer(**shape, recompute="selective") == 34 * sbh
    assert activation_bytes_per_layer(**shape, tp=4, sequence_parallel=True, recompute="full") == (
        2 * sbh / 4
    )
    with pytest.raises(ValueError):
        activation_bytes_per_layer(**shape, recompute="some")


# --------------------------------------------------------------------------- measured

S, B, H, A = 32, 2, 64, 4


def _measure(mode: str, *, dtype: torch.dtype, dropout: bool, math: bool) -> tuple[list, int]:
    """Saved tensors of one training-mode layer; backward runs under the same SDPA backend
    (a recomputation must pick the kernel the forward used)."""
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=H, num_heads=A, seq_length=S, dropout=0.1 if dropout else 0.0)
    layer = TransformerLayer(cfg, TPContext(), Recompute(mode)).to(dtype).train()
    x = torch.randn(S, B, H, dtype=dtype, requires_grad=True)
    backend = sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()
    with backend, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out, records = record_saved_tensors(layer, x)
        out.float().sum().backward()
    assert x.grad is not None
    return records, sum(r.nbytes for r in records)


def test_full_recompute_stores_only_the_layer_input() -> None:
    records, total = _measure("full", dtype=torch.float32, dropout=True, math=False)
    assert [(r.where, r.shape, r.dtype) for r in records] == [
        ("(checkpoint input)", (S, B, H), "float32")
    ]
    assert total == S * B * H * 4


def test_selective_drops_exactly_the_attention_core() -> None:
    none, none_bytes = _measure("none", dtype=torch.float32, dropout=True, math=True)
    sel, sel_bytes = _measure("selective", dtype=torch.float32, dropout=True, math=True)
    scores = A * S * S * B
    # At least the paper's 5as^2b term (at 4-byte activations, 1-byte masks) goes ...
    assert none_bytes - sel_bytes >= (4 + 1 + 4) * scores
    # ... and exactly the math kernel's saved tensors: scaled q, k and three s x s tensors
    # (the QKV output it kept through v is kept by the checkpoint's q, k, v instead).
    assert none_bytes - sel_bytes == 2 * S * B * H * 4 + 3 * scores * 4
    assert not any(r.shape[-2:] == (S, S) for r in sel)  # no s x s tensor is left
    outside = [r for r in none if r.where != "attn"]
    kept = [r for r in sel if r.where != "attn (checkpoint input)"]
    assert outside == kept  # everything outside the core is saved as before


CASES = [
    pytest.param(dtype, dropout, math, id=f"{name}-{'drop' if dropout else 'nodrop'}-{kernel}")
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
    for dropout, math, kernel in (
        (True, True, "math"),
        (False, True, "math"),
        (False, False, "fused"),
    )
]


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("dtype,dropout,math", CASES)
def test_measured_bytes_match_our_model(mode: str, dtype: torch.dtype, dropout: bool, math: bool):
    """The corrected formula (`ptdp_terms`) is exact: tolerance 0 bytes."""
    _, measured = _measure(mode, dtype=dtype, dropout=dropout, math=math)
    e = dtype.itemsize
    terms = ptdp_terms(
        seq=S,
        micro_batch=B,
        hidden=H,
        heads=A,
        kernels=Kernels.cpu(e, fused_attention=not math),
        recompute=mode,
        bytes_per_element=e,
        dropout=dropout,
    )
    assert measured == sum(t.bytes for t in terms)


def test_weights_and_their_copies_are_not_activations() -> None:
    linear = nn.Linear(8, 16)
    x = torch.randn(4, 8)
    _, records = record_saved_tensors(linear, x)
    assert sum(r.nbytes for r in records) == 4 * 8 * 4  # only the input
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 copies of fp32 weights
        _, records = record_saved_tensors(linear, x)
    assert sum(r.nbytes for r in records) == 4 * 8 * 2  # only the bf16 input copy


@pytest.mark.parametrize("mode", [Recompute.SELECTIVE, Recompute.FULL])
def test_recompute_replays_dropout_masks(mode: Recompute) -> None:
    """With dropout, recomputation must redraw the same masks: same loss, same gradients."""
    shape = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16}
    cfg = ModelConfig(**shape, vocab_size=50, dropout=0.2)
    tokens = torch.randint(0, 50, (2, 17))
    results = []
    for recompute in (Recompute.NONE, mode):
        model = GPT(cfg, recompute=recompute).train()
        torch.manual_seed(5)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
