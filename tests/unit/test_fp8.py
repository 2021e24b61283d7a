"""fp8 training on a CPU, by torchao's emulation (the casts are real, the float8 values are
multiplied in float32): ptdp's float8 GEMMs are torchao's Float8Linear, the zero-bubble W
GEMM is the same GEMM run later, a short run's loss stays near bf16's, and the log's MFU
and the performance model use the rates the issue names."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")

from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from ptdp.config.enums import Fp8Recipe, Precision  # noqa: E402
from ptdp.config.sections import ModelConfig
from ptdp.errors import ConfigError  # noqa: E402
from ptdp.model.gpt import GPT  # noqa: E402
from ptdp.parallel.fp8 import Fp8Gemms, check_device  # noqa: E402
from ptdp.parallel.wgrad import accumulate_grads, linear  # noqa: E402
from ptdp.perf.cost.costs import FP8_CAST_BYTES, Compute, Gemm  # noqa: E402
from ptdp.perf.cost.hardware_file import load_system  # noqa: E402
from ptdp.perf.cost.software import PTDP  # noqa: E402
from ptdp.train.peak import resolve_peak  # noqa: E402
from ptdp.train.run import train  # noqa: E402
from tests.helpers import tiny_config  # noqa: E402

RECIPES = list(Fp8Recipe)


FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with float8 (sm89+)")
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_gemms_are_torchaos_float8_linear(recipe: Fp8Recipe, device: str) -> None:
    """Forward, input and weight gradients equal torchao's own Float8Linear, bit for bit:
    emulated on a CPU, `torch._scaled_mm` on a GPU."""
    torch.manual_seed(0)
    plain = torch.nn.Linear(64, 48, bias=False).to(device, torch.bfloat16)
    ao = torch.nn.Sequential(copy.deepcopy(plain))
    emulate = device == "cpu"
    config = Float8LinearConfig.from_recipe_name(recipe.value)
    convert_to_float8_training(ao, config=dataclasses.replace(config, emulate=emulate))
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    x_ao = x.detach().clone().requires_grad_()
    dy = torch.randn(32, 48, device=device, dtype=torch.bfloat16)
    y = linear(x, plain.weight, None, None, Fp8Gemms.build(recipe))
    y.backward(dy)
    ao(x_ao).backward(dy)
    assert torch.equal(y, ao(x_ao.detach()))
    assert torch.equal(x.grad, x_ao.grad) and torch.equal(plain.weight.grad, ao[0].weight.grad)
    # and it is float8, not bf16: the product differs from the plain one
    assert not torch.equal(y, torch.nn.functional.linear(x, plain.weight))


def _model(recipe: Fp8Recipe) -> GPT:
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64)
    return GPT(cfg, seed=0, fp8=Fp8Gemms.build(recipe)).to(torch.bfloat16)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_deferred_weight_gradients_are_the_fused_ones(recipe: Fp8Recipe) -> None:
    """A split backward (B, then W from the kept operands) gives every parameter the gradient
    of the fused fp8 backward exactly: the W GEMM is the same float8 GEMM, later."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    fused, split = _model(recipe), _model(recipe)
    fused(tokens, tokens).backward()
    with split.wgrad.capture():
        loss = split(tokens, tokens)
    with split.wgrad.deferring("mb0"):
        loss.backward()
    assert split.layers["0"].mlp.fc1.weight.grad is None  # kept for W
    accumulate_grads(split.wgrad.flush("mb0"))
    for (name, a), (_, b) in zip(fused.named_parameters(), split.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def _last_losses(run_dir: Path, steps: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    return sum(losses[-steps:]) / steps


@pytest.fixture
def one_thread():
    """One intra-op thread, as the multi-process tests run: on a loaded 2-core machine two
    threads spin against each other in every small kernel (20x slower steps, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("device", DEVICES)
def test_weight_cast_from_shards_is_the_whole_weights_cast(device: str) -> None:
    """ZeRO-3's fp8 all-gather: a weight's two shards (split inside a row, as bucket shards
    are) cast with the scale of the max of their amaxes, their float8 bytes joined, give
    bitwise the forward and input-gradient GEMMs of casting the whole bf16 weight."""
    fp8 = Fp8Gemms.build(Fp8Recipe.TENSORWISE)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 16, generator=g).to(device, torch.bfloat16)
    x = torch.randn(16, 16, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(16, 32, generator=g).to(device, torch.bfloat16)
    flat = w.view(-1)
    shards = (flat[:200], flat[200:])
    amax = torch.stack([t.abs().max().float() for t in shards]).max().reshape(1)
    scale = fp8.weight_scales(amax)[0]
    data = torch.cat([fp8.cast_weight(t, scale).view(torch.uint8) for t in shards])
    w8 = fp8.gathered_weight(data.view(fp8.weight_dtype).view(32, 16), scale, w.dtype)
    assert torch.equal(fp8.forward(x, w, w8), fp8.forward(x, w))
    assert torch.equal(fp8.grad_input(dy, w, w8), fp8.grad_input(dy, w))


def test_fp8_loss_stays_within_2_percent_of_bf16(tiny_data: str, tmp_path: Path) -> None:
    """200 steps of a 2-layer, 32-wide model: the mean loss of the last 50 steps of each fp8
    recipe within 2% of bf16's (benchmarks/speed/fp8_loss.py measures the gap: BENCHMARKS.md)."""
    losses = {}
    for name, train_keys in {
        "bf16": {"precision": "bf16"},
        "tensorwise": {"precision": "fp8", "fp8_recipe": "tensorwise"},
        "rowwise": {"precision": "fp8", "fp8_recipe": "rowwise"},
    }.items():
        cfg = tiny_config(
            tiny_data,
            tmp_path / name,
            optim={"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 20},
            train={"steps": 200, "global_batch_size": 4, **train_keys},
        )
        train(cfg)
        losses[name] = _last_losses(tmp_path / name, 50)
    assert losses["bf16"] < 3.5  # it learned: from ln(256) = 5.5
    for recipe in ("tensorwise", "rowwise"):
        assert losses[recipe] == pytest.approx(losses["bf16"], rel=0.02), (recipe, losses)


def test_mfu_is_against_the_bf16_peak() -> None:
    """An fp8 run's MFU uses the dense bf16 peak, as TorchTitan's and Megatron's logs do."""
    peak = resolve_peak(0.0, "NVIDIA H100 80GB HBM3", Precision.FP8.value)
    assert peak.flops == 989e12 and "dense bf16" in peak.message


def test_performance_model_runs_linears_at_the_fp8_rate() -> None:
    """The linear layers' GEMMs at H100's fp8 peak (2x bf16) plus their operands' casts,
    attention at bf16's."""
    system = load_system("h100-sxm")
    bf16 = Compute(system, Precision.BF16, PTDP)
    fp8 = Compute(system, Precision.FP8, PTDP)
    assert fp8.linear_peak == 1979e12 and fp8.peak == bf16.peak == bf16.linear_peak == 989e12
    big = Gemm(8192, 8192, 8192)
    casts = fp8.stream(FP8_CAST_BYTES * 2 * 8192 * 8192)
    assert fp8.linears([big]).f == pytest.approx(bf16.linears([big]).f * 989 / 1979 + casts)


def test_a_gpu_without_float8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An A100 (compute capability 8.0) has no float8 tensor cores: refused with the fix; a
    CPU emulates them."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    check_device(torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"NVIDIA A100 has 8\.0; use --train.precision bf16"):
        check_device(torch.device("cuda"))
