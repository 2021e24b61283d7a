"""Mixture-of-experts blocks split over a tensor group, and experts split over an
expert-parallel group (gloo on CPU), against one process: every token's chosen experts in
every layer (not only the loss), the loss, every gradient gathered back to full shape, and
the logits; `sum_across`'s and the all-to-all's backward. The training-level
equivalence (every parallel dimension) is the grid's (tests/dist/test_grid.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
import torch

from ptdp.config.sections import ModelConfig
from ptdp.model.gpt import GPT
from ptdp.parallel import comm
from ptdp.parallel.comm import Group
from ptdp.parallel.grads import reduce_sequence_parallel_grads
from ptdp.parallel.init import expert_split, full_tensor, shard_spec
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

CFG = ModelConfig(
    num_layers=3, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64, num_experts=4,
    moe_top_k=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_capacity_factor=1.0,
    moe_shared_experts=1, moe_first_dense_layers=1,
)  # fmt: skip
SWIGLU = {"activation": "swiglu", "bias": False, "moe_score_function": "sigmoid"}


def _routes(model: GPT) -> dict[int, list]:
    """Each MoE layer's chosen experts per forward, by layer, as hooks record them."""
    seen: dict[int, list] = {}
    for i, block in model.moe_layers().items():
        block.router.register_forward_hook(
            lambda _m, _a, out, i=i: seen.setdefault(i, []).append(out.experts.clone())
        )
    return seen


def _check_block(tp: Group, options: dict, sp: bool, folded: bool) -> None:
    """`folded`: the experts whole on every tensor rank (etp = 1, dropless), each rank
    computing its own tokens'; else split over the tensor group like the MLP (etp = tp)."""
    cfg = replace(CFG, **options, **({"moe_capacity_factor": 0.0} if folded else {}))
    etp = Group.single() if folded else tp
    ref, model = GPT(cfg, seed=3), GPT(cfg, seed=3, tp=tp, etp=etp, sequence_parallel=sp)
    ref_routes, routes = _routes(ref), _routes(model)
    torch.manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    loss_ref = ref(tokens[:, :-1], tokens[:, 1:])
    loss = model(tokens[:, :-1], tokens[:, 1:])
    # Each tensor rank routes its own slice of the sequence, exactly as one process does.
    assert sorted(routes) == sorted(ref_routes) == [1, 2]
    for i in routes:
        mine = routes[i][0]
        every = comm.all_gather_objects(mine.tolist(), tp.group, tp.size)
        assert torch.equal(torch.tensor(sum(every, [])), ref_routes[i][0]), (i, sp)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    loss_ref.backward()
    loss.backward()
    reduce_sequence_parallel_grads(model, model.roles, tp)
    if folded:  # replicated experts: each tensor rank's gradient holds its own tokens'
        for p in model.parameters():
            if expert_split(p) is not None:
                comm.all_reduce_sum_(p.grad, tp)
    one = Group.single()  # drops the vocabulary padding of the reference's embedding too
    grads = {n: full_tensor(p.grad, shard_spec(p), one) for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        got = full_tensor(p.grad, shard_spec(p), tp, etp=etp)
        torch.testing.assert_close(got, grads[name], rtol=1e-5, atol=1e-6, msg=f"{name} sp={sp}")
    for i, block in model.moe_layers().items():  # summed over the tensor ranks: one process's
        stats, want = block.state.stats[i], ref.moe.stats[i]
        routed, dropped = stats.routed.clone(), stats.dropped.clone()
        comm.all_reduce_sum_(routed, tp)
        comm.all_reduce_sum_(dropped, tp)
        assert torch.equal(routed, want.routed) and torch.equal(dropped, want.dropped)
        torch.testing.assert_close(stats.aux, want.aux)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens[:1, :-1]), ref.eval()(tokens[:1, :-1]))


