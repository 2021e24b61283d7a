"""Where training figures go: a console line, RUN_DIR/metrics.jsonl, optionally TensorBoard
and Weights & Biases (rank 0 only)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import resource
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ptdp.errors import ConfigError
from ptdp.files import append_line
from ptdp.train.progress import format_duration

WANDB_MISSING = (
    "train.wandb_project is set but the wandb package is not installed: pip install wandb "
    "(or pip install 'ptdp[wandb]'), or leave train.wandb_project empty"
)


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated memory on a GPU; peak resident memory of the process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20


def check_wandb(project: str) -> None:
    """Before any process group: a wandb project needs the wandb package."""
    if project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(WANDB_MISSING)


def _import_wandb() -> ModuleType:
    """wandb is optional and imported only when asked for (it is slow to import)."""
    try:
        import wandb
    except ImportError as exc:
        raise ConfigError(WANDB_MISSING) from exc
    return wandb


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record, without its step (absent values are None)."""
    return {
        k: v
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)
    }


class MetricsWriter:
    """Append one JSON object per logged step; mirror scalars to TensorBoard and to a
    Weights & Biases run (`wandb_project`; files under $WANDB_DIR, else RUN_DIR) if asked.

    wandb honours its own environment (WANDB_MODE=offline, WANDB_API_KEY, ...)."""

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool,
        *,
        wandb_project: str = "",
        wandb_run_name: str = "",
        run_config: dict[str, Any] | None = None,
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError(
                    "train.tensorboard = true needs the tensorboard package: "
                    "pip install 'ptdp[tensorboard]'"
                ) from exc
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            self._wandb = _import_wandb().init(
                project=wandb_project,
                name=wandb_run_name or None,
                # Read here, not once per process as wandb itself does.
                dir=os.environ.get("WANDB_DIR") or str(run_dir),
                config=run_config,
            )

    def write(self, record: dict[str, Any]) -> None:
        append_line(self.path, json.dumps(record))  # whole, or not at all on a full disk
        scalars = _scalars(record)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def close(self, failed: bool = False) -> None:
        """`failed`: training stopped on an error; the wandb run is marked so."""
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)


def format_line(r: dict[str, Any]) -> str:
    return (
        f"step {r['step']:>6} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
        f"grad_norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
        f"{r['tflops_per_device']:.3f} TFLOP/s/device | MFU {_percent(r['mfu'])} | "
        f"peak mem {r['peak_mem_gb']:.2f} GB | elapsed {format_duration(r['elapsed_s'])} | "
        f"ETA {format_duration(r['eta_s'])}"
        + (
            f" | loss scale {r['loss_scale']:g} | skipped {r['skipped_steps']}"
            if "loss_scale" in r
            else ""
        )
        + _moe_part(r)
        + (" | mtp " + " ".join(f"{x:.4f}" for x in r["mtp_loss"]) if "mtp_loss" in r else "")
    )


def _moe_part(r: dict[str, Any]) -> str:
    """The mixture-of-experts figures of a record (ptdp/train/step/moe.py), if any."""
    if "moe_aux_loss" not in r:
        return ""
    text = f" | moe aux {r['moe_aux_loss']:.4f}"
    if "moe_z_loss" in r:
        text += f" | moe z {r['moe_z_loss']:.4f}"
    text += f" | load max/mean {r['moe_load_max_over_mean']:.2f}"
    if "moe_dropped" in r:
        text += f" | dropped {r['moe_dropped']:,.0f}"
    return text


def _percent(fraction: float | None) -> str:
    """MFU as a percentage; "-" when the device's peak is not known."""
    return "-" if fraction is None else f"{100 * fraction:.1f}%"
