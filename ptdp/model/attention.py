"""Causal self-attention on one tensor-parallel rank: its heads, its masks and its kernels.

Shapes: b = micro-batch, s = sequence, h = hidden, n = query heads, g = key/value groups,
d = head size (h / n, or model.head_size). The layer takes and returns [s, b, h],
sequence-first as the transformer body of `ptdp.model.gpt`, and runs its kernels on
[b, heads, s, d].

Given a tensor group of size t, each rank holds n / t query heads and g / t key/value
groups: the fused QKV weight split by columns, the output projection by rows
(`ptdp.parallel.tensor`). Attention goes through `scaled_dot_product_attention` with the
causal flag, so no mask is materialised and flash kernels are used on GPUs; only a sliding
window shorter than the sequence (`model.sliding_window`, Mistral), documents or a split
window (`ptdp.model.positions`) and cached generation (`ptdp.model.kv_cache`) need an
explicit mask. Under context parallelism the core runs over the cp group
(`ptdp.parallel.context`). A module of its own, apart from the block and the model that
stack it (`ptdp.model.gpt`), as the dense MLP (`ptdp.model.parts`) and the
mixture-of-experts block (`ptdp.model.moe`) are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ptdp.config.sections import ModelConfig
from ptdp.model.kv_cache import LayerCache
from ptdp.model.parts import TPContext, build_norm
from ptdp.model.positions import TokenPositions
from ptdp.model.rope import Rotary
from ptdp.parallel.context import context_attention
from ptdp.parallel.init import rank_rng
from ptdp.parallel.roles import ParamRoles
from ptdp.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def attention_mask(q_len: int, k_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Bool [q_len, k_len], True where query i (the position k_len - q_len + i) may read key
    j: j <= i, and with a sliding `window` (> 0) also i - j < window."""
    offset = k_len - q_len
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(offset)
    return mask.triu(offset - window + 1) if window else mask


