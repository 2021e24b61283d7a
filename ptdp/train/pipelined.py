"""A rank's model chunks and the pipeline step that runs them through a schedule.

With pp = 1 there is one chunk (the whole model) and the trainer runs plain gradient
accumulation; with pp > 1 the rank holds `vpp` chunks (stages r, r + pp, ...) and each
step executes this rank's action list from `ptdp.pipeline.schedules` with the runtime.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ptdp.config import RunConfig
from ptdp.layout import Layout
from ptdp.model.gpt import GPT
from ptdp.parallel.mesh import ParallelMesh
from ptdp.pipeline.actions import Action
from ptdp.pipeline.p2p import P2P
from ptdp.pipeline.partition import layer_ranges, stages_of_rank
from ptdp.pipeline.runtime import PipelineRuntime
from ptdp.pipeline.schedules import add_comms, build, forward_only
from ptdp.pipeline.verify import verify

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""mb -> (tokens, labels) of that microbatch."""


def build_chunks(cfg: RunConfig, mesh: ParallelMesh, layout: Layout) -> dict[int, GPT]:
    """This rank's model chunks by global stage, each initialised as its slice of the
    single-process model."""
    pp, vpp = layout.pp, layout.vpp
    ranges = layer_ranges(cfg.model.num_layers, pp, vpp)
    last = pp * vpp - 1
    tp = mesh.axis("tp") if layout.tp > 1 else None
    return {
        stage: GPT(
            cfg.model,
            seed=cfg.train.seed,
            recompute=cfg.parallel.recompute,
            tp=tp,
            sequence_parallel=cfg.parallel.sequence_parallel,
            layers=ranges[stage],
            has_embedding=stage == 0,
            has_head=stage == last,
        )
        for stage in stages_of_rank(mesh.coord("pp"), pp, vpp)
    }


def pipeline_summary(cfg: RunConfig, layout: Layout) -> str:
    """The schedule and its bubble under unit costs (verify's dry run), for the run's log."""
    name, pp, vpp, m = cfg.parallel.schedule.value, layout.pp, layout.vpp, layout.num_microbatches
    report = verify(add_comms(build(name, pp, m, vpp), pp, vpp), pp, vpp, m)
    return (
        f"pipeline | schedule {name} | {pp} stages x {vpp} chunks | {m} microbatches per "
        f"pipeline per step | predicted bubble {report.bubble_fraction:.3f} of the ideal time "
        f"(unit costs) | peak stored activations (microbatch x chunk) per rank "
        f"{list(report.peak_in_flight)}"
    )


class PipelineStep:
    """Runs one training or evaluation step of this rank's schedule."""

    def __init__(
        self,
        cfg: RunConfig,
        layout: Layout,
        mesh: ParallelMesh,
        chunks: dict[int, GPT],
        device: torch.device,
        autocast: Callable,
        on_final_backward: Callable[[int], None] | None = None,
        on_step_end: Callable[[], None] | None = None,
        dtype: torch.dtype = torch.float32,
        around_action: Callable | None = None,
        around_wait: Callable | None = None,
    ) -> None:
        self.cfg, self.layout, self.chunks, self.autocast = cfg, layout, chunks, autocast
        self.on_final_backward, self.on_step_end = on_final_backward, on_step_end
        self.device, self.dtype, self.around_action = device, dtype, around_action
        self.around_wait = around_wait
        pp, vpp, rank = layout.pp, layout.vpp, mesh.coord("pp")
        self.pp_rank, self.last = rank, pp * vpp - 1
        plan = build(cfg.parallel.schedule.value, pp, layout.num_microbatches, vpp)
        self.actions: list[Action] = add_comms(plan, pp, vpp)[rank]
        m, s, t = cfg.model, cfg.model.seq_length, layout.tp
        sp = cfg.parallel.sequence_parallel and t > 1
        coords = mesh.shape.coords(mesh.rank)
        self.p2p = P2P(
            ranks=[mesh.shape.rank_of(tp=coords["tp"], dp=coords["dp"], pp=i) for i in range(pp)],
            shape=(s // t if sp else s, cfg.train.micro_batch_size, m.hidden_size),
            dtype=dtype,  # the parameters' dtype: 16-bit boundaries under mixed precision
            device=device,
            tp=mesh.axis("tp"),
            scatter_gather=cfg.parallel.scatter_gather and t > 1 and not sp,
        )
        self.p2p.warm_up(rank)

    def _runtime(
        self, batch: Batch, num_microbatches: int, training: bool, loss_scale: float = 1.0
    ) -> PipelineRuntime:
        def forward_step(stage: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
            chunk = self.chunks[stage]  # only the first and last stage read the data
            with self.autocast():
                if stage == 0:
                    x = batch(mb)[0]
                if stage == self.last:
                    return chunk(x, batch(mb)[1]) / num_microbatches
                return chunk(x).to(self.dtype)

        return PipelineRuntime(
            self.chunks,
            forward_step,
            self.p2p,
            self.last + 1,
            self.layout.pp,
            on_final_backward=self.on_final_backward if training else None,
            on_step_end=self.on_step_end if training else None,
            loss_scale=loss_scale,
            around_action=self.around_action if training else None,
            around_wait=self.around_wait,
        )

    def train(self, batch: Batch, loss_scale: float = 1.0) -> torch.Tensor:
        """Forward and backward of every microbatch; returns this rank's share of the loss
        (the mean over microbatches on the last stage, 0 elsewhere). Gradients are those
        of the loss times `loss_scale` (fp16)."""
        runtime = self._runtime(batch, self.layout.num_microbatches, True, loss_scale)
        losses = runtime.run(self.actions)
        self.last_runtime = runtime  # for inspection: freed memory, timings
        return torch.stack(losses).sum().float() if losses else torch.zeros((), device=self.device)

    @torch.no_grad()
    def evaluate(self, batch: Batch, num_microbatches: int) -> torch.Tensor:
        plan = forward_only(self.layout.pp, num_microbatches, self.layout.vpp)
        actions = add_comms(plan, self.layout.pp, self.layout.vpp)[self.pp_rank]
        losses = self._runtime(batch, num_microbatches, False).run(actions)
        return torch.stack(losses).sum().float() if losses else torch.zeros((), device=self.device)
