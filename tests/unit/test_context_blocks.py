"""The local blocks of ring attention, without processes: each kernel against the
reference (explicit fp32 softmax), the kernel each block and dtype gets, the CUDA kernels'
calls traced with fake CUDA tensors (argument order and arity, output shapes and dtypes,
on a build without CUDA too), and a ring of c ranks emulated in one process against
attention over the whole window (CPU, and CUDA with its kernels where a GPU is present)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ptdp.model.positions import TokenPositions
from ptdp.parallel import blocks as blocks_module
from ptdp.parallel.blocks import (
    Block,
    Kernel,
    Kind,
    block_backward,
    block_forward,
    choose_kernel,
)
from ptdp.parallel.comm import Group
from ptdp.parallel.context import _merge, local_index, plan_block, split_sequence

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

B, N, D, SCALE = 2, 4, 16, 0.25
HALF = (torch.float16, torch.bfloat16)


def _block(kind: Kind, rows: int, cols: int, device="cpu", gen=None) -> Block:
    mask = None
    if kind is Kind.MASKED:  # random, with one row empty in sample 0 (it reads nothing)
        mask = torch.rand(B, 1, rows, cols, generator=gen) > 0.4
        mask[0, 0, 1] = False
        mask = mask.to(device)
    return Block(slice(0, rows), slice(0, cols), kind, mask)


def _inputs(rows: int, cols: int, dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, N, rows, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, N, cols, D, generator=gen) for _ in range(2))
    return [x.to(device, dtype) for x in (q, k, v)], dout.to(device), gen


def _shapes(kind: Kind) -> tuple[int, int]:
    """Causal blocks are square; others not, and not a multiple of 32 rows (the
    memory-efficient kernel pads its lse to one)."""
    return (24, 24) if kind is Kind.CAUSAL else (40, 24)


def _run(q, k, v, dout, block: Block, kernel: Kernel | None):
    """Forward and backward of one block on its own (its merged statistics are its own; a
    row reading nothing gets a finite lse, as a ring's own block gives every row)."""
    out, lse, run = block_forward(q, k, v, block, SCALE, kernel)
    delta = (dout * out).sum(-1)
    merged = lse.nan_to_num(neginf=0.0)
    grads = block_backward(dout, q, k, v, out, merged, delta, block, SCALE, run)
    return out, lse, run, grads


@pytest.mark.parametrize("kind", [Kind.FULL, Kind.CAUSAL])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_flash_blocks_equal_the_reference(kind: Kind, dtype: torch.dtype) -> None:
    (q, k, v), dout, _ = _inputs(*_shapes(kind), dtype, "cpu")
    block = _block(kind, *_shapes(kind))
    assert choose_kernel(block, q, k, v) is Kernel.CPU_FLASH
    out, lse, run, grads = _run(q, k, v, dout, block, None)
    assert run.kernel is Kernel.CPU_FLASH
    ref = _run(q, k, v, dout, block, Kernel.REFERENCE)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref[0], **tol)
    torch.testing.assert_close(lse, ref[1], **tol)
    for got, want, name in zip(grads, ref[3], "qkv"):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, **tol, msg=f"d{name}")


def test_masked_reference_block_gives_empty_rows_zero_and_minus_inf() -> None:
    (q, k, v), dout, gen = _inputs(40, 24, torch.float32, "cpu")
    block = _block(Kind.MASKED, 40, 24, gen=gen)
    assert choose_kernel(block, q, k, v) is Kernel.REFERENCE
    out, lse, run = block_forward(q, k, v, block, SCALE)
    assert lse[0, :, 1].eq(float("-inf")).all() and out[0, :, 1].eq(0).all()
    scores = (q @ k.transpose(-1, -2)) * SCALE
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=block.mask, scale=SCALE)
    keep = block.mask.any(-1, keepdim=True)  # rows reading something
    torch.testing.assert_close(out, torch.where(keep, dense, 0.0), rtol=1e-5, atol=1e-6)
    full = scores.masked_fill(~block.mask, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, full)