class AttentionCore(nn.Module):
    """What every attention layer shares once its queries, keys and values are made: the
    masks, dropout, kernels, selective recomputation and the context-parallel exchange.

    `scale` is the softmax's (None: 1 / sqrt of the query width, as the kernels default).
    """

    def __init__(
        self, cfg: ModelConfig, ctx: TPContext, recompute_core: bool, scale: float | None = None
    ) -> None:
        super().__init__()
        self.dropout = cfg.dropout
        self.window = cfg.sliding_window
        self.recompute_core = recompute_core
        self.scale = scale
        self.tp, self.cp, self.cp_comm = ctx.tp, ctx.cp, ctx.cp_comm
        if self.cp.size > 1 and self.dropout:
            raise ValueError("context parallelism has no attention dropout; set model.dropout 0")

    def _core(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: TokenPositions | None = None,
    ) -> torch.Tensor:
        s = q.shape[2]
        if positions is not None:  # documents or a split window: the mask says who reads whom
            mask = positions.allowed(positions, self.window)
        elif 0 < self.window < s:
            mask = attention_mask(s, s, self.window, q.device)
        else:  # a window as long as the sequence is plain causal attention: the flash path
            mask = None
        p = self.dropout if self.training else 0.0
        causal = mask is None
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=self.scale)
        with rank_rng(self.tp, q.device):  # heads are split: a different mask per rank
            return F.scaled_dot_product_attention(
                q, k, v, mask, dropout_p=p, is_causal=causal, scale=self.scale
            )

    def _recomputable(self, core, q, k, v, positions: TokenPositions | None) -> torch.Tensor:
        if self.recompute_core and self.training:
            # Selective recomputation (Korthikanti et al. 2022): keep only q, k, v.
            return checkpoint(core, q, k, v, positions, use_reentrant=False)
        return core(q, k, v, positions)

    def _context_core(self, q, k, v, positions: TokenPositions | None) -> torch.Tensor:
        """This rank's part of the window against all of it (`ptdp.parallel.context`)."""
        if positions is None:
            raise ValueError("context-parallel attention needs the tokens' positions")
        return context_attention(
            q, k, v, positions, self.cp, comm=self.cp_comm, window=self.window, scale=self.scale
        )

    def _cached_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, n, s, d] for the last s of the k/v positions [b, n, offset + s, d]."""
        s, total = q.shape[2], k.shape[2]
        if s == 1:  # one new token sees every cached position (in its window)
            if 0 < self.window < total:
                k, v = k[:, :, -self.window :], v[:, :, -self.window :]
            return F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        # is_causal aligns the mask top-left; new positions need it bottom-right.
        mask = attention_mask(s, total, self.window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        offset: int,
        positions: TokenPositions | None,
    ) -> torch.Tensor:
        """q [b, n, s, d] against k [b, g, offset + s, d] and v [b, g, offset + s, dv] (g
        divides n) -> [b, n, s, dv]."""
        if self.cp.size > 1:  # k/v cross the cp group with their g heads (fewer bytes, GQA)
            return self._recomputable(self._context_core, q, k, v, positions)
        if k.shape[1] != q.shape[1]:  # each group's k/v serve n / g query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if offset:
            return self._cached_core(q, k, v)
        return self._recomputable(self._core, q, k, v, positions)


class Attention(AttentionCore):
    """Causal self-attention with grouped-query support and an optional sliding window.

    The fused QKV weight is laid out group by group, [q heads of group 0, k0, v0, q heads
    of group 1, k1, v1, ...], so that a contiguous split of its rows over tensor-parallel
    ranks hands each rank whole groups (Megatron's layout); its bias (model.bias or
    model.qkv_bias) is split with the same rows. With model.qk_norm (Qwen3) each query and
    key head is normalised over d before the rotary positions; the two gains [d] are
    replicated over the tensor group, each rank applying them to its own heads, so their
    gradients are partial sums, summed over the group (`param_roles`).
    """

    def __init__(self, cfg: ModelConfig, ctx: TPContext, recompute_core: bool) -> None:
        super().__init__(cfg, ctx, recompute_core)
        t = ctx.tp.size
        self.num_heads, self.groups = cfg.num_heads // t, cfg.query_groups // t  # local
        self.head_dim = cfg.head_dim
        self.q_per_group = cfg.num_heads // cfg.query_groups
        qkv_out = cfg.query_groups * (self.q_per_group + 2) * self.head_dim
        sp = ctx.sequence_parallel
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            qkv_out,
            tp=ctx.tp,
            bias=cfg.bias or cfg.qkv_bias,
            sequence_parallel=sp,
            wgrad=ctx.wgrad,
            fp8=ctx.fp8,
        )
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = build_norm(cfg, self.head_dim)
            self.k_norm = build_norm(cfg, self.head_dim)
        self.proj = RowParallelLinear(
            cfg.num_heads * self.head_dim,
            cfg.hidden_size,
            tp=ctx.tp,
            bias=cfg.bias,
            sequence_parallel=sp,
            wgrad=ctx.wgrad,
            fp8=ctx.fp8,
        )

    def param_roles(self) -> ParamRoles:
        """The q/k norms' gains: replicated, with partial gradients per tensor rank."""
        if self.q_norm is None or self.tp.size == 1:
            return ParamRoles()
        norms = {"q_norm": self.q_norm, "k_norm": self.k_norm}
        names = {f"{n}.{leaf}" for n, norm in norms.items() for leaf, _ in norm.named_parameters()}
        return ParamRoles(sequence_parallel=frozenset(names))

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None,
        cache: LayerCache | None = None,
        positions: TokenPositions | None = None,
    ) -> torch.Tensor:
        """x [s, b, h] -> [s, b, h]. With `cache` (inference), x holds the positions after
        the cached ones, whose keys and values are appended to the cache; with `positions`,
        the tokens' places in the window (documents, a context-parallel split)."""
        qkv = self.qkv(x)  # [s, b, local groups * (q_per_group + 2) * d], full sequence
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.groups, self.q_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.q_per_group].reshape(s, b, self.num_heads, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [s, b, g, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        offset = 0 if cache is None else cache.offset
        if rotary is not None:
            ids = None if positions is None else positions.ids()
            q, k = rotary(q, offset, ids), rotary(k, offset, ids)
        if cache is not None:
            k, v = cache.update(k, v)  # [b, g, offset + s, d]
        out = self.attend(q, k, v, offset, positions)  # [b, n, s, d]
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)
        return self.proj(out)
