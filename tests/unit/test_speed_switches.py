"""train.cuda_graphs and train.attention_backend on a CPU: the compile mode each asks for,
the kernel `auto` keeps (timed on CUDA only, so a fake timer stands in here), the math
fallback of a named kernel, and the refusal of CUDA graphs where the device turns out to
be a CPU. The GPU path itself is measured by benchmarks/speed/small_model_speed.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ptdp.config.enums import AttentionBackend as AB
from ptdp.config.sections import ModelConfig
from ptdp.errors import ConfigError
from ptdp.model import compile as regional
from ptdp.model.attention_backend import attention_context, pick_backend, priority
from ptdp.model.gpt import GPT
from ptdp.parallel.env import LaunchEnv
from ptdp.rules import speed
from ptdp.train.run import train
from tests.helpers import tiny_config

SHAPE = (2, 4, 16, 8)


def test_auto_keeps_the_fastest_kernel_that_ran_and_a_named_one_as_asked() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    times = {AB.FLASH: 3e-3, AB.CUDNN: 2e-3, AB.EFFICIENT: None}  # efficient refused
    asked: list[AB] = []

    def timer(backend, shape, dtype, device):
        asked.append(backend)
        assert (shape, dtype, device) == (SHAPE, torch.bfloat16, cuda)
        return times[backend]

    kw = {"shape": SHAPE, "dtype": torch.bfloat16, "timer": timer}
    assert pick_backend(AB.AUTO, device=cuda, **kw) is AB.CUDNN
    assert asked == [AB.FLASH, AB.CUDNN, AB.EFFICIENT]
    times.update({AB.FLASH: None, AB.CUDNN: None})
    assert pick_backend(AB.AUTO, device=cuda, **kw) is None  # PyTorch's own choice
    asked.clear()
    assert pick_backend(AB.AUTO, device=cpu, **kw) is None and asked == []  # nothing timed
    assert pick_backend(AB.FLASH, device=cpu, **kw) is AB.FLASH and asked == []
    # Latent attention's values narrower than its queries: FlashAttention is not timed.
    times.update({AB.FLASH: 1e-3, AB.CUDNN: 2e-3, AB.EFFICIENT: 4e-3})
    assert pick_backend(AB.AUTO, device=cuda, value_dim=6, **kw) is AB.CUDNN
    assert asked == [AB.CUDNN, AB.EFFICIENT]
    assert pick_backend(AB.AUTO, device=cuda, value_dim=8, **kw) is AB.FLASH  # one width


def test_the_chosen_kernel_goes_first_and_the_others_stay_behind_it() -> None:
    from torch.nn.attention import SDPBackend as K

    assert priority(AB.CUDNN) == [K.CUDNN_ATTENTION, K.FLASH_ATTENTION,
                                  K.EFFICIENT_ATTENTION, K.MATH]  # fmt: skip
    assert priority(AB.MATH)[0] is K.MATH and len(priority(AB.MATH)) == 4


@pytest.mark.parametrize("backend", [None, AB.MATH, AB.FLASH, AB.CUDNN, AB.EFFICIENT])
def test_every_kernel_choice_computes_attention_on_a_cpu(backend: AB | None) -> None:
    """A CUDA-only kernel named on a CPU tensor gives way to one the CPU runs; a masked
    call too (flash takes no mask)."""
    q, k, v = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(0)).unbind(0)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(SHAPE[2], SHAPE[2], dtype=torch.bool).tril()
    with attention_context(backend):
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(masked, expected, rtol=1e-5, atol=1e-6)


def test_cuda_graphs_compile_each_region_in_reduce_overhead_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    modes: list[str | None] = []

    def fake_compile(fn=None, **kwargs):
        modes.append(kwargs.get("mode"))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64)
    assert regional.apply_compile([GPT(cfg, seed=0)], cuda_graphs=True) == 2
    assert regional.apply_compile([GPT(cfg, seed=0)]) == 2
    assert modes == ["reduce-overhead"] * 3 + [None] * 3  # 2 layers and the loss, each time


def test_cuda_graphs_on_a_device_that_resolves_to_a_cpu_are_refused(
    tiny_data: str, tmp_path: Path
) -> None:
    if torch.cuda.is_available():
        pytest.skip("auto resolves to CUDA here")
    switches = {"compile": True, "cuda_graphs": True, "device": "auto"}
    cfg = tiny_config(tiny_data, tmp_path, train=switches)
    with pytest.raises(ConfigError, match="train.cuda_graphs = true needs a CUDA device"):
        train(cfg, env=LaunchEnv(rank=0, world_size=1, local_rank=0))


def _cfg(**sections: dict):
    from ptdp.config.files import apply_updates
    from ptdp.config.sections import RunConfig

    base = {
        "model": {"num_layers": 4, "hidden_size": 32, "num_heads": 4, "seq_length": 32},
        "train": {"compile": True, "cuda_graphs": True, "device": "cuda"},
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    return apply_updates(RunConfig(), base, "a test")


def test_cuda_graphs_pass_a_static_step_and_name_every_reason_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ptdp.rules.layout import validate

    monkeypatch.setattr(speed, "torch_version", lambda: (2, 13))
    cfg = _cfg
    assert validate(cfg(), 1).dp == 1  # one GPU, compiled, static: captured
    assert validate(cfg(parallel={"tp": 2}), 2).tp == 2  # tensor parallelism: not refused
    with pytest.raises(ConfigError) as refused:
        validate(cfg(parallel={"cp": 2}, train={"compile": False}), 2)
    said = str(refused.value)
    assert "train.compile = false" in said and "parallel.cp = 2 (the ring's" in said
    # A modelled run (ptdp simulate --gpus) is not refused for its device.
    assert validate(cfg(train={"device": "cpu"}), 1, gpus=True).dp == 1


def test_compiled_tensor_parallelism_is_refused_under_a_torch_that_breaks_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.11's compiled tp backward gives wrong gradients (seen in
    tests/dist/test_compile.py under 2.11.0): refused there before any group exists, naming
    both fixes; a modelled run, one rank, or an eager run are not refused."""
    from ptdp.rules.layout import validate

    tp2 = _cfg(parallel={"tp": 2}, train={"cuda_graphs": False})
    monkeypatch.setattr(speed, "torch_version", lambda: (2, 11))
    with pytest.raises(ConfigError) as refused:
        validate(tp2, 2)
    said = str(refused.value)
    assert "train.compile = true with parallel.tp = 2 needs torch 2.13 or newer" in said
    assert "torch 2.11's" in said and "--train.compile false" in said
    assert validate(tp2, 2, gpus=True).tp == 2
    assert validate(_cfg(train={"cuda_graphs": False}), 1).tp == 1
    eager = _cfg(parallel={"tp": 2}, train={"cuda_graphs": False, "compile": False})
    assert validate(eager, 2).tp == 2
    monkeypatch.setattr(speed, "torch_version", lambda: (2, 13))
    assert validate(tp2, 2).tp == 2
    monkeypatch.setattr(speed, "torch_version", lambda: None)  # unknown: not refused
    assert validate(tp2, 2).tp == 2


def test_the_installed_torch_version_is_read_without_importing_it() -> None:
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert speed.torch_version() == (major, minor)
