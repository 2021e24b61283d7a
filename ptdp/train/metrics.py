"""Where training figures go: a console line, RUN_DIR/metrics.jsonl, optionally TensorBoard."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated memory on a GPU; peak resident memory of the process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kb * (1 if sys.platform != "darwin" else 1 / 1024) / 2**20


class MetricsWriter:
    """Append one JSON object per logged step; mirror scalars to TensorBoard if asked."""

    def __init__(self, run_dir: Path, tensorboard: bool) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
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

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def format_line(r: dict[str, Any]) -> str:
    return (
        f"step {r['step']:>6} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
        f"grad_norm {r['grad_norm']:.3f} | {r['tokens_per_s']:,.0f} tok/s | "
        f"{r['tflops_per_device']:.3f} TFLOP/s/device | peak mem {r['peak_mem_gb']:.2f} GB"
        + (
            f" | loss scale {r['loss_scale']:g} | skipped {r['skipped_steps']}"
            if "loss_scale" in r
            else ""
        )
    )
