"""A training run's checkpoints: one rank's save (synchronous or in the background) and its
restore in any layout, from the parts of the trainer they need.

Saving writes this rank's shards of the fp32 master weights and AdamW moments as DCP
entries (ptdp/checkpoint/sharded.py), its random state and the run's scalars; rank 0
publishes the step directory when every rank is done (ptdp/checkpoint/writer.py).
Restoring reads, for this rank's shards in the current layout, the overlapping pieces of
whatever the saving ranks wrote, so the layout may change between runs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from ptdp.checkpoint.full import load_checkpoint, local_model_state, local_optimizer_state
from ptdp.checkpoint.keys import MODEL, RNG, named_buffers, named_parameters
from ptdp.checkpoint.lazy import Lazy
from ptdp.checkpoint.sharded import (
    Slice,
    buffer_entries,
    copy_buffers,
    load_plan,
    sharded_state,
    stage_mesh,
    unpack,
)
from ptdp.checkpoint.store import (
    STATE_FILE,
    find_checkpoint,
    has_checkpoint,
    load_entries,
    read_metadata,
    verify_files,
)
from ptdp.checkpoint.summed import BackgroundCheck
from ptdp.checkpoint.writer import PendingCheckpoint, start_checkpoint
from ptdp.config.files import to_dict
from ptdp.config.sections import RunConfig
from ptdp.data.tokenizers import load_tokenizer
from ptdp.errors import CheckpointError
from ptdp.parallel.comm import Group, all_gather_objects, all_reduce_max_value, new_world_group
from ptdp.parallel.mesh import ParallelMesh

Moments = dict[nn.Parameter, dict[str, torch.Tensor]]


class NonFiniteState(CheckpointError):
    """A save refused: the weights or optimizer state to write hold a NaN or an infinity."""

    def __init__(self, step: int, run_dir: Path) -> None:
        self.step = step
        self.last_good = find_checkpoint(run_dir) if has_checkpoint(run_dir) else None
        self.where = (
            f"the last checkpoint is {self.last_good}"
            if self.last_good
            else "no checkpoint of this run was saved before"
        )
        super().__init__(
            f"the weights or optimizer state after step {step} hold a NaN or an infinity, so "
            f"no checkpoint of step {step} was written; {self.where}. The loss and gradient "
            "norm were finite: the update itself overflowed; lower optim.lr or raise "
            "optim.warmup_steps, then continue from that checkpoint with --resume"
        )


POSITIONS = "position.weight"  # the learned position table: [seq_length, h], replicated


class TrainOptimizer(Protocol):
    """What a checkpoint needs of the optimizer (ptdp/train/step/optim.py's Optimizer)."""

    @property
    def param_groups(self) -> list[dict]: ...

    def owned_slices(self) -> dict[nn.Parameter, Slice]: ...

    def step_count(self) -> int: ...

    def load(
        self, masters: dict[nn.Parameter, torch.Tensor], moments: Moments, step: int
    ) -> None: ...


class LossScaler(Protocol):
    """What a checkpoint needs of the fp16 loss scaler (ptdp/train/step/loss_scale.py)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class CheckpointManager:
    """Saves and restores one rank's training state; all ranks call its methods together.

    `cfg` is recorded in every checkpoint (config.toml and the `config` entry), and its
    train section says where (run_dir), how (async_save, keep_checkpoints) and the seed
    of the random streams a restore in another layout starts afresh.
    """

    chunks: list[nn.Module]
    optimizer: TrainOptimizer
    scaler: LossScaler | None
    mesh: ParallelMesh
    world: Group  # all ranks: their rank and count
    device: torch.device
    cfg: RunConfig
    layout: str  # Layout.describe(): the random state restores only in the same layout
    tokenizer_spec: str  # data.tokenizer_spec: "bytes", "" or a tokenizer.json path
    say: Callable[[str], None]
    _pending: PendingCheckpoint | None = field(default=None, init=False)  # async save in flight
    _async_group: ProcessGroup | None = field(default=None, init=False)  # its collectives' group
    _dcp_mesh: DeviceMesh | None = field(default=None, init=False)
    _dcp_mesh_built: bool = field(default=False, init=False)
    _tok_json: bytes | None = field(default=None, init=False)
    last_stall_s: float = field(default=0.0, init=False)
    """Seconds the training thread spent in the last `save` (with an asynchronous save:
    waiting for the previous one, the finite check and the one copy; the write is hidden)."""
    restored_layout: str = field(default="", init=False)
    """The layout (Layout.describe()) the last restored checkpoint was saved in."""

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.train.run_dir)

    def state(self, step: int) -> dict[str, Any]:
        """This rank's checkpoint entries at `step`: its shards of the fp32 master weights
        and AdamW moments as DCP tensors, its random state, and the run's scalars (the same
        on every rank; DCP writes them once). The tensors are views of the live ones (no
        copy): a synchronous save writes them as they are, an asynchronous one snapshots
        them once (ptdp/checkpoint/writer.py)."""
        slices = self.optimizer.owned_slices()  # fp32, also under 16-bit training
        state = sharded_state(self.chunks, slices, self._stage_mesh(), self.tp_rank)
        for name, b in named_buffers(self.chunks):  # replicated: DCP writes one copy
            state[MODEL + name] = b.detach()  # live: an asynchronous save copies it once
        opt_step = self.optimizer.step_count()
        rng = f"{RNG}rank{self.world.rank}/"
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
            "step": step,
            "consumed_samples": step * self.cfg.train.global_batch_size,
            "config": to_dict(self.cfg),
            "tokenizer": self._tokenizer_entry(),
            "layout": self.layout,
        }

    @property
    def tp_rank(self) -> int:
        return self.mesh.axis("tp").rank

    def _stage_mesh(self) -> DeviceMesh | None:
        """The DCP device mesh of this rank's pipeline stage (built once, collectively)."""
        if not self._dcp_mesh_built:
            self._dcp_mesh = stage_mesh(self.mesh, self.device)
            self._dcp_mesh_built = True
        return self._dcp_mesh

    def _tokenizer_json(self) -> bytes | None:
        """The tokenizer.json every checkpoint holds (the byte tokenizer's and a model
        directory's too), read once."""
        if self._tok_json is None and self.tokenizer_spec:
            self._tok_json = load_tokenizer(self.tokenizer_spec).to_json().encode("utf-8")
        return self._tok_json

    def _tokenizer_entry(self) -> str:
        """How generation finds the tokenizer: the tokenizer.json written beside the
        checkpoint (the byte tokenizer's too), or "" when the data records none."""
        return "tokenizer.json" if self.tokenizer_spec else ""

    def save(self, step: int) -> Path:
        """Every rank writes its own shards (no gather); rank 0 publishes the result.

        With `train.async_save`, the state is copied once to host memory and planned and
        written in the background; it is published by the next `save` or `finish_save`
        (all ranks call both at the same steps), so `latest` names it only then. The time
        spent here is `last_stall_s`."""
        start = time.perf_counter()
        try:
            return self._save(step)
        finally:
            self.last_stall_s = time.perf_counter() - start

    def _save(self, step: int) -> Path:
        self.finish_save()  # the previous asynchronous save first
        if not self.state_is_finite():
            raise NonFiniteState(step, self.run_dir)
        tok = self._tokenizer_json()
        asynchronous = self.cfg.train.async_save
        pending = start_checkpoint(
            self.run_dir,
            step,
            self.state(step),
            self.cfg,
            tok,
            keep=self.cfg.train.keep_checkpoints,
            distributed=self.world.size > 1,
            asynchronous=asynchronous,
            process_group=self._save_group() if asynchronous else None,
            threads=self.cfg.checkpoint.writer_threads,
        )
        if not asynchronous:
            return pending.finish()
        self._pending = pending
        return pending.final

    def state_is_finite(self) -> bool:
        """Collective: whether every rank's fp32 master weights, AdamW moments and buffers are
        finite. `save` asks first (one all-reduce, one host sync per save), so no checkpoint
        is ever written from a NaN or an infinity."""
        slices = self.optimizer.owned_slices().values()
        tensors = [t for s in slices for t in (s.master, *s.moments.values())]
        tensors += [b for _, b in named_buffers(self.chunks) if b.is_floating_point()]
        bad = torch.zeros((), device=self.device)
        for t in tensors:
            bad = torch.maximum(bad, (~torch.isfinite(t)).any().to(bad.dtype))
        return not all_reduce_max_value(bad, self.world).item()

    def finish_save(self) -> Path | None:
        """Wait for the asynchronous save in flight, if any, and publish it (collective)."""
        pending = self._pending
        if pending is None:
            return None
        self._pending = None
        step_dir = pending.finish()
        self.say(f"saved checkpoint {step_dir}")
        return step_dir

    def publish_save_after_failure(self) -> None:
        """A run that failed still publishes the asynchronous save of an earlier, good
        step, in one process: there is no peer to wait for. With several ranks publishing
        needs all of them, and some may be gone; that save stays unpublished (`.tmp`) and the
        next start publishes it if every rank finished writing it (checkpoint/recover.py)."""
        if self._pending is None or self.world.size > 1:
            return
        try:
            self.finish_save()
        except Exception as exc:  # the run's own error matters more: say, do not raise
            self.say(f"the background save could not be published: {exc}")

    def _save_group(self) -> ProcessGroup | None:
        """A gloo group of all ranks for the background writes' collectives, so they
        never interleave with training's (built once, collectively); None in one process."""
        if self.world.size == 1:
            return None
        if self._async_group is None:
            self._async_group = new_world_group("gloo")
        return self._async_group

    def restore(self, step_dir: Path) -> int:
        """Load a checkpoint saved in any layout: DCP reads, for this rank's shards in the
        current layout, the overlapping pieces of whatever the saving ranks wrote. Returns
        the checkpoint's step."""
        if (step_dir / STATE_FILE).is_file():  # the earlier single-file format
            return self._restore_full(load_checkpoint(step_dir))
        metadata = self._verified_metadata(step_dir)
        keys = metadata.state_dict_metadata
        entries, plan = load_plan(self.chunks, keys, self._stage_mesh(), self.tp_rank)
        entries |= buffer_entries(self.chunks, keys)
        scalars = ("step", "loss_scaler", "layout", "optimizer/step")
        entries |= {k: None for k in scalars if k in keys}
        rng = f"{RNG}rank{self.world.rank}/"
        for key in (k for k in keys if k.startswith(rng)):
            md = keys[key]
            entries[key] = torch.empty(md.size, dtype=md.properties.dtype)
        self._load_checked(step_dir, metadata, entries)
        masters, moments = unpack(plan, self.tp_rank)
        copy_buffers(self.chunks, entries)
        self.optimizer.load(masters, moments, int(entries.get("optimizer/step") or 0))
        if self.scaler and entries.get("loss_scaler"):
            self.scaler.load_state_dict(entries["loss_scaler"])
        step = int(entries["step"])
        self.restored_layout = entries.get("layout") or ""
        if entries.get("layout") == self.layout and rng + "cpu" in entries:
            torch.set_rng_state(entries[rng + "cpu"])
            if rng + "cuda" in entries and self.device.type == "cuda":
                torch.cuda.set_rng_state(entries[rng + "cuda"], self.device)
        else:
            self._reseed(step, f"it was saved in layout {entries.get('layout') or 'unknown'}")
        return step

    def _verified_metadata(self, step_dir: Path):
        """The DCP metadata, once every rank has checked its share of the files by name and
        size (missing, truncated) and all agree; checksums are checked while loading
        (`_load_checked`)."""
        metadata = read_metadata(step_dir)
        share = verify_files(step_dir, metadata, self.world.rank, self.world.size, checksums=False)
        self._raise_any(share)
        return metadata

    def _raise_any(self, problems: list[str], cause: BaseException | None = None) -> None:
        """Collective: raise every rank's problems as one CheckpointError, if any."""
        parts = all_gather_objects(problems, self.world.group, self.world.size)
        problems = [p for part in parts for p in part]
        if problems:
            raise CheckpointError("; ".join(problems)) from cause

    def _load_checked(self, step_dir: Path, metadata, entries: dict[str, Any]) -> None:
        """dcp.load into `entries` while this rank's share of the files is checksummed in a
        background thread (no separate full read before the load); every rank's checksum
        problems are raised, naming the damaged files, before anything loaded is used, and
        in place of DCP's own error when the damage made the load fail."""
        rank, size = self.world.rank, self.world.size
        failure: CheckpointError | None = None
        with BackgroundCheck(lambda: verify_files(step_dir, metadata, rank, size)) as check:
            try:
                load_entries(step_dir, entries, distributed=size > 1)
            except CheckpointError as exc:  # on every rank (DCP gathers its errors)
                failure = exc
            problems = check.problems()
        self._raise_any(problems, failure)
        if failure is not None:
            raise failure

    def load_weights(self, step_dir: Path) -> None:
        """Only the model weights of a checkpoint saved in any layout, resharded as in
        `restore`, with a fresh optimizer (checkpoint.init_from). A learned position table
        longer than this model's sequence keeps its first rows."""
        if (step_dir / STATE_FILE).is_file():  # the earlier single-file format
            self.load_model_state(load_checkpoint(step_dir)["model"])
            return
        checkpoint = self._verified_metadata(step_dir)
        metadata = checkpoint.state_dict_metadata
        keys = {k: v for k, v in metadata.items() if k.startswith(MODEL)}
        mine = dict(named_parameters(self.chunks)).get(POSITIONS)
        saved = keys.get(MODEL + POSITIONS)
        longer = mine is not None and saved is not None and saved.size[0] > mine.shape[0]
        if longer:  # plan for this model's rows, read all of the saved ones
            keys[MODEL + POSITIONS] = dataclasses.replace(saved, size=torch.Size(mine.shape))
        entries, plan = load_plan(self.chunks, keys, self._stage_mesh(), self.tp_rank)
        entries |= buffer_entries(self.chunks, keys)
        if longer:
            rows = entries[MODEL + POSITIONS]
            entries[MODEL + POSITIONS] = torch.empty(saved.size, dtype=torch.float32)
        self._load_checked(step_dir, checkpoint, entries)
        if longer:
            rows.copy_(entries[MODEL + POSITIONS][: rows.shape[0]])
        masters, _ = unpack(plan, self.tp_rank)
        copy_buffers(self.chunks, entries)
        self.optimizer.load(masters, {}, 0)

    def load_model_state(self, model: Mapping[str, torch.Tensor | Lazy]) -> None:
        """Model weights from a full-shape state by global name (a Hugging Face model's
        lazy tensors), each rank reading its shards alone; the optimizer starts fresh."""
        masters = local_model_state(self.chunks, model, self.mesh.axis("tp"))
        self.optimizer.load(masters, {}, 0)

    def _reseed(self, step: int, why: str) -> None:
        """A deterministic new random stream per data-parallel rank (as at the start)."""
        seed = self.cfg.train.seed + 7919 * (1 + self.mesh.coord("dp")) + 104729 * step
        torch.manual_seed(seed)
        self.say(f"checkpoint random state not restored ({why}); reseeded the random streams")

    def _restore_full(self, state: dict) -> int:
        """Restore from a full single-process state dict (the earlier checkpoint format);
        returns its step."""
        tp = self.mesh.axis("tp")
        masters = local_model_state(self.chunks, state["model"], tp)
        moments, step = local_optimizer_state(state["optimizer"], self.chunks, tp)
        self.optimizer.load(masters, moments, step)
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        return int(state["step"])