def _check_sum_across(g: Group) -> None:
    x = torch.full((3,), float(g.rank + 1), requires_grad=True)
    y = comm.sum_across(x, g)
    assert torch.equal(y.detach(), torch.full((3,), 3.0))
    (y * (g.rank + 1)).sum().backward()  # each member's loss reads the sum
    assert torch.equal(x.grad, torch.full((3,), 3.0))  # d(sum of the losses)/dx


def _check_expert_parallel(ep: Group, options: dict) -> None:
    """Each member runs its own tokens (as data-parallel replicas do) through experts split
    over the group; one process runs every member's tokens through all of them."""
    cfg = replace(CFG, **options)
    ref, model = GPT(cfg, seed=3), GPT(cfg, seed=3, ep=ep)
    for name, p in model.named_parameters():  # this member's experts of all of them
        assert p.shape[0] == (2 if ".experts." in name else p.shape[0]), name
    ref_routes, routes = _routes(ref), _routes(model)
    torch.manual_seed(11)
    tokens = torch.randint(0, cfg.vocab_size, (ep.size, 2, 17))
    ref_losses = [ref(t[:, :-1], t[:, 1:]) for t in tokens]
    loss = model(tokens[ep.rank, :, :-1], tokens[ep.rank, :, 1:])
    torch.testing.assert_close(loss, ref_losses[ep.rank], rtol=1e-5, atol=0)
    for i in routes:  # the member routes its tokens as one process does
        assert torch.equal(routes[i][0], ref_routes[i][ep.rank]), i
    sum(ref_losses).backward()
    loss.backward()
    for name, p in model.named_parameters():
        grad = p.grad if ".experts." in name else comm.sum_across(p.grad, ep)
        got = full_tensor(grad, shard_spec(p), Group.single(), ep, expert_split(p))
        mine = dict(ref.named_parameters())[name]
        want = full_tensor(mine.grad, shard_spec(mine), Group.single())  # drops padding
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
    for i, block in model.moe_layers().items():  # the members' loads add up to one's
        routed = block.state.stats[i].routed.clone()
        comm.all_reduce_sum_(routed, ep)
        assert torch.equal(routed, ref.moe.stats[i].routed), i


def _check_all_to_all(g: Group) -> None:
    """Member r sends r + 1 + i rows to member i, and receives them in member order; the
    gradient of every row goes back to the row it came from."""

    def count(src: int, dst: int) -> int:
        return src + 1 + dst

    def first(src: int, dst: int) -> int:  # where src's rows for dst start in its input
        return sum(count(src, i) for i in range(dst))

    send = [count(g.rank, i) for i in range(g.size)]
    recv = [count(r, g.rank) for r in range(g.size)]
    x = (torch.arange(sum(send)) + 100.0 * g.rank).requires_grad_()
    y = comm.all_to_all(x.view(-1, 1), g, send, recv).view(-1)
    want = [100.0 * r + first(r, g.rank) + j for r in range(g.size) for j in range(recv[r])]
    assert y.tolist() == want
    (y * (torch.arange(len(want)) + 1000.0 * g.rank)).sum().backward()
    back = []  # the weight member i gave each row this member sent it
    for i in range(g.size):
        at = sum(count(r, i) for r in range(g.rank))
        back += [1000.0 * i + at + j for j in range(send[i])]
    assert x.grad.tolist() == back


class _Mark(torch.autograd.Function):
    """Identity that records when autograd runs it, forward and backward: a stand-in for
    the shared experts that `parallel.moe_overlap` runs while the dispatch is in flight."""

    @staticmethod
    def forward(ctx, x, events):
        ctx.events = events
        events.append("compute")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.events.append("compute backward")
        return grad, None


