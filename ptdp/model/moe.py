"""The mixture-of-experts block that replaces a layer's MLP (GShard, Lepikhin et al. 2020,
arXiv 2006.16668; Switch, arXiv 2101.03961; Mixtral, Qwen3-MoE and DeepSeek-V3 options).

Shapes: s = sequence, b = micro-batch, h = hidden, t = tokens (s * b), e = experts,
k = experts per token, n = expert rows (the kept token-choices), tp = tensor-parallel size.

A block runs in three steps (`ptdp.model.dispatch`): `plan_dispatch` sorts the
token-choices by expert (dropping those over capacity), the experts compute their rows
(`GroupedExperts`), and `dispatch_combine` takes the rows to them and back into their
tokens, weighted. Under expert parallelism the experts are split over the ep group and an
all-to-all takes each row to the member holding its expert and back; every member routes
its own tokens, so what a token chooses and what it drops does not depend on the layout.
Under tensor parallelism every rank routes the whole sequence (gathered under sequence
parallelism) and computes its 1/tp of every expert; the weighted partial sums are reduced
once, as the dense MLP's are (all-reduce, or reduce-scatter under sequence parallelism).

The balancing losses reach the gradient as terms of the step's loss would, on any pipeline
stage: `_BalancingGrad` returns the block's output unchanged and, in backward, also starts
the losses' backward, scaled by `MoEState.grad_scale` (1 / microbatches, times the fp16
loss scale), which the trainer sets each step (Megatron's MoEAuxLossAutoScaler idea).
`MoEState` also sums each layer's statistics over the step for the log and the bias update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ptdp.config.enums import Activation
from ptdp.config.sections import ModelConfig
from ptdp.model.dispatch import PLANS, Dispatch, Dispatcher, capacity, dispatch_combine
from ptdp.model.experts import GroupedExperts
from ptdp.model.parts import MLP, TPContext
from ptdp.model.router import Router, RouterOptions, Routing, balancing_loss, z_loss
from ptdp.parallel import comm
from ptdp.parallel.roles import NO_ROLES, ParamRoles


@dataclass
class LayerStats:
    """One MoE layer's figures over a step's microbatches on this rank (device tensors)."""

    routed: torch.Tensor
    """[e] int64: token-choices routed to each expert (before any capacity cut)."""
    dropped: torch.Tensor
    """int64: token-choices dropped over capacity."""
    aux: torch.Tensor
    """fp32: the balancing loss (coefficient included), summed over microbatches."""
    z: torch.Tensor
    """fp32: the z-loss (coefficient included), summed over microbatches."""
    microbatches: int = 0


@dataclass
class MoEState:
    """What a model chunk's MoE layers share with the trainer; no module-level state."""

    grad_scale: float = 1.0
    """d(step loss) / d(a microbatch's balancing loss): 1 / microbatches, times the fp16 loss
    scale (1: the loss a plain `backward()` of one forward starts from)."""
    stats: dict[int, LayerStats] = field(default_factory=dict)
    """This step's figures by global layer index."""
    _recomputing: bool = False

    def begin_step(self, grad_scale: float) -> None:
        self.grad_scale, self.stats = grad_scale, {}

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """A forward recomputed in backward (activation checkpointing): not counted again."""
        self._recomputing = True
        try:
            yield
        finally:
            self._recomputing = False

    def record(self, layer: int, routed, dropped, aux, z) -> None:
        """Add one training forward's figures (aux, z: tensors or None)."""
        if self._recomputing:
            return
        zero = torch.zeros((), device=routed.device)
        aux = zero if aux is None else aux.detach().float()
        z = zero if z is None else z.detach().float()
        if layer not in self.stats:
            self.stats[layer] = LayerStats(routed.clone(), dropped.clone(), aux, z)
        else:
            s = self.stats[layer]
            s.routed, s.dropped = s.routed + routed, s.dropped + dropped
            s.aux, s.z = s.aux + aux, s.z + z
        self.stats[layer].microbatches += 1