def test_cuda_choice_per_kind_and_dtype(monkeypatch) -> None:
    """16-bit unmasked/causal blocks take flash, fp32 and masked blocks the memory-efficient
    kernel, the reference when PyTorch refuses both; the choice asks for the mask as bias."""
    asked = []

    def accepts(refuse):
        def check(kernel, q, k, v, bias, causal):
            asked.append((kernel, bias is not None, causal))
            return kernel not in refuse

        return check

    blocks = {kind: _block(kind, 24, 24) for kind in Kind}
    with FakeTensorMode():
        for dtype in (torch.float32, *HALF):
            q, k, v = (torch.empty(B, N, 24, D, dtype=dtype, device="cuda") for _ in range(3))
            bias = torch.empty(B, N, 24, 24, dtype=dtype, device="cuda")
            for kind, block in blocks.items():
                masked_bias = bias if kind is Kind.MASKED else None
                monkeypatch.setattr(blocks_module, "_cuda_accepts", accepts(()))
                got = choose_kernel(block, q, k, v, masked_bias)
                fast = Kernel.FLASH if dtype in HALF and kind is not Kind.MASKED else None
                assert got is (fast or Kernel.EFFICIENT), (dtype, kind)
                if kind is Kind.MASKED:
                    assert asked[-1] == (Kernel.EFFICIENT, True, False)
                monkeypatch.setattr(blocks_module, "_cuda_accepts", accepts((Kernel.FLASH,)))
                assert choose_kernel(block, q, k, v, masked_bias) is Kernel.EFFICIENT
                refuse = accepts((Kernel.FLASH, Kernel.EFFICIENT))
                monkeypatch.setattr(blocks_module, "_cuda_accepts", refuse)
                assert choose_kernel(block, q, k, v, masked_bias) is Kernel.REFERENCE
    assert (Kernel.FLASH, False, True) in asked  # causal blocks ask with causal on


def _fused_cases():
    for dtype in (torch.float32, *HALF):
        for kind in Kind:
            yield dtype, kind, Kernel.EFFICIENT
            if dtype in HALF and kind is not Kind.MASKED:
                yield dtype, kind, Kernel.FLASH


@pytest.mark.parametrize("dtype, kind, kernel", list(_fused_cases()))
def test_cuda_kernel_calls_trace_with_fake_cuda_tensors(dtype, kind, kernel) -> None:
    """The CUDA branch's aten calls run on fake CUDA tensors (their meta kernels): wrong
    arity or argument order fails here; outputs come back fp32 in the block's shapes."""
    rows, cols = _shapes(kind)
    with FakeTensorMode():
        q = torch.empty(B, N, rows, D, dtype=dtype, device="cuda")
        k, v = (torch.empty(B, N, cols, D, dtype=dtype, device="cuda") for _ in range(2))
        mask = torch.rand(B, 1, rows, cols, device="cuda") > 0.4
        block = Block(slice(0, rows), slice(0, cols), kind, mask if kind is Kind.MASKED else None)
        out, lse, run = block_forward(q, k, v, block, SCALE, kernel)
        assert run.kernel is kernel
        assert (out.shape, out.dtype, out.device.type) == ((B, N, rows, D), torch.float32, "cuda")
        assert (lse.shape, lse.dtype) == ((B, N, rows), torch.float32)
        dout = torch.empty(B, N, rows, D, device="cuda")
        delta = (dout * out).sum(-1)
        grads = block_backward(dout, q, k, v, out, lse, delta, block, SCALE, run)
        assert [(g.shape, g.dtype) for g in grads] == [
            ((B, N, rows, D), torch.float32),
            ((B, N, cols, D), torch.float32),
            ((B, N, cols, D), torch.float32),
        ]
        accepted = blocks_module._cuda_accepts(kernel, q, k, v, None, kind is Kind.CAUSAL)
        assert isinstance(accepted, bool)  # PyTorch's checks take these arguments
    if kernel is Kernel.EFFICIENT:  # its lse comes padded to 32 rows, and is cut back
        assert run.saved[2] == (64 if rows == 40 else 32)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_masks_become_aligned_additive_biases(dtype: torch.dtype) -> None:
    """0 where allowed, -inf not, every head and sample; rows 16-element aligned."""
    for samples in (1, B):
        mask = torch.rand(samples, 1, 40, 23, generator=torch.Generator().manual_seed(0)) > 0.5
        q = torch.empty(B, N, 40, D, dtype=dtype)
        bias = blocks_module.efficient_bias(mask, q)
        assert bias.shape == (B, N, 40, 23) and bias.dtype == dtype
        assert bias.stride(-1) == 1 and bias.stride(2) % 16 == 0 and bias.stride(1) == 0
        want = torch.zeros(()).masked_fill(~mask.expand(B, N, 40, 23), float("-inf"))
        assert torch.equal(bias.float(), want)


