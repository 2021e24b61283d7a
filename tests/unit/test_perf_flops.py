"""ptdp/perf/cost/flops.py: the FLOPs and parameter formulas against the paper (arXiv 2104.04473,
equations 2 and 3), MFU/HFU, the dense peak table and equation (4) (section 5.1)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ptdp.config.enums import Recompute
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.model.gpt import GPT, count_parameters
from ptdp.perf.cost.flops import (
    DENSE_PEAK_TFLOPS,
    dense_peak_flops,
    device_kind,
    flops_per_iteration,
    flops_per_token,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    paper_equation_3,
    paper_equation_4,
    paper_parameter_count,
    utilisation,
)
from ptdp.perf.cost.parameters import parameters_per_rank
from ptdp.perf.validate.paper import TABLE_1, preset

DAY = 86400

# Table 1 of the paper: (params in billions, heads, hidden, layers).
TABLE_1_SIZES = [
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


@pytest.mark.parametrize(("params", "heads", "hidden", "layers"), TABLE_1_SIZES)
def test_equation_2_reproduces_table_1(params: float, heads: int, hidden: int, layers: int):
    assert paper_parameter_count(layers, hidden, 51200, 2048) / 1e9 == pytest.approx(
        params, abs=0.1
    )


@pytest.mark.parametrize(("params", "heads", "hidden", "layers"), TABLE_1_SIZES)
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


def test_dense_peaks_are_the_datasheet_dense_figures() -> None:
    assert dense_peak_flops("a100", "bf16") == 312e12
    assert dense_peak_flops("h100-sxm", "bf16") == 989e12
    assert dense_peak_flops("h200", "fp16") == 989e12
    assert dense_peak_flops("a100", "fp32") == 19.5e12
    # Never the 2:4-sparse figure, which is twice the dense one (A100 624, H100 1979).
    assert all(t["bf16"] < 2000 or kind == "b200" for kind, t in DENSE_PEAK_TFLOPS.items())
    with pytest.raises(KeyError, match="v100"):
        dense_peak_flops("v100", "bf16")  # V100 has no bf16 tensor cores
    with pytest.raises(KeyError, match="known"):
        dense_peak_flops("tpu", "bf16")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA GH200 480GB", "h200"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA A10G", None),  # a different part (lower clocks), not in the table
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", None),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("NVIDIA B200", "b200"),
        ("AMD Instinct MI250X/MI250", "mi250x"),
        ("AMD Instinct MI300X", "mi300x"),
        ("Intel Xeon", None),
    ],
)
def test_device_kind_from_torch_names(name: str, kind: str | None) -> None:
    assert device_kind(name) == kind


def test_mfu_and_hfu_by_hand() -> None:
    # GPT-3 175B, batch 1536, 1024 A100s, 32 s per step (the README example).
    cfg = preset("gpt3-175b")
    model = model_flops_per_iteration(cfg, 1536)
    executed = hardware_flops_per_iteration(cfg, 1536, Recompute.FULL)
    assert executed == paper_equation_3(1536, 2048, 96, 12288, 51200)
    # Recomputation adds one forward of the layers: 96/72 of the layer term, logits alike.
    h, s, l, v = 12288, 2048, 96, 51200
    assert model == pytest.approx(72 * 1536 * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h)))
    hfu = utilisation(executed, 32.0, 1024, 312e12)
    mfu = utilisation(model, 32.0, 1024, 312e12)
    assert hfu == pytest.approx(executed / (32 * 1024 * 312e12))
    assert 0.43 < hfu < 0.45  # the README's "44% of the theoretical peak"
    assert mfu / hfu == pytest.approx(model / executed)
    assert model < executed


def test_selective_recompute_flops_between_none_and_full() -> None:
    cfg = preset("gpt-22b")
    none, sel, full = (flops_per_iteration(cfg, 4, r) for r in Recompute)
    assert none < sel < full
    # Korthikanti et al.: selective recomputation costs a few percent, full about a third.
    assert 1.01 < sel / none < 1.05
    assert full / none == pytest.approx(4 / 3, rel=0.02)


def test_equation_4_reproduces_the_papers_training_times() -> None:
    # GPT-3: 300B tokens on 1024 GPUs at 140 TFLOP/s -> 34 days; 1T: 450B tokens, 3072
    # GPUs, 163 TFLOP/s -> 84 days (the paper's printed figures, from equation (4)).
    assert paper_equation_4(300e9, 175e9, 1024, 140e12) / DAY == pytest.approx(34, abs=0.5)
    assert paper_equation_4(450e9, 1.008e12, 3072, 163e12) / DAY == pytest.approx(84, abs=0.5)


@pytest.mark.parametrize("row", TABLE_1, ids=lambda r: r.name)
def test_layer_count_is_equation_2_plus_the_final_norm(row) -> None:
    cfg = preset(row.name)
    ours = sum(parameters_per_rank(cfg))
    eq2 = paper_parameter_count(row.layers, row.hidden, 51200, 2048)
    assert ours == pytest.approx(eq2 + 2 * row.hidden, abs=1)  # eq. (2) omits the last LayerNorm
    assert ours / 1e9 == pytest.approx(row.params_billion, abs=0.1)


def test_parameter_formula_matches_a_real_model() -> None:
    cfg = apply_updates(
        RunConfig(),
        {"model": {"num_layers": 3, "hidden_size": 48, "num_heads": 4, "vocab_size": 70}},
        "t",
    ).model
    # Per rank: the vocabulary padded to a multiple of 128 (70 -> 128 rows) is allocated.
    assert sum(parameters_per_rank(cfg)) == count_parameters(GPT(cfg), full=False)
    assert count_parameters(GPT(cfg), full=False) - count_parameters(GPT(cfg)) == 58 * 48
    unpadded = replace(cfg, make_vocab_size_divisible_by=1)
    assert sum(parameters_per_rank(unpadded)) == count_parameters(GPT(cfg))
