"""benchmarks/speed/mfu.py's CPU smoke path: ptdp and the peers train, the table is sane; a peer
that cannot run here (not installed, CUDA only, no such recipe) leaves a row saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ptdp.config.sections import ModelConfig
from ptdp.perf.cost.flops import model_flops_per_iteration
from tests.helpers import load_benchmark


def test_cpu_smoke_run_reports_sane_numbers(tmp_path: Path, capsys) -> None:
    mfu = load_benchmark("speed/mfu")
    out = tmp_path / "mfu.json"
    argv = "--device cpu --models tiny --steps 2 --warmup 1 --no-compile --compare"
    argv += f" --vocab-size 512 --peak-tflops 0.5 --json {out}"
    rows = mfu.main(argv.split())
    printed = capsys.readouterr().out
    assert [r["impl"] for r in rows] == ["ptdp", "hf-gpt2", "plain-gpt", "megatron-core"]
    assert rows[-1]["error"].startswith("Megatron-Core runs on CUDA only")  # a row, not a gap
    assert "megatron-core |           bf16 |" in printed and "failed: Megatron-Core" in printed
    assert "tiny: ptdp / hf-gpt2 tokens/s = " in printed and "ptdp" in printed
    assert "compile off (peers off)" in printed  # the peers follow --compile
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    rows = rows[:-1]
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
        load_benchmark("speed/mfu").main(["--device", "cpu", "--models", "7t"])


def test_predictions_from_the_performance_model(capsys) -> None:
    """--predict-only trains nothing; the figures are ptdp simulate's for one device."""
    mfu = load_benchmark("speed/mfu")
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
    lines = load_benchmark("speed/mfu").ratios([row, peer, same])
    assert lines[0].startswith("1.3b: ptdp / hf-gpt2 tokens/s = 1.500 (micro-batch 8 against 4")
    assert lines[1] == "1.3b: ptdp / plain-gpt tokens/s = 1.200"


def test_a_cuda_row_sets_held_memory_beside_the_reserve() -> None:
    """On CUDA a ptdp row also carries what the process held beside its peak (the
    allocator's cache, the context and libraries): printed against the model's reserve."""
    mfu = load_benchmark("speed/mfu")
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


def _args(mfu, argv: str):
    return mfu.parse_args(argv.split())


def test_llama_rows_map_the_same_shape_onto_each_peer() -> None:
    """--arch llama: ptdp's Llama layer at the GPT sizes; TorchTitan and Megatron-Core get
    the same layers, widths, heads, MLP width, sequence, vocabulary and rotary base."""
    mfu = load_benchmark("speed/mfu")
    from benchmarks.speed.peers import PeerUnavailable
    from benchmarks.speed.peers.megatron import mcore_kwargs
    from benchmarks.speed.peers.torchtitan import titan_dims

    args = _args(mfu, "--arch llama --pad-peers")
    shape = mfu.peer_shape(args, mfu.MODELS["1.3b"], "fp8-rowwise")
    assert (shape.layers, shape.hidden, shape.heads, shape.seq) == (24, 2048, 16, 2048)
    assert shape.ffn == 5504 and shape.vocab == 50304 and shape.fp8_recipe == "rowwise"
    assert mfu.model_config(args, mfu.MODELS["1.3b"]).ffn_size == shape.ffn  # as ptdp builds
    titan = titan_dims(shape, "cuda")
    assert titan["dim"] == 2048 and titan["hidden_dim"] == 5504 and titan["head_dim"] == 128
    assert titan["attention"] == "flex" and titan["fp8_skip"] == ["lm_head"]
    assert titan_dims(shape, "cpu")["attention"] == "sdpa"  # flex has no backward on CPU
    with pytest.raises(PeerUnavailable, match="no rowwise fp8 recipe"):
        mcore_kwargs(shape, te=True)
    with pytest.raises(PeerUnavailable, match="through Transformer Engine only"):
        mcore_kwargs(shape, te=False)
    config, model = mcore_kwargs(mfu.peer_shape(args, mfu.MODELS["1.3b"], "bf16"), te=False)
    assert config["ffn_hidden_size"] == 5504 and config["gated_linear_unit"]
    assert config["normalization"] == "RMSNorm" and not config["add_bias_linear"]
    assert model["position_embedding_type"] == "rope" and model["rotary_base"] == 500000
    assert not model["share_embeddings_and_output_weights"] and model["vocab_size"] == 50304
    gpt = mfu.peer_shape(_args(mfu, ""), mfu.MODELS["125m"], "bf16")
    assert gpt.ffn == 4 * 768 and gpt.vocab == 50257
    with pytest.raises(PeerUnavailable, match="TorchTitan has no GPT-2"):
        titan_dims(gpt, "cuda")
    config, model = mcore_kwargs(gpt, te=False)
    assert config["normalization"] == "LayerNorm" and config["activation"] == "gelu"
    assert model["share_embeddings_and_output_weights"]


def test_an_fp8_row_asks_ptdp_for_the_fp8_keys() -> None:
    """ptdp's fp8 rows pass train.precision = "fp8" and train.fp8_recipe; the bf16 row not."""
    mfu = load_benchmark("speed/mfu")
    args = _args(mfu, "--device cpu --fp8 tensorwise,rowwise")
    shape = mfu.MODELS["tiny"]
    train = mfu.ptdp_updates(args, shape, 4, "d", "none", "fp8-rowwise")["train"]
    assert train["precision"] == "fp8" and train["fp8_recipe"] == "rowwise"
    train = mfu.ptdp_updates(args, shape, 4, "d", "none", "bf16")["train"]
    assert train["precision"] == "bf16" and "fp8_recipe" not in train


