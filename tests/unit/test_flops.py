"""FLOPs and parameter formulas against the paper (arXiv 2104.04473, eqs. 2 and 3)."""

from __future__ import annotations

import pytest

from ptdp.config import Recompute, RunConfig, apply_updates
from ptdp.perf.flops import (
    flops_per_iteration,
    flops_per_token,
    paper_equation_3,
    paper_parameter_count,
)

# Table 1 of the paper: (params in billions, heads, hidden, layers).
TABLE_1 = [
    (1.7, 24, 2304, 24),
    (3.6, 32, 3072, 30),
    (7.5, 32, 4096, 36),
    (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48),
    (76.1, 80, 10240, 60),
    (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96),
    (529.6, 128, 20480, 105),
    (1008.0, 160, 25600, 128),
]


def gpt(heads: int, hidden: int, layers: int, **kw) -> RunConfig:
    model = {
        "num_heads": heads,
        "hidden_size": hidden,
        "num_layers": layers,
        "seq_length": 2048,
        "vocab_size": 51200,
        **kw,
    }
    return apply_updates(RunConfig(), {"model": model}, "test")


@pytest.mark.parametrize(("params", "heads", "hidden", "layers"), TABLE_1)
def test_equation_2_reproduces_table_1(params: float, heads: int, hidden: int, layers: int):
    assert paper_parameter_count(layers, hidden, 51200, 2048) / 1e9 == pytest.approx(
        params, abs=0.1
    )


@pytest.mark.parametrize(("params", "heads", "hidden", "layers"), TABLE_1)
def test_generic_count_equals_equation_3_with_recompute(params, heads, hidden, layers):
    cfg = gpt(heads, hidden, layers).model
    ours = flops_per_iteration(cfg, 1536, Recompute.FULL)
    assert ours == pytest.approx(paper_equation_3(1536, 2048, layers, hidden, 51200), rel=1e-12)


def test_model_flops_without_recompute_is_the_72_form() -> None:
    b, s, l, h, v = 8, 2048, 24, 2304, 51200
    cfg = gpt(24, h, l).model
    expected = 72 * b * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    assert flops_per_iteration(cfg, b) == pytest.approx(expected, rel=1e-12)


def test_hand_computed_small_model() -> None:
    # h=4, s=2, one layer, V=10, f=16: qkv 2*4*12=96, proj 32, mlp 4*4*16=256, core 4*2*4=32.
    cfg = apply_updates(
        RunConfig(),
        {
            "model": {
                "num_layers": 1,
                "hidden_size": 4,
                "num_heads": 1,
                "seq_length": 2,
                "vocab_size": 10,
            }
        },
        "t",
    ).model
    forward_layer = 96 + 32 + 256 + 32
    assert flops_per_token(cfg) == 3 * forward_layer + 3 * 2 * 4 * 10
    assert flops_per_token(cfg, Recompute.SELECTIVE) == flops_per_token(cfg) + 32
    assert flops_per_token(cfg, Recompute.FULL) == flops_per_token(cfg) + forward_layer


def test_gqa_and_swiglu_terms() -> None:
    base = gpt(32, 4096, 32).model
    gqa = gpt(32, 4096, 32, num_query_groups=8).model
    swiglu = gpt(32, 4096, 32, activation="swiglu", ffn_hidden_size=11008).model
    h = 4096
    # K and V shrink from h to h/4 columns each: 2 * h * (2h - 2h/4) fewer FLOPs per token.
    assert flops_per_token(base) - flops_per_token(gqa) == pytest.approx(
        3 * 32 * 2 * h * (2 * h - 2 * h / 4)
    )
    assert flops_per_token(swiglu) - flops_per_token(base) == pytest.approx(
        3 * 32 * (6 * h * 11008 - 4 * h * 4 * h)
    )


def test_readme_gpt3_example_iteration_time() -> None:
    # GPT-3 175B on 1024 A100s, batch 1536, ~138 TFLOP/s per GPU -> about 32 s per iteration.
    cfg = gpt(96, 12288, 96).model
    seconds = flops_per_iteration(cfg, 1536, Recompute.FULL) / (1024 * 138e12)
    assert seconds == pytest.approx(32, abs=1.0)