class _BalancingGrad(torch.autograd.Function):
    """Identity on the block's output forward; backward also sends `scale` to `loss` (a
    scalar), the gradient it gets as a term of the step's loss."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.scale, ctx.dtype, ctx.device = scale, loss.dtype, loss.device
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.dtype, device=ctx.device), None


class MoE(nn.Module):
    """Router, routed experts and optional shared experts: [s, b, h] -> [s, b, h] (or
    [s/tp, b, h] in and out under sequence parallelism).

    Collectives: forward all-gathers the sequence (sequence parallelism) and reduces the
    experts' partial sums (all-reduce, or reduce-scatter); backward the conjugates (and the
    input gradient's reduction over tp of `copy_to_tp`). The router's weight and fc2's bias
    have partial gradients per tensor rank, summed over the group (`param_roles`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        ctx: TPContext,
        *,
        layer: int,
        state: MoEState,
        dispatch: Dispatcher | str = Dispatcher.FUSED,
    ) -> None:
        super().__init__()
        self.ctx, self.layer, self.state = ctx, layer, state
        self.dispatcher = Dispatcher(dispatch)  # REFERENCE: the oracle of tests, benchmarks
        self.num_experts, self.top_k = cfg.num_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        self.bias_update_rate = cfg.moe_bias_update_rate
        opts = RouterOptions.from_config(cfg)
        self.router = Router(cfg.hidden_size, opts, bias=cfg.moe_bias_update_rate > 0)
        self.experts = GroupedExperts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_ffn_size,
            tp=ctx.etp,
            swiglu=cfg.activation is Activation.SWIGLU,
            bias=cfg.bias,
            wgrad=ctx.wgrad,
            ep=ctx.ep,
            fp8=ctx.fp8,
        )
        self.shared = None
        if cfg.moe_shared_experts:  # a dense MLP every token goes through
            self.shared = MLP(cfg, ctx, ffn_size=cfg.moe_shared_ffn_size)

    def param_roles(self) -> ParamRoles:
        """Replicated weights whose gradient is a partial sum per rank of a group: the
        router's over the tensor group (each tensor rank routes its own tokens), fc2's bias
        over the expert tensor group (the shared MLP's layers name their own)."""
        if self.ctx.tp.size == 1 and self.ctx.etp.size == 1:
            return NO_ROLES
        names = {"router.weight"} if self.ctx.tp.size > 1 else set()
        if self.experts.fc2.bias is not None and self.ctx.etp.size > 1:
            names.add("experts.fc2.bias")  # summed by the experts' buffers over etp
        return ParamRoles(sequence_parallel=frozenset(names))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Each tensor rank routes its own 1/tp of the sequence (the slice sequence
        parallelism gives it, or its slice of the replicated input), the expert tensor
        group gathers its members' tokens, the ep group exchanges the rows, and the path
        back returns each rank its own tokens (gathered over tp again without sequence
        parallelism)."""
        tp, etp, sp = self.ctx.tp, self.ctx.etp, self.ctx.sequence_parallel
        if not sp and x.shape[0] % tp.size:
            return self._replicated(x)
        own = x if sp else comm.scatter_to_sp(x, tp)  # [s/tp, b, h]: this rank's tokens
        s, b, h = own.shape
        tokens = own.reshape(s * b, h)
        routing = self.router(tokens)
        chosen, weights = routing.experts, routing.weights
        if etp.size > 1:  # the expert tensor group computes its members' tokens together
            tokens = comm.gather_from_sp(tokens, etp)
            chosen = comm.gather_full(chosen, etp, 0)
            weights = comm.gather_from_sp(weights, etp)
        cap = capacity(self.capacity_factor, len(tokens), self.top_k, self.num_experts)
        plan = PLANS[self.dispatcher](Routing(chosen, weights, None, None), self.num_experts, cap)
        overlap = self.ctx.moe_overlap and self.shared is not None
        during = (lambda: self.shared(x)) if overlap else None  # while the rows travel
        out, shared = dispatch_combine(
            tokens, plan, weights, self.experts, self.ctx.ep, self.dispatcher, during
        )
        out = comm.reduce_scatter_to_sp(out, etp).view(s, b, h)  # partial sums over etp
        if self.training:
            out = self._balance(out, routing, plan)
        if not sp:
            out = comm.gather_seq_from_tp(out, tp)
        if self.shared is not None:
            out = out + (self.shared(x) if shared is None else shared)
        return out

    def _replicated(self, x: torch.Tensor) -> torch.Tensor:
        """Generation's sequences that do not split over tp (a decoded token, a prompt):
        every tensor rank computes every token, reducing the experts' partial sums over
        etp, without gradients (training splits the sequence: `forward`)."""
        tp, etp = self.ctx.tp, self.ctx.etp
        if torch.is_grad_enabled() or tp.size % etp.size:
            raise ValueError(
                f"a mixture-of-experts layer splits the sequence over the tensor group: "
                f"{x.shape[0]} tokens do not split over tp = {tp.size}"
            )
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routing = self.router(tokens)
        cap = capacity(self.capacity_factor, s * b, self.top_k, self.num_experts)
        plan = PLANS[self.dispatcher](routing, self.num_experts, cap)
        out, _ = dispatch_combine(
            tokens, plan, routing.weights, self.experts, self.ctx.ep, self.dispatcher
        )
        out = comm.reduce_from_tp(out, etp).view(s, b, h)
        return out if self.shared is None else out + self.shared(x)

    @torch.compiler.disable  # MoEState's figures, a Python side effect: ptdp.model.compile
    def _balance(self, out: torch.Tensor, routing: Routing, plan: Dispatch) -> torch.Tensor:
        """Record the figures; attach the balancing losses' gradient to `out`. `routing`:
        this rank's own tokens'; `plan`: its expert tensor group's (the dropped choices are
        counted on the group's first member only)."""
        aux = z = None
        routed = torch.bincount(routing.experts.reshape(-1), minlength=self.num_experts)
        if self.aux_coeff:
            groups = (self.ctx.tp, self.ctx.cp)  # a microbatch's sequence: one process's
            aux = self.aux_coeff * balancing_loss(routing.probs, routed, self.top_k, groups)
        if self.z_coeff:
            z = self.z_coeff * z_loss(routing.logits)
        dropped = plan.dropped if self.ctx.etp.rank == 0 else torch.zeros_like(plan.dropped)
        self.state.record(self.layer, routed, dropped, aux, z)
        losses = [loss for loss in (aux, z) if loss is not None and loss.requires_grad]
        if not losses:
            return out
        # Every tensor rank holds the whole sequence's aux and its own tokens' z; each
        # sends 1/tp of their gradient: the sums over the group (aux's statistics, the
        # router weight) add up to the one-process gradient, z as the mean of the tp means.
        scale = self.state.grad_scale / self.ctx.tp.size
        return _BalancingGrad.apply(out, sum(losses), scale)
