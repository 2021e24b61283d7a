"""Context-parallel attention equals attention over the whole window.

One spawn of 4 ranks checks cp = 4 and cp = 2 (two cp groups side by side), ring and
all-gather, with and without synthetic documents (straddling chunks and ranks), a sliding
window, grouped-query heads and window lengths whose chunks are odd-sized: the output and
the gradients of q, k and v (each rank's part, taken from the full-window run) to fp32
rounding.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from ptdp.config import CpComm
from ptdp.model.positions import TokenPositions
from ptdp.parallel.context import context_attention, local_index
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

B, N, G, D = 2, 4, 2, 8


def _documents(seq: int) -> torch.Tensor:
    """[b, S]: sample 0 cut at 5 and 11 (documents cross chunks), sample 1 one document."""
    doc = torch.zeros(B, seq, dtype=torch.long)
    doc[0, 5:] = 1
    doc[0, 11:] = 2
    return doc


def _full(seq: int, documents: bool, window: int):
    """q, k, v, dout over the whole window and the reference output and gradients."""
    gen = torch.Generator().manual_seed(seq + 7 * documents + window)
    q, k, v, dout = (torch.randn(B, h, seq, D, generator=gen) for h in (N, G, G, N))
    pos = TokenPositions(torch.arange(seq), None, _documents(seq) if documents else None)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    kk, vv = (x.repeat_interleave(N // G, dim=1) for x in leaves[1:])
    out = F.scaled_dot_product_attention(leaves[0], kk, vv, attn_mask=pos.allowed(pos, window))
    out.backward(dout)
    return (q, k, v, dout), pos, out.detach(), [x.grad for x in leaves]


def _check(mesh: ParallelMesh, seq: int, comm: CpComm, documents: bool, window: int) -> None:
    cp = mesh.axis("cp")
    (q, k, v, dout), pos, ref_out, ref_grads = _full(seq, documents, window)
    local = local_index(seq, cp.size, cp.rank)
    leaves = [x[:, :, local].clone().requires_grad_() for x in (q, k, v)]
    out = context_attention(*leaves, pos.select(local), cp, comm=comm, window=window)
    out.backward(dout[:, :, local])
    case = (cp.size, seq, comm.value, documents, window)
    torch.testing.assert_close(out, ref_out[:, :, local], rtol=1e-5, atol=1e-6, msg=str(case))
    for name, got, ref in zip("qkv", leaves, ref_grads):
        torch.testing.assert_close(
            got.grad, ref[:, :, local], rtol=1e-5, atol=1e-6, msg=f"d{name} {case}"
        )


def _ranks(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float32)
    meshes = {4: ParallelMesh.build(MeshShape(cp=4), rank)}
    meshes[2] = ParallelMesh.build(MeshShape(cp=2, dp=2), rank)
    for cp, mesh in meshes.items():
        # chunks of 3 (cp 4) and 5 (cp 2) tokens: odd, uneven without the balance
        for seq in (8 * cp, 6 * cp if cp == 4 else 10 * cp):
            for comm, documents, window in itertools.product(CpComm, (False, True), (0, 5)):
                _check(mesh, seq, comm, documents, window)


def test_ring_and_allgather_equal_full_attention() -> None:
    run_ranks(_ranks, 4, timeout_s=120)
