"""Run one GPT chunk through the pipeline runtime with the backward fused (BW) or split (B,
then W), and compare: shared by tests/unit/test_wgrad.py and tests/dist/test_wgrad.py.

Shapes: b = micro-batch, s = sequence, h = hidden.
"""

from __future__ import annotations

import pytest
import torch

from ptdp.config.enums import Recompute
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.model.gpt import GPT
from ptdp.parallel.comm import Group
from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.p2p import TAG_ACTIVATION, TAG_GRADIENT
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.runtime import PipelineRuntime
from tests.helpers import LLAMA

B, S, H, V, M = 2, 8, 32, 40, 2  # micro-batch, sequence, hidden, vocabulary, microbatches
FAMILIES = [pytest.param({}, id="gpt2"), pytest.param(LLAMA, id="llama")]
POSITIONS = {  # name -> (stage, number of stages)
    "whole": (0, 1),  # embedding ... head: with GPT-2 options the output weight is tied
    "first": (0, 3),
    "middle": (1, 3),
    "last": (2, 3),
}


def chunk_config(**kw) -> ModelConfig:
    base = {"num_layers": 2, "hidden_size": H, "num_heads": 4, "seq_length": S, "vocab_size": V}
    return apply_updates(RunConfig(), {"model": {**base, "dropout": 0.0, **kw}}, "test").model


class _Done:
    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


class FakeP2P:
    """Receives come from `activations` / `gradients` in microbatch order; sends are kept."""

    def __init__(self, activations: list[torch.Tensor], gradients: list[torch.Tensor]) -> None:
        self.queues = {TAG_ACTIVATION: list(activations), TAG_GRADIENT: list(gradients)}
        self.sent: dict[int, list[torch.Tensor]] = {TAG_ACTIVATION: [], TAG_GRADIENT: []}

    def post(self, sends, recvs):
        for _, tensor, tag in sends:
            self.sent[tag].append(tensor.detach().clone())
        return [_Done() for _ in sends], [(_Done(), self.queues[tag].pop(0)) for _, tag in recvs]

    def finish_recv(self, work, buf: torch.Tensor) -> torch.Tensor:
        return buf.clone()


def _actions(stage: int, num_stages: int, split: bool) -> list[Action]:
    """F of every microbatch, then B of each and W of each (split) or BW of each."""
    first, last = stage == 0, stage == num_stages - 1
    out = []
    for mb in range(M):
        out += [] if first else [Action(Kind.RECV_F, stage, mb)]
        out += [Action(Kind.F, stage, mb)]
        out += [] if last else [Action(Kind.SEND_F, stage, mb)]
    kinds = [Kind.B] if split else [Kind.BW]
    for mb in range(M):
        out += [] if last else [Action(Kind.RECV_B, stage, mb)]
        out += [Action(k, stage, mb) for k in kinds]
        out += [] if first else [Action(Kind.SEND_B, stage, mb)]
    if split:
        out += [Action(Kind.W, stage, mb) for mb in range(M)]
    return out


def run_chunk(
    options: dict,
    position: str,
    recompute: Recompute,
    split: bool,
    tp: Group | None = None,
    sequence_parallel: bool = False,
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Run one step of the chunk at `position` (this rank's shard of it, given `tp`);
    returns (parameter grads, sent input grads). tests/dist/test_wgrad.py runs it at tp = 2."""
    stage, num_stages = POSITIONS[position]
    first, last = stage == 0, stage == num_stages - 1
    cfg = chunk_config(**options)
    chunk = GPT(
        cfg,
        seed=3,
        recompute=recompute,
        tp=tp,
        sequence_parallel=sequence_parallel,
        has_embedding=first,
        has_head=last,
    )
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (M, B, S + 1), generator=g)
    s = S // tp.size if sequence_parallel else S  # the boundary tensors: [s, b, h]
    hidden = [torch.randn(s, B, H, generator=g) for _ in range(M)]
    out_grads = [torch.randn(s, B, H, generator=g) for _ in range(M)]

    def forward_step(stage_: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
        x = tokens[mb, :, :-1] if first else x
        return chunk(x, tokens[mb, :, 1:]) / M if last else chunk(x)

    p2p = FakeP2P(hidden, out_grads)
    runtime = PipelineRuntime(
        {stage: chunk}, forward_step, p2p, StageMap(num_stages), wgrad={stage: chunk.wgrad}
    )
    runtime.run(_actions(stage, num_stages, split))
    assert len(chunk.wgrad) == 0  # nothing kept after the step
    grads = {n: p.grad for n, p in chunk.named_parameters()}
    return grads, p2p.sent[TAG_GRADIENT]


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    rel = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
    assert rel < 1e-5, f"{what}: relative error {rel:.2e}"


def check_split_equals_fused(
    options: dict,
    position: str,
    recompute: Recompute,
    tp: Group | None = None,
    sequence_parallel: bool = False,
) -> None:
    """Split (B of each microbatch, then W of each) against fused (BW): same parameter
    gradients and sent input gradients, to float32 rounding."""
    runs = [run_chunk(options, position, recompute, s, tp, sequence_parallel) for s in (0, 1)]
    (fused, fused_dx), (split, split_dx) = runs
    what = f"{position} {recompute.value} sp={sequence_parallel}"
    assert fused.keys() == split.keys()
    for name, grad in fused.items():
        assert grad is not None and split[name] is not None, f"{what}: {name}"
        assert_close(split[name], grad, f"{what}: {name}")
    assert len(split_dx) == len(fused_dx) == (0 if position in ("whole", "first") else M)
    for mb, (a, b) in enumerate(zip(split_dx, fused_dx)):
        assert_close(a, b, f"{what}: input gradient of microbatch {mb}")
