"""One rank's trainer: its model chunks, gradient buffers and optimizer; a step's
microbatches, gradient accumulation, data-parallel averaging, clipping and AdamW;
evaluation; its checkpoints go through ptdp/checkpoint/manager.py. The loop around it is
ptdp/train/loop.py, the entry point ptdp/train/run.py.

Batch bookkeeping: optimizer step k consumes global samples [k*G, (k+1)*G). Data-parallel
rank r takes the contiguous slice [r*G/d, (r+1)*G/d) of them, in microbatches of
micro_batch_size, so the union over ranks is exactly the single-process batch and every
layout sees the same data. Each microbatch's mean loss is divided by the number of
microbatches, so the accumulated gradient is that of the mean loss over the batch.
"""

from __future__ import annotations

import contextlib
import math
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from ptdp.checkpoint import CheckpointManager
from ptdp.config.enums import AttentionBackend, Precision, Recovery
from ptdp.config.sections import RunConfig
from ptdp.data.documents import microbatch_positions
from ptdp.errors import ConfigError
from ptdp.model.attention_backend import attention_context, pick_backend, unequal_widths_note
from ptdp.model.compile import apply_compile, mark_step
from ptdp.model.gpt import count_parameters
from ptdp.parallel.comm import Group, all_reduce_mean_, all_reduce_sum_
from ptdp.parallel.context import split_sequence
from ptdp.parallel.data import GradBuffers
from ptdp.parallel.env import LaunchEnv, init_process_group, pick_device
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.parallel.roles import rank_roles
from ptdp.perf.cost.flops import flops_per_iteration, model_flops_per_iteration
from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.schedules import build
from ptdp.pipeline.timeline import TimelineRecorder
from ptdp.rules.layout import Layout
from ptdp.train.data_setup import RunData
from ptdp.train.faults.events import append_event
from ptdp.train.faults.numerical import FaultMonitor
from ptdp.train.faults.watchdog import Watchdog
from ptdp.train.step.loss_scale import DynamicLossScaler
from ptdp.train.step.moe import MoESteps
from ptdp.train.step.optim import Optimizer, lr_at, set_lr
from ptdp.train.step.pipelined import (
    Microbatch,
    PipelineStep,
    StepHooks,
    boundary_shape,
    build_chunks,
    build_p2p,
    tied_embedding_group,
)

PARAM_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
    Precision.FP8: torch.bfloat16,  # bf16 but for the linear layers' GEMMs
}


def _fp8_gemms(cfg: RunConfig, device: torch.device):
    """precision = fp8: the float8 GEMMs of the linear layers (torchao, imported only here
    among the trainer's modules: an optional dependency), if `device` can run them; else
    None."""
    if cfg.train.precision is not Precision.FP8:
        return None
    from ptdp.parallel.fp8 import Fp8Gemms, check_device

    check_device(device)
    return Fp8Gemms.build(cfg.train.fp8_recipe)


