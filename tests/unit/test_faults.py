"""Interrupted runs (SIGINT/SIGTERM) and numerical faults (train.on_nan) in one process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.config.files import to_toml
from ptdp.errors import ConfigError
from ptdp.train.faults.numerical import SPIKE_WINDOW, FaultMonitor, TrainingError
from ptdp.train.run import train
from ptdp.train.step import optim
from ptdp.train.step.trainer import Trainer
from tests.helpers import tiny_config

COMMON = {"optim": {"decay_steps": 6}, "model": {"dropout": 0.1}}
KERNELS = ["foreach", "fused"]
"""foreach: the CPU default, which checks the flags before the update. fused: CUDA's
default (it runs on CPU too), which queues the update with the flags as found_inf."""


def _use_kernel(monkeypatch, kernel: str) -> None:
    monkeypatch.setattr(optim, "adamw_kernel", lambda params: {kernel: True})


def _signal_during(monkeypatch, step: int, signum: int = signal.SIGTERM) -> None:
    """The process sends itself `signum` while computing step `step` (1-based)."""
    original = Trainer.forward_backward

    def forward_backward(self):
        if self.step + 1 == step:
            os.kill(os.getpid(), signum)
        return original(self)

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)


def _nan_at(monkeypatch, step: int, where: str = "loss") -> None:
    """Step `step` (1-based) gets a NaN loss or a NaN gradient."""
    original = Trainer.forward_backward

    def forward_backward(self):
        loss = original(self)
        if self.step + 1 == step:
            if where == "loss":
                return loss * float("nan")
            next(iter(self.model.parameters())).main_grad.view(-1)[0] = float("nan")
        return loss

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sigterm_saves_and_resume_is_exact(
    tiny_data: str, tmp_path: Path, monkeypatch, kernel: str
) -> None:
    _use_kernel(monkeypatch, kernel)
    full = train(tiny_config(tiny_data, tmp_path / "full", **COMMON))
    before = signal.getsignal(signal.SIGTERM)
    with monkeypatch.context() as m:
        _signal_during(m, 2)
        stopped = train(tiny_config(tiny_data, tmp_path / "split", **COMMON))
    assert signal.getsignal(signal.SIGTERM) is before  # the handler was restored
    assert stopped.interrupted == signal.SIGTERM and stopped.final_step == 2
    assert ckpt.find_checkpoint(tmp_path / "split").name == "step_00000002"
    resumed = train(tiny_config(tiny_data, tmp_path / "split", **COMMON), resume=True)
    assert resumed.start_step == 2 and resumed.final_step == 6 and not resumed.interrupted
    for step in range(3, 7):
        assert resumed.losses[step] == full.losses[step]  # bitwise


def test_sigint_after_a_save_step_exits_130(tiny_data: str, tmp_path: Path, monkeypatch) -> None:
    from ptdp.cli import main

    _signal_during(monkeypatch, 2, signal.SIGINT)
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"save_interval": 2, "async_save": True})
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    assert main(["train", "--config", str(tmp_path / "c.toml")]) == 130
    assert ckpt.find_checkpoint(tmp_path / "run").name == "step_00000002"


def _record_calls(monkeypatch, cls: type, name: str, calls: list[str]) -> None:
    method = getattr(cls, name)

    def wrapped(*args, **kwargs):
        calls.append(name)
        return method(*args, **kwargs)

    monkeypatch.setattr(cls, name, wrapped)


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_skip_leaves_the_weights_and_continues(
    tiny_data: str, tmp_path: Path, monkeypatch, kernel: str
) -> None:
    _use_kernel(monkeypatch, kernel)
    _nan_at(monkeypatch, 3, where="grad")
    seen, calls = {}, []
    original = Trainer.optimizer_step
    for cls, name in ((optim.Optimizer, "step"), (FaultMonitor, "decide")):
        _record_calls(monkeypatch, cls, name, calls)

    def optimizer_step(self, loss=None):
        assert self.optimizer.fused == (kernel == "fused")
        before = [p.detach().clone() for p in self.model.parameters()]
        state = [{k: v.clone() for k, v in x.items()} for x in self.optimizer.inner.state.values()]
        calls.clear()
        norm, skipped = original(self, loss)
        after = list(self.optimizer.inner.state.values())
        seen[self.step + 1] = (
            skipped,
            all(torch.equal(p, b) for p, b in zip(self.model.parameters(), before)),
            bool(state) and all(torch.equal(x[k], y[k]) for x, y in zip(state, after) for k in x),
            list(calls),
        )
        return norm, skipped

    monkeypatch.setattr(Trainer, "optimizer_step", optimizer_step)
    result = train(tiny_config(tiny_data, tmp_path / "run", train={"on_nan": "skip"}))
    assert result.final_step == 6 and result.nonfinite_skipped == 1
    assert seen[3][:3] == (True, True, True)  # skipped: weights, moments, step count unchanged
    assert all(not any(seen[s][:3]) for s in (1, 2, 4, 5, 6))
    if kernel == "fused":  # the update is queued before the host reads the flags
        assert all(seen[s][3] == ["step", "decide"] for s in range(1, 7))
    else:
        assert seen[3][3] == ["decide"] and seen[4][3] == ["decide", "step"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_stop_raises_and_saves_nothing(
    tiny_data: str, tmp_path: Path, monkeypatch, kernel: str
) -> None:
    _use_kernel(monkeypatch, kernel)
    _nan_at(monkeypatch, 3)
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"save_interval": 2})
    with pytest.raises(TrainingError, match=r"at step 3.*last good checkpoint is .*step_00000002"):
        train(cfg)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_rollback_restores_and_skips_the_batches(
    tiny_data: str, tmp_path: Path, monkeypatch, capsys, kernel: str
) -> None:
    _use_kernel(monkeypatch, kernel)
    _nan_at(monkeypatch, 4)
    cfg = tiny_config(tiny_data, tmp_path / "run", train={"save_interval": 2, "on_nan": "rollback"})
    result = train(cfg)
    assert result.rollbacks == [(2, 4)] and result.final_step == 6
    assert sorted(result.losses) == [1, 2, 5, 6]  # steps 3 and 4 were rolled back
    assert "rolled back to" in capsys.readouterr().out
    assert ckpt.find_checkpoint(tmp_path / "run").name == "step_00000006"


def test_rollback_needs_checkpoints(tiny_data: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="on_nan = rollback with train.save_interval = 0"):
        train(tiny_config(tiny_data, tmp_path / "run", train={"on_nan": "rollback"}))


def test_loss_spike_is_logged() -> None:
    said: list[str] = []
    from ptdp.config.enums import OnNan
    from ptdp.parallel.comm import Group

    monitor = FaultMonitor(OnNan.STOP, Group.single(), torch.device("cpu"), said.append)
    norm = torch.tensor(1.0)

    def check(step: int, loss: float) -> bool:
        loss_t = torch.tensor(loss)
        return monitor.decide(step, loss_t, norm, monitor.flags(loss_t, norm, fp16=False))

    for step in range(1, SPIKE_WINDOW + 1):
        assert not check(step, 2.0)
    assert not said
    check(SPIKE_WINDOW + 1, 5.0)
    assert not said  # 2.5 x the median
    check(SPIKE_WINDOW + 2, 7.0)
    assert len(said) == 1 and f"loss spike at step {SPIKE_WINDOW + 2}" in said[0]


def test_a_failed_run_publishes_the_background_save_of_a_good_step(
    tiny_data: str, tmp_path: Path, monkeypatch
) -> None:
    """Step 2's asynchronous save is still unpublished when step 3 raises; one process
    publishes it on the way out, so --resume loses no more than the failed step."""
    original = Trainer.forward_backward

    def forward_backward(self):
        if self.step + 1 == 3:
            raise RuntimeError("CUDA out of memory (injected)")
        return original(self)

    cfg = tiny_config(tiny_data, tmp_path / "run", train={"save_interval": 2, "async_save": True})
    with monkeypatch.context() as m:
        m.setattr(Trainer, "forward_backward", forward_backward)
        with pytest.raises(RuntimeError, match="injected"):
            train(cfg)
    assert ckpt.find_checkpoint(tmp_path / "run").name == "step_00000002"
    resumed = train(cfg, resume=True)
    full = train(tiny_config(tiny_data, tmp_path / "full", train={"save_interval": 2}))
    assert resumed.start_step == 2
    for step in range(3, 7):
        assert resumed.losses[step] == full.losses[step]  # bitwise
