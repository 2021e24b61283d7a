"""A rank's model chunks and the pipeline step that runs them through a schedule.

With pp = 1 there is one chunk (the whole model) and the trainer runs plain gradient
accumulation; with pp > 1 the rank holds `vpp` chunks (the stages its schedule's placement
gives it) and each step executes this rank's action list of the layout's `PipelinePlan` with
the runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ptdp.config.enums import CpComm, Recompute
from ptdp.config.sections import ModelConfig
from ptdp.model.gpt import GPT
from ptdp.model.positions import TokenPositions
from ptdp.parallel.comm import Group
from ptdp.parallel.mesh import ParallelMesh
from ptdp.pipeline.actions import Action
from ptdp.pipeline.p2p import P2P
from ptdp.pipeline.partition import layer_ranges
from ptdp.pipeline.plan import PipelinePlan, build_forward_only
from ptdp.pipeline.runtime import PipelineRuntime
from ptdp.rules.layout import Layout

if TYPE_CHECKING:
    from ptdp.parallel.fp8 import Fp8Gemms


class Microbatch(NamedTuple):
    """One microbatch as this rank's chunks read it."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: TokenPositions | None = None
    """The tokens' places in the window, where not simply 0..s-1 (`ptdp.model.positions`)."""


Batch = Callable[[int], Microbatch]
"""mb -> that microbatch, loaded once."""


def build_chunks(
    model: ModelConfig,
    layout: Layout,
    mesh: ParallelMesh,
    *,
    seed: int,
    recompute: Recompute,
    cp_comm: CpComm = CpComm.RING,
    fp8: Fp8Gemms | None = None,
) -> dict[int, GPT]:
    """This rank's model chunks by global stage, each initialised as its slice of the
    single-process model (`fp8`: their linear layers' GEMMs in float8)."""
    pp, vpp, stages = layout.pp, layout.vpp, layout.stages
    ranges = layer_ranges(model.num_layers, pp, vpp, layout.stage_layers)
    last = stages.last
    tp = mesh.axis("tp") if layout.tp > 1 else None
    return {
        stage: GPT(
            model,
            seed=seed,
            recompute=recompute,
            tp=tp,
            cp=mesh.axis("cp") if layout.cp > 1 else None,
            cp_comm=cp_comm,
            ep=mesh.axis("ep") if layout.ep > 1 else None,
            etp=mesh.axis("etp") if layout.etp > 1 else None,  # a dense model reads none
            sequence_parallel=layout.sequence_parallel,
            layers=ranges[stage],
            has_embedding=stage == 0,
            has_head=stage == last,
            fp8=fp8,
            moe_overlap=layout.moe_overlap,
        )
        for stage in stages.stages_of(mesh.coord("pp"))
    }


def tied_embedding_group(mesh: ParallelMesh, layout: Layout, *, tied: bool) -> Group:
    """Where a tied embedding's two copies sum their gradients: the first and the last
    pipeline rank, or no group when one rank holds both ends (pp = 1, ZB-V's V: the copies
    are summed on that rank, `ptdp.parallel.grads.sum_tied_`)."""
    stages = layout.stages
    if not tied or stages.same_rank(0, stages.last):
        return Group.single()
    return mesh.axis("embedding")


def build_p2p(
    mesh: ParallelMesh,
    layout: Layout,
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    scatter_gather: bool,
) -> P2P:
    """Transfers of boundary tensors `shape` ([s or s/t, b, h]) to this rank's pipeline peers
    (same tp, cp and dp coordinates), set up once (NCCL communicators exist before step 1)."""
    coords = mesh.shape.coords(mesh.rank)
    ranks = [mesh.shape.rank_of(**{**coords, "pp": i}) for i in range(layout.pp)]
    sp = layout.sequence_parallel and layout.tp > 1
    p2p = P2P(
        ranks=ranks,
        shape=shape,
        dtype=dtype,  # the parameters' dtype: 16-bit boundaries under mixed precision
        device=device,
        tp=mesh.axis("tp"),
        scatter_gather=scatter_gather and layout.tp > 1 and not sp,
    )
    p2p.warm_up(mesh.coord("pp"))
    return p2p


