"""PipelineRuntime on toy MLP stages over gloo, against the same MLP run in one process.

The runtime test of STYLE's three levels, independent of the GPT model: the stages are
small residual MLPs, each rank runs its lowered action list from `build_plan` with the
real `P2P`, and the loss and every parameter gradient must match one process to float32
rounding (rel < 1e-5), for gpipe, 1f1b, interleaved (vpp = 2), zb-h1, zb-h2 and zb-v (B/W
split), with m in {pp, 2pp} and with a loss scale. The hooks (on_final_backward once per
local stage, on_step_end once, last) and the freeing of sent outputs are checked on the
way. All cases of one pipeline size share one spawn.

Shapes: b = micro-batch rows, h = features (every stage maps [b, h] -> [b, h]).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ptdp.parallel.comm import all_reduce_sum_, gather_objects
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.p2p import P2P
from ptdp.pipeline.plan import build_plan
from ptdp.pipeline.runtime import PipelineRuntime
from ptdp.pipeline.schedules import SCHEDULES
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

B, H = 3, 8
CASES = [  # (schedule, vpp, loss scale)
    ("gpipe", 1, 1.0),
    ("1f1b", 1, 1.0),
    ("1f1b", 1, 4.0),
    ("interleaved", 2, 1.0),
    ("zb-h1", 1, 1.0),
    ("zb-h2", 1, 1.0),
    ("zb-v", 2, 1.0),
    ("dualpipev", 2, 1.0),  # m >= 2 pp: 2 pp and 2 pp + 1
]


class Block(nn.Module):
    """x + fc2(gelu(fc1(x))): ends in a residual add, as a GPT chunk does, so freeing a
    sent output (the runtime's deallocation) leaves its backward intact."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def _stage(stage: int) -> Block:
    """Stage `stage` of the model, the same in every process (seeded by its index)."""
    with torch.random.fork_rng():
        torch.manual_seed(100 + stage)
        return Block(H)


def _data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, [m, b, h] each."""
    g = torch.Generator().manual_seed(m)
    return torch.randn(m, B, H, generator=g), torch.randn(m, B, H, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor, m: int) -> torch.Tensor:
    return F.mse_loss(out, target) / m  # the runtime expects the loss over m already


def _reference(num_stages: int, m: int, scale: float) -> tuple[torch.Tensor, dict]:
    """The loss and gradients (of loss * scale) of the whole MLP in this process."""
    stages = [_stage(s) for s in range(num_stages)]
    xs, ys = _data(m)
    total = torch.zeros(())
    for x, y in zip(xs, ys):
        for block in stages:
            x = block(x)
        total = total + _loss(x, y, m)
    (total * scale).backward()
    grads = {f"{s}.{n}": p.grad for s, b in enumerate(stages) for n, p in b.named_parameters()}
    return total.detach(), grads


def _weight_grad(a: object) -> bool:
    return isinstance(a, Action) and a.kind in (Kind.BW, Kind.W)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _one_case(mesh: ParallelMesh, schedule: str, vpp: int, m: int, scale: float) -> None:
    pp, rank = mesh.size("pp"), mesh.coord("pp")
    num_stages, last = pp * vpp, pp * vpp - 1
    stages = SCHEDULES[schedule].stage_map(pp, vpp)
    chunks = {s: _stage(s) for s in stages.stages_of(rank)}
    xs, ys = _data(m)

    def forward_step(stage: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
        out = chunks[stage](xs[mb] if stage == 0 else x)
        return _loss(out, ys[mb], m) if stage == last else out

    p2p = P2P(
        ranks=[mesh.shape.rank_of(tp=0, dp=0, pp=i) for i in range(pp)],
        shape=(B, H),
        dtype=torch.float32,
        device=torch.device("cpu"),
        tp=mesh.axis("tp"),
    )
    log: list[object] = []  # compute actions, ("final", stage) and "end", in call order

    def around_action(a: Action) -> contextlib.AbstractContextManager:
        log.append(a)
        return contextlib.nullcontext()

    runtime = PipelineRuntime(
        chunks,
        forward_step,
        p2p,
        stages,
        on_final_backward=lambda stage: log.append(("final", stage)),
        on_step_end=lambda: log.append("end"),
        loss_scale=scale,
        around_action=around_action,
    )
    actions = build_plan(schedule, pp, m, vpp).actions(rank)
    losses = runtime.run(actions)

    what = f"{schedule} pp={pp} vpp={vpp} m={m} scale={scale} rank {rank}"
    assert log[-1] == "end" and log.count("end") == 1, f"{what}: {log}"
    computed = [a for a in log if isinstance(a, Action)]
    assert computed == [a for a in actions if not a.kind.is_comm], what
    finals = [(i, x[1]) for i, x in enumerate(log) if isinstance(x, tuple)]
    assert sorted(s for _, s in finals) == sorted(chunks), f"{what}: {finals}"
    for i, stage in finals:  # right before the stage's last weight-gradient action
        weights = [j for j, a in enumerate(log) if _weight_grad(a) and a.stage == stage]
        assert len(weights) == m and weights[-1] == i + 1, f"{what}: {log}"
    # Each stage that sends its output frees it; ZB-V's turn (stage pp - 1 to pp) keeps it.
    senders = sum(1 for s in chunks if s != last and not stages.same_rank(s, s + 1))
    assert runtime.freed_bytes >= senders * m * B * H * 4, f"{what}: {runtime.freed_bytes}"
    assert len(losses) == (m if last in chunks else 0), what

    loss = torch.stack(losses).sum() if losses else torch.zeros(())
    all_reduce_sum_(loss, mesh.axis("pp"))
    grads = {f"{s}.{n}": p.grad for s, b in chunks.items() for n, p in b.named_parameters()}
    parts = gather_objects(grads, mesh.axis("pp"))
    if mesh.rank != 0:
        return
    merged = {k: v for part in parts for k, v in part.items()}
    ref_loss, ref_grads = _reference(num_stages, m, scale)
    assert _rel(loss, ref_loss) < 1e-5, f"{what}: loss {loss.item()} vs {ref_loss.item()}"
    assert merged.keys() == ref_grads.keys(), what
    for name, g in merged.items():
        err = _rel(g, ref_grads[name])
        assert err < 1e-5, f"{what}: gradient of {name}, relative error {err:.1e}"


def _check_runtime(rank: int, world_size: int) -> None:
    mesh = ParallelMesh.build(MeshShape(tp=1, dp=1, pp=world_size), rank)
    for schedule, vpp, scale in CASES:
        least = SCHEDULES[schedule].min_microbatches(world_size)
        for m in sorted({max(world_size, least), max(2 * world_size, least + 1)}):
            _one_case(mesh, schedule, vpp, m, scale)


@pytest.mark.parametrize("pp", [2, 4])
def test_runtime_matches_one_process_on_mlp_stages(pp: int) -> None:
    run_ranks(_check_runtime, pp, timeout_s=120)
