"""Pipeline schedules executed on real GPT chunks against one process (gloo on CPU).

For p in {2, 4}, v in {1, 2}, m in {p, 2p} (DualPipeV: {2p, 3p}), tp in {1, 2} and every
schedule: the loss
and every parameter's gradient (gathered over tensor and pipeline ranks to full shape)
match the single-process model within 1e-5 relative; with pp = 2 also uneven stages
(`parallel.pipeline_layers`), first and last stages without layers among them. Several
schedules share one spawn.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.model.gpt import GPT
from ptdp.parallel.comm import Group, all_reduce_sum_, gather_objects
from ptdp.parallel.grads import reduce_tied_grads
from ptdp.parallel.init import full_tensor, shard_spec
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.parallel.roles import rank_roles
from ptdp.rules.layout import validate
from ptdp.train.step.pipelined import (
    Microbatch,
    PipelineStep,
    boundary_shape,
    build_chunks,
    build_p2p,
    tied_embedding_group,
)
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

CASES = [  # (schedule, vpp)
    ("gpipe", 1),
    ("1f1b", 1),
    ("zb-h1", 1),
    ("zb-h2", 1),
    ("interleaved", 2),
    ("zb-v", 2),
]


UNEVEN = [  # (schedule, vpp, layers per virtual stage) over pp = 2, 6 layers
    ("1f1b", 1, (2, 4)),
    ("zb-h1", 1, (4, 2)),
    ("interleaved", 2, (1, 2, 2, 1)),
    ("zb-v", 2, (2, 1, 1, 2)),
    # stages without layers: the embedding alone first, the norm, output layer and loss last
    ("gpipe", 1, (0, 6)),
    ("zb-h2", 1, (6, 0)),
    ("interleaved", 2, (0, 3, 3, 0)),
    ("zb-v", 2, (0, 3, 3, 0)),  # both on rank 0
    ("dualpipev", 2, (0, 3, 3, 0)),
]


def _config(
    tp: int, pp: int, schedule: str, vpp: int, m: int, tied: bool, layers: tuple[int, ...] = ()
) -> RunConfig:
    model = {
        "num_layers": sum(layers) or 2 * pp,
        "hidden_size": 32,
        "num_heads": 4,
        "seq_length": 16,
        "vocab_size": 51,
        "tie_embeddings": tied,
    }
    parallel = {"tp": tp, "pp": pp, "vpp": vpp, "schedule": schedule, "pipeline_layers": layers}
    train = {"micro_batch_size": 2, "global_batch_size": 2 * m}
    return apply_updates(RunConfig(), {"model": model, "parallel": parallel, "train": train}, "t")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _one_case(mesh: ParallelMesh, cfg: RunConfig, tokens: torch.Tensor) -> None:
    layout = validate(cfg, mesh.shape.world_size)
    mbs = cfg.train.micro_batch_size
    chunks = build_chunks(
        cfg.model, layout, mesh, seed=cfg.train.seed, recompute=cfg.parallel.recompute
    )
    shape = boundary_shape(cfg.model, layout, mbs)
    p2p = build_p2p(mesh, layout, shape, torch.float32, torch.device("cpu"), scatter_gather=True)
    step = PipelineStep(layout.pipeline, chunks, p2p, contextlib.nullcontext)

    reads = []

    def batch(mb: int) -> Microbatch:
        reads.append(mb)
        rows = tokens[mb * mbs : (mb + 1) * mbs]
        return Microbatch(rows[:, :-1], rows[:, 1:])

    loss = step.train(batch)
    stages, rank = layout.stages, mesh.coord("pp")
    # Every stage reads each microbatch: its layers take the tokens' positions (documents, a
    # context-parallel split) from it, never from a received tensor.
    assert set(reads) == set(range(layout.num_microbatches)), (rank, reads)
    reads.clear()
    # A stage that sends its output frees it once sent (ZB-V's turn keeps it on the rank).
    senders = [s for s in chunks if s < stages.last and not stages.same_rank(s, s + 1)]
    out_bytes = 4 * cfg.model.seq_length * mbs * cfg.model.hidden_size
    assert step.last_runtime.freed_bytes >= out_bytes * layout.num_microbatches * len(senders)
    group = tied_embedding_group(mesh, layout, tied=cfg.model.tie_embeddings)
    if cfg.model.tie_embeddings:
        reduce_tied_grads(chunks.values(), rank_roles(chunks.values()), group)
    all_reduce_sum_(loss, mesh.axis("pp"))
    tp = mesh.axis("tp")
    grads = {
        name: full_tensor(p.grad, shard_spec(p), tp)
        for chunk in chunks.values()
        for name, p in chunk.named_parameters()
        if not chunk.roles.is_tied_copy(name)
    }
    parts = gather_objects(grads, mesh.axis("pp")) if tp.rank == 0 else []
    if mesh.rank != 0:
        return
    merged = {k: v for part in parts for k, v in part.items()}
    ref = GPT(cfg.model, seed=cfg.train.seed)
    m = layout.num_microbatches
    ref_loss = sum(ref(*batch(j)[:2]) / m for j in range(m))
    ref_loss.backward()
    what = f"{cfg.parallel.schedule.value} {layout.describe()}"
    assert _rel(loss, ref_loss.detach()) < 1e-5, f"{what}: loss {loss} vs {ref_loss}"
    ref_grads = dict(ref.named_parameters())
    assert merged.keys() == ref_grads.keys(), what
    for name, g in merged.items():
        ref_grad = full_tensor(ref_grads[name].grad, shard_spec(ref_grads[name]), Group.single())
        err = _rel(g, ref_grad)  # the single process's padded vocabulary rows left out
        assert err < 1e-5, f"{what}: gradient of {name}, relative error {err:.1e}"


def _check_schedules(rank: int, world_size: int, tp: int, pp: int) -> None:
    mesh = ParallelMesh.build(MeshShape(tp=tp, dp=1, pp=pp), rank)
    torch.manual_seed(0)
    tokens = torch.randint(0, 51, (4 * pp * 2, 17))  # enough rows for m = 2p microbatches of 2
    for schedule, vpp in CASES:
        for m in (pp, 2 * pp):
            for tied in (True, False):
                _one_case(mesh, _config(tp, pp, schedule, vpp, m, tied), tokens)
    for m, tied in ((2 * pp, True), (3 * pp, False)):  # DualPipeV takes m >= 2 pp
        _one_case(mesh, _config(tp, pp, "dualpipev", 2, m, tied), tokens)
    if pp == 2:  # uneven stages (parallel.pipeline_layers)
        for schedule, vpp, layers in UNEVEN:
            _one_case(mesh, _config(tp, pp, schedule, vpp, 2 * pp, True, layers), tokens)


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (1, 4), (2, 2), (2, 4)])
def test_every_schedule_matches_one_process(tp: int, pp: int) -> None:
    run_ranks(_check_schedules, tp * pp, tp, pp, timeout_s=300)
