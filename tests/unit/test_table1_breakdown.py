"""`benchmarks/perf_model/table1_breakdown.py`: its kernel inventory against a hand count, its terms
adding up to the model's layer, and the roofline variant of the attention core."""

from __future__ import annotations

from unittest.mock import patch

import pytest

from ptdp.config.enums import Precision
from ptdp.perf.cost.costs import Compute, attention_core
from ptdp.perf.cost.hardware_file import load_system
from ptdp.perf.cost.software import MEGATRON_2021
from ptdp.perf.validate.paper import TABLE_1, paper_run
from tests.helpers import load_benchmark

A100 = load_system("a100-80gb")
bench = load_benchmark("perf_model/table1_breakdown")


def test_kernel_bytes_by_hand() -> None:
    # n 2 tokens, h 4, 2 heads, s 2, t 1: n h = 8 activations, 8 scores, 32 MLP activations.
    # Forward: norms 2 x 2 x 8 x 2 = 64, softmax 2 x 8 x 2 = 32, dropout 8 x 5 = 40, GeLU
    # 2 x 32 x 2 = 128, dropout-adds 2 x 8 x 7 = 112, the copy 2 x 8 x 2 = 32: 408 bytes.
    # Backward: 96 + 48 + 40 + 192 + 80 (dropout-adds 2 x 8 x 5) + 96 (sums) + 32 = 584.
    assert bench.kernel_bytes(2, 4, 2, 2, 1) == (408, 584)


@pytest.mark.parametrize("name", ["gpt-7.5b", "gpt-18.4b"])
def test_terms_add_up_to_the_layer(name: str) -> None:
    row = next(r for r in TABLE_1 if r.name == name)
    terms, layer = bench.layer_terms(row, A100)
    assert sum(model for _, model, _ in terms) == pytest.approx(layer, rel=1e-3)
    assert all(model > floor for _, model, floor in terms)  # no term beats its floor


def test_roofline_core_is_the_slower_of_math_and_bytes() -> None:
    m = paper_run(TABLE_1[2], micro_batch=1, vpp=1).model
    c = Compute(A100, Precision.BF16, MEGATRON_2021)
    model, roof = attention_core(m, 1, 4, c), bench.roofline_core(m, 1, 4, c)
    assert 0.4 * model.f < roof.f < model.f  # the model adds what the roofline overlaps


def test_refit_gives_the_22b_layer_its_time_again() -> None:
    target = bench.korthikanti_layer(MEGATRON_2021)
    with patch("ptdp.perf.cost.costs.attention_core", bench.roofline_core):
        assert bench.korthikanti_layer(MEGATRON_2021)[0] < target[0]  # the core got cheaper
        sw = bench.refit(target)
        assert bench.korthikanti_layer(sw) == pytest.approx(target, rel=1e-6)
    assert sw.elementwise_traffic > MEGATRON_2021.elementwise_traffic  # the kernels took it
