"""fp8 experts on a CPU, by torchao's emulation: each expert's three GEMMs are those of a
torchao Float8Linear of that expert's weight on its rows, bit for bit; a zero-bubble W of
the experts is the fused backward's GEMM, later; a short MoE run's loss stays near bf16's
within the dense fp8 tolerance (tests/unit/test_fp8.py's 2%). On an sm90 GPU also the
grouped rowwise kernel against the per-expert loop."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from ptdp.config.enums import Fp8Recipe  # noqa: E402
from ptdp.config.sections import ModelConfig  # noqa: E402
from ptdp.model.gpt import GPT  # noqa: E402
from ptdp.parallel.fp8 import Fp8Gemms  # noqa: E402
from ptdp.parallel.fp8_grouped import choose_fp8_gemm  # noqa: E402
from ptdp.parallel.grouped import GemmKernel  # noqa: E402
from ptdp.parallel.wgrad import WeightGradStore, accumulate_grads, grouped_linear  # noqa: E402
from ptdp.train.run import train  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402

RECIPES = list(Fp8Recipe)
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _operands(device: str = "cpu", counts=(20, 0, 9, 35)):
    """x [n, 32] with its gradient wanted, weight [e, 48, 32], counts [e] (one empty)."""
    g = torch.Generator().manual_seed(0)
    counts_t = torch.tensor(counts)
    n = int(counts_t.sum())
    x = torch.randn(n, 32, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = torch.nn.Parameter(torch.randn(len(counts), 48, 32, generator=g).to(device, torch.bfloat16))
    dy = torch.randn(n, 48, generator=g).to(device, torch.bfloat16)
    return x, w, counts_t.to(device), dy


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_each_expert_is_torchaos_float8_linear(recipe: Fp8Recipe) -> None:
    """Output, input gradient and each expert's weight gradient equal torchao's Float8Linear
    run on that expert's rows with its weight; an expert without rows gets a zero gradient."""
    x, w, counts, dy = _operands()
    y = grouped_linear(x, w, counts, fp8=Fp8Gemms.build(recipe))
    y.backward(dy)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe.value), emulate=True)
    start = 0
    for i, rows in enumerate(counts.tolist()):
        if not rows:
            assert torch.equal(w.grad[i], torch.zeros_like(w.grad[i]))
            continue
        layer = torch.nn.Linear(32, 48, bias=False, dtype=torch.bfloat16)
        layer.weight.data.copy_(w.detach()[i])
        ao = torch.nn.Sequential(copy.deepcopy(layer))
        convert_to_float8_training(ao, config=config)
        xi = x.detach()[start : start + rows].clone().requires_grad_()
        yi = ao(xi)
        yi.backward(dy[start : start + rows])
        assert torch.equal(y[start : start + rows], yi), i
        assert torch.equal(x.grad[start : start + rows], xi.grad), i
        assert torch.equal(w.grad[i], ao[0].weight.grad), i
        start += rows
    # float8, not bf16: differs from the 16-bit product
    plain = torch.cat([xi @ w[i].t() for i, xi in enumerate(x.split(counts.tolist()))])
    assert not torch.equal(y, plain)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_deferred_expert_weight_gradients_are_the_fused_ones(recipe: Fp8Recipe) -> None:
    """A split backward keeps (x, dy) with the recipe; W runs the same float8 GEMM."""
    fp8 = Fp8Gemms.build(recipe)
    x, w, counts, dy = _operands()
    grouped_linear(x, w, counts, fp8=fp8).backward(dy)
    fused = w.grad.clone()
    w.grad, store = None, WeightGradStore()
    with store.capture():
        y = grouped_linear(x, w, counts, store, fp8=fp8)
    with store.deferring("mb0"):
        y.backward(dy)
    assert w.grad is None  # kept for W
    accumulate_grads(store.flush("mb0"))
    assert torch.equal(w.grad, fused)


def _moe_model(recipe: Fp8Recipe) -> GPT:
    cfg = ModelConfig(
        num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64,
        num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_shared_experts=1,
    )  # fmt: skip
    return GPT(cfg, seed=0, fp8=Fp8Gemms.build(recipe)).to(torch.bfloat16)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_moe_model_split_backward_is_the_fused_one(recipe: Fp8Recipe) -> None:
    """A whole fp8 MoE model (routed and shared experts): B then W from the kept operands
    gives every parameter the fused fp8 backward's gradient exactly."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    fused, split = _moe_model(recipe), _moe_model(recipe)
    fused(tokens, tokens).backward()
    with split.wgrad.capture():
        loss = split(tokens, tokens)
    with split.wgrad.deferring("mb0"):
        loss.backward()
    assert split.layers["0"].mlp.experts.fc1.weight.grad is None  # kept for W
    accumulate_grads(split.wgrad.flush("mb0"))
    for (name, a), (_, b) in zip(fused.named_parameters(), split.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def _mean_last(run_dir: Path, steps: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    return sum(losses[-steps:]) / steps


@pytest.fixture
def one_thread():
    """One intra-op thread (tests/unit/test_fp8.py: two spin against each other here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_fp8_moe_loss_stays_within_2_percent_of_bf16(tiny_data: str, tmp_path: Path) -> None:
    """A 2-layer, 32-wide model with 4 experts (top-2, a shared expert): the mean loss of
    the last 30 of 120 steps of each fp8 recipe within 2% of bf16's, the dense tolerance."""
    model = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 32}
    model |= {"num_experts": 4, "moe_top_k": 2, "moe_ffn_hidden_size": 32}
    model |= {"moe_shared_experts": 1, "moe_aux_loss_coeff": 0.01}
    losses = {}
    for name, keys in {
        "bf16": {"precision": "bf16"},
        "tensorwise": {"precision": "fp8", "fp8_recipe": "tensorwise"},
        "rowwise": {"precision": "fp8", "fp8_recipe": "rowwise"},
    }.items():
        cfg = tiny_config(
            tiny_data,
            tmp_path / name,
            model=model,
            optim={"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 20},
            train={"steps": 120, "global_batch_size": 4, "log_interval": 1, **keys},
        )
        train(cfg)
        losses[name] = _mean_last(tmp_path / name, 30)
    assert losses["bf16"] < 4.0  # it learned: from ln(256) = 5.5
    for recipe in ("tensorwise", "rowwise"):
        assert losses[recipe] == pytest.approx(losses["bf16"], rel=0.02), (recipe, losses)


@pytest.mark.skipif(not SM90, reason="needs an sm90 GPU (H100, H200): torchao's grouped kernel")
def test_grouped_rowwise_kernel_matches_the_loop() -> None:
    """On sm90 the rowwise recipe runs one `torch._scaled_grouped_mm` per GEMM with the
    same casts as the per-expert loop; only the accumulation differs (fast accumulation)."""
    fp8 = Fp8Gemms.build(Fp8Recipe.ROWWISE)
    x, w, counts, dy = _operands("cuda", counts=(40, 0, 24, 56))
    got = {}
    for kernel in (GemmKernel.LOOP, GemmKernel.GROUPED):
        x.grad = w.grad = None
        y = grouped_linear(x, w, counts, kernel=kernel, fp8=fp8)
        y.backward(dy)
        got[kernel] = (y.detach(), x.grad.clone(), w.grad.clone())
    assert choose_fp8_gemm(fp8.recipe, x, w) is GemmKernel.GROUPED
    for a, b in zip(got[GemmKernel.LOOP], got[GemmKernel.GROUPED]):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)
