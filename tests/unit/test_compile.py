"""The fast path (issue 8): compiled layers and loss, the AdamW kernel, mask-free attention.

CPU tests compare `train.compile = true` with eager training of the same tiny model
(float32, dropout 0): same losses and gradient norms to float32 rounding. The CUDA tests
(fused AdamW, bf16 compile, flash attention) skip without a GPU.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from ptdp.config.enums import Recompute
from ptdp.config.sections import ModelConfig
from ptdp.model.compile import apply_compile
from ptdp.model.gpt import GPT
from ptdp.train.run import train
from ptdp.train.step.optim import adamw_kernel
from tests.helpers import LLAMA, tiny_config

HAS_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None
needs_cxx = pytest.mark.skipif(
    not HAS_CXX, reason="torch.compile (Inductor) on CPU needs a C++ compiler (g++)"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64)


def _assert_close(a: dict[int, float], b: dict[int, float], rel: float) -> None:
    assert a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) <= rel * abs(a[step]), (step, a[step], b[step])


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_attention_materialises_no_mask_in_training(monkeypatch, recompute: str) -> None:
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = GPT(CFG, recompute=Recompute(recompute))
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length + 1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert calls, "attention did not go through scaled_dot_product_attention"
    assert all(c.get("attn_mask") is None and c.get("is_causal") is True for c in calls)


def test_adamw_kernel_choice_and_foreach_is_exact_on_cpu() -> None:
    assert adamw_kernel([torch.zeros(3)]) == {"foreach": True}

    def run(**kernel) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(n, generator=gen) for n in (300, 7, 50)]
        opt = torch.optim.AdamW(
            [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:]}],
            lr=1e-3,
            betas=(0.9, 0.95),
            **kernel,
        )
        for step in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (step + 1)
            opt.step()
        return params

    for a, b in zip(run(foreach=False), run(foreach=True)):
        assert torch.equal(a, b)  # bit for bit, so existing results do not move


def test_compile_keeps_parameter_names() -> None:
    eager, compiled = GPT(CFG, seed=3), GPT(CFG, seed=3)
    assert apply_compile([compiled]) == CFG.num_layers  # lazy: compiles on the first call
    assert eager.state_dict().keys() == compiled.state_dict().keys()
    assert "loss" in vars(compiled)  # the loss region, replaced on the instance


@needs_cxx
def test_layers_and_loss_are_two_graphs_without_breaks() -> None:
    """Every layer shares one graph; the loss (norm, output layer, padding mask, upcast,
    cross-entropy over a vocabulary padded from 70 to 128) is the other."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=70)
    eager, compiled = GPT(cfg, seed=1), GPT(cfg, seed=1)
    apply_compile([compiled])
    counters.clear()
    tokens = torch.randint(0, 70, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = [m(tokens[:, :-1], tokens[:, 1:]) for m in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


@needs_cxx
def test_compiled_training_matches_eager(tiny_data: str, tmp_path: Path) -> None:
    """Llama options with full recomputation (checkpointing inside the compiled layer) and
    an evaluation (eval mode compiles again); GPT-2 options: tests/dist/test_compile.py."""
    model = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 32} | LLAMA
    train_cfg = {"steps": 4, "eval_interval": 4, "eval_iters": 2}
    eager, compiled = (
        train(
            tiny_config(
                tiny_data,
                tmp_path / f"run-{compile}",
                model=model,
                parallel={"recompute": "full"},
                train=train_cfg | {"compile": compile},
            )
        )
        for compile in (False, True)
    )
    _assert_close(eager.losses, compiled.losses, 1e-5)
    _assert_close(eager.grad_norms, compiled.grad_norms, 1e-4)
    _assert_close(eager.val_losses, compiled.val_losses, 1e-5)


@needs_cxx
@pytest.mark.timeout(900)  # two runs and a compile: near pytest's 300 s on a loaded machine
def test_compiled_moe_training_matches_eager(tiny_data: str, tmp_path: Path) -> None:
    """An MoE model (4 experts, top-2, balancing and z-losses, a shared expert) with full
    recomputation: routing's dispatch, the grouped products and the balancing figures run
    eager between the layer's compiled graphs (`ptdp.model.compile`); the same losses and
    gradient norms as eager to float32 rounding, and the same expert loads every step."""
    model = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16}
    model |= {"num_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01}
    model |= {"moe_z_loss_coeff": 0.001, "moe_shared_experts": 1}
    runs = {}
    for compile in (False, True):
        counters.clear()
        run_dir = tmp_path / f"run-{compile}"
        runs[compile] = train(
            tiny_config(
                tiny_data,
                run_dir,
                model=model,
                parallel={"recompute": "full"},
                train={"steps": 3, "micro_batch_size": 2, "compile": compile},
            )
        )
    eager, compiled = runs[False], runs[True]
    _assert_close(eager.losses, compiled.losses, 1e-5)
    _assert_close(eager.grad_norms, compiled.grad_norms, 1e-4)
    assert counters["stats"]["unique_graphs"] > 0  # it did compile
    loads = [
        [json.loads(line).get("moe_load") for line in (tmp_path / f"run-{c}" / "metrics.jsonl")
         .read_text().splitlines()]
        for c in (False, True)
    ]  # fmt: skip
    assert loads[0] == loads[1] and any(loads[0])


# ---------------------------------------------------------------------------- CUDA only


@needs_cuda
def test_fused_adamw_on_cuda(tiny_data: str, tmp_path: Path) -> None:
    from ptdp.parallel.env import LaunchEnv
    from ptdp.train.run import prepare
    from ptdp.train.step.trainer import Trainer

    assert adamw_kernel([torch.zeros(3, device="cuda")]) == {"fused": True}
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"device": "cuda", "steps": 2})
    env = LaunchEnv(0, 1, 0)
    cfg, layout, data = prepare(cfg, env)
    trainer = Trainer(cfg, layout, env, data)
    assert trainer.optimizer.fused and trainer.optimizer.inner.defaults["fused"]
    del trainer
    cpu = train(tiny_config(tiny_data, tmp_path / "cpu", train={"steps": 2}))
    gpu = train(tiny_config(tiny_data, tmp_path / "gpu", train={"device": "cuda", "steps": 2}))
    _assert_close(cpu.losses, gpu.losses, 1e-3)  # different kernels, same update


