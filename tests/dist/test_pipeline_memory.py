"""What the runtime holds per rank, measured, against the verifier's in-flight count.

For every schedule (gpipe, 1f1b, interleaved vpp = 2, zb-h1, zb-h2, zb-v) with pp in {2, 4}
and m in {pp, 2pp}, real GPT chunks (one layer per stage) run one training step through
`PipelineRuntime` over gloo. After each compute action the test measures which (stage, mb)
pairs the rank still holds: those with a saved tensor of their forward graph alive (packed
through `torch.autograd.graph.saved_tensors_hooks` and counted until autograd releases it)
and those whose weight-gradient inputs wait in the chunk's `WeightGradStore` for W. That set
must be the runtime's own `held_pairs()`, and its peak over the step the verifier's
`peak_in_flight` and the memory model's `in_flight` for this rank.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.perf.cost.memory import in_flight
from ptdp.pipeline.actions import Action
from ptdp.pipeline.runtime import PipelineRuntime
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.rules.layout import validate
from ptdp.train.step.pipelined import boundary_shape, build_chunks, build_p2p
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

MBS, SEQ, VOCAB = 2, 8, 37

Pair = tuple[int, int]  # (stage, mb)


class _Saved:
    """A tensor autograd saved for backward; dropped when autograd releases it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensors:
    """Counts, per (stage, mb), the saved tensors of its forward graph that are still alive."""

    def __init__(self) -> None:
        self.alive: Counter[Pair] = Counter()
        self.packed_bytes: Counter[Pair] = Counter()
        self.pair: Pair | None = None  # the action running now

    def pack(self, tensor: torch.Tensor) -> _Saved:
        assert self.pair is not None, "a tensor saved outside a compute action"
        saved, pair = _Saved(tensor), self.pair
        self.alive[pair] += 1
        self.packed_bytes[pair] += tensor.numel() * tensor.element_size()
        weakref.finalize(saved, self._release, pair)
        return saved

    @staticmethod
    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, pair: Pair) -> None:
        self.alive[pair] -= 1

    def graphs(self) -> set[Pair]:
        return {pair for pair, n in self.alive.items() if n > 0}


def _config(pp: int, schedule: str, vpp: int, m: int) -> RunConfig:
    model = {
        "num_layers": pp * vpp,
        "hidden_size": 16,
        "num_heads": 2,
        "seq_length": SEQ,
        "vocab_size": VOCAB,
        "tie_embeddings": False,
    }
    parallel = {"pp": pp, "vpp": vpp, "schedule": schedule}
    train = {"micro_batch_size": MBS, "global_batch_size": MBS * m}
    return apply_updates(RunConfig(), {"model": model, "parallel": parallel, "train": train}, "t")


def _one_case(mesh: ParallelMesh, schedule: str, vpp: int, m: int) -> None:
    pp, rank = mesh.size("pp"), mesh.coord("pp")
    cfg = _config(pp, schedule, vpp, m)
    layout = validate(cfg, mesh.shape.world_size)
    plan = layout.pipeline
    chunks = build_chunks(cfg.model, layout, mesh, seed=1, recompute=cfg.parallel.recompute)
    shape = boundary_shape(cfg.model, layout, MBS)
    p2p = build_p2p(mesh, layout, shape, torch.float32, torch.device("cpu"), scatter_gather=True)
    tokens = torch.randint(0, VOCAB, (m, MBS, SEQ + 1), generator=torch.Generator().manual_seed(m))

    def forward_step(stage: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
        chunk = chunks[stage]
        if stage == 0:
            x = tokens[mb, :, :-1]
        if stage == plan.stages.last:
            return chunk(x, tokens[mb, :, 1:]) / m
        return chunk(x)

    saved, held = SavedTensors(), []  # held: the pairs after each compute action

    @contextlib.contextmanager
    def measured(a: Action) -> Iterator[None]:
        saved.pair = (a.stage, a.mb)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            yield
        saved.pair = None
        stashed = {key for chunk in chunks.values() for key in chunk.wgrad.keys()}
        now = saved.graphs() | stashed
        what = f"{schedule} pp={pp} m={m} rank {rank} after {a}"
        assert now == runtime.held_pairs(), f"{what}: measured {now}, {runtime.held_pairs()}"
        held.append(now)

    runtime = PipelineRuntime(
        chunks,
        forward_step,
        p2p,
        plan.stages,
        around_action=measured,
        wgrad={stage: chunk.wgrad for stage, chunk in chunks.items()},
    )
    runtime.run(plan.actions(rank))

    what = f"{schedule} pp={pp} vpp={vpp} m={m} rank {rank}"
    assert held[-1] == set() and runtime.held_pairs() == set(), f"{what}: {held[-1]}"
    peak = max(len(pairs) for pairs in held)
    assert peak == plan.report.peak_in_flight[rank], f"{what}: measured peak {peak}"
    assert peak == in_flight(plan)[rank], f"{what}: memory model {in_flight(plan)}"
    # Every microbatch's forward through a stage saves the same tensors.
    for stage in chunks:
        sizes = {saved.packed_bytes[(stage, mb)] for mb in range(m)}
        assert len(sizes) == 1 and sizes.pop() > 0, f"{what}: stage {stage} saved {sizes}"


def _check_held(rank: int, world_size: int) -> None:
    mesh = ParallelMesh.build(MeshShape(tp=1, dp=1, pp=world_size), rank)
    torch.manual_seed(0)
    for schedule, spec in SCHEDULES.items():
        vpp = spec.chunks or 2  # interleaved: two chunks per rank
        least = spec.min_microbatches(world_size)  # DualPipeV: 2 pp
        for m in sorted({max(world_size, least), max(2 * world_size, least + 1)}):
            _one_case(mesh, schedule, vpp, m)


@pytest.mark.parametrize("pp", [2, 4])
def test_held_activations_per_rank_are_the_verifiers_count(pp: int) -> None:
    run_ranks(_check_held, pp, timeout_s=240)
