"""One rank's trainer: its model chunks, gradient buffers and optimizer; a step's
microbatches, gradient accumulation, data-parallel averaging, clipping and AdamW;
evaluation; and the checkpoint state. The loop around it is ptdp/train/loop.py, the
entry point ptdp/train/run.py.

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from ptdp.config import Precision, RunConfig, to_dict
from ptdp.errors import CheckpointError
from ptdp.layout import Layout
from ptdp.model.compile import apply_compile
from ptdp.model.gpt import count_parameters
from ptdp.parallel.comm import Group, all_gather_objects, all_reduce_mean_, all_reduce_sum_
from ptdp.parallel.data import GradBuffers
from ptdp.parallel.env import LaunchEnv, init_process_group, pick_device
from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.parallel.roles import rank_roles
from ptdp.parallel.sharded_state import load_plan, sharded_state, stage_mesh, unpack
from ptdp.parallel.state import local_model_state, local_optimizer_state
from ptdp.perf.flops import flops_per_iteration
from ptdp.perf.timeline import TimelineRecorder
from ptdp.pipeline.actions import Action, Kind
from ptdp.train import checkpoint as ckpt
from ptdp.train.data_setup import RunData
from ptdp.train.faults import FaultMonitor
from ptdp.train.loop import TrainResult, run_loop
from ptdp.train.loss_scale import DynamicLossScaler
from ptdp.train.optim import Optimizer, lr_at, set_lr
from ptdp.train.pipelined import PipelineStep, build_chunks
from ptdp.train.watchdog import Watchdog

PARAM_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
}


class Trainer:
    """Owns one rank's model, optimizer and data position; `run()` trains to train.steps."""

    def __init__(self, cfg: RunConfig, layout: Layout, env: LaunchEnv, data: RunData) -> None:
        self.cfg, self.layout, self.env, self.data = cfg, layout, env, data
        self.device = pick_device(cfg.train.device, env.local_rank)
        t = cfg.train
        store = init_process_group(env, self.device, t.collective_timeout_s)
        self.owns_process_group = store is not None
        self.mesh = (
            ParallelMesh.build(MeshShape(layout.tp, layout.dp, layout.pp), env.rank)
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
            )
            if store is not None
            else None
        )
        self.run_dir = Path(cfg.train.run_dir)
        self.tp, self.pp = self.mesh.axis("tp"), self.mesh.axis("pp")
        by_stage = build_chunks(cfg, self.mesh, layout)  # this rank's model chunks
        if cfg.train.compile:  # regional: each transformer layer (ptdp/model/compile.py)
            apply_compile(by_stage.values())
        self.chunks = list(by_stage.values())
        self.model = nn.ModuleList(self.chunks).to(self.device)
        self.grads = GradBuffers(
            self.chunks,
            roles=rank_roles(self.chunks),
            dp=self.mesh.axis("dp"),
            tp=self.tp,
            embedding=self.mesh.axis("embedding") if cfg.model.tie_embeddings else Group.single(),
            bucket_mb=cfg.parallel.bucket_mb,
            shard=cfg.optim.distributed,
            overlap=cfg.parallel.overlap_grad_reduce,
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
        chunk_of_stage = {stage: i for i, stage in enumerate(by_stage)}
        self.pipeline = (
            PipelineStep(
                cfg,
                layout,
                self.mesh,
                by_stage,
                self.device,
                self._autocast,
                on_final_backward=lambda stage: self.grads.start_final(chunk_of_stage[stage]),
                on_step_end=self.grads.finish,
                dtype=dtype,
                around_action=self._around if self.recorder or self.watchdog else None,
                around_wait=self.watchdog.waiting_for if self.watchdog else None,
            )
            if layout.pp > 1
            else None
        )
        self.step = 0
        self._pending_save: ckpt.PendingCheckpoint | None = None  # async save in flight
        self._async_group: dist.ProcessGroup | None = None  # its collectives' own group
        world = Group(None, env.world_size, env.rank) if env.world_size > 1 else Group.single()
        self.faults = FaultMonitor(cfg.train.on_nan, world, self.device, self.say)
        # Dropout: the shared stream is per data-parallel rank (they see different samples)
        # and the same on the ranks of a tensor group; split regions fork it (rank_rng).
        torch.manual_seed(cfg.train.seed + 7919 * (1 + self.mesh.coord("dp")))
        self.flops_per_step = flops_per_iteration(
            cfg.model, cfg.train.global_batch_size, cfg.parallel.recompute
        )
        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        if self.watchdog:
            self.watchdog.start()

    # ------------------------------------------------------------------ batches

    def _around(self, action: Action | str) -> contextlib.ExitStack:
        """Around each action: the timeline records it, the watchdog shows it."""
        stack = contextlib.ExitStack()
        if self.recorder and isinstance(action, Action):
            stack.enter_context(self.recorder.around_action(action))
        if self.watchdog:
            stack.enter_context(self.watchdog.doing(action))
        return stack

    def _microbatch(self, dataset, first_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = dataset.batch(first_sample, self.cfg.train.micro_batch_size)
        batch = batch.to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

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
        """mb -> (tokens, labels), loaded once per microbatch."""
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        size = self.cfg.train.micro_batch_size

        def batch(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
            if mb not in cache:
                cache[mb] = self._microbatch(dataset, first + mb * size)
            return cache[mb]

        return batch

    def _accumulate(self, batch, n: int, loss_scale: float) -> torch.Tensor:
        """Forward and backward of n microbatches on the whole model (no pipeline)."""
        total = torch.zeros((), device=self.device)
        timed = self._around
        for j in range(n):
            tokens, labels = batch(j)
            with timed(Action(Kind.F, 0, j)), self._autocast():
                loss = self.chunks[0](tokens, labels) / n
            if j == n - 1:  # its buckets reduce while the rest of this backward runs
                self.grads.start_final(0)
            with timed(Action(Kind.BW, 0, j)):
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
        if self.pipeline is None:
            total = self._accumulate(batch, self.layout.num_microbatches, scale)
        else:  # the runtime starts and finishes the gradient reduction
            total = self.pipeline.train(batch, scale)
        all_reduce_sum_(total, self.pp)  # the loss lives on the last stage
        all_reduce_mean_(total, self.mesh.axis("dp"))
        return total

    def optimizer_step(self, loss: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """Unscale, clip and apply the reduced gradients; returns (grad norm, skipped).

        fp16: a step with inf/NaN gradients is skipped and the loss scale halved. Otherwise a
        non-finite loss or norm is a fault, handled by train.on_nan (ptdp/train/faults.py):
        skip returns skipped, stop and rollback raise NumericalFault (on every rank)."""
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
        set_lr(self.optimizer, lr_at(self.step, self.cfg.optim, self.cfg.train.steps))
        self.optimizer.clip(self.cfg.optim.grad_clip, norm)
        self.optimizer.step(found_inf)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (mean loss over the global batch, grad norm)."""
        with self._around("forward-backward"):
            total = self.forward_backward()
        with self._around("optimizer step"):
            grad_norm, _ = self.optimizer_step(total)
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
                tokens, labels = batch(j)
                with self._autocast():
                    total += self.chunks[0](tokens, labels).float() / per_rank
        else:
            total = self.pipeline.evaluate(batch, per_rank)
        all_reduce_sum_(total, self.pp)
        all_reduce_mean_(total, self.mesh.axis("dp"))
        return total.item()

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, Any]:
        """This rank's checkpoint entries (ptdp/train/checkpoint.py): its shards of the
        fp32 master weights and AdamW moments as DCP tensors, its random state, and the
        run's scalars (the same on every rank; DCP writes them once)."""
        masters = self.optimizer.master_weights()  # fp32, also under 16-bit training
        moments, opt_step = self.optimizer.moments()
        state = sharded_state(self.chunks, masters, moments, self._stage_mesh(), self.tp.rank)
        rng = f"{ckpt.RNG}rank{self.env.rank}/"
        state[rng + "cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            state[rng + "cuda"] = torch.cuda.get_rng_state(self.device)
        groups = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]
        return state | {
            "optimizer/step": opt_step,
            "optimizer/param_groups": groups,
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
            "step": self.step,
            "consumed_samples": self.step * self.cfg.train.global_batch_size,
            "config": to_dict(self.cfg),
            "tokenizer": self._tokenizer_entry(),
            "layout": self.layout.describe(),
        }

    def _stage_mesh(self):
        """The DCP device mesh of this rank's pipeline stage (built once, collectively)."""
        if not hasattr(self, "_dcp_mesh"):
            self._dcp_mesh = stage_mesh(self.mesh, self.device)
        return self._dcp_mesh

    def _tokenizer_entry(self) -> str:
        """How generation finds the tokenizer: "bytes", the copied tokenizer.json, or ""."""
        spec = self.data.tokenizer_spec
        return spec if spec in ("bytes", "") else "tokenizer.json"

    def save(self) -> Path:
        """Every rank writes its own shards (no gather); rank 0 publishes the result.

        With `train.async_save`, the state is copied to CPU memory and written in the
        background; it is published by the next `save` or `finish_save` (all ranks call
        both at the same steps), so `latest` names it only then."""
        self.finish_save()  # the previous asynchronous save first
        spec = self.data.tokenizer_spec
        tok = Path(spec) if spec and spec != "bytes" else None
        asynchronous = self.cfg.train.async_save
        pending = ckpt.start_checkpoint(
            self.run_dir,
            self.step,
            self.state(),
            self.cfg,
            tok,
            keep=self.cfg.train.keep_checkpoints,
            distributed=self.env.world_size > 1,
            asynchronous=asynchronous,
            process_group=self._save_group() if asynchronous else None,
        )
        if not asynchronous:
            return pending.finish()
        self._pending_save = pending
        return pending.final

    def finish_save(self) -> Path | None:
        """Wait for the asynchronous save in flight, if any, and publish it (collective)."""
        pending = self._pending_save
        if pending is None:
            return None
        self._pending_save = None
        step_dir = pending.finish()
        self.say(f"saved checkpoint {step_dir}")
        return step_dir

    def publish_save_after_failure(self) -> None:
        """A run that failed still publishes the asynchronous save of an earlier, good
        step, in one process: there is no peer to wait for. With several ranks publishing
        needs all of them, and some may be gone; that save stays unpublished (`.tmp`)."""
        if self._pending_save is None or self.env.world_size > 1:
            return
        try:
            self.finish_save()
        except Exception as exc:  # the run's own error matters more: say, do not raise
            self.say(f"the background save could not be published: {exc}")

    def _save_group(self):
        """A gloo group of all ranks for the background writes' collectives, so they
        never interleave with training's (built once, collectively); None in one process."""
        if self.env.world_size == 1:
            return None
        if self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def restore(self, step_dir: Path) -> None:
        """Load a checkpoint saved in any layout: DCP reads, for this rank's shards in the
        current layout, the overlapping pieces of whatever the saving ranks wrote."""
        if (step_dir / ckpt.STATE_FILE).is_file():  # the earlier single-file format
            self._restore_full(ckpt.load_checkpoint(step_dir))
            return
        distributed = self.env.world_size > 1
        metadata = ckpt.read_metadata(step_dir)
        problems = ckpt.verify_files(step_dir, metadata, self.env.rank, self.env.world_size)
        # Each rank checked a share of the files; all must agree.
        parts = all_gather_objects(problems, None, self.env.world_size)
        problems = [p for part in parts for p in part]
        if problems:
            raise CheckpointError("; ".join(problems))
        keys = metadata.state_dict_metadata
        entries, plan = load_plan(self.chunks, keys, self._stage_mesh(), self.tp.rank)
        scalars = ("step", "loss_scaler", "layout", "optimizer/step")
        entries |= {k: None for k in scalars if k in keys}
        rng = f"{ckpt.RNG}rank{self.env.rank}/"
        for key in (k for k in keys if k.startswith(rng)):
            md = keys[key]
            entries[key] = torch.empty(md.size, dtype=md.properties.dtype)
        ckpt.load_entries(step_dir, entries, distributed=distributed)
        masters, moments = unpack(plan, self.tp.rank)
        self.optimizer.load(masters, moments, int(entries.get("optimizer/step") or 0))
        if self.scaler and entries.get("loss_scaler"):
            self.scaler.load_state_dict(entries["loss_scaler"])
        self.step = int(entries["step"])
        if entries.get("layout") == self.layout.describe() and rng + "cpu" in entries:
            torch.set_rng_state(entries[rng + "cpu"])
            if rng + "cuda" in entries and self.device.type == "cuda":
                torch.cuda.set_rng_state(entries[rng + "cuda"], self.device)
        else:
            self._reseed(f"it was saved in layout {entries.get('layout') or 'unknown'}")

    def _reseed(self, why: str) -> None:
        """A deterministic new random stream per data-parallel rank (as at the start)."""
        seed = self.cfg.train.seed + 7919 * (1 + self.mesh.coord("dp")) + 104729 * self.step
        torch.manual_seed(seed)
        self.say(f"checkpoint random state not restored ({why}); reseeded the random streams")

    def _restore_full(self, state: dict) -> None:
        """Restore from a full single-process state dict (the earlier checkpoint format)."""
        masters = local_model_state(self.chunks, state["model"], self.tp)
        moments, step = local_optimizer_state(state["optimizer"], self.chunks, self.tp)
        self.optimizer.load(masters, moments, step)
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    # ------------------------------------------------------------------ logging, the loop

    def say(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message, file=sys.stdout)

    def run(self) -> TrainResult:
        """Train to train.steps (ptdp/train/loop.py)."""
        return run_loop(self)
