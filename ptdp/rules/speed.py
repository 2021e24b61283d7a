"""The rules of `ptdp.rules.layout.validate` for the launch-overhead switches: train.cuda_graphs
and train.attention_backend, each message naming the key and the fix.

Pure (no torch.distributed), so a setting that cannot apply fails before any process group
exists. CUDA graphs replay a recorded step at fixed addresses: they need compiled regions
whose inputs keep their shapes and whose outputs are consumed before the next replay, which
a pipeline (several microbatches' activations in flight), the cp ring, MoE routing (token
counts per expert change every step) and ZeRO-3 (parameters gathered into fresh storage
each step) do not give.
"""

from __future__ import annotations

import importlib.metadata
import re

from ptdp.config.enums import AttentionBackend
from ptdp.config.sections import RunConfig

CPU_BACKENDS = (AttentionBackend.AUTO, AttentionBackend.FLASH, AttentionBackend.MATH)
"""What PyTorch's CPU attention runs: its flash kernel or the math reference."""


COMPILED_TP_TORCH = (2, 13)
"""The oldest torch whose compiled tensor-parallel layers match eager: under torch 2.11 the
compiled backward of the sequence-parallel reduce-scatter gives zero gradients, and the
tensor-parallel all-reduce of a gradient is dropped (tests/dist/test_compile.py)."""


def torch_version() -> tuple[int, int] | None:
    """(major, minor) of the installed torch, read without importing it; None if unknown."""
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return (int(found[1]), int(found[2])) if found else None


def speed_rules(cfg: RunConfig, errors: list[str], runtime: bool) -> None:
    """Append what is wrong with train.cuda_graphs and train.attention_backend to `errors`.
    `runtime`: a run on this machine (not a modelled one), where the device matters."""
    t, p = cfg.train, cfg.parallel
    if runtime and t.device == "cpu" and t.attention_backend not in CPU_BACKENDS:
        errors.append(
            f"train.attention_backend = {t.attention_backend.value} is a CUDA kernel, and "
            "train.device = cpu; use --train.attention_backend auto (or math, flash)"
        )
    version = torch_version() if runtime and t.compile and p.tp > 1 else None
    if version is not None and version < COMPILED_TP_TORCH:
        errors.append(
            f"train.compile = true with parallel.tp = {p.tp} needs torch "
            f"{'.'.join(map(str, COMPILED_TP_TORCH))} or newer: torch "
            f"{'.'.join(map(str, version))}'s compiled tensor-parallel backward gives wrong "
            "gradients; upgrade torch, or use --train.compile false"
        )
    if not t.cuda_graphs:
        return
    why = []
    if not t.compile:
        why.append("train.compile = false (the graphs capture its compiled regions)")
    if runtime and t.device == "cpu":
        why.append("train.device = cpu (CUDA graphs need a CUDA device)")
    if p.pp > 1:
        why.append(f"parallel.pp = {p.pp} (a pipeline keeps several microbatches in flight)")
    if p.cp > 1:
        why.append(f"parallel.cp = {p.cp} (the ring's transfers are not captured)")
    if cfg.model.num_experts > 0:
        why.append("model.num_experts > 0 (MoE routing changes shapes every step)")
    if p.zero >= 3:
        why.append("parallel.zero = 3 (parameters are gathered into new storage each step)")
    if why:
        errors.append(
            "train.cuda_graphs = true cannot capture this run: "
            + "; ".join(why)
            + "; set --train.cuda_graphs false, or fix each of these"
        )
