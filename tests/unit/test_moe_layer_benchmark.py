"""benchmarks/speed/moe_layer.py off CUDA: the smoke run times the loops (bf16, and float8
by torchao's emulation), names the grouped rows as skipped, and says it is unmeasured; the
float8 rows are float8 (they differ from bf16) and near it."""

from __future__ import annotations

import pytest

from tests.helpers import load_benchmark

pytest.importorskip("torchao")


def test_cpu_smoke_run(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("speed/moe_layer")
    result = bench.main(["--device", "cpu", "--reps", "1", "--warmup", "0"])
    timed = {r["variant"]: r for r in result["rows"]}
    assert list(timed) == ["bf16 loop", "fp8 tensorwise loop", "fp8 rowwise loop"]
    assert {s["variant"] for s in result["skipped"]} == {"bf16 grouped", "fp8 rowwise grouped"}
    assert result["unmeasured"] and "UNMEASURED" in capsys.readouterr().out
    for name in ("fp8 tensorwise loop", "fp8 rowwise loop"):
        assert 0 < timed[name]["diff_output"] < 0.2, timed[name]
        assert 0 < timed[name]["diff_input_grad"] < 0.2, timed[name]