def _check_async_all_to_all(g: Group) -> None:
    """`all_to_all_start`/`all_to_all_wait` exchange as `all_to_all` does, forward and
    backward, and what is made between them runs while the exchange is in flight: in
    forward between post and wait, and in backward between the gradient's post and wait."""
    send = [g.rank + 1 + i for i in range(g.size)]
    recv = [r + 1 + g.rank for r in range(g.size)]
    x = (torch.arange(sum(send)) + 100.0 * g.rank).requires_grad_()
    x_plain = x.detach().clone().requires_grad_()
    side = torch.ones(3, requires_grad=True)
    events: list[str] = []
    plain = comm._all_to_all_async

    def logged(*args):
        events.append("post")
        return plain(*args)

    comm._all_to_all_async = logged
    try:
        posted, handle = comm.all_to_all_start(x.view(-1, 1), g, send, recv)
        wait = handle.wait
        handle.wait = lambda: (events.append("wait"), wait())[1]
        marked = _Mark.apply(side * 2, events)
        y = comm.all_to_all_wait(posted, handle).view(-1)
        weights = torch.arange(len(y)) + 1000.0 * g.rank
        ((y * weights).sum() + marked.sum()).backward()
    finally:
        comm._all_to_all_async = plain
    y_plain = comm.all_to_all(x_plain.view(-1, 1), g, send, recv).view(-1)
    (y_plain * weights).sum().backward()
    assert torch.equal(y.detach(), y_plain.detach()) and torch.equal(x.grad, x_plain.grad)
    assert events == ["post", "compute", "wait", "post", "compute backward", "wait"], events


def _check_bytes(ep: Group) -> None:
    """Under uniform routing (token i's j-th choice: expert (k i + j) mod e) the rows the
    all-to-alls send to other members in one forward and backward are 4 x the performance
    model's `alltoall_bytes` per MoE layer: dispatch and combine, and their conjugates."""
    from ptdp.perf.cost.moe import alltoall_bytes

    cfg = replace(CFG, moe_capacity_factor=0.0)
    model = GPT(cfg, seed=3, ep=ep)
    for block in model.moe_layers().values():
        routed = block.router.forward

        def uniform(x, routed=routed):
            got = routed(x)
            t, k = got.experts.shape
            choice = torch.arange(t * k).view(t, k) % cfg.num_experts
            return dataclasses.replace(got, experts=choice)

        block.router.forward = uniform
    sent, plain = [], comm._all_to_all

    def counted(x, g, send, recv):
        sent.append(sum(n for i, n in enumerate(send) if i != g.rank) * x[0].nbytes)
        return plain(x, g, send, recv)

    comm._all_to_all = counted
    try:
        tokens = torch.randint(
            0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(ep.rank)
        )
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    finally:
        comm._all_to_all = plain
    layers = len(model.moe_layers())
    per_call = alltoall_bytes(2 * 16, cfg.moe_top_k, cfg.hidden_size, ep.size, 4)
    assert len(sent) == 4 * layers and per_call > 0
    assert sum(sent) == 4 * layers * per_call


def _check(rank: int, world_size: int) -> None:
    tp = Group(None, world_size, rank)
    _check_sum_across(tp)
    for options in ({}, SWIGLU):
        for sp in (False, True):
            for folded in (False, True):
                _check_block(tp, options, sp, folded)


def test_tensor_parallel_moe_routes_and_computes_as_one_process() -> None:
    run_ranks(_check, 2)


def _check_ep(rank: int, world_size: int) -> None:
    ep = Group(None, world_size, rank)
    _check_all_to_all(ep)
    _check_async_all_to_all(ep)
    _check_bytes(ep)
    for options in ({}, SWIGLU):
        _check_expert_parallel(ep, options)


def test_expert_parallel_moe_computes_as_one_process() -> None:
    run_ranks(_check_ep, 2)


def _check_bytes_ep4(rank: int, world_size: int) -> None:
    _check_bytes(Group(None, world_size, rank))


def test_alltoall_bytes_equal_the_performance_model_at_ep4() -> None:
    run_ranks(_check_bytes_ep4, 4)
