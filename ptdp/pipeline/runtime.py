"""Execute one rank's action list (built by a schedule of schedules.py) on real model chunks.

The runtime knows nothing of any particular schedule (DESIGN invariant 1): it dispatches
each action through a {Kind: handler} table and keeps tensors keyed by (stage, mb).
Consecutive communication actions are posted together; a receive is waited on when its
tensor is first needed, sends when the step ends. A pair (`Action.paired`, DualPipeV and
`parallel.moe_overlap`) needs no handler of its own: lowered, it is both receives, the two
passes, both sends, so both transfers are posted together and in flight during both passes,
which run in turn (what else overlaps inside a pass is the MoE layer's business,
`ptdp.model.moe`).

Backward: `BW` is the usual full backward of a microbatch. A zero-bubble schedule splits
it (Qi et al. 2023, arXiv 2401.10241): `B` computes what the previous stage waits for and
`W`, later, the weight gradients, without walking the graph again. The split is made in
the layers (`ptdp.parallel.wgrad`): a microbatch whose plan has a `B` runs its forward
under its chunk's `WeightGradStore`, and `B` is then the whole backward, graph freed, in
which the linear layers compute their input gradient and keep (input, output gradient)
for their weight-gradient GEMM; the gradients of everything else (norms, biases,
embeddings) are computed there too and held. `W` runs the kept GEMMs and accumulates all
of the microbatch's parameter gradients through autograd, so gradient hooks (data-parallel
buffers) fire in `W` as they do in `BW`. A chunk without a store (plain modules) computes
all its gradients in `B`; its `W` only accumulates them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ptdp.parallel.wgrad import WeightGradStore, accumulate_grads
from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.p2p import P2P, TAG_ACTIVATION, TAG_GRADIENT
from ptdp.pipeline.placement import StageMap

# forward_step(stage, mb, input) -> output; input is None on stage 0, the output of the
# last stage is the microbatch's loss already divided by the number of microbatches.
ForwardStep = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]


@dataclass
class PipelineRuntime:
    chunks: dict[int, nn.Module]
    """This rank's model chunks, by global stage."""
    forward_step: ForwardStep
    p2p: P2P
    stages: StageMap
    """Which pipeline rank holds each stage: peers of the transfers, and the stage pairs on
    this rank whose boundary tensors stay in memory (ZB-V's turn)."""
    on_final_backward: Callable[[int], None] | None = None
    """Called with a stage before that stage's last weight-gradient action of the step, so
    that its data-parallel reduction can overlap with the rest of backward."""
    on_step_end: Callable[[], None] | None = None
    """Called once after this rank's last action (finishing gradient reduction)."""
    loss_scale: float = 1.0
    """Backward starts from d(loss * loss_scale)/d loss (fp16 loss scaling)."""
    around_action: Callable[[Action], AbstractContextManager] | None = None
    """Wraps each compute action (timelines, profilers); None = nothing."""
    around_wait: Callable[[str], AbstractContextManager] | None = None
    """Wraps each wait for a received tensor, given what is awaited (the watchdog)."""
    wgrad: dict[int, WeightGradStore] = field(default_factory=dict)
    """The weight-gradient stores of the chunks (by stage) whose layers can defer their
    weight-gradient GEMMs to `W`; a stage without one computes all its gradients in `B`."""
    _inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _recvs: dict[tuple[Kind, int, int], tuple] = field(default_factory=dict)
    _split: set[tuple[int, int]] = field(default_factory=set)
    _param_grads: dict[tuple[int, int], list] = field(default_factory=dict)
    _grads_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _sends: list = field(default_factory=list)
    _sent_outputs: list = field(default_factory=list)
    freed_bytes: int = 0
    """Bytes of stage outputs released after their send completed (this step)."""
    freed_before_end: int = 0
    """The part of freed_bytes released during the step, before its final wait."""
    losses: list[torch.Tensor] = field(default_factory=list)

    def run(self, actions: list[Action]) -> list[torch.Tensor]:
        """Run one step's actions; return the last stage's per-microbatch losses (if any)."""
        self.losses, self.freed_bytes = [], 0
        self._split = {(a.stage, a.mb) for a in actions if a.kind is Kind.B}
        handlers = {
            Kind.F: self._forward,
            Kind.BW: self._backward_full,
            Kind.B: self._backward_input,
            Kind.W: self._backward_weight,
        }
        final = {}  # stage -> index of its last weight-gradient action
        for index, a in enumerate(actions):
            if a.kind in (Kind.BW, Kind.W):
                final[a.stage] = index
        final_at = {index: stage for stage, index in final.items()}
        i = 0
        while i < len(actions):
            if actions[i].kind.is_comm:
                j = i
                while j < len(actions) and actions[j].kind.is_comm:
                    j += 1
                self._post(actions[i:j])
                i = j
                continue
            self._release_sent_outputs()
            a = actions[i]
            if i in final_at and self.on_final_backward is not None:
                self.on_final_backward(a.stage)
            with self.around_action(a) if self.around_action else nullcontext():
                handlers[a.kind](a)
            i += 1
        self.freed_before_end = self.freed_bytes
        for work in self._sends:
            work.wait()
        self._sends.clear()
        self._release_sent_outputs()
        if self.on_step_end is not None:
            self.on_step_end()
        return self.losses

    def held_pairs(self) -> set[tuple[int, int]]:
        """The (stage, mb) pairs whose activations this rank holds now: forward run and
        backward not (the output with its graph), or B run and W not (the weight-gradient
        inputs kept in the chunk's store, the other gradients held for W). What `verify`
        counts as in flight; tests/dist/test_pipeline_memory.py measures it."""
        stashed = {key for store in self.wgrad.values() for key in store.keys()}
        return set(self._outputs) | set(self._param_grads) | stashed

    # ------------------------------------------------------------------ communication

    def _peer(self, stage: int) -> int:
        return self.stages.rank(stage)

    def _post(self, actions: list[Action]) -> None:
        sends, recvs, keys = [], [], []
        for a in actions:
            if a.kind is Kind.SEND_F:
                out = self._outputs[(a.stage, a.mb)]
                sends.append((self._peer(a.stage + 1), out, TAG_ACTIVATION))
            elif a.kind is Kind.SEND_B:
                grad = self._grads_out.pop((a.stage, a.mb))
                sends.append((self._peer(a.stage - 1), grad, TAG_GRADIENT))
            elif a.kind is Kind.RECV_F:
                recvs.append((self._peer(a.stage - 1), TAG_ACTIVATION))
                keys.append((Kind.F, a.stage, a.mb))
            else:  # RECV_B
                recvs.append((self._peer(a.stage + 1), TAG_GRADIENT))
                keys.append((Kind.B, a.stage, a.mb))
        send_works, recv_works = self.p2p.post(sends, recvs)
        self._sends.extend(send_works)
        for (_, tensor, tag), work in zip(sends, send_works):
            if tag == TAG_ACTIVATION:
                self._sent_outputs.append((work, tensor))
        self._recvs.update(zip(keys, recv_works))

    def _release_sent_outputs(self) -> None:
        """Free the memory of stage outputs whose send has completed.

        The next stage has its own copy; this stage's backward needs only the output's
        autograd node (a residual add, which saves no output) and its shape, both of which
        survive: the storage is resized to zero, the tensor's metadata is kept. This is
        Megatron's deallocate-output trick without its private autograd call. How early it
        happens depends on the backend: NCCL reports a send complete as soon as the data
        has left; gloo only when waited on, which this runtime does at the end of the step
        (waiting earlier could deadlock), so on CPU the memory is returned then.
        """
        self._sends = [w for w in self._sends if not w.is_completed()]  # drop sent buffers
        pending = []
        for work, out in self._sent_outputs:
            if work.is_completed():
                storage = out.untyped_storage()
                self.freed_bytes += storage.nbytes()
                storage.resize_(0)
            else:
                pending.append((work, out))
        self._sent_outputs = pending

    def _received(self, kind: Kind, stage: int, mb: int) -> torch.Tensor:
        work, buf = self._recvs.pop((kind, stage, mb))
        if self.around_wait is None:
            return self.p2p.finish_recv(work, buf)
        what, peer = ("activation", stage - 1) if kind is Kind.F else ("gradient", stage + 1)
        with self.around_wait(
            f"the {what} of microbatch {mb} from pipeline rank {self._peer(peer)}"
        ):
            return self.p2p.finish_recv(work, buf)

    # ------------------------------------------------------------------ compute

    def _forward(self, a: Action) -> None:
        x = None
        if a.stage > 0 and self.stages.same_rank(a.stage - 1, a.stage):  # a new graph per stage
            x = self._outputs[(a.stage - 1, a.mb)].detach().requires_grad_()
            self._inputs[(a.stage, a.mb)] = x
        elif a.stage > 0:
            x = self._received(Kind.F, a.stage, a.mb).requires_grad_()
            self._inputs[(a.stage, a.mb)] = x
        store = self.wgrad.get(a.stage)
        split = store is not None and (a.stage, a.mb) in self._split
        with store.capture() if split else nullcontext():
            out = self.forward_step(a.stage, a.mb, x)
        if a.stage == self.stages.last:
            self.losses.append(out.detach())
        self._outputs[(a.stage, a.mb)] = out

    def _grad_of_output(self, a: Action, out: torch.Tensor) -> torch.Tensor | None:
        if a.stage == self.stages.last:  # the loss: d (loss * scale) / d loss = scale
            return None if self.loss_scale == 1 else torch.full_like(out, self.loss_scale)
        if self.stages.same_rank(a.stage + 1, a.stage):
            return self._grads_out.pop((a.stage + 1, a.mb))
        return self._received(Kind.B, a.stage, a.mb)

    def _backward_full(self, a: Action) -> None:
        key = (a.stage, a.mb)
        out = self._outputs.pop(key)
        grad = self._grad_of_output(a, out)
        torch.autograd.backward(out, grad)
        x = self._inputs.pop(key, None)
        if x is not None:
            self._grads_out[key] = x.grad

    def _backward_input(self, a: Action) -> None:
        """The whole backward, graph freed; the linear layers keep their weight-gradient
        GEMMs in the store, every other parameter gradient is held for `W`."""
        key = (a.stage, a.mb)
        out = self._outputs.pop(key)
        grad = self._grad_of_output(a, out)
        x = self._inputs.pop(key, None)
        params = [p for p in self.chunks[a.stage].parameters() if p.requires_grad]
        inputs = ([] if x is None else [x]) + params
        store = self.wgrad.get(a.stage)
        with store.deferring(key) if store is not None else nullcontext():
            grads = torch.autograd.grad(out, inputs, grad, allow_unused=True)
        if x is not None:
            self._grads_out[key], grads = grads[0], grads[1:]
        self._param_grads[key] = [(p, g) for p, g in zip(params, grads) if g is not None]

    def _backward_weight(self, a: Action) -> None:
        """The kept weight-gradient GEMMs, then one accumulation of every gradient."""
        key = (a.stage, a.mb)
        grads = self._param_grads.pop(key)
        store = self.wgrad.get(a.stage)
        if store is not None:
            grads += store.flush(key)
        accumulate_grads(grads)
