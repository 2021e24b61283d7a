"""Deferred weight gradients (ptdp.parallel.wgrad) through the pipeline runtime, one process.

A split backward (B of every microbatch, then W of every microbatch) must give the same
parameter gradients and the same input gradients (sent to the previous stage) as the
fused backward (BW), for GPT chunks in each pipeline position, GPT-2 and Llama options,
and each recomputation mode. The split must be real: B frees the graph, W walks none, and
nothing stays kept after the step. The runtime talks to a fake point-to-point object that
hands it the boundary tensors (a hidden input, an output gradient) and records its sends.

Shapes: b = micro-batch, s = sequence, h = hidden.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ptdp.config.enums import Recompute
from ptdp.model.gpt import GPT
from ptdp.parallel.wgrad import WeightGradStore, accumulate_grads, linear
from ptdp.pipeline.actions import Action, Kind
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.runtime import PipelineRuntime
from tests.helpers import LLAMA
from tests.split_backward import (
    FAMILIES,
    POSITIONS,
    B,
    H,
    M,
    S,
    V,
    check_split_equals_fused,
    chunk_config,
    run_chunk,
)


@pytest.mark.parametrize("options", FAMILIES)
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("recompute", list(Recompute), ids=lambda r: r.value)
def test_split_backward_equals_fused(options: dict, position: str, recompute: Recompute) -> None:
    check_split_equals_fused(options, position, recompute)


def test_fused_backward_is_unchanged_bit_for_bit() -> None:
    """A chunk whose plan has no B is the plain model: same gradients, bit for bit, as
    autograd's backward of the same model run outside the runtime."""
    grads, _ = run_chunk({}, "whole", Recompute.NONE, split=False)
    chunk = GPT(chunk_config(), seed=3)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (M, B, S + 1), generator=g)
    for mb in range(M):
        (chunk(tokens[mb, :, :-1], tokens[mb, :, 1:]) / M).backward()
    for name, p in chunk.named_parameters():
        assert torch.equal(grads[name], p.grad), name


def test_b_frees_the_graph_and_w_walks_none() -> None:
    """Stop after B: the weight GEMMs are kept, the graph is gone; W runs no graph node
    other than the accumulation of each parameter's gradient."""
    cfg = chunk_config(**LLAMA)
    chunk = GPT(cfg, seed=3, has_embedding=False, has_head=False)
    x = torch.randn(S, B, H, requires_grad=True)
    with chunk.wgrad.capture():
        out = chunk(x)
    params = list(chunk.parameters())
    with chunk.wgrad.deferring(0):
        grads = torch.autograd.grad(out, [x, *params], torch.ones_like(out), allow_unused=True)
    deferred = {p for p, g in zip(params, grads[1:]) if g is None}
    linears = {p for n, p in chunk.named_parameters() if n.endswith("weight") and p.dim() == 2}
    assert deferred == linears  # every linear weight waits for W, nothing else does
    assert len(chunk.wgrad) == 1
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward(torch.ones_like(out))

    with _OpCounter() as ops:
        accumulate_grads([(p, g) for p, g in zip(params, grads[1:]) if g is not None])
        accumulate_grads(chunk.wgrad.flush(0))
    assert len(chunk.wgrad) == 0
    assert all(p.grad is not None for p in params)
    # W is the kept GEMMs and nothing of the layers' backward (no norm, attention,
    # activation or addmm backward kernels run).
    assert ops.count("aten.mm.default") == len(linears)
    assert not [op for op in ops if "backward" in op or op.startswith("aten.addmm")], ops


class _OpCounter(TorchDispatchMode):
    """The aten ops run inside, by name."""

    def __enter__(self):
        self.ops: list[str] = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return self.ops.count(name)

    def __iter__(self):
        return iter(self.ops)


def test_data_parallel_hooks_fire_once_per_parameter_in_w() -> None:
    """What the data-parallel buffers rely on: in the step's W, one post-accumulate hook
    call per parameter (a tied embedding's two gradients summed first), none in B; and
    the runtime's W runs no backward kernel (it walks no graph)."""
    calls: list[str] = []
    names = {}
    cfg = chunk_config()  # GPT-2 options: tied output weight on one stage
    chunk = GPT(cfg, seed=3)
    for n, p in chunk.named_parameters():
        names[p] = n
        p.register_post_accumulate_grad_hook(lambda p: calls.append(names[p]))
    tokens = torch.randint(0, V, (B, S + 1))

    def forward_step(stage: int, mb: int, x: torch.Tensor | None) -> torch.Tensor:
        return chunk(tokens[:, :-1], tokens[:, 1:])

    runtime = PipelineRuntime({0: chunk}, forward_step, None, StageMap(1), wgrad={0: chunk.wgrad})
    marks = []
    runtime.around_action = lambda a: _Mark(marks, a, calls)
    runtime.run([Action(Kind.F, 0, 0), Action(Kind.B, 0, 0), Action(Kind.W, 0, 0)])
    assert [m[:2] for m in marks] == [("0F0", 0), ("0B0", 0), ("0W0", len(names))]
    assert sorted(calls) == sorted(names.values())
    w_ops = marks[-1][2]
    assert w_ops.count("aten.mm.default") == 1 + 4 * cfg.num_layers  # output layer + linears
    assert not [op for op in w_ops if "backward" in op or op.startswith("aten.addmm")], w_ops


class _Mark:
    """Records, after each action, how many hook calls it made and the ops it ran."""

    def __init__(self, marks: list, action: Action, calls: list) -> None:
        self.marks, self.action, self.calls = marks, action, calls

    def __enter__(self) -> None:
        self.before = len(self.calls)
        self.ops = _OpCounter().__enter__()

    def __exit__(self, *exc) -> None:
        self.ops.__exit__(*exc)
        self.marks.append((str(self.action), len(self.calls) - self.before, self.ops.ops))


def test_deferred_linear_under_autocast_matches_f_linear() -> None:
    """bf16 autocast over fp32 weights: the deferred weight gradient is the bf16 GEMM cast
    to fp32, as autograd's own, and the output and input gradient are F.linear's."""
    torch.manual_seed(0)
    w = torch.randn(24, 16, requires_grad=True)
    bias = torch.randn(24, requires_grad=True)
    x = torch.randn(5, 3, 16, requires_grad=True)
    dy = torch.randn(5, 3, 24).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = torch.nn.functional.linear(x, w, bias)
    ref_grads = torch.autograd.grad(ref, [x, w, bias], dy)
    store = WeightGradStore()
    with store.capture(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x, w, bias, store)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    with store.deferring("mb"):
        dx, dw, db = torch.autograd.grad(out, [x, w, bias], dy, allow_unused=True)
    assert dw is None
    ((param, deferred),) = store.flush("mb")
    assert param is w and deferred.dtype == torch.float32
    torch.testing.assert_close(dx, ref_grads[0])
    torch.testing.assert_close(deferred, ref_grads[1], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(db, ref_grads[2], rtol=1e-2, atol=1e-2)
