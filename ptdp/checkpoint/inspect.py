"""What a checkpoint holds, as text (`ptdp inspect`): its step, the model and layout it was
trained with, every tensor with its shape, dtype and size, the optimizer state and the
tokenizer. Reads the files only: no model is built and no process group is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ptdp.checkpoint.full import load_checkpoint
from ptdp.checkpoint.store import find_checkpoint, load_config
from ptdp.config.files import to_dict
from ptdp.config.sections import RunConfig
from ptdp.errors import DataError


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:,} {unit}" if unit == "B" else f"{nbytes:,.1f} {unit}"
        nbytes /= 1024
    raise AssertionError  # unreachable


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**6 else f"{n:,} ({n / 1e6:.2f}M)"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _tensors(state: dict[str, torch.Tensor]) -> list[str]:
    width = max((len(name) for name in state), default=0)
    lines, numel, nbytes = [], 0, 0
    for name, t in state.items():
        shape = "x".join(map(str, t.shape)) or "scalar"
        lines.append(f"  {name:<{width}}  {shape:<14} {_dtype(t):<9} {_size(t.nbytes):>10}")
        numel, nbytes = numel + t.numel(), nbytes + t.nbytes
    lines.append(f"  total: {len(state)} tensors, {_count(numel)} parameters, {_size(nbytes)}")
    return lines


_GROUP_KEYS = ("lr", "weight_decay", "betas", "eps")


def _optimizer(saved: Any) -> list[str]:
    if not isinstance(saved, dict) or not saved.get("state"):
        return ["  none (no optimizer state saved)"]
    per_param = saved["state"]
    keys = sorted({k for entry in per_param.values() for k, v in entry.items() if _is_tensor(v)})
    tensors = [v for entry in per_param.values() for v in entry.values() if _is_tensor(v)]
    steps = sorted({int(entry["step"]) for entry in per_param.values() if "step" in entry})
    nbytes = sum(t.nbytes for t in tensors)
    lines = [
        f"  {len(per_param)} parameters with state {', '.join(keys)}; "
        f"step {', '.join(map(str, steps)) or '?'}; "
        f"{_size(nbytes)} ({', '.join(sorted({_dtype(t) for t in tensors}))})"
    ]
    for i, group in enumerate(saved.get("param_groups", [])):
        shown = [f"{k}={group[k]}" for k in _GROUP_KEYS if k in group]
        lines.append(f"  group {i}: " + ", ".join(shown))
    return lines


def _is_tensor(v: Any) -> bool:
    return torch.is_tensor(v) and v.dim() > 0


def _tokenizer(step_dir: Path, entry: str) -> str:
    if entry == "bytes":
        return "bytes (byte-level, built in)"
    if not entry:
        return "none recorded (data preprocessed elsewhere; `ptdp generate` cannot decode)"
    path = step_dir / entry
    if not path.is_file():
        return f"{entry} (MISSING in {step_dir})"
    from ptdp.data.tokenizers import ByteTokenizer, load_tokenizer

    try:
        kind = "bytes, " if isinstance(load_tokenizer(path), ByteTokenizer) else ""
    except DataError as e:
        return f"{entry} (UNREADABLE in {step_dir}: {e})"
    return f"{entry} ({kind}present in {step_dir})"


def _config(cfg: RunConfig) -> list[str]:
    sections = to_dict(cfg)
    model = sections["model"]
    p = cfg.parallel
    dp = p.dp or "auto (world size / (tp * pp))"
    return [
        "model:",
        *(f"  {key} = {value}" for key, value in model.items()),
        "layout:",
        f"  tp={p.tp} pp={p.pp} dp={dp} vpp={p.vpp} schedule={p.schedule.value} "
        f"sequence_parallel={str(p.sequence_parallel).lower()} recompute={p.recompute.value}",
        f"  precision={cfg.train.precision.value} "
        f"micro_batch_size={cfg.train.micro_batch_size} "
        f"global_batch_size={cfg.train.global_batch_size}",
    ]


def describe_checkpoint(path: str | Path) -> str:
    """A report of the checkpoint at `path` (a run, checkpoints or step directory).

    Raises CheckpointError when there is none there or its files cannot be read.
    """
    step_dir = find_checkpoint(path)
    state = load_checkpoint(step_dir)
    cfg = load_config(step_dir)
    model = state.get("model", {})
    lines = [
        f"checkpoint: {step_dir}",
        f"step: {state.get('step', '?')}"
        + (f" ({state['consumed_samples']:,} samples)" if "consumed_samples" in state else ""),
        f"tokenizer: {_tokenizer(step_dir, state.get('tokenizer', ''))}",
        *_config(cfg),
        "tensors:",
        *_tensors(model),
        "optimizer:",
        *_optimizer(state.get("optimizer")),
    ]
    if state.get("loss_scaler"):
        lines.append(f"loss scaler: {state['loss_scaler']}")
    files = sorted(step_dir.iterdir())
    total = sum(f.stat().st_size for f in files if f.is_file())
    lines.append(f"files: {', '.join(f.name for f in files)} ({_size(total)} on disk)")
    return "\n".join(lines)
