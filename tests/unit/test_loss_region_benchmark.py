"""benchmarks/memory/loss_region.py, tiny: the compiled bf16 loss keeps half the bytes for backward
(16-bit logits instead of float32 log-probabilities), every variant gives the same loss, and
the performance model's head term counts what each variant keeps."""

from __future__ import annotations

import shutil

import pytest

from ptdp.config.enums import Precision
from ptdp.config.sections import ModelConfig
from ptdp.perf.cost.layer_bytes import head_activation_bytes
from tests.helpers import load_benchmark


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="torch.compile (Inductor) on CPU needs a C++ compiler (g++)",
)
def test_compiled_bf16_loss_saves_half_and_agrees(capsys) -> None:
    rows = load_benchmark("memory/loss_region").main(
        "--device cpu --tokens 256 --hidden 32 --vocab-size 1000 --precisions bf16 "
        "--rounds 1".split()
    )
    assert [(r["vocab_rows"], r["compiled"]) for r in rows] == [
        (1000, False), (1000, True), (1024, False), (1024, True),
    ]  # fmt: skip
    eager, compiled = rows[0], rows[1]
    logprobs = 256 * 1000 * 4  # what eager keeps: float32 [tokens, v] log-probabilities
    assert eager["saved_mib"] * 2**20 >= logprobs
    assert compiled["saved_mib"] < 0.6 * eager["saved_mib"]
    for r in rows:
        assert r["loss"] == pytest.approx(eager["loss"], rel=1e-3)  # bf16 rounding
        assert r["ms"] > 0
    assert "| bf16 | 1,024 | yes |" in capsys.readouterr().out
    for r in rows:  # the performance model's head term, against what autograd kept
        model = ModelConfig(
            hidden_size=32, num_heads=1, seq_length=256, vocab_size=1000,
            make_vocab_size_divisible_by=128 if r["vocab_rows"] > 1000 else 1,
        )  # fmt: skip
        assert model.padded_vocab_size(1) == r["vocab_rows"]
        predicted = head_activation_bytes(
            model, micro_batch=1, precision=Precision.BF16, compiled=r["compiled"]
        )
        assert r["saved_mib"] * 2**20 == pytest.approx(predicted, rel=0.015)
