"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3, Kimi K2)
on one tensor-parallel rank.

Shapes: b = micro-batch, s = sequence, h = hidden, n = heads (n / t on a rank),
c = model.kv_lora_rank (the keys' and values' latent), r = model.qk_rope_head_dim,
p = model.qk_nope_head_dim, dv = model.v_head_dim; queries and keys are p + r wide.

Every token's keys and values come from one latent of c features plus one rotary key of r
features shared by all heads: the latent is normalised and up-projected per head to the
keys' p position-free features and the values, and each head's key is those p features
followed by the shared rotary key. Queries are up-projected from their own latent
(model.q_lora_rank; 0 = from the hidden state directly). Generation caches only the latent
and the rotary key, c + r numbers per token and layer for all heads, and attends in the
latent space: the keys' up-projection is folded into the queries, the values' into the
output ("absorbed", as DeepSeek's inference code does).

Under tensor parallelism the up-projections are column-parallel (whole heads per rank) and
the output projection row-parallel; the down-projections are replicated
(`ReplicatedLinear`). Under sequence parallelism they run on the rank's own sequence slice
and the up-projections all-gather the latents, which are narrower than the hidden state
(Megatron-Core's layout); their weights' gradients are then partial sums over the group,
as the norms'.
"""

from __future__ import annotations

import torch
from torch import nn

from ptdp.config.enums import RopeScaling
from ptdp.config.sections import ModelConfig
from ptdp.model.attention import AttentionCore
from ptdp.model.kv_cache import LayerCache
from ptdp.model.parts import TPContext
from ptdp.model.positions import TokenPositions
from ptdp.model.rope import Rotary, yarn_mscale
from ptdp.parallel import comm
from ptdp.parallel.tensor import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

LATENT_NORM_EPS = 1e-6
"""The latents' RMSNorms' epsilon, whatever model.norm_eps says: DeepSeek's code and
`transformers` build them with the default 1e-6."""


def latent_softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(p + r), times m(mscale_all_dim)^2 under yarn with that key set (DeepSeek-V3
    as published and as `transformers` computes it)."""
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope_scaling is RopeScaling.YARN and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


class LatentAttention(AttentionCore):
    """MLA with the parameters `q_down`, `q_norm` (with model.q_lora_rank), `q_up`,
    `kv_down` (the latent and the rotary key, c + r rows), `kv_norm`, `kv_up` (per head
    [p key rows; dv value rows]) and `proj`; model.bias adds biases to the down- and output
    projections (DeepSeek's attention_bias)."""

    def __init__(self, cfg: ModelConfig, ctx: TPContext, recompute_core: bool) -> None:
        super().__init__(cfg, ctx, recompute_core, scale=latent_softmax_scale(cfg))
        t, h = ctx.tp.size, cfg.hidden_size
        self.num_heads = cfg.num_heads // t  # local
        self.nope, self.rope, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        sp = self.sequence_parallel = ctx.sequence_parallel
        gemms = {"wgrad": ctx.wgrad, "fp8": ctx.fp8}
        column = {"tp": ctx.tp, "bias": False, "sequence_parallel": sp, **gemms}
        queries = cfg.num_heads * cfg.qk_head_dim
        self.q_down = self.q_norm = None
        if cfg.q_lora_rank:
            self.q_down = ReplicatedLinear(
                h, cfg.q_lora_rank, bias=cfg.bias, sequence_parallel=sp, **gemms
            )
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
        self.q_up = ColumnParallelLinear(cfg.q_lora_rank or h, queries, **column)
        self.kv_down = ReplicatedLinear(
            h, self.latent + self.rope, bias=cfg.bias, sequence_parallel=sp, **gemms
        )
        self.kv_norm = nn.RMSNorm(self.latent, eps=LATENT_NORM_EPS)
        self.kv_up = ColumnParallelLinear(
            self.latent, cfg.num_heads * (self.nope + self.dv), **column
        )
        self.proj = RowParallelLinear(
            cfg.num_heads * self.dv, h, tp=ctx.tp, bias=cfg.bias, sequence_parallel=sp, **gemms
        )

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None,
        cache: LayerCache | None = None,
        positions: TokenPositions | None = None,
    ) -> torch.Tensor:
        """x [s, b, h] ([s/t, b, h] under sequence parallelism) -> the same, as
        `ptdp.model.attention.Attention`."""
        if rotary is None:
            raise ValueError("latent attention needs rotary positions (model.position_embedding)")
        q = self.q_up(x if self.q_down is None else self.q_norm(self.q_down(x)))
        s, b, _ = q.shape  # the whole sequence: q_up gathered it
        n = self.num_heads
        q = q.view(s, b, n, self.nope + self.rope).permute(1, 2, 0, 3)  # [b, n, s, p + r]
        latent, k_rope = self.kv_down(x).split([self.latent, self.rope], -1)
        latent = self.kv_norm(latent)  # [s(/t), b, c]
        # The rotary key serves this rank's heads only: its gradient is summed over the
        # group (all-reduce, or reduce-scatter back to the slices).
        if self.sequence_parallel:
            k_rope = comm.gather_from_sp(k_rope, self.tp)
        else:
            k_rope = comm.copy_to_tp(k_rope, self.tp)
        k_rope = k_rope.permute(1, 0, 2).unsqueeze(1)  # [b, 1, s, r]
        q_nope, q_rope = q.split([self.nope, self.rope], -1)
        offset = 0 if cache is None else cache.offset
        ids = None if positions is None else positions.ids()
        q_rope, k_rope = rotary(q_rope, offset, ids), rotary(k_rope, offset, ids)
        if cache is not None:
            latents, k_ropes = cache.update(latent.permute(1, 0, 2).unsqueeze(1), k_rope)
            out = self._absorbed(q_nope, q_rope, latents, k_ropes)
        else:
            kv = self.kv_up(latent).view(s, b, n, self.nope + self.dv).permute(1, 2, 0, 3)
            k_nope, v = kv.split([self.nope, self.dv], -1)
            k = torch.cat([k_nope, k_rope.expand(b, n, s, self.rope)], -1)
            out = self.attend(torch.cat([q_nope, q_rope], -1), k, v, 0, positions)
        out = out.permute(2, 0, 1, 3).reshape(s, b, n * self.dv)  # [s, b, n * dv]
        return self.proj(out)

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latents: torch.Tensor,
        k_ropes: torch.Tensor,
    ) -> torch.Tensor:
        """The new queries [b, n, s, p] and [b, n, s, r] against the cached latents
        [b, 1, S, c] and rotary keys [b, 1, S, r] -> [b, n, s, dv], never forming the keys
        and values: q_nope . (W_k l) = (W_k^T q_nope) . l, and the values' up-projection
        W_v applied once to the attended latent."""
        n, total = self.num_heads, latents.shape[2]
        w = self.kv_up.weight.view(n, self.nope + self.dv, self.latent).to(q_nope.dtype)
        w_k, w_v = w[:, : self.nope], w[:, self.nope :]
        q = torch.cat([torch.einsum("bnsp,npc->bnsc", q_nope, w_k), q_rope], -1)
        b = q.shape[0]
        k = torch.cat([latents, k_ropes], -1).expand(b, n, total, self.latent + self.rope)
        attended = self._cached_core(q, k, latents.expand(b, n, total, self.latent))
        return torch.einsum("bnsc,nvc->bnsv", attended, w_v)