@needs_cuda
def test_bf16_compile_on_cuda_matches_eager(tiny_data: str, tmp_path: Path) -> None:
    common = {"device": "cuda", "precision": "bf16", "steps": 4}
    eager, compiled = (
        train(tiny_config(tiny_data, tmp_path / f"run-{c}", train=common | {"compile": c}))
        for c in (False, True)
    )
    _assert_close(eager.losses, compiled.losses, 2e-2)  # bf16 rounding, fused differently


@needs_cuda
def test_flash_attention_serves_the_training_path() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = ModelConfig(num_layers=2, hidden_size=128, num_heads=2, seq_length=128, vocab_size=64)
    model = GPT(cfg).cuda().to(torch.bfloat16)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), device="cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot take the call
        model(tokens[:, :-1], tokens[:, 1:]).backward()


@needs_cuda
def test_compiled_bf16_training_step_runs_on_flash_attention(
    tiny_data: str, tmp_path: Path
) -> None:
    """What mfu.py times: a compiled bf16 Trainer step (fused AdamW, its update queued with
    found_inf) with SDPA restricted to flash, which raises if the traced call cannot use it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ptdp.parallel.env import LaunchEnv
    from ptdp.train.run import prepare
    from ptdp.train.step.trainer import Trainer

    train_ = {"device": "cuda", "precision": "bf16", "compile": True, "steps": 2}
    env = LaunchEnv(0, 1, 0)
    cfg, layout, data = prepare(tiny_config(tiny_data, tmp_path / "run", train=train_), env)
    trainer = Trainer(cfg, layout, env, data)
    assert trainer.optimizer.fused
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        losses = [trainer.train_step()[0].item() for _ in range(2)]
    assert all(math.isfinite(x) for x in losses)
    assert not any(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before))
