"""The fused dispatch and combine (ptdp/model/dispatch.py) against the reference path they
replace: the plans equal, the rows the experts compute equal token by token, the block's
output and every gradient equal to fp32 rounding, dropless and over capacity; runs repeat
bit for bit; the row movers' gradients; the receiver's regrouping against a sort.
Under expert parallelism: tests/dist/test_moe.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ptdp.config.enums import Activation, ScoreFunction
from ptdp.config.sections import ModelConfig
from ptdp.model.dispatch import (
    Dispatch,
    Dispatcher,
    _Permute,
    _Reorder,
    _Unpermute,
    capacity,
    plan_dispatch,
    plan_dispatch_reference,
    regroup,
)
from ptdp.model.gpt import TPContext
from ptdp.model.moe import MoE, MoEState
from ptdp.model.router import RouterOptions, Routing, route

H, E = 16, 4
BASE = ModelConfig(
    num_layers=2, hidden_size=H, num_heads=2, seq_length=8, vocab_size=32, ffn_hidden_size=24,
    num_experts=E, moe_top_k=2,
)  # fmt: skip
VARIANTS = {
    "dropless": {},
    "top3-renormalized": {"moe_top_k": 3, "moe_renormalize": True},
    "capacity": {"moe_capacity_factor": 1.0},
    "capacity-top1": {"moe_capacity_factor": 1.25, "moe_top_k": 1},
    "swiglu-sigmoid-capacity": {
        "activation": Activation.SWIGLU, "bias": False, "moe_capacity_factor": 1.0,
        "moe_score_function": ScoreFunction.SIGMOID, "moe_routed_scaling": 2.5,
        "moe_top_k": 3,
    },
    "losses-shared": {"moe_aux_loss_coeff": 0.3, "moe_z_loss_coeff": 0.05, "moe_shared_experts": 1},
}  # fmt: skip


def _blocks(cfg: ModelConfig) -> dict[Dispatcher, MoE]:
    """A block per dispatcher, with the same parameters."""
    blocks = {}
    for d in Dispatcher:
        torch.manual_seed(0)
        block = MoE(cfg, TPContext(), layer=0, state=MoEState(), dispatch=d.value)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.5)
        blocks[d] = block.train()
    return blocks


def _run(block: MoE, x: torch.Tensor, r: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, the rows the experts saw, the input's and every parameter's gradient."""
    seen = []
    hook = block.experts.register_forward_hook(lambda _m, a, _o: seen.append(a[0].detach()))
    x = x.clone().requires_grad_()
    block.zero_grad()
    out = block(x)
    (out * r).sum().backward()
    hook.remove()
    got = {"out": out.detach(), "rows": seen[0], "dx": x.grad}
    return got | {n: p.grad.clone() for n, p in block.named_parameters()}


def _routing(t: int, k: int, seed: int, ties: bool = False) -> Routing:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, E, generator=gen)
    if ties:  # few distinct weights: the capacity cut decides by token order
        logits = logits.round()
    return route(logits, None, RouterOptions(E, k))


