"""A checkpoint is never written from non-finite state, and every file a save writes reads
back: the weights a save would write are checked first (ptdp/checkpoint/manager.py), and the
resolved config.toml is valid TOML for every value a field can hold (ptdp/config/files.py)."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import pytest

from ptdp import checkpoint as ckpt
from ptdp.checkpoint.manager import NonFiniteState
from ptdp.config.files import from_dict, to_toml, write_config
from ptdp.config.sections import SECTIONS, RunConfig
from ptdp.errors import ConfigError
from ptdp.parallel.env import LaunchEnv
from ptdp.rules.domains import config_problems
from ptdp.train.faults.numerical import TrainingError
from ptdp.train.run import train
from ptdp.train.step.optim import Optimizer
from tests.helpers import tiny_config
from tests.unit.test_run_dir import snapshot

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ONE = LaunchEnv(rank=0, world_size=1, local_rank=0)
TEXTS = ('quote " backslash \\ tab \t newline \n', "del \x7f bell \x07 nul \x00", "é ü 日本 😀")
"""Strings json.dumps would not write as valid TOML (DEL raw, an emoji as surrogates)."""


def _with(cfg: RunConfig, section: str, name: str, value: object) -> RunConfig:
    return dataclasses.replace(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})}
    )


def test_config_toml_holds_every_value(tmp_path: Path) -> None:
    """Every float field at NaN and both infinities, every text field with quotes, control
    characters and characters beyond the BMP: written, read back, the same config."""
    variants = []
    for section, cls in SECTIONS.items():
        hints = get_type_hints(cls)
        for f in fields(cls):
            typ = hints[f.name]
            values: tuple = ()
            if typ is float:
                values = (math.nan, math.inf, -math.inf, 1e-300, 1.5e300)
            elif typ is str and f.name not in ("device",):
                values = TEXTS
            elif typ == tuple[str, ...]:
                values = (TEXTS,)
            variants += [_with(RunConfig(), section, f.name, v) for v in values]
    assert len(variants) > 100
    for cfg in variants:
        path = tmp_path / "config.toml"
        write_config(path, cfg)  # reads the file back itself
        text = path.read_text(encoding="utf-8")
        assert to_toml(from_dict(tomllib.loads(text))) == text


def test_text_that_is_not_unicode_is_refused_before_a_run() -> None:
    cfg = _with(RunConfig(), "train", "run_dir", "runs/caf\udce9")  # an undecodable file name
    with pytest.raises(ConfigError, match="train.run_dir = .* holds characters that are not"):
        to_toml(cfg)
    (problem,) = config_problems(cfg)
    assert problem.startswith("train.run_dir = ") and "UTF-8" in problem


def _steps(run: Path) -> list[str]:
    root = ckpt.checkpoint_root(run)
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


@pytest.fixture
def overflow_after(monkeypatch: pytest.MonkeyPatch):
    """`overflow_after(k)`: the update of step k leaves an infinity in a master weight while
    that step's loss and gradient norm stay finite (as an update that overflows float32
    does; ptdp/rules/domains.py refuses the learning rates that would, so it is injected)."""

    armed, real = {}, Optimizer.step

    def step_then_overflow(self: Optimizer, found_inf=None) -> None:
        real(self, found_inf)
        if self.step_count() == armed.get("step"):
            self.pieces[0].master.view(-1)[0] = math.inf
            self.pieces[0].stored().copy_(self.pieces[0].master)

    monkeypatch.setattr(Optimizer, "step", step_then_overflow)
    return lambda step: armed.update(step=step)


def test_no_checkpoint_is_written_from_non_finite_state(
    tiny_data: str, tmp_path: Path, overflow_after
) -> None:
    """The NaN policy's last-good save, a periodic save and a background save each refuse
    to write weights holding an infinity, naming the step and the last checkpoint; no step
    directory appears and every file of the checkpoints folder keeps its bytes."""
    # on_nan = stop, the weights broken by step 1's update: no good state exists.
    overflow_after(1)
    run = tmp_path / "stop"
    with pytest.raises(TrainingError) as info:
        train(tiny_config(tiny_data, run, train={"steps": 4}), env=ONE)
    text = str(info.value)
    assert "non-finite loss" in text and "at step 2" in text
    assert "no good state to save: the weights after step 1 already hold a NaN" in text
    assert "no checkpoint of this run was saved before" in text and _steps(run) == []
    # After a good checkpoint (step 2), broken by step 3's update.
    overflow_after(3)
    run = tmp_path / "after-a-checkpoint"
    train_cfg = {"steps": 6, "save_interval": 2, "keep_checkpoints": 0}
    with pytest.raises(TrainingError) as info:
        train(tiny_config(tiny_data, run, train=train_cfg), env=ONE)
    text = str(info.value)
    assert "at step 4" in text and "no good state to save: the weights after step 3" in text
    assert f"the last checkpoint is {ckpt.checkpoint_root(run) / 'step_00000002'}" in text
    assert _steps(run) == ["latest", "step_00000002"]
    # Periodic saves, written in the foreground and in the background, under skip.
    for async_save in (False, True):
        run = tmp_path / f"periodic-{async_save}"
        train(tiny_config(tiny_data, run, train={"steps": 2, "save_interval": 1}), env=ONE)
        before = snapshot(ckpt.checkpoint_root(run))
        train_cfg = {"steps": 4, "save_interval": 1, "on_nan": "skip", "async_save": async_save}
        with pytest.raises(NonFiniteState) as info:
            train(tiny_config(tiny_data, run, train=train_cfg), resume=True, env=ONE)
        text = str(info.value)
        assert "after step 3 hold a NaN or an infinity, so no checkpoint of step 3" in text
        assert "the last checkpoint is" in text and "step_00000002" in text
        assert snapshot(ckpt.checkpoint_root(run)) == before
