"""The dense peak FLOP/s of one device, the denominator of the training log's MFU.

MFU (model FLOPs utilisation) = the job's model FLOP/s (ptdp.perf.cost.flops, no recomputation
counted) / world size / one device's dense peak at the run's precision. The peak is
train.peak_tflops when set, else the row of ptdp.perf.cost.flops.DENSE_PEAK_TFLOPS that the
device name torch reports maps to. An fp8 run's MFU is against the dense bf16 peak, as
TorchTitan and Megatron-Core report theirs: fp8 shows as a higher MFU, not as a second
scale. A device not in the table (a CPU, an unknown GPU) has no
peak: MFU is left out rather than invented, and the log says once how to set it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptdp.perf.cost.flops import DENSE_PEAK_TFLOPS, device_kind


@dataclass(frozen=True)
class Peak:
    """One device's dense peak, or None when it is not known, and where it came from."""

    flops: float | None
    """FLOP/s of one device; None = unknown (MFU is left out)."""
    message: str
    """One log line: the peak used, or how to give one."""


def resolve_peak(override_tflops: float, device_name: str | None, precision: str) -> Peak:
    """The peak for MFU: `override_tflops` if > 0, else the table's `precision` rate (fp32,
    bf16 or fp16; bf16 for fp8) of the device named `device_name` (None for a CPU)."""
    precision = "bf16" if precision == "fp8" else precision
    if override_tflops > 0:
        return Peak(
            override_tflops * 1e12,
            f"MFU against train.peak_tflops = {override_tflops:g} TFLOP/s per device",
        )
    how = "set --train.peak_tflops (dense TFLOP/s of one device) to log it"
    if device_name is None:
        return Peak(None, f"MFU not logged: no known peak for a CPU; {how}")
    kind = device_kind(device_name)
    if kind is None:
        return Peak(None, f"MFU not logged: {device_name!r} is not in the peak table; {how}")
    tflops = DENSE_PEAK_TFLOPS[kind].get(precision, 0.0)
    if tflops <= 0:
        return Peak(
            None, f"MFU not logged: {device_name} ({kind}) has no dense {precision} rate; {how}"
        )
    return Peak(
        tflops * 1e12,
        f"MFU against {tflops:g} TFLOP/s per device ({device_name}: {kind}, dense {precision}; "
        "--train.peak_tflops overrides)",
    )


def device_name(device: torch.device) -> str | None:
    """The name torch reports for a GPU ("NVIDIA H100 80GB HBM3"); None for a CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
