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
is the single-process reference model. Attention is `ptdp.model.attention`'s, or latent
attention (`ptdp.model.latent_attention`) under model.attention = mla.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ptdp.config.enums import CpComm, PositionEmbedding, Recompute
from ptdp.config.sections import ModelConfig
from ptdp.model.attention import Attention
from ptdp.model.init import apply_init
from ptdp.model.kv_cache import KVCache, LayerCache
from ptdp.model.latent_attention import LatentAttention
from ptdp.model.moe import MoE, MoEState
from ptdp.model.mtp import MtpModule, MtpState, shifted, valid_positions
from ptdp.model.parts import MLP, TPContext, build_norm
from ptdp.model.positions import TokenPositions
from ptdp.model.rope import Rotary
from ptdp.parallel import comm
from ptdp.parallel.comm import Group
from ptdp.parallel.init import ShardSpec, global_shape, rank_rng
from ptdp.parallel.loss import vocab_parallel_cross_entropy
from ptdp.parallel.roles import ParamRoles
from ptdp.parallel.tensor import ColumnParallelLinear, VocabParallelEmbedding
from ptdp.parallel.wgrad import WeightGradStore, linear

if TYPE_CHECKING:
    from ptdp.parallel.fp8 import Fp8Gemms

__all__ = ["GPT", "MLP", "TPContext", "TransformerLayer", "build_norm"]


class TransformerLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the mlp is a
    mixture-of-experts block (`ptdp.model.moe`) where `cfg.is_moe_layer(index)` (or
    `moe_block` says), its figures kept in `moe` (the chunk's; a new one if None)."""

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: TPContext,
        recompute: Recompute = Recompute.NONE,
        *,
        index: int = 0,
        moe: MoEState | None = None,
        moe_block: bool | None = None,
    ) -> None:
        super().__init__()
        self.norm1 = build_norm(cfg)
        kind = LatentAttention if cfg.is_mla else Attention
        self.attn = kind(cfg, ctx, recompute_core=recompute is Recompute.SELECTIVE)
        self.norm2 = build_norm(cfg)
        if cfg.is_moe_layer(index) if moe_block is None else moe_block:
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
            `ptdp.model.moe`); etp: its expert tensor-parallel group (its members split each
            expert's matrices).
        sequence_parallel: split norm/dropout activations along the sequence over `tp`.
        layers: the global indices of the layers this chunk holds (default: all).
        has_embedding / has_head: whether this chunk holds the input embedding /
            the final norm, output layer and loss.
        fp8: the float8 recipe of the linear layers' and the output layer's GEMMs
            (precision = fp8, `ptdp.parallel.fp8`); None: the parameters' dtype.
        moe_overlap: MoE layers overlap their dispatch all-to-all with the shared experts
            (`parallel.moe_overlap`, `ptdp.model.moe.MoE`); the same numbers either way.
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
        etp: Group | None = None,
        sequence_parallel: bool = False,
        layers: range | None = None,
        has_embedding: bool = True,
        has_head: bool = True,
        fp8: Fp8Gemms | None = None,
        moe_overlap: bool = False,
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
            etp or Group.single(),
            fp8,
            moe_overlap,
        )
        self.has_embedding, self.has_head = has_embedding, has_head
        layers = range(cfg.num_layers) if layers is None else layers
        if has_embedding:
            self.embedding = self._vocab_embedding()
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
        self.mtp_state = MtpState()
        """The step's multi-token-prediction losses by depth (`ptdp.model.mtp`)."""
        if has_head and cfg.mtp_depth:
            last = cfg.num_layers - 1  # each module's layer is dense or MoE as the last one
            self.mtp = nn.ModuleDict()
            for k in range(1, cfg.mtp_depth + 1):
                layer = TransformerLayer(
                    cfg, ctx, recompute, index=last + k, moe=self.moe,
                    moe_block=cfg.is_moe_layer(last),
                )  # fmt: skip
                self.mtp[str(k)] = MtpModule(cfg, ctx, layer)
            if not has_embedding:  # a later stage: its copy of stage 0's embedding
                self.mtp_embedding = self._vocab_embedding()
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

    def _vocab_embedding(self) -> VocabParallelEmbedding:
        cfg, ctx = self.cfg, self.ctx
        return VocabParallelEmbedding(
            cfg.vocab_size,
            cfg.hidden_size,
            tp=ctx.tp,
            sequence_parallel=ctx.sequence_parallel,
            divisible_by=cfg.make_vocab_size_divisible_by,
        )

    def _param_roles(self) -> ParamRoles:
        """The tied copy of the embedding, and the sequence-parallel weights."""
        tied: dict[str, str] = {}
        if self.cfg.tie_embeddings and hasattr(self, "output"):
            # The last pipeline stage's copy of the embedding shared with stage 0: same
            # initial value, gradients summed over the embedding group.
            tied["output.weight"] = "embedding.weight"
        if hasattr(self, "mtp_embedding"):  # the last stage's for multi-token prediction
            tied["mtp_embedding.weight"] = "embedding.weight"
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
        """This chunk's mixture-of-experts blocks by global layer index (multi-token
        prediction's after the model's: num_layers - 1 + depth)."""
        blocks = [(int(i), layer.mlp) for i, layer in self.layers.items()]
        if hasattr(self, "mtp"):
            mtp = [m.layer.mlp for m in self.mtp.values()]
            blocks += [(block.layer, block) for block in mtp if isinstance(block, MoE)]
        return {i: block for i, block in blocks if isinstance(block, MoE)}

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

    def head(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        """hidden -> this rank's vocabulary slice of the logits, [s, b, v/t], through the
        final norm (or `norm`: a multi-token-prediction module's own)."""
        x = (self.final_norm if norm is None else norm)(x)
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
            if hasattr(self, "mtp") and self.training and cache is None:
                return self.loss(x, labels) + self.mtp_loss(x, labels, positions)
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

    def mtp_loss(
        self, x: torch.Tensor, labels: torch.Tensor, positions: TokenPositions | None = None
    ) -> torch.Tensor:
        """model.mtp_loss_weight x the mean over depths of each depth's mean token loss, from
        the main model's last hidden state x [s, b, h] (`ptdp.model.mtp`)."""
        embedding = self.mtp_embedding if hasattr(self, "mtp_embedding") else self.embedding
        losses, hidden = [], x
        for k, module in self.mtp.items():
            depth = int(k)
            hidden = module(hidden, embedding(shifted(labels, depth - 1)), self.rotary, positions)
            logits = self.head(hidden, module.norm)
            target, keep = shifted(labels, depth).t(), valid_positions(labels, depth)
            tp, vocab = self.ctx.tp, self.cfg.vocab_size
            losses.append(vocab_parallel_cross_entropy(logits, target, tp, vocab, keep))
        self.mtp_state.record(losses)
        return self.cfg.mtp_loss_weight * torch.stack(losses).mean()


def count_parameters(model: GPT, *, full: bool = True, skip_tied_copies: bool = False) -> int:
    """Parameters of the whole (unsharded) model, or only this rank's shards."""
    total = 0
    for name, p in model.named_parameters():
        if skip_tied_copies and model.roles.is_tied_copy(name):
            continue
        total += math.prod(global_shape(p)) if full else p.numel()
    return total