def boundary_shape(
    model: ModelConfig, layout: Layout, micro_batch_size: int
) -> tuple[int, int, int]:
    """[s, b, h] of what crosses between stages, s being this rank's part of the window
    (S/cp); [s/t, b, h] under sequence parallelism."""
    s, t = model.seq_length // layout.cp, layout.tp
    sp = layout.sequence_parallel and t > 1
    return (s // t if sp else s, micro_batch_size, model.hidden_size)


@dataclass(frozen=True)
class StepHooks:
    """What the trainer injects into a training step (none is needed to run one)."""

    on_final_backward: Callable[[int], None] | None = None
    """Called with a stage before its last weight-gradient action: start its DP reduction."""
    on_step_end: Callable[[], None] | None = None
    """Called after this rank's last action: finish the gradient reduction."""
    around_action: Callable[[Action], AbstractContextManager] | None = None
    """Wraps each compute action of a training step (timeline, watchdog)."""
    around_wait: Callable[[str], AbstractContextManager] | None = None
    """Wraps each wait for a received tensor (watchdog)."""


class PipelineStep:
    """Runs one training or evaluation step of this rank's share of a `PipelinePlan`."""

    def __init__(
        self,
        plan: PipelinePlan,
        chunks: dict[int, GPT],
        p2p: P2P,
        autocast: Callable[[], AbstractContextManager],
        hooks: StepHooks = StepHooks(),
    ) -> None:
        self.plan, self.chunks, self.p2p = plan, chunks, p2p
        self.autocast, self.hooks = autocast, hooks
        self.pp_rank = plan.stages.rank(next(iter(chunks)))
        self.last = plan.stages.last

    def _runtime(
        self, batch: Batch, num_microbatches: int, training: bool, loss_scale: float = 1.0
    ) -> PipelineRuntime:
        dtype = self.p2p.dtype

        def forward_step(stage: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
            chunk = self.chunks[stage]  # tokens for the first stage, labels for the last
            data = batch(mb)
            with self.autocast():
                if stage == 0:
                    x = data.tokens
                if stage == self.last:
                    return chunk(x, data.labels, positions=data.positions) / num_microbatches
                return chunk(x, positions=data.positions).to(dtype)

        hooks = self.hooks if training else StepHooks(around_wait=self.hooks.around_wait)
        return PipelineRuntime(
            self.chunks,
            forward_step,
            self.p2p,
            self.plan.stages,
            on_final_backward=hooks.on_final_backward,
            on_step_end=hooks.on_step_end,
            loss_scale=loss_scale,
            around_action=hooks.around_action,
            around_wait=hooks.around_wait,
            wgrad={stage: chunk.wgrad for stage, chunk in self.chunks.items()},
        )

    def train(self, batch: Batch, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every microbatch; returns this rank's share of the loss
        (the mean over microbatches on the last stage, 0 elsewhere). Gradients are those
        of the loss times `loss_scale` (fp16)."""
        runtime = self._runtime(batch, self.plan.num_microbatches, True, loss_scale)
        losses = runtime.run(self.plan.actions(self.pp_rank))
        self.last_runtime = runtime  # for inspection: freed memory, timings
        return self._sum(losses)

    @torch.no_grad()
    def evaluate(self, batch: Batch, num_microbatches: int) -> torch.Tensor:
        plan = build_forward_only(self.plan.stages, num_microbatches)
        losses = self._runtime(batch, num_microbatches, False).run(plan.actions(self.pp_rank))
        return self._sum(losses)

    def _sum(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if not losses:
            return torch.zeros((), device=self.p2p.device)
        return torch.stack(losses).sum().float()