def _equal(a: Dispatch, b: Dispatch) -> None:
    for name in ("choice", "expert", "counts", "routed", "dropped"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("ties", [False, True])
def test_the_one_sort_plan_equals_the_reference(k: int, ties: bool) -> None:
    for seed in range(4):
        routing = _routing(37, k, seed, ties)
        for factor in (0.0, 1.0, 1.25, 2.0):
            cap = capacity(factor, 37, k, E)
            _equal(plan_dispatch(routing, E, cap), plan_dispatch_reference(routing, E, cap))


def test_the_capacity_key_orders_weights_as_floats() -> None:
    """The integer key of a weight sorts as the float: zeros of both signs tie, tiny and
    large weights in order (what a float64 key expert - weight would blur)."""
    w = torch.tensor([[0.0], [1e-38], [-0.0], [3.0], [1e-45], [1.0], [3.0], [0.5]])
    routing = Routing(torch.zeros(8, 1, dtype=torch.int64), w, w, w)
    got = plan_dispatch(routing, 1, cap=8)
    assert got.choice.tolist() == [3, 6, 5, 7, 1, 4, 0, 2]
    _equal(got, plan_dispatch_reference(routing, 1, cap=8))


@pytest.mark.parametrize("name", VARIANTS)
def test_fused_block_matches_the_reference_token_by_token(name: str) -> None:
    """The experts see the same rows in the same order; the output and every gradient
    agree to fp32 rounding (the combine adds a token's choices in expert order, the
    reference in choice order)."""
    cfg = replace(BASE, **VARIANTS[name])
    blocks = _blocks(cfg)
    torch.manual_seed(1)
    x, r = torch.randn(6, 3, H), torch.randn(6, 3, H)
    fused, ref = (_run(blocks[d], x, r) for d in (Dispatcher.FUSED, Dispatcher.REFERENCE))
    assert torch.equal(fused["rows"], ref["rows"])
    for key in ref:
        torch.testing.assert_close(fused[key], ref[key], rtol=1e-6, atol=1e-6, msg=key)
    f, w = (blocks[d].state.stats[0] for d in (Dispatcher.FUSED, Dispatcher.REFERENCE))
    assert torch.equal(f.routed, w.routed) and torch.equal(f.dropped, w.dropped)
    if cfg.moe_capacity_factor:
        assert int(f.dropped) > 0
    if cfg.moe_top_k <= 2:  # two terms add alike in either order
        assert torch.equal(fused["out"], ref["out"])


def test_fused_block_repeats_bit_for_bit() -> None:
    cfg = replace(BASE, moe_capacity_factor=1.0, moe_top_k=3)
    block = _blocks(cfg)[Dispatcher.FUSED]
    torch.manual_seed(2)
    x, r = torch.randn(8, 4, H), torch.randn(8, 4, H)
    first, second = _run(block, x, r), _run(block, x, r)
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_fused_block_under_autocast_matches_the_reference() -> None:
    """bf16 products: both combine in fp32 and return the rows' dtype."""
    blocks = _blocks(replace(BASE, moe_capacity_factor=1.0))
    torch.manual_seed(3)
    x, r = torch.randn(6, 3, H), torch.randn(6, 3, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, ref = (_run(blocks[d], x, r) for d in (Dispatcher.FUSED, Dispatcher.REFERENCE))
    assert fused["out"].dtype == ref["out"].dtype
    for key in ref:
        torch.testing.assert_close(fused[key], ref[key], rtol=1e-2, atol=1e-2, msg=key)


def test_row_movers_have_their_gradients() -> None:
    """gradcheck in float64 of the gather in, the weighted scatter-add out (a dropped
    choice included) and a reorder."""
    torch.manual_seed(4)
    t, k, h = 5, 2, 3
    choice = torch.tensor([0, 3, 4, 9, 6, 1, 7, 2])  # choices 5 and 8 dropped
    token = choice // k
    tokens = torch.randn(t, h, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(len(choice), h, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(t, k, dtype=torch.float64, requires_grad=True)
    perm = torch.randperm(len(choice))
    inverse = torch.empty_like(perm).index_copy_(0, perm, torch.arange(len(choice)))
    assert torch.autograd.gradcheck(lambda a: _Permute.apply(a, token), (tokens,))
    assert torch.autograd.gradcheck(
        lambda a, w: _Unpermute.apply(a, w, choice, token), (rows, weights)
    )
    assert torch.autograd.gradcheck(lambda a: _Reorder.apply(a, perm, inverse), (rows,))


def test_regrouping_from_the_counts_equals_a_stable_sort() -> None:
    """The receiver's order without a sort: what the reference computes with two."""
    gen = torch.Generator().manual_seed(5)
    for sources, local in ((2, 2), (4, 2), (3, 5), (1, 4)):
        got = torch.randint(0, 4, (sources, local), generator=gen)
        got[0, 0] = 0  # an empty segment
        m = int(got.sum())
        to_expert, to_source, counts, expert = regroup(got, m)
        arrival = torch.arange(local).repeat(sources).repeat_interleave(got.reshape(-1))
        order = torch.sort(arrival, stable=True).indices
        assert torch.equal(to_expert, order) and torch.equal(to_source, torch.argsort(order))
        assert torch.equal(counts, got.sum(0)) and torch.equal(expert, arrival[order])


def test_the_benchmark_switches_the_dispatcher_and_the_kernel() -> None:
    """benchmarks/parallelism/moe_dispatch.py's variants run what they name (the timing
    itself is the benchmark's, never asserted)."""
    from ptdp.parallel import wgrad
    from ptdp.parallel.grouped import GemmKernel
    from tests.helpers import load_benchmark

    bench = load_benchmark("parallelism/moe_dispatch")
    block = _blocks(BASE)[Dispatcher.FUSED]
    x, w = torch.randn(4, 8), torch.randn(2, 8, 8)
    want = {
        "reference": (Dispatcher.REFERENCE, GemmKernel.LOOP),
        "fused-loop": (Dispatcher.FUSED, GemmKernel.LOOP),
        "fused": (Dispatcher.FUSED, GemmKernel.UNPADDED),
    }
    assert set(bench.VARIANTS) == set(want)
    for name, (dispatcher, kernel) in want.items():
        with bench.variant([block], name):
            assert block.dispatcher is dispatcher and wgrad.choose_gemm(x, w) is kernel
