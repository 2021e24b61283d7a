"""Single-writer checkpoints with an atomic `latest` pointer.

Layout: RUN_DIR/checkpoints/step_00000100/{state.pt, config.toml, tokenizer.json?} and
RUN_DIR/checkpoints/latest (a text file naming the newest complete step directory).
A checkpoint is written under `step_X.tmp`, renamed when complete, and only then does
`latest` move (written to a temporary file and `os.replace`d), so a crash at any point
leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ptdp.config import RunConfig, load_toml, to_toml
from ptdp.errors import CheckpointError

STATE_FILE = "state.pt"
LATEST = "latest"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    cfg: RunConfig,
    tokenizer_file: Path | None,
    keep: int = 0,
) -> Path:
    """Write `state` as the checkpoint of `step` and make it the latest."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / STATE_FILE)
    (tmp / "config.toml").write_text(to_toml(cfg))
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / f"{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    if keep:
        _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a run dir, a checkpoints dir or a step dir to a complete step directory."""
    path = Path(path)
    for root in (path, path / "checkpoints"):
        if (root / LATEST).is_file():
            step_dir = root / (root / LATEST).read_text().strip()
            if not (step_dir / STATE_FILE).is_file():
                raise CheckpointError(
                    f"{root / LATEST} points to {step_dir}, which has no {STATE_FILE}; "
                    "the checkpoint directory was modified by hand"
                )
            return step_dir
    if (path / STATE_FILE).is_file():
        return path
    raise CheckpointError(
        f"no checkpoint found at {path}: expected a run directory, its checkpoints/ "
        f"directory, or a step directory containing {STATE_FILE}"
    )


def load_checkpoint(step_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint's state; a damaged file is named in the error."""
    file = step_dir / STATE_FILE
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for damaged zip archives
        raise CheckpointError(f"cannot read checkpoint file {file}: {exc}") from exc


def load_config(step_dir: Path) -> RunConfig:
    """The resolved config the checkpoint was trained with."""
    return load_toml(step_dir / "config.toml")
