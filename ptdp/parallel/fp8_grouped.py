"""float8 GEMMs of a mixture-of-experts layer's experts (precision = fp8): each expert's
rows of X times its own matrix, its input gradient and its weight gradient, each with its
operands cast to float8 by torchao.

Shapes: n = rows (token-choices sorted by expert), e = experts, k = input features,
m = output features of Y_i = X_i W_i^T; `counts` [e] holds each expert's rows, in order.

The numerics are those of e separate float8 linear layers: expert i's three GEMMs cast
their operands as torchao's `Float8Linear` would cast them for a layer of weight W_i and
input X_i (`ptdp.parallel.fp8.Fp8Gemms`, the dense path's recipe). Two kernels compute it
(`choose_fp8_gemm`, as `ptdp.parallel.grouped.choose_gemm` does for bf16):

- LOOP: one dense float8 GEMM per expert, `Fp8Gemms`' own (`torch._scaled_mm` on a GPU;
  on a CPU torchao's emulation, the float8 values multiplied in float32, as the dense
  layers' fp8 runs on a CPU). Any recipe; the counts go to the host. Tensorwise scaling
  uses it on a GPU too: the grouped kernel takes one scale per row, not per group.
- GROUPED: the rowwise recipe on sm90 (H100, H200): torchao's Triton casts of its MoE
  training (`torchao.prototype.moe_training.kernels`, the ones its `_Float8GroupedMM`
  calls) and one `torch._scaled_grouped_mm` per GEMM, as torchao calls it, no host sync.
  Rowwise scales are per row of X and dY and per (expert, feature) of W, so they do not
  depend on how the rows are grouped; the weight gradient's scales are per expert's group
  of rows (torchao's jagged colwise scales). So GROUPED casts as LOOP does, and differs
  only by the accumulation (torchao's grouped GEMMs use fast accumulation).

The three GEMMs are separate functions (not torchao's fused autograd function) so that the
weight gradient can run at a zero-bubble W action from the kept X and dY
(`ptdp.parallel.wgrad.grouped_linear`). Each expert's group is padded with zero rows to a
multiple of 16, float8's alignment, where a kernel needs it: a zero row changes no scale
(amaxes are of absolute values) and adds nothing to a product.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ptdp.config.enums import Fp8Recipe
from ptdp.parallel.grouped import GemmKernel, aligned_rows, pad_rows, splits

if TYPE_CHECKING:
    from ptdp.parallel.fp8 import Fp8Gemms

FP8_ALIGN = 16
"""Rows and features a float8 GEMM's operands are aligned to (`torch._scaled_mm`)."""
_SCALED_GROUPED_MM = getattr(torch, "_scaled_grouped_mm", None)


def fp8_gemm_for_cuda(
    recipe: Fp8Recipe, dtype: torch.dtype, capability: tuple[int, int], dims: tuple[int, ...]
) -> GemmKernel:
    """GROUPED for the rowwise recipe on sm90 with bf16 operands whose feature sizes `dims`
    are multiples of 16 (what torchao's float8 grouped GEMM serves); else LOOP."""
    fused = recipe is Fp8Recipe.ROWWISE and dtype == torch.bfloat16 and capability[0] == 9
    aligned = all(d % FP8_ALIGN == 0 for d in dims)
    return GemmKernel.GROUPED if fused and aligned and _SCALED_GROUPED_MM else GemmKernel.LOOP


def choose_fp8_gemm(recipe: Fp8Recipe, x: torch.Tensor, weight: torch.Tensor) -> GemmKernel:
    """The kernel for x [n, k] times weight [e, m, k]: `fp8_gemm_for_cuda` on CUDA, LOOP
    elsewhere (no float8 grouped kernel on a CPU)."""
    if x.device.type != "cuda":
        return GemmKernel.LOOP
    capability = torch.cuda.get_device_capability(x.device)
    return fp8_gemm_for_cuda(recipe, x.dtype, capability, (weight.shape[1], weight.shape[2]))


# ------------------------------------------------------------------ LOOP: per expert


def _pad16(t: torch.Tensor) -> torch.Tensor:
    """t [r, c] with zero rows up to a multiple of 16: `torch._scaled_mm` needs the inner
    dimension of the weight-gradient GEMM (the rows) aligned; a CPU's emulation does not."""
    extra = -len(t) % FP8_ALIGN
    if t.device.type != "cuda" or not extra:
        return t
    return torch.cat([t, t.new_zeros(extra, t.shape[-1])])


def _loop_forward(fp8: Fp8Gemms, x, weight, counts):
    m = weight.shape[1]
    parts = [
        fp8.forward(xi, weight[i]) if len(xi) else xi.new_zeros(0, m)
        for i, xi in enumerate(x.split(splits(counts)))
    ]
    return torch.cat(parts) if parts else x.new_zeros(0, m)


def _loop_grad_input(fp8: Fp8Gemms, dy, weight, counts):
    k = weight.shape[2]
    parts = [
        fp8.grad_input(dyi, weight[i]) if len(dyi) else dyi.new_zeros(0, k)
        for i, dyi in enumerate(dy.split(splits(counts)))
    ]
    return torch.cat(parts) if parts else dy.new_zeros(0, k)


