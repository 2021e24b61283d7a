"""ZeRO-3 (Rajbhandari et al. 2020, arXiv 1910.02054): parameters stored as each rank's 1/dp
of every bucket and all-gathered per unit just before they are used.

A unit is one transformer layer (`layers.<i>`) or a chunk's remaining parameters, its root
(embedding, position table, final norm, output layer: the first and last things a chunk
runs). `GradBuffers` cuts buckets at unit boundaries (`unit_of`), so a unit is a list of
whole buckets. Each bucket's persistent parameters are its 1/dp shard in the chunk's flat
parameter buffer (16-bit under bf16/fp16: the gathers move 16-bit values; the optimizer
keeps the fp32 masters of the shard). Its full parameters live in a tensor of their own,
`Bucket.whole`, which the module's parameters view; its storage is resized to zero when no
one uses it and back before an all-gather refills it. The parameters keep their identity
(autograd's saved weights are the same tensors), so nothing in the model changes.

When a bucket is in use, counted per bucket in `Bucket.users`:
- forward: a unit's forward pre-hook gathers it (the chunk's pre-hook gathers the root),
  and starts the next unit's gather, asynchronously, while this one computes (prefetch).
  The forward hook releases it again (`reshard_after_forward`), or keeps it until its
  backward (FSDP's reshard_after_forward=False: one gather per microbatch instead of two,
  at the price of every unit held from forward to backward, which under pipelining means
  over all microbatches in flight). Without autograd (evaluation) it is always released.
- backward: a hook on the unit's output gradient gathers it again before the unit's
  backward runs (and a recomputed forward, which runs inside it) and prefetches the unit
  before it; the bucket is released when each of its parameters has received its gradient
  (`GradBuffers`: with a split backward, at W).
`reset` (end of step) frees whatever is left. Outside these windows a parameter's storage is
empty: code that reads weights between steps must read the optimizer's masters or the
shards (`GradBuffers.owned_params`), as checkpoints do, never the parameters.

Bytes moved per rank per step: the forward and backward gathers, 2 x (dp-1)/dp x the
parameters per microbatch (1 x when kept), plus ZeRO-2's reduce-scatter of the gradients:
the paper's 3 Psi at one microbatch. With the fp8 all-gather (`ptdp.parallel.zero3_fp8`)
the buckets of the linear layers' float8 weights gather their float8 bytes into
`Bucket.whole8` instead, half the bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from ptdp.parallel.buckets import Bucket, ChunkBuffer
from ptdp.parallel.comm import Group, all_gather_flat_async
from ptdp.parallel.zero3_fp8 import Fp8Gather


def unit_of(name: str) -> str:
    """The unit of a parameter by its name in a chunk: `layers.<i>`, or '' (the root)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 2 else ""


class ParamGather:
    """The all-gathers of a rank's ZeRO-3 buckets, driven by module and gradient hooks."""

    def __init__(
        self,
        chunks: list[nn.Module],
        buffers: list[ChunkBuffer],
        names: dict[nn.Parameter, str],
        dp: Group,
        *,
        reshard_after_forward: bool = True,
        count: Callable[..., None] = lambda kind, tensor, times=1: None,
        fp8: Fp8Gather | None = None,
    ) -> None:
        self.dp, self.reshard, self.count = dp, reshard_after_forward, count
        self.fp8 = fp8
        """The fp8 all-gather's buckets (`ptdp.parallel.zero3_fp8`), gathered in float8."""
        self.prefetch = True
        """Start the next unit's gather early; off only to measure the gathers' total time."""
        self.wait_s = 0.0
        """Seconds spent blocked on gathers (exposed communication)."""
        self.peak_bytes = 0
        """The most bytes of gathered (full) parameters allocated at once."""
        self.buckets = [b for buf in buffers for b in buf.buckets]
        self._hooks = []
        for chunk, buf in zip(chunks, buffers):
            units: dict[str, list] = {}
            for b in buf.buckets:
                units.setdefault(unit_of(names[b.params[0]]), []).append(b)
            layers = getattr(chunk, "layers", None)
            order = [(chunk, units.get("", []))]
            if isinstance(layers, nn.ModuleDict):
                order += [(m, units.get(f"layers.{k}", [])) for k, m in layers.items()]
            for i, (module, unit) in enumerate(order):
                after = order[i + 1][1] if i + 1 < len(order) else []
                # Backward runs the other way; the root is held from the chunk's first
                # backward to its last, so layer 0 prefetches nothing.
                before = order[-1][1] if i == 0 else order[i - 1][1] if i > 1 else []
                self._install(module, unit, after, before)

    def _install(self, module: nn.Module, unit, after, before) -> None:
        def pre(_module, _args):
            self.acquire(unit)
            if self.prefetch:
                self.start(after)

        def post(_module, _args, out):
            backward = torch.is_grad_enabled() and isinstance(out, torch.Tensor)
            if backward and out.requires_grad:
                out.register_hook(lambda grad: self._before_backward(unit, before))
            else:
                backward = False
            if self.reshard or not backward:
                self.release(unit)

        self._hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _before_backward(self, unit, before) -> None:
        if self.reshard:
            self.acquire(unit)
            if self.prefetch:
                self.start(before)

    # ------------------------------------------------------------------ buckets

    def start(self, buckets) -> None:
        """Begin gathering the buckets not held or in flight (asynchronous)."""
        for b in buckets:
            if b.users or b.gather is not None:
                continue
            whole, shard = b.whole, b.shard
            if b.whole8 is not None:  # its bytes (gloo and NCCL gather no float8 dtype)
                self.fp8.prepare(self.count)
                b.shard8 = self.fp8.cast(b)
                whole, shard = b.whole8.view(torch.uint8), b.shard8.view(torch.uint8)
            whole.untyped_storage().resize_(whole.numel() * whole.element_size())
            b.gather = all_gather_flat_async(whole, shard, self.dp)
            self.count("all_gather", whole)
            self.peak_bytes = max(self.peak_bytes, self.gathered_bytes())

    def acquire(self, buckets) -> None:
        """Hold the buckets' full parameters: gather them (or wait for the prefetch)."""
        self.start(buckets)
        for b in buckets:
            if b.gather is not None:
                began = time.perf_counter()
                b.gather.wait()
                self.wait_s += time.perf_counter() - began
                b.gather = b.shard8 = None
            b.users += 1

    def release(self, buckets) -> None:
        """One use fewer; a bucket no one uses gives its full parameters' memory back."""
        for b in buckets:
            if b.users == 0:
                continue
            b.users -= 1
            if b.users == 0:
                _free(b)

    def reset(self) -> None:
        """Free every bucket (end of a step, or after a failed one)."""
        for b in self.buckets:
            if b.gather is not None:
                b.gather.wait()
                b.gather = b.shard8 = None
            b.users = 0
            _free(b)
        if self.fp8 is not None:  # the weights change before the next step's gathers
            self.fp8.invalidate()

    def gathered_bytes(self) -> int:
        """Bytes of full parameters allocated now (16-bit or float8), and of the fp8
        all-gather's float8 shards cast for gathers in flight."""
        held = [b.whole for b in self.buckets] + [b.whole8 for b in self.buckets]
        held += [b.shard8 for b in self.buckets]
        return sum(t.untyped_storage().nbytes() for t in held if t is not None)


def _free(b: Bucket) -> None:
    """A bucket's full parameters' memory given back."""
    (b.whole if b.whole8 is None else b.whole8).untyped_storage().resize_(0)
