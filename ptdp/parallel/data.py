"""Data-parallel gradient reduction over contiguous, bucketed buffers: when each bucket is
reduced, over which groups, and the all-gather of updated parameter shards. The buffers'
layout (flat buffers, buckets, `main_grad` views, shards) is `ptdp.parallel.buckets`.

A hook on every parameter adds its gradient into `main_grad` (a view of the chunk's fp32
gradient buffer) and drops `param.grad`, so 16-bit gradients accumulate over microbatches
in fp32.

During the last microbatch's backward of a chunk (`start_final`), a bucket whose
parameters have all received their gradient starts its reduction at once, as an
asynchronous collective, while backward goes on; earlier microbatches only accumulate.
The pipeline runtime, not autograd, knows which backward is the last one, which is why
this is written on collectives rather than by wrapping DDP.

The reduction averages over the data-parallel group: an all-reduce, or with the
distributed optimizer a reduce-scatter that leaves each rank the mean of its 1/dp shard
of every bucket (buckets are padded to a multiple of dp). After the optimizer step,
`gather_params` all-gathers the updated shards of the parameter buffer.

Two reductions over other groups must come first. Under sequence parallelism, the
gradients of replicated weights (norms, row-parallel biases) are partial sums per
tensor rank: they are summed over the tensor group (synchronously: the tensor ranks run
the same backward in lockstep) just before the bucket starts. A tied embedding shared by
the first and last pipeline stages sits alone in a deferred bucket, summed over the
embedding group in `finish` (its two holders reach their last backward at different
times), then reduced like the rest. Which parameters play these roles, the model chunks'
`ParamRoles` record says (`ptdp.parallel.roles`).

ZeRO-2 (`shard_grads`) keeps no full gradient buffer between reductions: the persistent
fp32 buffer is each rank's 1/dp of every bucket, and a bucket's full-size fp32 gradient
exists only from its first gradient of a backward until its reduce-scatter completes.
It is then freed and the reduced 1/dp added into the shard. So the reduction runs in every
microbatch's backward, not only the last: m times ZeRO-1's reduce-scatter traffic under
gradient accumulation or pipelining, for gradient memory of about 1/dp plus the buckets in
flight (the choice of DeepSpeed's ZeRO-2 and of FSDP with a reduction per microbatch). A
bucket is started when each of its parameters has had one gradient since the bucket was
last allocated; which microbatch a gradient belongs to does not matter for the sum (a split
backward's B and W may interleave). A tied embedding's bucket (deferred) and, without
overlap, every bucket stay full over the step and are reduced in `finish`.

When the experts are laid out apart from attention (expert parallelism, or an expert
tensor split other than tp: parallel folding, `ptdp.parallel.mesh`), a mixture-of-experts
layer's experts are replicated only over the "edp" group of a stage's ranks. Their
parameters live in buffers of their own, a second `GradBuffers` (`experts`) reduced and
sharded over that group instead: the same buckets, overlap and ZeRO levels, with the
gradients still divided by dp*cp, the replicas the loss is averaged over (each expert's
gradient already sums the tokens that the all-to-all brought to it, and edp adds those of
the other tensor ranks, which routed other tokens). The first instance drives the second:
every method below that the trainer calls also runs on `experts`.

ZeRO-3 (`shard_params`) also keeps only each rank's 1/dp of the parameters: `params` holds
the shards, buckets never span two units (a transformer layer, or a chunk's other
parameters) and `ParamGather` (`ptdp.parallel.zero3`) all-gathers a unit's buckets around
its forward and its backward; with `fp8_gather` the float8 weights of the linear layers
are gathered as float8 (`ptdp.parallel.zero3_fp8`). `traffic` counts what the data-parallel
collectives move.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ptdp.parallel.buckets import (
    Bucket,
    ChunkBuffer,
    allocate_chunk,
    cast_chunk,
    split_into_buckets,
)
from ptdp.parallel.comm import (
    Group,
    all_gather_flat_async,
    all_reduce_async,
    all_reduce_tensors_,
    reduce_scatter_flat_async,
)
from ptdp.parallel.grads import sum_tied_
from ptdp.parallel.init import expert_split
from ptdp.parallel.roles import ParamRoles
from ptdp.parallel.zero3 import ParamGather, unit_of
from ptdp.parallel.zero3_fp8 import Fp8Gather, fp8_weights

if TYPE_CHECKING:  # torchao is optional: only an fp8 run imports ptdp.parallel.fp8
    from ptdp.parallel.fp8 import Fp8Gemms


def _holds(*, experts_only: bool, experts_apart: bool) -> Callable[[nn.Parameter], bool]:
    """Which parameters an instance holds: the expert-split ones (the experts' instance),
    all others (the rank's, when the experts have their own), or every one."""
    if experts_only:
        return lambda p: expert_split(p) is not None
    if experts_apart:
        return lambda p: expert_split(p) is None
    return lambda p: True


def _unit(named: list[tuple[str, nn.Parameter]], fp8: set[nn.Parameter]) -> Callable:
    """ZeRO-3's bucket cuts by name: at unit boundaries, and where the fp8 all-gather's
    weights begin or end (they are gathered in float8, in buckets of their own)."""
    in_fp8 = {n for n, p in named if p in fp8}
    return lambda name: (unit_of(name), name in in_fp8)


def _fp8_gather(
    buffers: list[ChunkBuffer], params: set[nn.Parameter], fp8: Fp8Gemms | None, dp: Group
) -> Fp8Gather | None:
    """The fp8 all-gather of the buckets holding `params` (none: off)."""
    buckets = [b for buf in buffers for b in buf.buckets if b.params[0] in params]
    return Fp8Gather(buckets, fp8, dp) if buckets else None


def _weak_hook(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """`method` called while its object lives; the hook itself keeps nothing alive."""
    ref = weakref.WeakMethod(method)

    def hook(p: nn.Parameter) -> None:
        if (bound := ref()) is not None:
            bound(p)

    return hook


class GradBuffers:
    """The flat buffers of a rank's chunks and the data-parallel reduction of their buckets.

    `roles`: the chunks' merged record (`ptdp.parallel.roles.rank_roles`; `NO_ROLES` for
    plain modules), naming the tied copy and the sequence-parallel parameters. `shard`:
    reduce-scatter so that each rank owns 1/dp of every bucket (ZeRO-1); `shard_grads`:
    also keep only that 1/dp of the gradients (ZeRO-2, module doc; implies `shard`);
    `shard_params`: and of the parameters (ZeRO-3, `ptdp.parallel.zero3`; implies both),
    re-gathered before each backward unless `reshard_after_forward` is off; `fp8_gather`:
    the fp8 linear weights gathered in float8 (`ptdp.parallel.zero3_fp8`). `expert_dp`
    (experts laid out apart from attention): the group over which the expert parameters,
    kept in an instance of their own (`experts`), are reduced and sharded; `ep`: the group
    holding the other experts; `expert_tp`: the one splitting each expert (that instance's
    `tp`, over which its replicated weights' partial gradients are summed). `_experts_only`
    and `_divisor` build that instance.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        *,
        roles: ParamRoles,
        dp: Group,
        tp: Group,
        embedding: Group,
        bucket_mb: float = 25.0,
        shard: bool = False,
        shard_grads: bool = False,
        shard_params: bool = False,
        reshard_after_forward: bool = True,
        fp8_gather: Fp8Gemms | None = None,
        overlap: bool = True,
        expert_dp: Group | None = None,
        ep: Group | None = None,
        expert_tp: Group | None = None,
        _experts_only: bool = False,
        _divisor: int = 0,
    ) -> None:
        self.dp, self.tp, self.embedding, self.roles = dp, tp, embedding, roles
        self.divisor = _divisor or dp.size
        """What the reduction divides the summed gradients by: the loss's replicas."""
        self.ep = (ep if _experts_only else None) or Group.single()
        """The members holding other experts of the same names (the experts' instance):
        the gradient norm sums over it."""
        self.shard = (shard or shard_grads or shard_params) and dp.size > 1
        self.shard_grads = (shard_grads or shard_params) and self.shard
        self.shard_params = shard_params and self.shard
        self.traffic: dict[str, list[int]] = {}
        """Data-parallel collectives so far: kind -> [elements, bytes] of the full buffers
        (an all-gather or reduce-scatter of n elements counts n, an all-reduce 2n)."""
        self.full_bytes = 0
        """ZeRO-2: bytes of full bucket gradients alive now; `peak_full_bytes` the most."""
        self.peak_full_bytes = 0
        self._inflight: list[tuple[ChunkBuffer, Bucket, dist.Work, torch.Tensor]] = []
        """ZeRO-2: reduce-scatters started, in launch order: (chunk, bucket, work, full)."""
        self.overlap = overlap
        self.launches = 0
        """Bucket reductions started so far; `early_launches` of them during a backward."""
        self.early_launches = 0
        self.chunks: list[ChunkBuffer] = []
        self._bucket_of: dict[nn.Parameter, tuple[ChunkBuffer, Bucket]] = {}
        mine = _holds(experts_only=_experts_only, experts_apart=expert_dp is not None)
        names = {n for chunk in chunks for n, p in chunk.named_parameters() if mine(p)}
        self._both_ends = "embedding.weight" in names and any(map(roles.is_tied_copy, names))
        """This rank holds the embedding and its tied copy (ZB-V's V): they sum here."""
        bucket_elems = max(1, int(bucket_mb * 2**20 / 4))
        fp8_params = fp8_weights(chunks) if fp8_gather is not None and self.shard_params else set()
        align = dp.size if self.shard else 1
        for chunk in chunks:
            named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad and mine(p)]
            named = named[::-1]
            if not named:  # a chunk with no parameter of this instance's kind
                device = next(chunk.parameters()).device
                empty = ChunkBuffer(torch.zeros(0, device=device), torch.zeros(0, device=device))
                self.chunks.append(empty)
                continue
            unit = _unit(named, fp8_params) if self.shard_params else (lambda name: "")
            groups = split_into_buckets(named, bucket_elems, self._is_tied, unit)
            buf = allocate_chunk(
                groups,
                named,
                dp=dp,
                align=align,
                is_tied=self._is_tied,
                is_sequence_parallel=roles.is_sequence_parallel,
                shard_grads=self.shard_grads,
                shard_params=self.shard_params,
            )
            self.chunks.append(buf)
            self._bucket_of.update({p: (buf, b) for b in buf.buckets for p in b.params})
        # Through a weak reference: a parameter's own hook holding these buffers (which hold
        # the parameter) is a cycle that Python's collector cannot see through a tensor, so
        # a finished Trainer would keep its weights and gradient buffers for good.
        on_grad = _weak_hook(self._on_grad)
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in self._bucket_of]
        self.gather = None
        if self.shard_params:
            names = {p: n for chunk in chunks for n, p in chunk.named_parameters()}
            self.gather = ParamGather(
                chunks,
                self.chunks,
                names,
                dp,
                reshard_after_forward=reshard_after_forward,
                count=self._count,
                fp8=_fp8_gather(self.chunks, fp8_params, fp8_gather, dp),
            )
        self.experts: GradBuffers | None = None
        """The expert parameters' buffers, reduced over `expert_dp` (module doc)."""
        if expert_dp is not None and not _experts_only:
            self.experts = GradBuffers(
                chunks,
                roles=roles,
                dp=expert_dp,
                tp=expert_tp or tp,
                embedding=embedding,
                bucket_mb=bucket_mb,
                shard=shard,
                shard_grads=shard_grads,
                shard_params=shard_params,
                reshard_after_forward=reshard_after_forward,
                overlap=overlap,
                ep=ep,
                _experts_only=True,
                _divisor=dp.size,
            )

    def parts(self) -> list[GradBuffers]:
        """This instance and, under expert parallelism, the experts' one."""
        return [self] if self.experts is None else [self, self.experts]

    def _count(self, kind: str, tensor: torch.Tensor, times: int = 1) -> None:
        counts = self.traffic.setdefault(kind, [0, 0])
        counts[0] += times * tensor.numel()
        counts[1] += times * tensor.nbytes

    def _is_tied(self, name: str) -> bool:
        """The embedding that the first and last pipeline stages both hold (pp > 1, tied)."""
        return (self.embedding.size > 1 or self._both_ends) and (
            name == "embedding.weight" or self.roles.is_tied_copy(name)
        )

    # ------------------------------------------------------------------ dtype

    def cast_params(self, dtype: torch.dtype) -> None:
        """Store the parameters in `dtype` (16-bit training); gradients stay fp32."""
        for buf in self.chunks:
            cast_chunk(buf, dtype, dp=self.dp, shard_params=self.shard_params)
        if self.experts is not None:
            self.experts.cast_params(dtype)

    # ------------------------------------------------------------------ the step

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """The part of a bucket this rank owns: all of it, or its 1/dp under sharding."""
        if not self.shard:
            return bucket.start, bucket.end
        part = bucket.size // self.dp.size
        first = bucket.start + self.dp.rank * part
        return first, first + part

    def owned_params(self, buf: ChunkBuffer, bucket: Bucket) -> torch.Tensor:
        """The parameters of `shard_range(bucket)` as stored: where the optimizer writes."""
        if self.shard_params:
            return bucket.shard
        first, last = self.shard_range(bucket)
        return buf.params[first:last]

    def owned_grads(self, buf: ChunkBuffer, bucket: Bucket) -> torch.Tensor:
        """The reduced fp32 gradient of `shard_range(bucket)`, where the optimizer reads it."""
        first, last = self.shard_range(bucket)
        if not self.shard_grads:
            return buf.grads[first:last]
        at = bucket.start // self.dp.size  # buckets are padded to multiples of dp
        return buf.grads[at : at + last - first]

    def param_bytes(self) -> int:
        """Bytes of parameters this rank holds now: its buffers and any gathered buckets."""
        gathered = self.gather.gathered_bytes() if self.gather else 0
        experts = self.experts.param_bytes() if self.experts else 0
        return sum(buf.params.nbytes for buf in self.chunks) + gathered + experts

    def grad_bytes(self) -> int:
        """Bytes of fp32 gradient this rank holds now: its buffers and any full buckets."""
        experts = self.experts.grad_bytes() if self.experts else 0
        return sum(buf.grads.nbytes for buf in self.chunks) + self.full_bytes + experts

    def start_final(self, chunk: int) -> None:
        """The next backward of chunk `chunk` is its last of this step."""
        if self.experts is not None:
            self.experts.start_final(chunk)
        buf = self.chunks[chunk]
        buf.final = True
        if self.shard_grads:  # counted per allocation of the bucket, every microbatch
            return
        for bucket in buf.buckets:
            bucket.pending = len(bucket.params)

    def _on_grad(self, p: nn.Parameter) -> None:
        buf, bucket = self._bucket_of[p]
        if self.shard_grads:
            self._on_sharded_grad(p, buf, bucket)
            return
        p.main_grad.add_(p.grad)
        p.grad = None
        if buf.final:
            bucket.pending -= 1
            if bucket.pending == 0 and self.overlap and not bucket.deferred:
                self.early_launches += 1
                self._launch(buf, bucket)

    # ------------------------------------------------------------------ ZeRO-2

    def _on_sharded_grad(self, p: nn.Parameter, buf: ChunkBuffer, bucket: Bucket) -> None:
        if bucket.full is None:
            self._materialize(bucket)
        p.main_grad.add_(p.grad)
        p.grad = None
        bucket.pending -= 1
        if bucket.pending > 0:
            return
        if self.gather is not None:  # every parameter has its gradient: one use done
            self.gather.release([bucket])
        if self.overlap and not bucket.deferred:
            self.early_launches += 1
            self._launch(buf, bucket)
            self._retire(keep=1)  # this one reduces while the next bucket fills
        else:  # reduced in `finish`; keep counting for the next microbatch
            bucket.pending = len(bucket.params)

    def _materialize(self, bucket: Bucket) -> None:
        """Allocate the bucket's full fp32 gradient and point its parameters' main_grad at it."""
        full = torch.zeros(bucket.size, dtype=torch.float32, device=self.chunks[0].grads.device)
        bucket.full, bucket.pending, at = full, len(bucket.params), 0
        for p in bucket.params:
            p.main_grad = full[at : at + p.numel()].view_as(p)
            at += p.numel()
        self.full_bytes += full.nbytes
        self.peak_full_bytes = max(self.peak_full_bytes, self.full_bytes)

    def _scatter_full(self, buf: ChunkBuffer, bucket: Bucket) -> None:
        """Start reducing the bucket's full gradient into this rank's part; drop its views."""
        full, part = bucket.full, bucket.size // self.dp.size
        bucket.full = None
        for p in bucket.params:
            p.main_grad = None
        full.div_(self.divisor)
        self._count("reduce_scatter", full)
        out = full[self.dp.rank * part : (self.dp.rank + 1) * part]
        self._inflight.append((buf, bucket, reduce_scatter_flat_async(out, full, self.dp), full))

    def _retire(self, keep: int) -> None:
        """Wait for the reductions started before the last `keep`, in launch order (so that a
        shard sums its microbatches in the same order on every run), add each rank's part
        into its shard and free the full buffer. Bounds the full buffers in flight."""
        while len(self._inflight) > keep:
            buf, bucket, work, full = self._inflight.pop(0)
            work.wait()
            part = bucket.size // self.dp.size
            mine = full[self.dp.rank * part : (self.dp.rank + 1) * part]
            self.owned_grads(buf, bucket).add_(mine)
            self.full_bytes -= full.nbytes

    # ------------------------------------------------------------------ reduction

    def _launch(self, buf: ChunkBuffer, bucket: Bucket) -> None:
        bucket.launched = True
        self.launches += 1
        if self.tp.size > 1:
            sp = [p.main_grad for p in bucket.sequence_parallel]
            if sp:
                all_reduce_tensors_(sp, self.tp, average=False)
        if self.shard_grads:
            self._scatter_full(buf, bucket)
            return
        grads = buf.grads[bucket.start : bucket.end]
        if self.divisor > 1:
            grads.div_(self.divisor)
        if self.dp.size == 1:
            return
        if self.shard:
            first, last = self.shard_range(bucket)
            out = buf.grads[first:last]
            bucket.work = reduce_scatter_flat_async(out, grads, self.dp)
            self._count("reduce_scatter", grads)
        else:
            bucket.work = all_reduce_async(grads, self.dp)
            self._count("all_reduce", grads, times=2)

    def finish(self) -> None:
        """Complete the step's reduction: deferred and not yet started buckets, then wait."""
        if self.shard_grads:
            for b in (b for buf in self.chunks for b in buf.buckets if b.deferred):
                if b.full is None:  # every holder of the tied embedding sums, even with zeros
                    self._materialize(b)
        tied = [
            p.main_grad for buf in self.chunks for b in buf.buckets if b.deferred for p in b.params
        ]
        sum_tied_(tied, self.embedding)
        for buf in self.chunks:
            for bucket in buf.buckets:
                if self.shard_grads and bucket.full is not None:
                    self._launch(buf, bucket)  # what has not been reduced yet
                elif not self.shard_grads and not bucket.launched:
                    self._launch(buf, bucket)
        if self.shard_grads:
            self._retire(keep=0)
        if self.gather is not None:
            self.gather.reset()
        for buf in self.chunks:
            buf.final = False
            for bucket in buf.buckets:
                if bucket.work is not None:
                    bucket.work.wait()
                bucket.work, bucket.launched = None, False
        if self.experts is not None:
            self.experts.finish()

    def zero_grad(self) -> None:
        self._retire(keep=0)  # ZeRO-2: reductions a failed step left running
        if self.gather is not None:  # ZeRO-3: gathers a failed step left held
            self.gather.reset()
        for buf in self.chunks:
            buf.grads.zero_()
            for bucket in buf.buckets:  # ZeRO-2: a step's leftovers would be stale
                if bucket.full is not None:
                    self.full_bytes -= bucket.full.nbytes
                    bucket.full = None
                    for p in bucket.params:
                        p.main_grad = None
        if self.experts is not None:
            self.experts.zero_grad()

    def gather_params(self) -> None:
        """All-gather each rank's updated shard of the parameters (distributed optimizer);
        under ZeRO-3 the shards are the parameters, gathered when next used."""
        if self.experts is not None:
            self.experts.gather_params()
        if not self.shard or self.shard_params:
            return
        works = []
        for buf in self.chunks:
            for bucket in buf.buckets:
                first, last = self.shard_range(bucket)
                whole = buf.params[bucket.start : bucket.end]
                shard = buf.params[first:last]
                works.append(all_gather_flat_async(whole, shard, self.dp))
                self._count("all_gather", whole)
        for work in works:
            work.wait()
