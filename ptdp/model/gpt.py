"""GPT decoder (GPT-2 and Llama options), the single-process reference model.

Shapes: b = micro-batch, s = sequence, h = hidden, v = vocabulary, n = query heads,
g = key/value groups, d = head size (h / n, or model.head_size). The transformer body runs
sequence-first, [s, b, h], as Megatron does, so that sequence parallelism can later split
dim 0 contiguously. Tokens and labels stay [b, s].

The model is built from swappable parts (embedding, layers keyed by their *global*
index, final norm + output layer) so that a pipeline stage can hold a range of layers
(`layers=range(...)`, `has_embedding`, `has_head`). Its linear layers and embedding are
the tensor-parallel ones of `ptdp.parallel.tensor`: given a tensor group of size t, each
rank holds 1/t of the heads, the MLP width and the vocabulary; with t = 1 (no group) it
is the single-process reference model. Attention goes through
`scaled_dot_product_attention` with the causal flag, so no mask is materialised and
flash kernels are used on GPUs; only a sliding window shorter than the sequence
(`model.sliding_window`, Mistral) needs an explicit mask.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ptdp.config.enums import CpComm, PositionEmbedding, Recompute
from ptdp.config.sections import ModelConfig
from ptdp.model.init import apply_init
from ptdp.model.kv_cache import KVCache, LayerCache
from ptdp.model.moe import MoE, MoEState
from ptdp.model.parts import MLP, TPContext, build_norm
from ptdp.model.positions import TokenPositions
from ptdp.model.rope import Rotary
from ptdp.parallel import comm
from ptdp.parallel.comm import Group
from ptdp.parallel.context import context_attention
from ptdp.parallel.init import ShardSpec, global_shape, rank_rng
from ptdp.parallel.loss import vocab_parallel_cross_entropy
from ptdp.parallel.roles import ParamRoles
from ptdp.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ptdp.parallel.wgrad import WeightGradStore, linear

if TYPE_CHECKING:
    from ptdp.parallel.fp8 import Fp8Gemms

__all__ = ["GPT", "MLP", "Attention", "TPContext", "TransformerLayer", "build_norm"]


def attention_mask(q_len: int, k_len: int, window: int, device: torch.device) -> torch.Tensor:
    """Bool [q_len, k_len], True where query i (the position k_len - q_len + i) may read key
    j: j <= i, and with a sliding `window` (> 0) also i - j < window."""
    offset = k_len - q_len
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(offset)
    return mask.triu(offset - window + 1) if window else mask


class Attention(nn.Module):
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
        super().__init__()
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
        self.dropout = cfg.dropout
        self.window = cfg.sliding_window
        self.recompute_core = recompute_core
        self.tp, self.cp, self.cp_comm = ctx.tp, ctx.cp, ctx.cp_comm
        if self.cp.size > 1 and self.dropout:
            raise ValueError("context parallelism has no attention dropout; set model.dropout 0")

    def param_roles(self) -> ParamRoles:
        """The q/k norms' gains: replicated, with partial gradients per tensor rank."""
        if self.q_norm is None or self.tp.size == 1:
            return ParamRoles()
        norms = {"q_norm": self.q_norm, "k_norm": self.k_norm}
        names = {f"{n}.{leaf}" for n, norm in norms.items() for leaf, _ in norm.named_parameters()}
        return ParamRoles(sequence_parallel=frozenset(names))

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
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None)
        with rank_rng(self.tp, q.device):  # heads are split: a different mask per rank
            return F.scaled_dot_product_attention(
                q, k, v, mask, dropout_p=p, is_causal=mask is None
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
        return context_attention(q, k, v, positions, self.cp, comm=self.cp_comm, window=self.window)

    def _cached_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, n, s, d] for the last s of the k/v positions [b, n, offset + s, d]."""
        s, total = q.shape[2], k.shape[2]
        if s == 1:  # one new token sees every cached position (in its window)
            if 0 < self.window < total:
                k, v = k[:, :, -self.window :], v[:, :, -self.window :]
            return F.scaled_dot_product_attention(q, k, v)
        # is_causal aligns the mask top-left; new positions need it bottom-right.
        mask = attention_mask(s, total, self.window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

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
        if self.cp.size > 1:  # k/v cross the cp group with their g heads (fewer bytes, GQA)
            out = self._recomputable(self._context_core, q, k, v, positions)
        else:
            if self.q_per_group > 1:  # each group's k/v serve q_per_group query heads
                k = k.repeat_interleave(self.q_per_group, dim=1)
                v = v.repeat_interleave(self.q_per_group, dim=1)
            if offset:
                out = self._cached_core(q, k, v)
            else:
                out = self._recomputable(self._core, q, k, v, positions)  # [b, n, s, d]
        out = out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)
        return self.proj(out)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the mlp is a
    mixture-of-experts block (`ptdp.model.moe`) where `cfg.is_moe_layer(index)`, its
    figures kept in `moe` (the chunk's; a new one if None)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: TPContext,
        recompute: Recompute = Recompute.NONE,
        *,
        index: int = 0,
        moe: MoEState | None = None,
    ) -> None:
        super().__init__()
        self.norm1 = build_norm(cfg)
        self.attn = Attention(cfg, ctx, recompute_core=recompute is Recompute.SELECTIVE)
        self.norm2 = build_norm(cfg)
        if cfg.is_moe_layer(index):
            self.mlp: nn.Module = MoE(cfg, ctx, layer=index, state=moe or MoEState())
        else:
            self.mlp = MLP(cfg, ctx)
        self.dropout = nn.Dropout(cfg.dropout)
        self.recompute_full = recompute is Recompute.FULL
        self.ctx = ctx

    def _residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.dropout.p):
            return x
        if self.ctx.sequence_parallel:  # a sequence slice per rank: per-rank masks
            with rank_rng(self.ctx.tp, x.device):
                return self.dropout(x)
        return self.dropout(x)  # replicated: the shared stream keeps ranks identical

    def _forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None,
        cache: LayerCache | None = None,
        positions: TokenPositions | None = None,
    ) -> torch.Tensor:
        x = x + self._residual_dropout(self.attn(self.norm1(x), rotary, cache, positions))
        return x + self._residual_dropout(self.mlp(self.norm2(x)))

    def forward(
        self,
        x: torch.Tensor,
        rotary: Rotary | None = None,
        cache: LayerCache | None = None,
        positions: TokenPositions | None = None,
    ) -> torch.Tensor:
        if self.recompute_full and self.training:
            # Full recomputation: store only the layer input, redo the layer in backward.
            # An MoE block counts its figures in the first forward only; a dense layer
            # passes no context_fn, which torch.compile would have to trace.
            extra = {"context_fn": self._recompute_contexts} if isinstance(self.mlp, MoE) else {}
            return checkpoint(
                self._forward, x, rotary, None, positions, use_reentrant=False, **extra
            )
        return self._forward(x, rotary, cache, positions)

    def _recompute_contexts(self) -> tuple[contextlib.AbstractContextManager, ...]:
        """Around the first forward and around its recomputation (MoE layers only)."""
        return contextlib.nullcontext(), self.mlp.state.recomputing()


class GPT(nn.Module):
    """A GPT model, or one pipeline chunk of it, on one tensor-parallel rank.

    Args:
        cfg: model shape; `cfg.vocab_size` must be resolved (> 0).
        seed: initialisation seed; weights depend only on it and parameter names.
        recompute: activation recomputation mode.
        tp: this rank's tensor-parallel group (default: none, the reference model).
        cp, cp_comm: this rank's context-parallel group (it holds part of each sequence;
            `ptdp.parallel.context`) and how attention exchanges keys and values.
        ep: this rank's expert-parallel group (its members split each MoE layer's experts;
            `ptdp.model.moe`).
        sequence_parallel: split norm/dropout activations along the sequence over `tp`.
        layers: the global indices of the layers this chunk holds (default: all).
        has_embedding / has_head: whether this chunk holds the input embedding /
            the final norm, output layer and loss.
        fp8: the float8 recipe of the linear layers' and the output layer's GEMMs
            (precision = fp8, `ptdp.parallel.fp8`); None: the parameters' dtype.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        seed: int = 1234,
        recompute: Recompute = Recompute.NONE,
        tp: Group | None = None,
        cp: Group | None = None,
        cp_comm: CpComm = CpComm.RING,
        ep: Group | None = None,
        sequence_parallel: bool = False,
        layers: range | None = None,
        has_embedding: bool = True,
        has_head: bool = True,
        fp8: Fp8Gemms | None = None,
    ) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("GPT needs a resolved model.vocab_size (> 0)")
        self.cfg = cfg
        self.wgrad = WeightGradStore()
        """Weight-gradient GEMMs its linear layers put off in a split backward (the pipeline
        runtime's B and W actions; `ptdp.parallel.wgrad`)."""
        self.ctx = ctx = TPContext(
            tp or Group.single(),
            sequence_parallel and tp is not None,
            self.wgrad,
            cp or Group.single(),
            cp_comm,
            ep or Group.single(),
            fp8,
        )
        self.has_embedding, self.has_head = has_embedding, has_head
        layers = range(cfg.num_layers) if layers is None else layers
        if has_embedding:
            self.embedding = VocabParallelEmbedding(
                cfg.vocab_size,
                cfg.hidden_size,
                tp=ctx.tp,
                sequence_parallel=ctx.sequence_parallel,
                divisible_by=cfg.make_vocab_size_divisible_by,
            )
            if cfg.position_embedding is PositionEmbedding.LEARNED:
                self.position = nn.Embedding(cfg.seq_length, cfg.hidden_size)
            self.embed_dropout = nn.Dropout(cfg.dropout)
        self.rotary = (
            Rotary.from_config(cfg) if cfg.position_embedding is PositionEmbedding.ROPE else None
        )
        self.moe = MoEState()
        """The step's figures of this chunk's MoE layers and their loss scale (`ptdp.model.moe`)."""
        # Keyed by global index, so parameter names (and thus init) match across layouts.
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(cfg, ctx, recompute, index=i, moe=self.moe) for i in layers}
        )
        if has_head:
            self.final_norm = build_norm(cfg)
            if not (cfg.tie_embeddings and has_embedding):
                self.output = ColumnParallelLinear(
                    cfg.hidden_size,
                    cfg.vocab_size,
                    tp=ctx.tp,
                    bias=False,
                    pad_to_multiple=cfg.make_vocab_size_divisible_by,
                    wgrad=self.wgrad,
                    fp8=fp8,
                )
        self.roles = self._param_roles()
        """Which parameters are tied copies or sequence-parallel (`ptdp.parallel.roles`)."""
        apply_init(
            self,
            seed=seed,
            base_std=cfg.init_std,
            num_layers=cfg.num_layers,
            tp=ctx.tp,
            roles=self.roles,
        )

    def _param_roles(self) -> ParamRoles:
        """The tied copy of the embedding, and the sequence-parallel weights."""
        tied: dict[str, str] = {}
        if self.cfg.tie_embeddings and hasattr(self, "output"):
            # The last pipeline stage's copy of the embedding shared with stage 0: same
            # initial value, gradients summed over the embedding group.
            tied["output.weight"] = "embedding.weight"
        records = [ParamRoles(tied=tied)]
        # Layers that name their own: the biases of row-parallel layers (sequence
        # parallelism), an MoE block's router (tensor parallelism).
        for prefix, module in self.named_modules():
            if prefix and hasattr(module, "param_roles"):
                records.append(module.param_roles().prefixed(prefix))
        if self.ctx.sequence_parallel:
            # Replicated weights that each rank applies to its own sequence slice: norms and
            # learned positions.
            names = {"position.weight"} if hasattr(self, "position") else set()
            for prefix, module in self.named_modules():
                if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                    names.update(f"{prefix}.{leaf}" for leaf, _ in module.named_parameters())
            records.append(ParamRoles(sequence_parallel=frozenset(names)))
        return ParamRoles.merge(records)

    def state_buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers by global name: model state that no optimizer updates (the MoE
        routers' balancing biases), saved and restored beside the parameters."""
        saved = self.state_dict(keep_vars=True)
        return {name: b for name, b in self.named_buffers() if name in saved}

    def moe_layers(self) -> dict[int, MoE]:
        """This chunk's mixture-of-experts blocks by global layer index."""
        return {int(i): layer.mlp for i, layer in self.layers.items() if isinstance(layer.mlp, MoE)}

    def output_weight(self) -> torch.Tensor:
        """[v/t, h]: the output layer's weight, the embedding's when they are tied."""
        return self.embedding.weight if not hasattr(self, "output") else self.output.weight

    def embed(
        self, tokens: torch.Tensor, offset: int = 0, positions: TokenPositions | None = None
    ) -> torch.Tensor:
        """tokens [b, s] at positions offset.. (or `positions`) -> hidden [s, b, h]
        ([s/t, b, h] under sequence parallelism)."""
        x = self.embedding(tokens)
        if hasattr(self, "position"):
            s = x.shape[0]
            first = self.ctx.tp.rank * s if self.ctx.sequence_parallel else 0
            if positions is None:
                ids = torch.arange(first + offset, first + offset + s, device=tokens.device)
                x = x + self.position(ids)[:, None]
            else:  # this rank's slice of the ids, [b or 1, s] -> [s, b or 1, h]
                x = x + self.position(positions.ids()[:, first : first + s]).transpose(0, 1)
        if self.training and self.embed_dropout.p and self.ctx.sequence_parallel:
            with rank_rng(self.ctx.tp, x.device):
                return self.embed_dropout(x)
        return self.embed_dropout(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """hidden -> this rank's vocabulary slice of the logits, [s, b, v/t]."""
        x = self.final_norm(x)
        if self.ctx.sequence_parallel:
            x = comm.gather_from_sp(x, self.ctx.tp)
        else:
            x = comm.copy_to_tp(x, self.ctx.tp)
        # The output weight is the embedding's when tied (on a single stage): its deferred
        # gradient is added to the embedding's own, computed in B, at W.
        return linear(x, self.output_weight(), None, self.wgrad, self.ctx.fp8)

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        positions: TokenPositions | None = None,
    ) -> torch.Tensor:
        """Tokens [b, s] (or hidden [s, b, h] for a later chunk) -> hidden, logits or loss.

        With the head: full logits [b, s, v] when `labels` is None, else the mean token loss.
        With `cache` (inference, no sequence parallelism): x holds positions cache.length..,
        which attend to the cached ones too, and the cache grows by s.
        """
        if cache is None:
            if self.has_embedding:
                x = self.embed(x, positions=positions)
            for layer in self.layers.values():
                x = layer(x, self.rotary, positions=positions)
        else:
            if positions is not None:
                raise ValueError("a KV cache reads positions from the cache, not `positions`")
            if self.ctx.sequence_parallel:
                raise ValueError("a KV cache needs a model built without sequence parallelism")
            cache.check_room(x.shape[1] if self.has_embedding else x.shape[0])
            if self.has_embedding:
                x = self.embed(x, cache.length)
            for name, layer in self.layers.items():
                x = layer(x, self.rotary, cache.layer(name))
            cache.advance(x.shape[0])
        if not self.has_head:
            return x
        if labels is not None:
            return self.loss(x, labels)
        tp = self.ctx.tp
        logits = comm.gather_from_tp(self.head(x), tp)  # [s, b, t * padded/t]
        split = ShardSpec(0, self.cfg.vocab_size, logits.shape[-1], tp.size)
        logits = logits.unflatten(-1, (tp.size, -1))[..., : split.rows(0)].flatten(-2)
        return logits[..., : self.cfg.vocab_size].transpose(0, 1)  # each rank's ids, in order

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Hidden [s, b, h] -> mean token loss: final norm, output layer, cross-entropy.

        One function so that train.compile compiles it as a region: Inductor then fuses the
        padding slice or mask, the float32 upcast and the softmax instead of writing each
        [s, b, v] intermediate to memory (model/compile.py).
        """
        logits = self.head(x)
        return vocab_parallel_cross_entropy(logits, labels.t(), self.ctx.tp, self.cfg.vocab_size)


def count_parameters(model: GPT, *, full: bool = True, skip_tied_copies: bool = False) -> int:
    """Parameters of the whole (unsharded) model, or only this rank's shards."""
    total = 0
    for name, p in model.named_parameters():
        if skip_tied_copies and model.roles.is_tied_copy(name):
            continue
        total += math.prod(global_shape(p)) if full else p.numel()
    return total
