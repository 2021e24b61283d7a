"""Context-parallel attention equals attention over the whole window.

One spawn of 4 ranks checks cp = 4 and cp = 2 (two cp groups side by side), ring and
all-gather, with and without synthetic documents (straddling chunks and ranks), a sliding
window, grouped-query heads and window lengths whose chunks are odd-sized: the output and
the gradients of q, k and v (each rank's part, taken from the full-window run) to fp32
rounding. Then checkpoints saved at cp = 2 restore in one process and back.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ptdp.config.enums import CpComm
from ptdp.model.positions import TokenPositions
from ptdp.parallel.context import context_attention, local_index, split_sequence
from ptdp.parallel.env import LaunchEnv
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.train.run import train
from tests.dist.harness import run_ranks
from tests.dist.test_checkpoint_sharded import _config, _copy_saved, _read, _resume_in, _write

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
    ids = torch.zeros(B, seq, dtype=torch.long)  # only the positions' split is used
    mine = split_sequence(ids, ids, pos, cp)[2]
    leaves = [x[:, :, local].clone().requires_grad_() for x in (q, k, v)]
    out = context_attention(*leaves, mine, cp, comm=comm, window=window)
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


def _cp2_runs(rank: int, world: int, data: str, root: str) -> None:
    """At cp = 2 (ZeRO-1 over the cp pair): a run saving step 3, and a resume of the
    one-process checkpoint."""
    env, tmp = LaunchEnv(rank, world, rank), Path(root)
    cfg = _config(data, tmp / "cp2", 4, CP2, SMALL, train={"save_interval": 3})
    _write(root, "cp2", rank, train(cfg, env=env).losses)
    _resume_in(rank, world, data, root, "cp2-from-one", CP2, SMALL)


CP2 = {"cp": 2, "zero": 1}
SMALL = {"num_layers": 2, "seq_length": 16}


def test_checkpoints_move_between_cp2_and_one_process(tiny_data: str, tmp_path: Path) -> None:
    """Parameters are replicated over cp, so a cp = 2 checkpoint restores in one process and
    a one-process checkpoint at cp = 2, each to the loss the other run reaches at step 4."""
    one = train(_config(tiny_data, tmp_path / "one", 4, {}, SMALL, train={"save_interval": 3}))
    _copy_saved(tmp_path / "one", tmp_path / "cp2-from-one")
    run_ranks(_cp2_runs, 2, tiny_data, str(tmp_path))
    cp2 = _read(tmp_path, "cp2")
    for step, loss in one.losses.items():  # and cp = 2 trains like one process
        assert cp2[step] == pytest.approx(loss, rel=1e-5), step
    assert _read(tmp_path, "cp2-from-one") == {4: pytest.approx(one.losses[4], rel=1e-5)}
    _copy_saved(tmp_path / "cp2", tmp_path / "one-from-cp2")
    resumed = train(_config(tiny_data, tmp_path / "one-from-cp2", 4, {}, SMALL), resume=True)
    assert resumed.losses == {4: pytest.approx(cp2[4], rel=1e-5)}