def test_cuda_backward_gets_out_in_the_kernels_own_layout() -> None:
    """The memory-efficient backward derives out's row stride from a [b, r, n, d] layout."""
    out = torch.randn(B, N, 40, D)[:, :, 3:27]  # rows of the merged output, any layout
    laid = blocks_module._rows_outer(out)
    assert torch.equal(laid, out) and laid.transpose(1, 2).is_contiguous()
    assert laid.stride(2) == N * D


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("kind", list(Kind))
def test_cuda_kernels_equal_the_reference(dtype: torch.dtype, kind: Kind) -> None:
    rows, cols = _shapes(kind)
    (q, k, v), dout, gen = _inputs(rows, cols, dtype, "cuda", seed=1)
    block = _block(kind, rows, cols, "cuda", gen)
    out, lse, run, grads = _run(q, k, v, dout, block, None)
    if torch.cuda.get_device_capability() >= (8, 0):  # both kernels run on Ampere and later
        fast = dtype in HALF and kind is not Kind.MASKED
        assert run.kernel is (Kernel.FLASH if fast else Kernel.EFFICIENT)
    ref = _run(q, k, v, dout, block, Kernel.REFERENCE)
    tol = dict(rtol=2e-4, atol=2e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref[0], **tol, msg=f"out {run.kernel}")
    torch.testing.assert_close(lse, ref[1], **tol, msg=f"lse {run.kernel}")
    for got, want, name in zip(grads, ref[3], "qkv"):
        torch.testing.assert_close(got, want, **tol, msg=f"d{name} {run.kernel}")


def _emulated_ring(q, k, v, dout, positions: TokenPositions, cp: int, window: int):
    """Ring attention of c ranks in one process, block by block as `_RingAttention` does
    (merge through the lse, backward against the merged statistics): out and dq, dk, dv
    over the whole window."""
    seq = q.shape[2]
    ids = torch.zeros(1, seq, dtype=torch.long, device=q.device)
    mine = [split_sequence(ids, ids, positions, Group(None, cp, r))[2] for r in range(cp)]
    local = [local_index(seq, cp, r).to(q.device) for r in range(cp)]
    out, lse = torch.zeros(B, N, seq, D, device=q.device), torch.zeros(B, N, seq, device=q.device)
    dq, dk, dv = (torch.zeros(B, N, seq, D, device=q.device) for _ in range(3))
    for i in range(cp):
        qi = q[:, :, local[i]]
        o = torch.zeros(B, N, len(local[i]), D, device=q.device)
        m = torch.full((B, N, len(local[i])), float("-inf"), device=q.device)
        plans = [(j, plan_block(mine[i], mine[i].keys[j], window)) for j in range(cp)]
        runs = {}
        for j, block in plans:
            if block is not None:
                kj, vj = (x[:, :, local[j]][:, :, block.cols] for x in (k, v))
                *part, runs[j] = block_forward(qi[:, :, block.rows], kj, vj, block, SCALE)
                _merge(o, m, *part, block.rows)
        delta = (dout[:, :, local[i]] * o).sum(-1)
        for j, block in plans:
            if block is not None:
                r, c = block.rows, block.cols
                kj, vj = (x[:, :, local[j]][:, :, c] for x in (k, v))
                args = [x[:, :, r] for x in (dout[:, :, local[i]], qi)]
                grads = block_backward(
                    args[0], args[1], kj, vj, o[:, :, r], m[:, :, r], delta[:, :, r], block,
                    SCALE, runs[j],
                )  # fmt: skip
                dq[:, :, local[i][r]] += grads[0]
                dk[:, :, local[j][c]] += grads[1]
                dv[:, :, local[j][c]] += grads[2]
        out[:, :, local[i]], lse[:, :, local[i]] = o, m
    return out, (dq, dk, dv)


def _ring_case(device: str, dtype: torch.dtype, cp: int, documents: bool, window: int):
    seq = 8 * cp
    (q, k, v), dout, _ = _inputs(seq, seq, dtype, device, seed=cp + window)
    docs = None
    if documents:  # sample 0: three documents crossing chunks and ranks; sample 1: one
        docs = torch.zeros(B, seq, dtype=torch.long, device=device)
        docs[0, 5:], docs[0, 11:] = 1, 2
    positions = TokenPositions(torch.arange(seq, device=device), None, docs)
    out, grads = _emulated_ring(q, k, v, dout, positions, cp, window)
    leaves = [x.float().clone().requires_grad_() for x in (q, k, v)]
    mask = positions.allowed(positions, window)
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=SCALE)
    ref.backward(dout)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out, ref.detach(), **tol, msg="out")
    for got, leaf, name in zip(grads, leaves, "qkv"):
        torch.testing.assert_close(got, leaf.grad, **tol, msg=f"d{name}")


RING_CASES = [(2, False, 0), (4, False, 0), (2, True, 0), (2, False, 5), (4, True, 5)]


@pytest.mark.parametrize("cp, documents, window", RING_CASES)
def test_emulated_ring_equals_whole_window_attention_cpu(cp, documents, window) -> None:
    _ring_case("cpu", torch.float32, cp, documents, window)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("cp, documents, window", RING_CASES)
def test_emulated_ring_equals_whole_window_attention_cuda(dtype, cp, documents, window) -> None:
    _ring_case("cuda", dtype, cp, documents, window)