def test_peers_that_cannot_run_leave_rows_that_say_why(tmp_path: Path, capsys) -> None:
    """Llama rows with fp8: TorchTitan trains where it is installed (else the row says it is
    not importable), Megatron-Core and every fp8 peer row say they need CUDA; ptdp's fp8 row
    trains or names the fp8 key this ptdp lacks."""
    mfu = load_benchmark("speed/mfu")
    out = tmp_path / "mfu.json"
    argv = "--device cpu --models tiny --steps 1 --warmup 0 --no-compile --compare --arch llama"
    argv += f" --vocab-size 512 --fp8 tensorwise --fp8-models tiny --json {out}"
    rows = mfu.main(argv.split())
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(rows))
    got = {(r["impl"], r["precision"]): r for r in rows}
    assert list(got) == [
        (impl, precision)
        for precision in ("bf16", "fp8-tensorwise")
        for impl in ("ptdp", "torchtitan", "megatron-core")
    ]
    assert "error" not in got["ptdp", "bf16"] and got["ptdp", "bf16"]["arch"] == "llama"
    titan = got["torchtitan", "bf16"]
    if "error" in titan:
        assert titan["error"].startswith("torchtitan is not importable")
    else:
        assert titan["params"] == got["ptdp", "bf16"]["params"]  # the same Llama
    assert got["torchtitan", "fp8-tensorwise"]["error"].startswith("torchtitan trains fp8 on CUDA")
    for precision in ("bf16", "fp8-tensorwise"):
        assert "CUDA only" in got["megatron-core", precision]["error"]
    ours = got["ptdp", "fp8-tensorwise"]
    assert "fp8" in ours["error"] if "error" in ours else ours["tokens_per_s"] > 0
    printed = capsys.readouterr().out
    assert "failed: Megatron-Core runs on CUDA only" in printed


def test_ratios_pair_rows_of_one_precision_and_leave_failures_out() -> None:
    row = {"model": "1.3b", "impl": "ptdp", "precision": "bf16", "micro_batch": 8}
    rows = [
        row | {"tokens_per_s": 100.0},
        row | {"impl": "torchtitan", "tokens_per_s": 80.0},
        row | {"impl": "megatron-core", "error": "needs CUDA"},
        row | {"precision": "fp8-rowwise", "tokens_per_s": 150.0},
        row | {"impl": "torchtitan", "precision": "fp8-rowwise", "tokens_per_s": 125.0},
    ]
    assert load_benchmark("speed/mfu").ratios(rows) == [
        "1.3b: ptdp / torchtitan tokens/s = 1.250",
        "1.3b: ptdp fp8-rowwise / bf16 tokens/s = 1.500",
        "1.3b fp8-rowwise: ptdp / torchtitan tokens/s = 1.200",
    ]


def test_megatron_core_takes_the_mapped_config_where_installed() -> None:
    """Megatron-Core's own TransformerConfig accepts what mcore_kwargs gives, for GPT-2 and
    Llama layers (its forward pass needs CUDA; building the config does not)."""
    pytest.importorskip("megatron.core")
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks.speed.peers.megatron import mcore_kwargs

    mfu = load_benchmark("speed/mfu")
    for arch, activation in (("gpt", F.gelu), ("llama", F.silu)):
        shape = mfu.peer_shape(_args(mfu, f"--arch {arch}"), mfu.MODELS["tiny"], "bf16")
        config, _ = mcore_kwargs(shape, te=False)
        assert config.pop("activation") == activation.__name__
        built = TransformerConfig(**config, activation_func=activation)
        assert built.ffn_hidden_size == shape.ffn and built.num_layers == 2


def test_a_ptdp_failure_keeps_its_row_lets_the_peers_run_and_exits_non_zero(
    tmp_path: Path, monkeypatch
) -> None:
    mfu = load_benchmark("speed/mfu")

    def broken(*args, **kwargs):
        raise RuntimeError("compiled graph broke")

    monkeypatch.setattr(mfu, "run_ptdp", broken)
    out = tmp_path / "mfu.json"
    argv = "--device cpu --models tiny --steps 1 --warmup 0 --no-compile --compare"
    argv += f" --peers plain-gpt --vocab-size 512 --json {out}"
    with pytest.raises(SystemExit, match="ptdp failed: tiny: RuntimeError: compiled graph broke"):
        mfu.main(argv.split())
    ptdp, peer = json.loads(out.read_text())["rows"]
    assert ptdp["error"] == "RuntimeError: compiled graph broke" and peer["tokens_per_s"] > 0


def test_rows_past_the_time_limit_are_named_not_run(tmp_path: Path) -> None:
    """--time-limit: a row that would end past it is recorded as not run (a caller's hard
    limit would otherwise cut it midway and lose it)."""
    out = tmp_path / "mfu.json"
    argv = "--device cpu --models tiny --no-compile --compare --peers plain-gpt --fp8 rowwise"
    argv += f" --vocab-size 512 --time-limit 1e-9 --json {out}"
    rows = load_benchmark("speed/mfu").main(argv.split())
    assert [(r["impl"], r["precision"]) for r in rows] == [
        ("ptdp", "bf16"), ("plain-gpt", "bf16"), ("ptdp", "fp8-rowwise"),
        ("plain-gpt", "fp8-rowwise"),
    ]  # fmt: skip
    assert all(r["error"] == "not run: --time-limit 1e-09 s would pass during it" for r in rows)
