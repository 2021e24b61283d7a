"""One block of context-parallel attention: this rank's queries against one source's keys.

A block returns its partial output and log-sum-exp (lse), which the ring merges in fp32;
its backward takes the merged output and lse back (its softmax is exp(scores - lse)).
`choose_kernel` picks what computes a block; the choice made in the forward is kept for
its backward (`BlockRun`), with what the kernel's backward needs from its forward.

Shapes: b = micro-batch, n = query heads (keys and values already repeated to n),
r = the block's query rows, c = its key columns, d = head size.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

_aten = torch.ops.aten
_EFFICIENT_BIAS_ALIGN = 16  # elements a bias row's stride must be a multiple of
_NEG_INF = float("-inf")


class Kind(Enum):
    FULL = "full"
    CAUSAL = "causal"
    MASKED = "masked"


@dataclass(frozen=True)
class Block:
    """The part of one source's keys that this rank's queries read."""

    rows: slice
    cols: slice
    kind: Kind
    mask: torch.Tensor | None = None
    """Bool [b or 1, 1, rows, cols] for MASKED."""


class Kernel(Enum):
    """What computes a block (`choose_kernel`)."""

    REFERENCE = "reference"  # explicit fp32 scores and softmax
    CPU_FLASH = "cpu_flash"  # aten._scaled_dot_product_flash_attention_for_cpu
    FLASH = "flash"  # CUDA FlashAttention-2: aten._scaled_dot_product_flash_attention
    EFFICIENT = "efficient"  # CUDA memory-efficient: aten._scaled_dot_product_efficient_attention


@dataclass(frozen=True)
class BlockRun:
    """How a block's forward ran and what its backward needs from it: for FLASH the
    sequence facts and random state the kernel returned, for EFFICIENT its random state
    and the width of its lse (padded along the rows)."""

    kernel: Kernel
    saved: tuple = ()


def _dense(x: torch.Tensor) -> torch.Tensor:
    """`x.contiguous()`, spelled as the clone it makes: fake CUDA tensors trace it on a
    build without CUDA too (tests/unit/test_context_blocks.py)."""
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _rows_outer(x: torch.Tensor) -> torch.Tensor:
    """x [b, n, r, d] stored [b, r, n, d], as the CUDA kernels lay out their output: the
    memory-efficient backward reads `out` with the row stride that layout implies."""
    return _dense(x.transpose(1, 2)).transpose(1, 2)


def _cuda_accepts(kernel: Kernel, q, k, v, bias: torch.Tensor | None, causal: bool) -> bool:
    """PyTorch's own checks for a CUDA kernel (dtype, head size, GPU, alignment), and the
    user's switches (`torch.backends.cuda.enable_flash_sdp`, `sdpa_kernel`)."""
    cuda = torch.backends.cuda
    params = cuda.SDPAParams(q, k, v, bias, 0.0, causal, False)
    if kernel is Kernel.FLASH:
        return cuda.flash_sdp_enabled() and cuda.can_use_flash_attention(params)
    return cuda.mem_efficient_sdp_enabled() and cuda.can_use_efficient_attention(params)


def choose_kernel(block: Block, q, k, v, bias: torch.Tensor | None = None) -> Kernel:
    """The kernel for one block, each fused one returning the block's lse (the merge needs
    it) and taking the merged one back in backward:

    - CPU: PyTorch's flash kernel for unmasked and causal blocks; masked ones the reference.
    - CUDA: FlashAttention-2 for 16-bit unmasked and causal blocks (the fastest; it has no
      fp32 and no mask input); the memory-efficient kernel for fp32 blocks and for masked
      blocks, the mask as an additive `bias`; the reference where PyTorch refuses both
      (dtype, head size, GPU), they are switched off, or the head size is not a multiple
      of 8.
    - elsewhere the reference.

    The kernels' causal flag aligns the diagonal top-left; CAUSAL blocks are square
    (`plan_block`), where that is the block's own diagonal."""
    masked, causal = block.kind is Kind.MASKED, block.kind is Kind.CAUSAL
    if q.device.type == "cpu":  # its flash kernel needs one width for q, k and v
        return Kernel.REFERENCE if masked or v.shape[-1] != q.shape[-1] else Kernel.CPU_FLASH
    if q.device.type != "cuda":
        return Kernel.REFERENCE
    if q.shape[-1] % 8:  # PyTorch's own entry pads such head sizes before these kernels
        return Kernel.REFERENCE
    half = q.dtype in (torch.float16, torch.bfloat16)
    if half and not masked and _cuda_accepts(Kernel.FLASH, q, k, v, None, causal):
        return Kernel.FLASH
    if _cuda_accepts(Kernel.EFFICIENT, q, k, v, bias, causal):
        return Kernel.EFFICIENT
    return Kernel.REFERENCE


