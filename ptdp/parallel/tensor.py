"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053).

Shapes: s = sequence, b = batch, h = hidden, v = vocabulary, t = tensor-parallel size.
Activations are sequence-first [s, b, h]; under sequence parallelism (Korthikanti et al.
2022) the tensors outside the layers' split regions are [s/t, b, h].

Each layer allocates only its shard, records how it is split (`param.tp_shard`), and is
a composition of `comm.py` operators and a plain `F.linear`/`F.embedding`. With t = 1 the
operators are identities, so the same classes make the single-process model.
A layer with parameters whose gradient must be summed over the tensor group after
backward (replicated weights that see only a sequence slice under sequence parallelism)
names them in its `param_roles()` (`ptdp.parallel.roles`).
Given a `WeightGradStore` (`wgrad=`), the linear layers' weight-gradient GEMM can be put
off to a zero-bubble W action (`ptdp.parallel.wgrad`); under sequence parallelism the
column-parallel layer keeps its all-gathered input for it. Given an `Fp8Gemms` (`fp8=`,
precision = fp8), the linear layers' GEMMs run in float8, each rank scaling its own shard
(`ptdp.parallel.fp8`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ptdp.parallel import comm
from ptdp.parallel.comm import Group
from ptdp.parallel.init import ShardSpec, padded
from ptdp.parallel.roles import NO_ROLES, ParamRoles
from ptdp.parallel.wgrad import WeightGradStore, linear

if TYPE_CHECKING:
    from ptdp.parallel.fp8 import Fp8Gemms


def _sharded(shape: tuple[int, ...], spec: ShardSpec | None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape))
    if spec is not None and (spec.size > 1 or spec.padded_size != spec.full_size):
        param.tp_shard = spec  # split over ranks, or padded: either way not the full tensor
    return param


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns: A = [A_1 ... A_t], rank i computes Y_i = X A_i.

    Input: replicated [s, b, in] (or [s/t, b, in] under sequence parallelism, all-gathered
    here). Output: [s, b, out/t], or [s, b, out] with `gather_output`.
    Forward: nothing (all-gather of the sequence under SP). Backward: all-reduce of dX
    (reduce-scatter under SP). `parts` > 1 splits each of that many row blocks separately.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: Group,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        parts: int = 1,
        pad_to_multiple: int = 0,
        wgrad: WeightGradStore | None = None,
        fp8: Fp8Gemms | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.gather_output, self.sequence_parallel = tp, gather_output, sequence_parallel
        self.wgrad, self.fp8 = wgrad, fp8
        full = padded(out_features, pad_to_multiple * tp.size) if pad_to_multiple else out_features
        if full % (tp.size * parts):
            raise ValueError(f"{out_features} output features do not split over {tp.size} ranks")
        spec = ShardSpec(dim=0, full_size=out_features, padded_size=full, size=tp.size, parts=parts)
        self.weight = _sharded((full // tp.size, in_features), spec)
        self.bias = _sharded((full // tp.size,), spec) if bias else None
        if gather_output and (parts > 1 or full != out_features):
            raise ValueError("gather_output needs an unpadded, single-block split")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (
            comm.gather_from_sp(x, self.tp)
            if self.sequence_parallel
            else comm.copy_to_tp(x, self.tp)
        )
        y = linear(x, self.weight, self.bias, self.wgrad, self.fp8)
        return comm.gather_from_tp(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows and X by columns: Y = sum_i X_i A_i.

    Input: [s, b, in/t], already split (the output of a ColumnParallelLinear).
    Output: replicated [s, b, out], or [s/t, b, out] under sequence parallelism.
    Forward: all-reduce of the partial sums (reduce-scatter under SP). Backward: nothing
    (all-gather under SP). The bias is added after the reduction, once.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: Group,
        bias: bool = True,
        sequence_parallel: bool = False,
        wgrad: WeightGradStore | None = None,
        fp8: Fp8Gemms | None = None,
    ) -> None:
        super().__init__()
        self.tp, self.sequence_parallel, self.wgrad = tp, sequence_parallel, wgrad
        self.fp8 = fp8
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split over {tp.size} ranks")
        spec = ShardSpec(dim=1, full_size=in_features, padded_size=in_features, size=tp.size)
        self.weight = _sharded((out_features, in_features // tp.size), spec)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def param_roles(self) -> ParamRoles:
        """Under sequence parallelism each rank adds the bias to its own sequence slice, so
        its gradient is a partial sum over the tensor group."""
        if self.bias is not None and self.sequence_parallel:
            return ParamRoles(sequence_parallel=frozenset({"bias"}))
        return NO_ROLES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None, self.wgrad, self.fp8)
        if self.sequence_parallel:
            y = comm.reduce_scatter_to_sp(y, self.tp)
        else:
            y = comm.reduce_from_tp(y, self.tp)
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(nn.Module):
    """Y = X A with A whole on every rank of the tensor group: a small projection ahead of
    column-parallel ones (latent attention's down-projections, `ptdp.model.latent_attention`).

    Input and output as the input's layout: replicated [s, b, in] or this rank's sequence
    slice [s/t, b, in]. No communication: the column-parallel layer after it gathers (or
    copies) its output, so backward hands it the whole gradient of its own rows. Under
    sequence parallelism each rank computes the weight's gradient from its slice alone: a
    partial sum over the tensor group (`param_roles`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        wgrad: WeightGradStore | None = None,
        fp8: Fp8Gemms | None = None,
    ) -> None:
        super().__init__()
        self.sequence_parallel, self.wgrad, self.fp8 = sequence_parallel, wgrad, fp8
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def param_roles(self) -> ParamRoles:
        if not self.sequence_parallel:
            return NO_ROLES
        return ParamRoles(sequence_parallel=frozenset(n for n, _ in self.named_parameters()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.wgrad, self.fp8)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows.

    Rank i holds vocabulary ids [i*k, (i+1)*k), k = ceil(v/t), followed by zero rows up to
    padded(v, divisible_by * t) / t rows (never produced by the tokenizer, masked out of
    the loss). Tokens [b, s] -> [s, b, h] replicated (all-reduce of the per-rank partial
    lookups) or [s/t, b, h] (reduce-scatter) under SP.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp: Group,
        sequence_parallel: bool = False,
        divisible_by: int = 1,
    ) -> None:
        super().__init__()
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.num_embeddings = num_embeddings
        full = padded(num_embeddings, divisible_by * tp.size)
        spec = ShardSpec(dim=0, full_size=num_embeddings, padded_size=full, size=tp.size)
        self.vocab_start = spec.start(tp.rank)
        self.vocab_end = self.vocab_start + spec.rows(tp.rank)
        self.weight = _sharded((spec.local_size, embedding_dim), spec)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.t()  # [s, b]: sequence-first from here on
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sp(x, self.tp)
        return comm.reduce_from_tp(x, self.tp)
