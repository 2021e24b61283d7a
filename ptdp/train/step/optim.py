"""AdamW on fp32 master weights, optionally sharded over the data-parallel group, and the
learning-rate schedule.

The optimizer updates the part of each gradient bucket this rank owns (`GradBuffers.
shard_range`): every bucket without the distributed optimizer, 1/dp of it with. For
each parameter slice in that part it keeps a "piece": an fp32 master tensor whose
`.grad` is the matching view of the fp32 gradient buffer (`GradBuffers.owned_grads`: the
full buffer, or under ZeRO-2 the rank's persistent 1/dp of it). In fp32 training the master
is a view of the parameter itself (no copy); with 16-bit parameters it is an fp32 copy,
written back after each step. With the distributed optimizer, masters and AdamW state
exist only for the rank's shard, so their memory falls by dp, and the updated shards
are all-gathered into every replica's parameters. Under ZeRO-3 what the model stores is
the rank's shard (`GradBuffers.owned_params`), all-gathered when a layer next runs.

Weight decay applies to matrices and embeddings only (GPT-2 practice). The global
gradient norm counts every element of the single-process model once: replicated tensor
slices (norms, row-parallel biases) on tensor rank 0 only, the last stage's copy of a
tied embedding not at all.

The AdamW kernel is torch's fused one on CUDA and its foreach (multi-tensor) one on CPU
(`adamw_kernel`); both compute the same update as the per-tensor loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ptdp.checkpoint.keys import STATE_KEYS
from ptdp.checkpoint.sharded import Slice
from ptdp.config.sections import OptimConfig
from ptdp.parallel.comm import Group, all_gather_flat, all_reduce_sum_
from ptdp.parallel.data import GradBuffers
from ptdp.parallel.grads import counted_in_norm, squared_sum


@dataclass
class Piece:
    """The slice [lo, hi) of a parameter's flattened (tensor-local) elements this rank updates."""

    name: str
    param: nn.Parameter
    lo: int
    hi: int
    master: torch.Tensor
    """fp32, 1-D; its .grad is the slice [lo, hi) of the parameter's reduced gradient."""
    where: tuple[GradBuffers, Any, Any, int]
    """(buffers, chunk buffer, bucket, offset in `owned_params`): where the slice is stored
    (the buffers: the rank's, or under expert parallelism the experts' own)."""

    def stored(self) -> torch.Tensor:
        """The slice as the model stores it (16-bit under bf16/fp16; ZeRO-3: the shard)."""
        part, buf, bucket, at = self.where
        return part.owned_params(buf, bucket)[at : at + self.hi - self.lo]


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies: matrices and embeddings, not norms or biases (an MoE
    block's expert biases are [experts, features], matrices by shape only)."""
    return param.dim() >= 2 and not name.endswith("bias")


class Optimizer:
    """AdamW over this rank's pieces; `step()` updates them and refreshes the parameters."""

    def __init__(
        self,
        chunks: list[nn.Module],
        buffers: GradBuffers,
        cfg: OptimConfig,
        *,
        param_dtype: torch.dtype,
        tp: Group,
        pp: Group,
    ) -> None:
        self.buffers, self.tp, self.pp = buffers, tp, pp
        self.copies = param_dtype != torch.float32
        names = {p: name for chunk in chunks for name, p in chunk.named_parameters()}
        self.pieces: list[Piece] = []
        self.by_bucket: list[tuple[GradBuffers, Any, Any, list[Piece]]] = []
        for part in buffers.parts():
            for buf in part.chunks:
                for bucket in buf.buckets:
                    mine = self._pieces(part, buf, bucket, names)
                    self.pieces += mine
                    self.by_bucket.append((part, buf, bucket, mine))
        decay = [x.master for x in self.pieces if decays(x.name, x.param)]
        no_decay = [x.master for x in self.pieces if not decays(x.name, x.param)]
        self.inner = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            **adamw_kernel(decay + no_decay),
        )
        self.fused = bool(self.inner.defaults.get("fused"))

    def _pieces(self, part: GradBuffers, buf, bucket, names: dict) -> list[Piece]:
        """The pieces of the part of `bucket` this rank owns."""
        first, last = part.shard_range(bucket)
        owned = part.owned_grads(buf, bucket)
        stored = part.owned_params(buf, bucket)
        mine, at = [], bucket.start
        for p in bucket.params:
            lo, hi = max(first, at) - at, min(last, at + p.numel()) - at
            if lo < hi:
                flat = stored[at + lo - first : at + hi - first]
                master = flat.clone() if self.copies else flat
                piece = Piece(names[p], p, lo, hi, master, (part, buf, bucket, at + lo - first))
                piece.master.grad = owned[at + lo - first : at + hi - first]
                mine.append(piece)
            at += p.numel()
        return mine

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    # ------------------------------------------------------------------ gradients

    def grads(self) -> list[torch.Tensor]:
        return [x.master.grad for x in self.pieces]

    def grad_norm(self) -> torch.Tensor:
        """The single-process model's gradient norm, the same on every rank."""
        roles, device = self.buffers.roles, self.buffers.chunks[0].grads.device
        total = torch.zeros((), dtype=torch.float32, device=device)
        for part in self.buffers.parts():
            counted = [  # part.tp: the experts' own tensor group for theirs
                x.master.grad
                for x in self.pieces
                if x.where[0] is part and counted_in_norm(x.name, x.param, roles, part.tp)
            ]
            squares = squared_sum(counted, device)
            if part.shard:
                all_reduce_sum_(squares, part.dp)
            if part is not self.buffers:  # the experts, laid out apart: whole on every rank,
                all_reduce_sum_(squares, part.ep)  # then counted on tensor rank 0 only
                all_reduce_sum_(squares, part.tp)
                squares = squares if self.tp.rank == 0 else torch.zeros_like(squares)
            total += squares
        all_reduce_sum_(total, self.tp)
        all_reduce_sum_(total, self.pp)
        return total.sqrt()

    def scale_grads(self, factor: torch.Tensor | float) -> None:
        grads = self.grads()
        if grads:
            torch._foreach_mul_(grads, factor)

    def clip(self, max_norm: float, norm: torch.Tensor | None = None) -> torch.Tensor:
        """Scale the gradients so that the global norm (`norm` if already known) is at most
        max_norm; return the norm."""
        norm = self.grad_norm() if norm is None else norm
        if max_norm > 0 and math.isfinite(max_norm):
            self.scale_grads(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    # ------------------------------------------------------------------ the update

    @torch.no_grad()
    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """`found_inf` (fused kernel only; torch's foreach one refuses it): a float32 0-d
        device tensor; 1.0 leaves the weights, moments and step count as they were,
        without a host sync."""
        if found_inf is not None:
            self.inner.found_inf = found_inf  # read by torch's fused AdamW, as GradScaler does
        try:
            self.inner.step()
        finally:
            self.inner.found_inf = None
        if self.copies and self.pieces:  # one multi-tensor kernel, not a copy per parameter
            torch._foreach_copy_(
                [x.stored() for x in self.pieces],
                [x.master for x in self.pieces],
            )
        self.buffers.gather_params()

    def planned_state_bytes(self) -> int:
        """What state_bytes() will be once AdamW has allocated its moments (first step)."""
        per_element = 8 + (4 if self.copies else 0)
        return per_element * sum(x.hi - x.lo for x in self.pieces)

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: master copies and AdamW moments."""
        total = sum(x.master.nbytes for x in self.pieces) if self.copies else 0
        for state in self.inner.state.values():
            total += sum(v.nbytes for k, v in state.items() if k in STATE_KEYS)
        return total

    # ------------------------------------------------------------------ state

    def _gather(self, get) -> dict[str, torch.Tensor]:
        """Each parameter's whole (tensor-local) tensor of `get(piece)`, over the dp shards."""
        out = {}
        for part, buf, bucket, pieces in self.by_bucket:
            first, last = part.shard_range(bucket)
            device = buf.grads.device
            local = torch.zeros(last - first, dtype=torch.float32, device=device)
            at = 0
            for x in pieces:
                local[at : at + x.hi - x.lo] = get(x)
                at += x.hi - x.lo
            whole = local
            if part.shard:
                whole = torch.empty(bucket.size, dtype=torch.float32, device=device)
                all_gather_flat(whole, local, part.dp)
            at = 0
            for p in bucket.params:
                out[p] = whole[at : at + p.numel()].view(p.shape).clone()
                at += p.numel()
        return out

    def owned_slices(self) -> dict[nn.Parameter, Slice]:
        """The master and moments of each parameter slice this rank updates, as stored:
        what a checkpoint writes, with no gather."""
        state = self.inner.state
        return {
            x.param: Slice(
                x.lo,
                x.master,
                {k: state[x.master][k] for k in STATE_KEYS} if x.master in state else {},
            )
            for x in self.pieces
        }

    def step_count(self) -> int:
        """AdamW's step count (0 before the first step)."""
        if not self.inner.state:
            return 0
        return int(next(iter(self.inner.state.values()))["step"])

    def master_weights(self) -> dict[nn.Parameter, torch.Tensor]:
        """fp32 master weights by parameter, tensor-local shape, all-gathered over the dp
        shards (for tests and one-process views; checkpoints write `owned_slices`)."""
        return self._gather(lambda x: x.master)

    def moments(self) -> tuple[dict[nn.Parameter, dict], int]:
        """AdamW moments by parameter (tensor-local shape), and the step count."""
        if not self.inner.state:
            return {}, 0
        step = self.step_count()
        gathered = {
            k: self._gather(lambda x, k=k: self.inner.state[x.master][k]) for k in STATE_KEYS
        }
        return {p: {k: gathered[k][p] for k in STATE_KEYS} for p in gathered[STATE_KEYS[0]]}, step

    @torch.no_grad()
    def load(
        self,
        masters: dict[nn.Parameter, torch.Tensor],
        moments: dict[nn.Parameter, dict],
        step: int,
    ) -> None:
        """Set master weights (and parameters) and AdamW state from tensor-local tensors."""
        for x in self.pieces:
            x.master.copy_(masters[x.param].reshape(-1)[x.lo : x.hi])
            x.stored().copy_(x.master)
            if x.param in moments:
                self.inner.state[x.master] = {
                    # The fused kernel keeps the step count on the parameters' device.
                    "step": torch.tensor(
                        float(step), device=x.master.device if self.fused else "cpu"
                    ),
                    **{
                        k: _own_range(moments[x.param][k], x.lo, x.hi, x.master) for k in STATE_KEYS
                    },
                }
        self.buffers.gather_params()


def _own_range(loaded: torch.Tensor, lo: int, hi: int, like: torch.Tensor) -> torch.Tensor:
    """Elements lo:hi of a tensor just loaded, as `like`'s dtype and device: the tensor
    itself where the range is all of it (it is nobody else's), else a compact copy, so that
    the rest of the loaded tensor can be freed."""
    flat = loaded.reshape(-1)
    if lo == 0 and hi == flat.numel():
        return flat.to(like)
    return flat[lo:hi].clone().to(like)


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """Which AdamW implementation to ask for: fused (one kernel for all tensors) when every
    tensor is a floating-point CUDA tensor, else foreach (a few multi-tensor ops), which on
    CPU gives bit-for-bit the results of the per-tensor loop that is torch's CPU default."""
    if params and all(p.is_cuda and p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": True}


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warm-up, cosine to min_lr.

    Warm-up starts at lr/warmup rather than 0, so that the first step is not wasted.
    """
    decay_steps = cfg.decay_steps or total_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
