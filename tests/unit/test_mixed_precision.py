"""16-bit training: fp32 master weights, the dynamic loss scaler, and exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ptdp import checkpoint as ckpt
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import prepare, train
from ptdp.train.step.loss_scale import DynamicLossScaler
from ptdp.train.step.trainer import Trainer
from tests.helpers import tiny_config


def test_scaler_backs_off_and_grows_back() -> None:
    s = DynamicLossScaler(scale=1024.0, window=3)
    s.update(found_inf=True)
    assert (s.scale, s.skipped, s.good_steps) == (512.0, 1, 0)
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 512.0  # not yet a whole window
    s.update(found_inf=False)
    assert (s.scale, s.good_steps) == (1024.0, 0)
    s.update(found_inf=False)
    s.update(found_inf=True)  # an overflow restarts the window
    assert (s.scale, s.good_steps, s.skipped) == (512.0, 0, 2)
    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored == s


def _trainer(cfg) -> Trainer:
    env = LaunchEnv(0, 1, 0)
    cfg, layout, data = prepare(cfg, env)
    return Trainer(cfg, layout, env, data)


def test_fp16_skips_a_step_with_inf_and_recovers(tiny_data: str, tmp_path: Path) -> None:
    cfg = tiny_config(
        tiny_data,
        tmp_path / "run",
        train={"precision": "fp16"},
        optim={"initial_loss_scale": 1024.0, "loss_scale_window": 2},
    )
    trainer = _trainer(cfg)
    params = list(trainer.model.parameters())
    assert all(p.dtype == torch.float16 for p in params)
    assert all(x.master.dtype == torch.float32 for x in trainer.optimizer.pieces)
    before = [p.detach().clone() for p in params]
    loss = trainer.forward_backward()
    assert math.isfinite(loss.item())
    params[0].main_grad.view(-1)[0] = float("inf")  # an overflow in one gradient
    norm, skipped = trainer.optimizer_step()
    assert skipped and not math.isfinite(norm.item())
    assert trainer.scaler.scale == 512.0 and trainer.scaler.skipped == 1
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "a skipped step changed weights"
    for _ in range(2):  # a window of good steps doubles the scale again
        trainer.forward_backward()
        norm, skipped = trainer.optimizer_step()
        assert not skipped and math.isfinite(norm.item())
    assert trainer.scaler.scale == 1024.0
    assert not all(torch.equal(p, b) for p, b in zip(params, before))


def test_bf16_keeps_fp32_masters_and_resumes_exactly(tiny_data: str, tmp_path: Path) -> None:
    common = {"optim": {"decay_steps": 6}, "train": {"precision": "bf16"}}
    fp32 = train(tiny_config(tiny_data, tmp_path / "fp32", optim={"decay_steps": 6}))
    full = train(tiny_config(tiny_data, tmp_path / "full", **common))
    for step, loss in fp32.losses.items():  # 16-bit compute, close to fp32
        assert abs(full.losses[step] - loss) < 0.02 * loss
    split = {"optim": {"decay_steps": 6}}
    train(
        tiny_config(tiny_data, tmp_path / "split", train={"steps": 3, "precision": "bf16"}, **split)
    )
    resumed = train(
        tiny_config(
            tiny_data, tmp_path / "split", train={"steps": 6, "precision": "bf16"}, **split
        ),
        resume=True,
    )
    for step in (4, 5, 6):
        assert resumed.losses[step] == full.losses[step]  # bitwise: the masters were saved
    state = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "full"))
    assert all(t.dtype == torch.float32 for t in state["model"].values())
    # The checkpoint holds the fp32 masters, not their bf16 rounding.
    assert any(not torch.equal(t, t.bfloat16().float()) for t in state["model"].values())
