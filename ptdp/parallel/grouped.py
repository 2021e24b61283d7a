"""Grouped matrix products of a mixture-of-experts layer: each expert's rows of an input
times that expert's own matrix, and the weight gradient of that.

Shapes: n = rows (token-choices, sorted by expert), e = experts, k = input features,
m = output features; `counts` [e] holds each expert's rows, in order (an expert may have
none). `choose_gemm` picks what computes them, as `ptdp.parallel.blocks.choose_kernel`
does for attention blocks; `kernel=` overrides it (tests compare the two).
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
"""torch.nn.functional.grouped_mm (public since torch 2.10), torch._grouped_mm before."""
_ALIGN = 8
"""Rows and features a grouped kernel's operands are aligned to: 16 bytes of bf16."""
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What grouped_mm takes on a CPU (torch 2.13 refuses float64)."""


class GemmKernel(Enum):
    """What computes a grouped product (`choose_gemm`)."""

    LOOP = "loop"  # one torch.mm per expert: any device and dtype; the counts go to the host
    GROUPED = "grouped"  # grouped_mm: one CUTLASS kernel for all experts, no host sync
    UNPADDED = "unpadded"  # grouped_mm on unpadded rows: PyTorch's CPU kernel (its own C++ loop)


def gemm_for_cuda(
    dtype: torch.dtype, capability: tuple[int, int], dims: tuple[int, ...]
) -> GemmKernel:
    """The kernel on a CUDA device of `capability` for operands of `dtype` whose feature
    sizes are `dims`: GROUPED where PyTorch runs its fused kernel (bf16 on sm90/sm100;
    elsewhere grouped_mm falls back to a loop of its own, with the same host sync as ours)
    and every feature size keeps rows 16-byte aligned, as the kernel requires; else LOOP."""
    fused = dtype == torch.bfloat16 and capability[0] in (9, 10) and _GROUPED_MM is not None
    return GemmKernel.GROUPED if fused and all(d % _ALIGN == 0 for d in dims) else GemmKernel.LOOP


def gemm_for_cpu(dtype: torch.dtype, rows: int, dims: tuple[int, ...]) -> GemmKernel:
    """The kernel on a CPU: UNPADDED where grouped_mm takes the operands (its dtypes, some
    rows, every feature size a multiple of 16 bytes: its stride check), else LOOP. On a CPU
    grouped_mm loops over the experts in C++ with the same GEMM per expert as LOOP (the
    results agree bit for bit, tests/unit/test_moe.py), without LOOP's Python loop and
    `torch.cat`; nothing needs padding (rows need no alignment there)."""
    size = torch.tensor([], dtype=dtype).element_size()
    ok = _GROUPED_MM is not None and dtype in _CPU_DTYPES and rows > 0
    return GemmKernel.UNPADDED if ok and all(d * size % 16 == 0 for d in dims) else GemmKernel.LOOP


def choose_gemm(x: torch.Tensor, weight: torch.Tensor) -> GemmKernel:
    """The kernel for x [n, k] times weight [e, k, m]: GROUPED on CUDA where
    `gemm_for_cuda` allows it, UNPADDED on a CPU where `gemm_for_cpu` does; else LOOP."""
    if x.dtype != weight.dtype:
        return GemmKernel.LOOP
    if x.device.type == "cpu":
        # every operand's rows: the forward's and the backward's (dy [n, m] too)
        return gemm_for_cpu(x.dtype, x.shape[0], (x.shape[-1], *weight.shape[-2:]))
    if x.device.type != "cuda":
        return GemmKernel.LOOP
    capability = torch.cuda.get_device_capability(x.device)
    return gemm_for_cuda(x.dtype, capability, (x.shape[-1], weight.shape[-1]))


def splits(counts: torch.Tensor) -> list[int]:
    """Each expert's row count on the host, for a loop over experts."""
    return counts.tolist()  # a host sync on a GPU: what the grouped kernel avoids


def aligned_rows(
    counts: torch.Tensor, n: int, align: int = _ALIGN
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(where each row goes, int32 group ends, padded row count) of a layout in which every
    expert's group starts at a multiple of `align` rows (8: the bf16 grouped kernel's
    alignment, which PyTorch documents for the weight gradient, torchtitan pads alike; 16:
    float8's, `ptdp.parallel.fp8_grouped`). The padded count is the bound n + align e, so
    no size is read back to the host."""
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)  # padded start - start, per expert
    expert = torch.repeat_interleave(
        torch.arange(len(counts), device=counts.device), counts, output_size=n
    )
    rows = torch.arange(n, device=counts.device) + shift[expert]
    return rows, ends.to(torch.int32), n + align * len(counts)


def pad_rows(x: torch.Tensor, rows: torch.Tensor, total: int) -> torch.Tensor:
    """x [n, k] -> [total, k]: row i at rows[i], zeros between the groups."""
    return x.new_zeros(total, x.shape[-1]).index_copy(0, rows, x)


def grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, kernel: GemmKernel | None = None
) -> torch.Tensor:
    """x [n, k] -> [n, m]: the rows of expert i times weight[i] ([e, k, m], any strides)."""
    kernel = kernel or choose_gemm(x, weight)
    if kernel is GemmKernel.UNPADDED:
        return _GROUPED_MM(x, weight, offs=counts.cumsum(0).to(torch.int32))
    if kernel is GemmKernel.GROUPED:
        rows, ends, total = aligned_rows(counts, x.shape[0])
        return _GROUPED_MM(pad_rows(x, rows, total), weight, offs=ends)[rows]
    parts = [xi.mm(weight[i]) for i, xi in enumerate(x.split(splits(counts)))]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[-1])


def grouped_wgrad(
    dy: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, kernel: GemmKernel | None = None
) -> torch.Tensor:
    """dy [n, m], x [n, k] -> [e, m, k]: for each expert i, dy_i^T x_i over its rows (zero
    for an expert without rows), the weight gradient of y_i = x_i W_i^T."""
    kernel = kernel or choose_gemm(x, dy.new_empty(0, 0, dy.shape[-1]))
    if kernel is GemmKernel.UNPADDED:
        return _GROUPED_MM(dy.t(), x, offs=counts.cumsum(0).to(torch.int32))
    if kernel is GemmKernel.GROUPED:
        rows, ends, total = aligned_rows(counts, x.shape[0])
        return _GROUPED_MM(pad_rows(dy, rows, total).t(), pad_rows(x, rows, total), offs=ends)
    rows = splits(counts)
    return torch.stack([a.t().mm(b) for a, b in zip(dy.split(rows), x.split(rows))])
