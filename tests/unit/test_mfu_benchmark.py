"""benchmarks/mfu.py's CPU smoke path: ptdp and the peers train, the table is sane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ptdp.config import ModelConfig
from ptdp.perf.cost.flops import model_flops_per_iteration
from tests.helpers import load_benchmark


def test_cpu_smoke_run_reports_sane_numbers(tmp_path: Path, capsys) -> None:
    mfu = load_benchmark("mfu")
    out = tmp_path / "mfu.json"
    argv = "--device cpu --models tiny --steps 2 --warmup 1 --no-compile --compare"
    argv += f" --vocab-size 512 --peak-tflops 0.5 --json {out}"
    rows = mfu.main(argv.split())
    printed = capsys.readouterr().out
    assert [r["impl"] for r in rows] == ["ptdp", "hf-gpt2", "plain-gpt"]
    assert "tiny: ptdp / hf-gpt2 tokens/s = " in printed and "ptdp" in printed
    assert "compile off (peers off)" in printed  # the peers follow --compile
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    shape = mfu.MODELS["tiny"]
    model = ModelConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_heads=shape.heads,
        seq_length=shape.seq,
        vocab_size=512,
    )
    for r in rows:
        assert r["params"] == rows[0]["params"]  # the same GPT in all three
        assert r["tokens_per_s"] > 0 and r["seconds"] > 0
        tokens = r["global_batch"] * shape.seq * r["steps"]
        assert r["tokens_per_s"] == pytest.approx(tokens / r["seconds"])
        flops = model_flops_per_iteration(model, r["global_batch"])
        assert r["flops_per_step"] == flops
        assert r["tflops"] == pytest.approx(flops * r["steps"] / r["seconds"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.5)
        assert 0 < r["mfu"] < 1


def test_unknown_model_is_named() -> None:
    with pytest.raises(SystemExit, match="unknown"):
        load_benchmark("mfu").main(["--device", "cpu", "--models", "7t"])


def test_predictions_from_the_performance_model(capsys) -> None:
    """--predict-only trains nothing; the figures are ptdp simulate's for one device."""
    mfu = load_benchmark("mfu")
    rows = mfu.main("--predict h100-sxm --predict-only --models 125m,1.3b --fill".split())
    by_name = {r["model"]: r for r in rows}
    assert list(by_name) == ["125m", "1.3b", *mfu.FILL]
    big = by_name["1.3b"]
    assert big["fits"] and 0.3 < big["mfu"] < 0.7 and big["recompute"] == "none"
    tokens = 8 * 2048  # micro-batch 8, sequence 2048, one microbatch per step
    assert big["tokens_per_s"] == pytest.approx(tokens / big["seconds_per_step"])
    assert by_name["2.7b"]["fits"] and not by_name["13b"]["fits"]  # 18 bytes/param of state
    assert by_name["125m"]["mfu"] < big["mfu"]  # small matrices use the GPU less well
    assert "does not fit" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--predict SYSTEM"):
        mfu.main("--device cpu --predict-only".split())


def test_ratio_flags_unequal_micro_batches() -> None:
    """An out-of-memory retry halves one side's micro-batch: the ratio says so."""
    row = {"model": "1.3b", "impl": "ptdp", "tokens_per_s": 300.0, "micro_batch": 8}
    peer = row | {"impl": "hf-gpt2", "tokens_per_s": 200.0, "micro_batch": 4}
    same = row | {"impl": "plain-gpt", "tokens_per_s": 250.0}
    lines = load_benchmark("mfu").ratios([row, peer, same])
    assert lines[0].startswith("1.3b: ptdp / hf-gpt2 tokens/s = 1.500 (micro-batch 8 against 4")
    assert lines[1] == "1.3b: ptdp / plain-gpt tokens/s = 1.200"


def test_a_cuda_row_sets_held_memory_beside_the_reserve() -> None:
    """On CUDA a ptdp row also carries what the process held beside its peak (the
    allocator's cache, the context and libraries): printed against the model's reserve."""
    mfu = load_benchmark("mfu")
    predicted = {"system": "h100-sxm", "tokens_per_s": 1000.0, "mfu": 0.5}
    predicted |= {"memory_gib": 52.0, "reserve_gib": 0.7, "fits": True}
    row = {"model": "1.3b", "tokens_per_s": 900.0, "peak_gib": 51.3, "predicted": predicted}
    lines = mfu.against_prediction([row | {"allocator_gib": 1.25, "context_gib": 0.5}])
    assert lines[0].startswith("1.3b: measured / predicted on h100-sxm tokens/s = 0.900")
    assert lines[1] == (
        "1.3b: memory GiB: peak allocated 51.30 against the model's count 52.00; held beside "
        "it 1.75 (allocator 1.25, context and libraries 0.50) against the reserve 0.70; the "
        "model: fits"
    )
    assert len(mfu.against_prediction([row])) == 1  # a CPU row: nothing held to report