def efficient_bias(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A bool block mask [b or 1, 1, r, c] as the memory-efficient kernel's additive bias
    [b, n, r, c] in q's dtype (0 allowed, -inf not), its rows' storage padded to a multiple
    of 16 elements: the kernel requires that stride."""
    rows, cols = mask.shape[-2:]
    padded = cols + (-cols % _EFFICIENT_BIAS_ALIGN)
    bias = torch.zeros(mask.shape[0], 1, rows, padded, dtype=q.dtype, device=q.device)
    bias = bias.narrow(-1, 0, cols)
    bias.masked_fill_(mask.logical_not(), _NEG_INF)
    return bias.expand(q.shape[0], q.shape[1], rows, cols)


def _scores(q, k, block: Block, scale: float) -> torch.Tensor:
    """fp32 [b, n, r, c] scaled scores, -inf where the block's mask forbids."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if block.kind is Kind.CAUSAL:
        forbid = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(forbid, _NEG_INF)
    elif block.kind is Kind.MASKED:
        s = s.masked_fill(~block.mask, _NEG_INF)
    return s


def block_forward(q, k, v, block: Block, scale: float, kernel: Kernel | None = None):
    """(out fp32 [b, n, r, d], lse fp32 [b, n, r], BlockRun) of q [b, n, r, d] against k, v
    [b, n, c, d]; rows that read nothing get out 0 and lse -inf. `kernel` overrides the
    choice (tests compare the kernels)."""
    causal, rows, cuda = block.kind is Kind.CAUSAL, q.shape[2], q.device.type == "cuda"
    if cuda or kernel not in (None, Kernel.REFERENCE):  # as the kernels take them
        q, k, v = (_dense(x) for x in (q, k, v))
    biased = kernel is Kernel.EFFICIENT or (kernel is None and cuda)
    bias = efficient_bias(block.mask, q) if biased and block.kind is Kind.MASKED else None
    kernel = kernel or choose_kernel(block, q, k, v, bias)
    if kernel is Kernel.CPU_FLASH:
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out.float(), lse.float(), BlockRun(kernel)
    if kernel is Kernel.FLASH:
        out, lse, *saved, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )  # saved: cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused
        return out.float(), lse.narrow(-1, 0, rows).float(), BlockRun(kernel, tuple(saved))
    if kernel is Kernel.EFFICIENT:
        out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, causal, scale=scale
        )
        run = BlockRun(kernel, (seed, offset, lse.shape[-1]))
        out, lse = out.float(), lse.narrow(-1, 0, rows).float()
        if bias is not None:  # rows the mask empties: out 0 and lse -inf, as the merge needs
            empty = block.mask.any(-1).logical_not()  # [b or 1, 1, r]
            out = out.masked_fill(empty.unsqueeze(-1), 0.0)
            lse = lse.masked_fill(empty, _NEG_INF)
        return out, lse, run
    s = _scores(q, k, block, scale)
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return p @ v.float(), lse, BlockRun(Kernel.REFERENCE)


def block_backward(dout, q, k, v, out, lse, delta, block: Block, scale: float, run: BlockRun):
    """(dq, dk, dv) fp32 of one block, given the merged `out`, `lse` and delta =
    rowsum(dout * out) of its rows, by the kernel that ran its forward (`run`)."""
    causal, kernel = block.kind is Kind.CAUSAL, run.kernel
    if kernel is not Kernel.REFERENCE:  # the kernels take out and dout in q's dtype
        q, k, v, lse = (_dense(x) for x in (q, k, v, lse))
        layout = _dense if kernel is Kernel.CPU_FLASH else _rows_outer
        dout, out = layout(dout.to(q.dtype)), layout(out.to(q.dtype))
    if kernel is Kernel.CPU_FLASH:
        grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return tuple(g.float() for g in grads)
    if kernel is Kernel.FLASH:
        cum_q, cum_k, max_q, max_k, seed, offset = run.saved
        grads = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset,
            scale=scale,
        )  # fmt: skip
        return tuple(g.float() for g in grads)
    if kernel is Kernel.EFFICIENT:
        seed, offset, width = run.saved
        bias = efficient_bias(block.mask, q) if block.kind is Kind.MASKED else None
        lse = F.pad(lse, (0, width - lse.shape[-1]))  # the kernel's layout: rows padded
        grads = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False],
            causal, scale=scale,
        )  # fmt: skip
        return tuple(g.float() for g in grads[:3])
    p = torch.exp(_scores(q, k, block, scale) - lse.unsqueeze(-1))  # masked -> 0
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.float().transpose(-1, -2) - delta.unsqueeze(-1))
    return (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, dv