def _loop_grad_weight(fp8: Fp8Gemms, dy, x, counts):
    rows = splits(counts)
    zero = dy.new_zeros(dy.shape[-1], x.shape[-1])
    return torch.stack(
        [
            fp8.grad_weight(_pad16(a), _pad16(b)) if len(a) else zero
            for a, b in zip(dy.split(rows), x.split(rows))
        ]
    )


# ------------------------------------------------------- GROUPED: rowwise, CUDA sm90


def _kernels():
    """torchao's Triton casts (imported here: they need Triton, a CUDA-only dependency)."""
    from torchao.prototype.moe_training import kernels

    return kernels


def _grouped_forward(fp8: Fp8Gemms, x, weight, counts):
    k = _kernels()
    cast = {"output_dtype": fp8.config.cast_config_input.target_dtype}
    cast["round_scales_to_power_of_2"] = fp8.config.round_scales_to_power_of_2
    rows, ends, total = aligned_rows(counts, len(x), FP8_ALIGN)
    xq, xs = k.triton_fp8_rowwise_2d_scale_and_cast(pad_rows(x, rows, total), **cast)
    # weight [e, m, k] seen as [e, k, m] column-major: the right operand the kernel wants
    wq, ws = k.triton_fp8_colwise_3d_scale_and_cast(weight.transpose(1, 2), **cast)
    y = _SCALED_GROUPED_MM(
        xq, wq, xs.squeeze(-1).reciprocal(), ws.squeeze(1).reciprocal(), ends,
        out_dtype=x.dtype, use_fast_accum=True,
    )  # fmt: skip
    return y[rows]


def _grouped_grad_input(fp8: Fp8Gemms, dy, weight, counts):
    k = _kernels()
    cast = {"output_dtype": fp8.config.cast_config_grad_output.target_dtype}
    cast["round_scales_to_power_of_2"] = fp8.config.round_scales_to_power_of_2
    rows, ends, total = aligned_rows(counts, len(dy), FP8_ALIGN)
    dyq, dys = k.triton_fp8_rowwise_2d_scale_and_cast(pad_rows(dy, rows, total), **cast)
    wq, ws = k.triton_fp8_rowwise_3d_transpose_rhs(weight.transpose(1, 2), **cast)  # [e, m, k]
    dx = _SCALED_GROUPED_MM(
        dyq, wq, dys.squeeze(-1).reciprocal(), ws.squeeze(1).reciprocal(), ends,
        out_dtype=dy.dtype, use_fast_accum=True,
    )  # fmt: skip
    return dx[rows]


def _grouped_grad_weight(fp8: Fp8Gemms, dy, x, counts):
    k = _kernels()
    rows, ends, total = aligned_rows(counts, len(x), FP8_ALIGN)
    dyq, dys, xq, xs = k.triton_fp8_per_group_colwise_scales_dual(
        pad_rows(dy, rows, total), pad_rows(x, rows, total), ends,
        fp8.config.cast_config_grad_output_for_grad_weight.target_dtype,
        round_scales_to_power_of_2=fp8.config.round_scales_to_power_of_2,
    )  # fmt: skip
    return _SCALED_GROUPED_MM(
        dyq.t(), xq, dys.t().reciprocal(), xs.reciprocal(), ends,
        out_dtype=dy.dtype, use_fast_accum=True,
    )  # fmt: skip


# ------------------------------------------------------------------------ the GEMMs


def fp8_grouped_mm(
    fp8: Fp8Gemms, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, kernel=None
) -> torch.Tensor:
    """x [n, k] -> [n, m]: expert i's rows times weight[i]^T ([e, m, k]), in float8."""
    kernel = kernel or choose_fp8_gemm(fp8.recipe, x, weight)
    if kernel is GemmKernel.GROUPED:
        return _grouped_forward(fp8, x, weight, counts)
    return _loop_forward(fp8, x, weight, counts)


def fp8_grouped_grad_input(
    fp8: Fp8Gemms, dy: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, kernel=None
) -> torch.Tensor:
    """dy [n, m] -> dX [n, k]: expert i's rows of dy times weight[i] ([e, m, k])."""
    kernel = kernel or choose_fp8_gemm(fp8.recipe, dy, weight)
    if kernel is GemmKernel.GROUPED:
        return _grouped_grad_input(fp8, dy, weight, counts)
    return _loop_grad_input(fp8, dy, weight, counts)


def fp8_grouped_wgrad(
    fp8: Fp8Gemms, dy: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, kernel=None
) -> torch.Tensor:
    """dy [n, m], x [n, k] -> dW [e, m, k]: dy_i^T x_i per expert (zero without rows), now
    or at a zero-bubble W action."""
    if kernel is None:
        kernel = choose_fp8_gemm(fp8.recipe, x, x.new_empty(0, dy.shape[-1], x.shape[-1]))
    if kernel is GemmKernel.GROUPED:
        return _grouped_grad_weight(fp8, dy, x, counts)
    return _loop_grad_weight(fp8, dy, x, counts)
