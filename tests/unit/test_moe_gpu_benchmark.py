"""benchmarks/speed/moe_gpu.py off CUDA: the kernel it forces is the one that runs, the loop's
output and gradients against the layer written out token by token, the expert GEMM FLOPs
against ptdp's count, and the rows of a tiny run (the loop timed, GROUPED named as
skipped; a dense and an MoE model whose active parameters and FLOPs differ by the router).
On CUDA (scripts/gpu-check.sh's cuda-tests) also the grouped kernel against the loop."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ptdp.parallel import grouped
from ptdp.parallel.grouped import GemmKernel
from ptdp.perf.cost.flops import mlp_forward_flops_per_token
from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("speed/moe_gpu")


@pytest.fixture(scope="module")
def tiny(bench):
    shape = bench.LAYERS["tiny"]
    block = bench.build_layer(shape, torch.device("cpu"), torch.float32)
    return shape, block, *bench.layer_inputs(shape, torch.device("cpu"), torch.float32)


def _expert(block, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e (SwiGLU, no biases) on rows x [r, h], written out."""
    gate, up = (x @ block.experts.fc1.weight[e].t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ block.experts.fc2.weight[e].t()


def test_the_forced_kernel_is_the_one_that_runs(bench, tiny, monkeypatch) -> None:
    _, block, x, dy = tiny
    calls = []
    real = grouped._GROUPED_MM
    monkeypatch.setattr(grouped, "_GROUPED_MM", lambda *a, **k: calls.append(1) or real(*a, **k))
    loop = bench.run_pass(block, x, dy, GemmKernel.LOOP)
    assert calls == []
    fused = bench.run_pass(block, x, dy, GemmKernel.GROUPED)  # torch's CPU grouped_mm
    assert len(calls) == 6  # fc1, fc2: forward, input gradient, weight gradient
    for a, b in zip(loop, fused):
        torch.testing.assert_close(b, a)
    diff = bench.kernel_difference(block, x, dy)
    assert diff["output"] < 1e-6 and diff["input_grad"] < 1e-6


def test_the_loop_computes_the_layer_written_out(bench, tiny) -> None:
    shape, block, x, dy = tiny
    out, _ = bench.run_pass(block, x, dy, GemmKernel.LOOP)
    tokens = x.detach().reshape(-1, shape.hidden)
    routing = block.router(tokens)
    want = torch.zeros_like(tokens)
    for t in range(shape.tokens):
        for j in range(shape.top_k):
            e = int(routing.experts[t, j])
            want[t] += routing.weights[t, j] * _expert(block, e, tokens[t : t + 1])[0]
    torch.testing.assert_close(out.reshape(-1, shape.hidden), want.detach())


def test_the_experts_pass_and_its_weight_gradients_match_per_expert_products(bench, tiny):
    _, block, x, _ = tiny
    rows, counts, expert, dy = bench.expert_inputs(block, x)
    assert counts.sum() == len(rows) == bench.LAYERS["tiny"].tokens * 2
    step = bench.passes(block, x, None, "experts")
    with bench.forced_kernel(GemmKernel.LOOP):
        step()
    got = [block.experts.fc1.weight.grad.clone(), block.experts.fc2.weight.grad.clone()]
    block.zero_grad(set_to_none=True)
    want = torch.cat([_expert(block, e, r) for e, r in enumerate(rows.split(counts.tolist()))])
    want.backward(dy)
    torch.testing.assert_close(got[0], block.experts.fc1.weight.grad)
    torch.testing.assert_close(got[1], block.experts.fc2.weight.grad)


def test_expert_gemm_flops_are_ptdps_count_less_the_router(bench) -> None:
    for shape in bench.LAYERS.values():
        cfg = bench.layer_config(shape)
        per_token = mlp_forward_flops_per_token(cfg, moe=True) - 2 * shape.hidden * shape.experts
        assert bench.expert_gemm_flops(shape) == 3 * shape.tokens * per_token


def test_a_cpu_run_times_the_loop_and_names_grouped_as_skipped(bench, tmp_path: Path, capsys):
    out = tmp_path / "moe.json"
    argv = "--device cpu --reps 1 --warmup 0 --steps 1 --vocab-size 512 --peak-tflops 0.5"
    result = bench.main([*argv.split(), "--json", str(out)])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    layer = [r for r in result["rows"] if r["part"] == "layer"]
    assert [(r["scope"], r["kernel"]) for r in layer] == [("layer", "loop"), ("experts", "loop")]
    for r in layer:
        assert r["ms"] > 0 and r["dtype"] == "float32"
        assert r["expert_tflops"] == pytest.approx(r["expert_gemm_flops"] / r["ms"] / 1e9)
    (skip,) = result["skipped"]
    assert skip["kernel"] == "grouped" and skip["reason"].startswith("no CUDA")
    assert "tiny: GROUPED skipped: no CUDA" in printed
    assert "both without torch.compile" in printed
    dense, moe = (r for r in result["rows"] if r["part"] == "model")
    assert (dense["model"], moe["model"]) == ("dense", "moe")
    assert dense["total_params"] == dense["active_params"] == dense["params"]
    assert moe["total_params"] == moe["params"] > moe["active_params"]
    # 2 experts of width 2h a token: the dense MLP's weights; an MoE layer adds its router
    # [e, h] and, the biases kept, one more fc2 bias [h] (one per expert a token uses).
    layers, h, e = dense["layers"], dense["hidden"], moe["num_experts"]
    assert moe["active_params"] - dense["active_params"] == layers * (e * h + h)
    tokens = dense["micro_batch"] * dense["seq"]
    assert moe["flops_per_step"] - dense["flops_per_step"] == 3 * 2 * h * e * tokens * layers
    for r in (dense, moe):
        assert r["compile"] is False and r["seconds"] > 0
        assert r["tokens_per_s"] == pytest.approx(tokens * r["steps"] / r["seconds"])
        assert r["tflops"] == pytest.approx(r["flops_per_step"] * r["steps"] / r["seconds"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.5)


def test_where_grouped_runs_its_rows_carry_the_ratio_and_the_difference(bench, monkeypatch):
    """The CUDA rows' shape, run here through torch's CPU grouped_mm (not timed for real)."""
    monkeypatch.setattr(bench, "grouped_skip_reason", lambda *a: "")
    args = argparse.Namespace(device="cpu", warmup=0, reps=1)
    skipped: list[dict] = []
    rows = bench.layer_rows(args, "tiny", skipped)
    assert skipped == []
    kinds = [(r["scope"], r["kernel"]) for r in rows]
    assert kinds == [(s, k) for s in ("layer", "experts") for k in ("loop", "grouped")]
    for loop, fused in (rows[:2], rows[2:]):
        assert loop["loop_over_grouped"] is None
        assert fused["loop_over_grouped"] == pytest.approx(loop["ms"] / fused["ms"])
    assert rows[1]["max_rel_diff"]["output"] < 1e-6 and rows[3]["max_rel_diff"] is None
    table = bench.layer_table(rows)
    assert len(table) == 2 + 4
    assert table[3].startswith("| tiny (64, 4 x 32, top-2, 128, float32) | layer | grouped |")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_grouped_kernel_agrees_with_the_loop_in_bf16(bench) -> None:
    """What the benchmark times on a GPU computes the same layer: output and input gradient
    of GROUPED within bf16 rounding of LOOP's (relative to the largest value)."""
    device = torch.device("cuda")
    shape = bench.LayerShape(hidden=256, experts=8, ffn=128, top_k=2, tokens=1024)
    block = bench.build_layer(shape, device, torch.bfloat16)
    x, dy = bench.layer_inputs(shape, device, torch.bfloat16)
    if reason := bench.grouped_skip_reason(device, torch.bfloat16, shape):
        pytest.skip(reason)
    diff = bench.kernel_difference(block, x, dy)
    assert diff["output"] < 2e-2 and diff["input_grad"] < 2e-2, diff
