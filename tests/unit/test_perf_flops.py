"""MFU/HFU, the dense peak table and equation (4) (arXiv 2104.04473, section 5.1)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ptdp.config import Recompute, RunConfig, apply_updates
from ptdp.model.gpt import GPT, count_parameters
from ptdp.perf.flops import (
    DENSE_PEAK_TFLOPS,
    dense_peak_flops,
    device_kind,
    flops_per_iteration,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    paper_equation_3,
    paper_equation_4,
    paper_parameter_count,
    utilisation,
)
from ptdp.perf.memory import parameters_per_rank
from ptdp.perf.paper import TABLE_1, preset

DAY = 86400


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