class Trainer:
    """Owns one rank's model, optimizer and data position; `ptdp.train.loop.run_loop` trains
    it to train.steps through its public methods."""

    def __init__(self, cfg: RunConfig, layout: Layout, env: LaunchEnv, data: RunData) -> None:
        self.cfg, self.layout, self.env, self.data = cfg, layout, env, data
        self.device = pick_device(cfg.train.device, env.local_rank)
        fp8 = _fp8_gemms(cfg, self.device)  # a GPU without float8 is refused before any group
        t = cfg.train
        if t.cuda_graphs and self.device.type != "cuda":  # train.device = auto on a CPU
            raise ConfigError(
                f"train.cuda_graphs = true needs a CUDA device, and this run has "
                f"{self.device.type}; set --train.cuda_graphs false"
            )
        store = init_process_group(env, self.device, t.collective_timeout_s)
        self.owns_process_group = store is not None
        self.mesh = (
            ParallelMesh.build(
                MeshShape(layout.tp, layout.dp, layout.pp, layout.cp, layout.ep, layout.etp),
                env.rank,
                timeout=timedelta(seconds=t.collective_timeout_s),
            )
            if env.world_size > 1
            else ParallelMesh.single()
        )
        self.is_main = env.rank == 0
        self.watchdog = (  # started at the end of __init__; None under a test harness
            Watchdog(
                store,
                env.rank,
                env.world_size,
                t.collective_timeout_s,
                straggler_factor=t.straggler_factor,
                say=self.say,
                store_host=env.store_host(),
                restart=env.restart,
                store_on_rank0=not env.elastic,
                on_failure=lambda record: append_event(self.run_dir, "failure", **record),
                in_process=t.recovery is Recovery.IN_PROCESS,
            )
            if store is not None
            else None
        )
        self.run_dir = Path(cfg.train.run_dir)
        self.tp, self.pp = self.mesh.axis("tp"), self.mesh.axis("pp")
        by_stage = build_chunks(  # this rank's model chunks
            cfg.model,
            layout,
            self.mesh,
            seed=t.seed,
            recompute=cfg.parallel.recompute,
            cp_comm=cfg.parallel.cp_comm,
            fp8=fp8,
        )
        if cfg.train.compile:  # regional: each transformer layer (ptdp/model/compile.py)
            apply_compile(by_stage.values(), cuda_graphs=t.cuda_graphs)
        self.chunks = list(by_stage.values())
        self.model = nn.ModuleList(self.chunks).to(self.device)
        folded = layout.folded
        self.grads = GradBuffers(
            self.chunks,
            roles=rank_roles(self.chunks),
            dp=self.mesh.axis("dp_cp"),  # replicas over dp and cp: one reduction (README)
            tp=self.tp,
            embedding=tied_embedding_group(
                self.mesh, layout, tied=cfg.model.tie_embeddings or cfg.model.mtp_depth > 0
            ),
            bucket_mb=cfg.parallel.bucket_mb,
            shard=layout.shards_optimizer,
            shard_grads=layout.shards_grads,
            shard_params=layout.shards_params,
            reshard_after_forward=cfg.parallel.zero3_reshard_after_forward,
            fp8_gather=fp8 if cfg.parallel.zero3_fp8_all_gather else None,
            overlap=cfg.parallel.overlap_grad_reduce,
            # Experts laid out apart from attention: their gradients over their replicas.
            expert_dp=self.mesh.axis("edp") if folded else None,
            ep=self.mesh.axis("ep") if folded else None,
            expert_tp=self.mesh.axis("etp") if folded else None,
        )
        dtype = PARAM_DTYPES[cfg.train.precision]
        # fp32 masters are taken from the fp32 initial weights, then the model is cast.
        self.optimizer = Optimizer(
            self.chunks, self.grads, cfg.optim, param_dtype=dtype, tp=self.tp, pp=self.pp
        )
        self.grads.cast_params(dtype)
        self.scaler = (
            DynamicLossScaler(cfg.optim.initial_loss_scale, cfg.optim.loss_scale_window)
            if cfg.train.precision is Precision.FP16
            else None
        )
        self.recorder = (
            TimelineRecorder(
                self.mesh.coord("pp"),
                sync=torch.cuda.synchronize if self.device.type == "cuda" else None,
            )
            if cfg.train.profile_timeline
            else None
        )
        self.moe = MoESteps(
            self.chunks,
            dp_cp=self.mesh.axis("dp_cp"),
            pp=self.pp,
            num_experts=cfg.model.num_experts,
            tp=self.tp,
        )
        """The MoE layers' loss scale, loads, bias updates and log figures (none if dense)."""
        self._mtp_interval: torch.Tensor | float = 0.0
        self._mtp_steps = 0
        self.pipeline = self._pipeline_step(by_stage, dtype) if layout.pp > 1 else None
        self.step = 0
        self.update_started = False
        """The optimizer update of the step in flight began (in-process recovery: the
        weights are no longer those of the start of the step)."""
        world = Group(None, env.world_size, env.rank) if env.world_size > 1 else Group.single()
        self.checkpoints = CheckpointManager(
            self.chunks,
            self.optimizer,
            self.scaler,
            self.mesh,
            world,
            self.device,
            cfg,
            layout.describe(),
            data.tokenizer_spec,
            self.say,
        )
        self.faults = FaultMonitor(cfg.train.on_nan, world, self.device, self.say)
        # Dropout: the shared stream is per data-parallel rank (they see different samples)
        # and the same on the ranks of a tensor group; split regions fork it (rank_rng).
        torch.manual_seed(cfg.train.seed + 7919 * (1 + self.mesh.coord("dp")))
        self.flops_per_step = flops_per_iteration(
            cfg.model, cfg.train.global_batch_size, cfg.parallel.recompute
        )  # executed, recomputation included; MFU counts model FLOPs (without it)
        self.model_flops_per_step = model_flops_per_iteration(
            cfg.model, cfg.train.global_batch_size
        )
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.attention = self._attention_kernel(dtype)
        if self.watchdog:
            self.watchdog.start()

    def _attention_kernel(self, dtype: torch.dtype) -> AttentionBackend | None:
        """train.attention_backend, `auto` timed once on this rank's attention shape."""
        m, t = self.cfg.model, self.cfg.train
        heads = max(1, m.num_heads // self.layout.tp)
        shape = (t.micro_batch_size, heads, m.seq_length // self.layout.cp, m.qk_head_dim)
        if note := unequal_widths_note(m.qk_head_dim, m.value_head_dim):
            self.say(note)
        kernel = pick_backend(
            t.attention_backend, shape=shape, dtype=dtype, device=self.device,
            value_dim=m.value_head_dim,
        )  # fmt: skip
        if t.attention_backend is AttentionBackend.AUTO and kernel is not None:
            self.say(f"attention kernel: {kernel.value} (the fastest on {list(shape)})")
        return kernel

    def _pipeline_step(self, by_stage: dict[int, nn.Module], dtype: torch.dtype) -> PipelineStep:
        """The layout's plan on this rank's chunks; the gradient reduction, timeline and
        watchdog hook into it."""
        cfg, layout = self.cfg, self.layout
        chunk_of_stage = {stage: i for i, stage in enumerate(by_stage)}
        shape = boundary_shape(cfg.model, layout, cfg.train.micro_batch_size)
        p2p = build_p2p(
            self.mesh, layout, shape, dtype, self.device, scatter_gather=cfg.parallel.scatter_gather
        )
        hooks = StepHooks(
            on_final_backward=lambda stage: self.grads.start_final(chunk_of_stage[stage]),
            on_step_end=self.grads.finish,
            around_action=self.around if self.recorder or self.watchdog else None,
            around_wait=self.watchdog.waiting_for if self.watchdog else None,
        )
        return PipelineStep(layout.pipeline, by_stage, p2p, self._autocast, hooks)

    # ------------------------------------------------------------------ batches

    def around(self, action: Action | str) -> contextlib.ExitStack:
        """Around each action: the timeline records it, the watchdog shows it."""
        stack = contextlib.ExitStack()
        if self.recorder and isinstance(action, Action):
            stack.enter_context(self.recorder.around_action(action))
        if self.watchdog:
            stack.enter_context(self.watchdog.doing(action))
        return stack

    def _microbatch(self, dataset, first_sample: int) -> Microbatch:
        size = self.cfg.train.micro_batch_size
        batch = dataset.batch(first_sample, size).to(self.device, non_blocking=True)
        positions = microbatch_positions(dataset, first_sample, size, self.cfg.data, self.device)
        # Under context parallelism each rank keeps its part of the window (and its positions).
        cp = self.mesh.axis("cp")
        return Microbatch(*split_sequence(batch[:, :-1], batch[:, 1:], positions, cp))

    def _autocast(self):
        """16-bit training: the weights are 16-bit already; autocast keeps the ops that need
        fp32 (softmax, norms, the loss) in fp32 and reconciles mixed dtypes."""
        dtype = PARAM_DTYPES[self.cfg.train.precision]
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def parameter_count(self, *, full: bool) -> int:
        """The whole model's parameters (full), or this rank's (its shards of its stages)."""
        local = sum(count_parameters(c, full=full, skip_tied_copies=full) for c in self.chunks)
        if not full:
            return local
        # On the device (NCCL reduces no CPU tensor), int64 (float32 is exact only to 2^24).
        total = torch.tensor(local, dtype=torch.int64, device=self.device)
        all_reduce_sum_(total, self.pp)
        return int(total.item())

    def _batches(self, dataset, first: int):
        """mb -> that microbatch, loaded once."""
        cache: dict[int, Microbatch] = {}
        size = self.cfg.train.micro_batch_size

        def batch(mb: int) -> Microbatch:
            if mb not in cache:
                cache[mb] = self._microbatch(dataset, first + mb * size)
            return cache[mb]

        return batch

    def _accumulate(self, batch, n: int, loss_scale: float) -> torch.Tensor:
        """Forward and backward of n microbatches on the whole model (no pipeline): one after
        the other, or under parallel.moe_overlap the forward of microbatch j + 1 paired with
        the backward of microbatch j (`one_f_one_b_paired`; the backwards, hence the
        gradient sums, in the same order)."""
        total = torch.zeros((), device=self.device)
        timed, losses = self.around, {}
        for a in build("1f1b", 1, n, paired=self.layout.moe_overlap)[0]:
            if a.kind is Kind.F:
                tokens, labels, positions = batch(a.mb)
                mark_step(self.cfg.train.cuda_graphs)
                with timed(a), self._autocast():
                    losses[a.mb] = self.chunks[0](tokens, labels, positions=positions) / n
                continue
            loss = losses.pop(a.mb)
            if a.mb == n - 1:  # its buckets reduce while the rest of this backward runs
                self.grads.start_final(0)
            with timed(a):
                (loss * loss_scale).backward()
            total += loss.detach().float()
        self.grads.finish()
        return total

    def forward_backward(self) -> torch.Tensor:
        """Gradients of the step's global batch, reduced over data-parallel ranks (this
        rank's shard of them with the distributed optimizer); returns the mean loss."""
        t, dp_rank = self.cfg.train, self.mesh.coord("dp")
        per_rank = t.global_batch_size // self.layout.dp
        batch = self._batches(self.data.train, self.step * t.global_batch_size + dp_rank * per_rank)
        scale = self.scaler.scale if self.scaler else 1.0
        self.model.train()
        self.grads.zero_grad()
        if self.recorder:
            self.recorder.clear()  # keep the last step only
        # A microbatch's MoE balancing losses enter the step's loss as its own loss does.
        self.moe.begin_step(scale / self.layout.num_microbatches)
        for chunk in self.chunks:
            chunk.mtp_state.begin_step()
        if self.pipeline is None:
            total = self._accumulate(batch, self.layout.num_microbatches, scale)
        else:  # the runtime starts and finishes the gradient reduction
            total = self.pipeline.train(batch, scale)
        balancing = self.moe.end_step()  # on every stage that holds MoE layers
        if balancing is not None:
            total = total + balancing
        # The loss (and each multi-token-prediction depth's, for the log) lives on the last
        # stage; equal token counts over dp x cp: the mean. One reduction for all of them.
        figures = torch.cat([total.view(1), self._mtp_depths()])
        all_reduce_sum_(figures, self.pp)
        all_reduce_mean_(figures, self.mesh.axis("dp_cp"))
        if self.cfg.model.mtp_depth:
            self._mtp_interval = self._mtp_interval + figures[1:]
            self._mtp_steps += 1
        return figures[0]

    def _mtp_depths(self) -> torch.Tensor:
        """This rank's multi-token-prediction loss of each depth this step ([mtp_depth],
        a microbatch's mean; zeros on a stage without the modules)."""
        depths = torch.zeros(self.cfg.model.mtp_depth, device=self.device)
        for state in (chunk.mtp_state for chunk in self.chunks):
            if state.microbatches:
                depths += torch.stack(state.losses) / state.microbatches
        return depths

    def mtp_log_record(self) -> dict:
        """mtp_loss: each depth's loss per step since the last call (not weighted; the
        logged training `loss` holds model.mtp_loss_weight x their mean, `val_loss` none)."""
        if not self._mtp_steps:
            return {}
        record = {"mtp_loss": (self._mtp_interval / self._mtp_steps).tolist()}
        self._mtp_interval, self._mtp_steps = 0.0, 0
        return record

    def optimizer_step(self, loss: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """Unscale, clip and apply the reduced gradients; returns (grad norm, skipped).

        fp16: a step with inf/NaN gradients is skipped and the loss scale halved. Otherwise a
        non-finite loss or norm is a fault, handled by train.on_nan
        (ptdp/train/faults/numerical.py): skip returns skipped, stop and rollback raise
        NumericalFault (on every rank)."""
        if self.scaler:
            self.optimizer.scale_grads(1.0 / self.scaler.scale)
        norm = self.optimizer.grad_norm()
        flags = self.faults.flags(loss, norm, fp16=self.scaler is not None)
        if self.optimizer.fused and not self.scaler:
            # Queue the update first; the kernel drops it on the device if flags[0] is 1.
            self._update(norm, found_inf=flags[0])
            return norm, self.faults.decide(self.step + 1, loss, norm, flags)
        skipped = self.faults.decide(self.step + 1, loss, norm, flags)
        if self.scaler:
            skipped = not math.isfinite(norm.item())
            self.scaler.update(found_inf=skipped)
        if not skipped:
            self._update(norm)
        return norm, skipped

    def _update(self, norm: torch.Tensor, found_inf: torch.Tensor | None = None) -> None:
        self.update_started = True
        set_lr(self.optimizer, lr_at(self.step, self.cfg.optim, self.cfg.train.steps))
        self.optimizer.clip(self.cfg.optim.grad_clip, norm)
        self.optimizer.step(found_inf)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss over the global batch, MoE balancing losses
        included, grad norm)."""
        with self.around("forward-backward"), attention_context(self.attention):
            total = self.forward_backward()
        with self.around("optimizer step"):
            grad_norm, skipped = self.optimizer_step(total)
            if not skipped:
                self.moe.update_biases()
        self.step += 1
        return total, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first eval_iters microbatches of the validation split, shared
        out over data-parallel ranks (so every layout evaluates the same samples)."""
        t, valid, dp = self.cfg.train, self.data.valid, self.layout.dp
        per_rank = max(1, min(-(-t.eval_iters // dp), len(valid) // (t.micro_batch_size * dp)))
        batch = self._batches(valid, self.mesh.coord("dp") * per_rank * t.micro_batch_size)
        self.model.eval()
        if self.pipeline is None:
            total = torch.zeros((), device=self.device)
            for j in range(per_rank):
                tokens, labels, positions = batch(j)
                with self._autocast():
                    loss = self.chunks[0](tokens, labels, positions=positions)
                    total += loss.float() / per_rank
        else:
            total = self.pipeline.evaluate(batch, per_rank)
        all_reduce_sum_(total, self.pp)
        all_reduce_mean_(total, self.mesh.axis("dp_cp"))
        return total.item()

    # ------------------------------------------------------------------ checkpoints
    # The bodies live in ptdp/checkpoint/manager.py; these keep the loop's interface.

    def state(self) -> dict[str, Any]:
        """This rank's checkpoint entries at the current step (CheckpointManager.state)."""
        return self.checkpoints.state(self.step)

    def save(self) -> Path:
        """Save the current step (CheckpointManager.save; collective)."""
        return self.checkpoints.save(self.step)

    def finish_save(self) -> Path | None:
        """Publish the asynchronous save in flight, if any (collective)."""
        return self.checkpoints.finish_save()

    def publish_save_after_failure(self) -> None:
        """After a failure, publish an earlier asynchronous save where one process can."""
        self.checkpoints.publish_save_after_failure()

    def restore(self, step_dir: Path) -> None:
        """Load a checkpoint saved in any layout and continue from its step."""
        self.step = self.checkpoints.restore(step_dir)

    # ------------------------------------------------------------------ logging

    def say(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message, file=sys.stdout)
