"""The run's speed switches as the cost model prices them: train.cuda_graphs and
train.attention_backend.

A profile (`Software`, `--software`) says what a runtime can do; these two keys say what
one run of it does, so `run_software` folds them into the profile before anything is
priced (`simulate`, `plan`): the planner keeps the user's setting and never searches them.

- `attention_backend = math` runs PyTorch's reference attention: the s x s scores written,
  soft-maxed and kept for backward, as the unfused core of Megatron-LM 2021
  (`Software.fused_attention` False: its GEMMs in `costs.attention_core`, its memory-bound
  passes and saved scores through the stored bytes, `ptdp.perf.cost.memory`; what else the
  switches keep in memory: `ptdp.perf.cost.switch_bytes`). flash, cudnn,
  efficient and auto price one fused kernel: the device files hold no figure per kernel, so
  auto's pick, the fastest fused one, is that same kernel.
- `cuda_graphs = true` replays each compiled region from a CUDA graph
  (`Software.cuda_graphs`, `Compute.replayed`); `ptdp.rules.speed` has already refused
  the layouts it cannot capture (no compile, a pipeline, cp, MoE, ZeRO-3).

A setting the modelled software or device could not run is refused here, naming the key and
the fix, instead of being priced as if it ran.
"""

from __future__ import annotations

from dataclasses import replace

from ptdp.config.enums import AttentionBackend
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.perf.cost.hardware import System
from ptdp.perf.cost.software import Software
from ptdp.perf.cost.switch_bytes import math_attention
from ptdp.rules.speed import CPU_BACKENDS

FUSED = (AttentionBackend.FLASH, AttentionBackend.CUDNN, AttentionBackend.EFFICIENT)
"""The named fused kernels (auto is one of them where the software has any)."""


def switch_problems(cfg: RunConfig, software: Software, system: System) -> list[str]:
    """What of train.cuda_graphs and train.attention_backend the modelled software or the
    device file cannot run, one message each."""
    t, device, errors = cfg.train, system.device, []
    backend = t.attention_backend
    if backend in FUSED and not software.fused_attention:
        errors.append(
            f"train.attention_backend = {backend.value} is a fused kernel, which the modelled "
            "software (--software) did not have; use --train.attention_backend auto or math"
        )
    if device.gloo and backend not in CPU_BACKENDS:
        errors.append(
            f"train.attention_backend = {backend.value} is a CUDA kernel, and the device file "
            f"{system.name} models a CPU; use --train.attention_backend auto (or math, flash)"
        )
    if t.cuda_graphs and not software.captures_graphs:
        errors.append(
            "train.cuda_graphs = true is ptdp's capture of its compiled regions, which the "
            "modelled software (--software) is priced without; set --train.cuda_graphs false "
            "or --software ptdp"
        )
    if t.cuda_graphs and device.gloo:
        errors.append(
            f"train.cuda_graphs = true needs a CUDA device, and the device file {system.name} "
            "models a CPU; set --train.cuda_graphs false"
        )
    return errors


def run_software(cfg: RunConfig, software: Software, system: System) -> Software:
    """`software` as this run's switches set it (module doc); ConfigError where the software
    or the device cannot run them."""
    if errors := switch_problems(cfg, software, system):
        raise ConfigError("; ".join(errors))
    math = math_attention(cfg) and software.fused_attention  # PyTorch's kernel in place of it
    return replace(
        software,
        fused_attention=software.fused_attention and not math,
        math_kernel=software.math_kernel or math,
        cuda_graphs=cfg.train.cuda_graphs,
    )
