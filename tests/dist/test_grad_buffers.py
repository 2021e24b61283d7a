"""GradBuffers on a plain module over two data-parallel ranks: gradients accumulate in
fp32 buffers, nothing is reduced before the last microbatch, each bucket starts during
that microbatch's backward (with overlap on), and the result is the mean over ranks of
the accumulated gradient (or this rank's shard of it, with sharding)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ptdp.parallel.comm import Group
from ptdp.parallel.data import GradBuffers
from ptdp.parallel.roles import NO_ROLES
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

BUCKET_MB = 50 * 4 / 2**20  # about 50 fp32 elements: this model gets two buckets


def _check(rank: int, world_size: int, shard: bool, overlap: bool) -> None:
    torch.manual_seed(0)  # the same weights and data on every rank
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    xs = torch.randn(world_size, 3, 5, 8)
    dp = Group(dist.group.WORLD, world_size, rank)
    single = Group.single()
    buffers = GradBuffers(
        [model], roles=NO_ROLES, dp=dp, tp=single, embedding=single, bucket_mb=BUCKET_MB,
        shard=shard, overlap=overlap,
    )  # fmt: skip
    buckets = buffers.chunks[0].buckets
    assert len(buckets) == 2
    # Reverse registration order: the output layer (ready first in backward) comes first.
    assert buckets[0].params[0] is model[2].bias
    m = xs.shape[1]
    for j in range(m):
        if j == m - 1:
            buffers.start_final(0)
        model(xs[rank, j]).pow(2).mean().div(m).backward()
        assert all(p.grad is None for p in model.parameters())  # moved into main_grad
        if j < m - 1:
            assert buffers.launches == 0, "reduced before the last microbatch"
    assert buffers.early_launches == (2 if overlap else 0)
    buffers.finish()
    assert buffers.launches == 2
    for r in range(world_size):
        for j in range(m):
            ref(xs[r, j]).pow(2).mean().div(m * world_size).backward()
    expected = torch.zeros_like(buffers.chunks[0].grads)
    ref_params = dict(zip(model.parameters(), ref.parameters()))
    for bucket in buckets:
        at = bucket.start
        for p in bucket.params:
            expected[at : at + p.numel()] = ref_params[p].grad.reshape(-1)
            at += p.numel()
    for bucket in buckets:
        first, last = buffers.shard_range(bucket)
        assert (last - first) * (world_size if shard else 1) == bucket.size
        torch.testing.assert_close(buffers.chunks[0].grads[first:last], expected[first:last])
    # Each rank changes its shard of the parameters; the gather gives everyone all of them.
    before = buffers.chunks[0].params.clone()
    for bucket in buckets:
        first, last = buffers.shard_range(bucket)
        buffers.chunks[0].params[first:last] += 1.0
    buffers.gather_params()
    if shard:
        torch.testing.assert_close(buffers.chunks[0].params, before + 1.0)
        torch.testing.assert_close(model[0].weight, ref[0].weight + 1.0)


@pytest.mark.parametrize(("shard", "overlap"), [(False, True), (True, True), (False, False)])
def test_bucketed_reduction(shard: bool, overlap: bool) -> None:
    run_ranks(_check, 2, shard, overlap)


def _check_sharded_grads(rank: int, world_size: int) -> None:
    """ZeRO-2: each rank keeps 1/dp of the gradients; every microbatch's buckets reduce
    during its backward (with overlap) and their full buffers are freed afterwards."""
    for overlap in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 3))
        ref = copy.deepcopy(model)
        xs = torch.randn(world_size, 3, 5, 8)
        dp = Group(dist.group.WORLD, world_size, rank)
        single = Group.single()
        buffers = GradBuffers(
            [model], roles=NO_ROLES, dp=dp, tp=single, embedding=single, bucket_mb=BUCKET_MB,
            shard_grads=True, overlap=overlap,
        )  # fmt: skip
        buf = buffers.chunks[0]
        full = sum(b.size for b in buf.buckets)
        assert buffers.shard and buf.grads.numel() * world_size == full
        m = xs.shape[1]
        for step in range(2):  # the second step starts from zeroed shards
            buffers.zero_grad()
            for j in range(m):
                if j == m - 1:
                    buffers.start_final(0)
                model(xs[rank, j]).pow(2).mean().div(m).backward()
                if overlap:  # all three buckets reduced in this microbatch's backward
                    assert buffers.launches == 3 * (step * m + j + 1)
                    assert all(p.main_grad is None for p in model.parameters())
            buffers.finish()
            assert buffers.full_bytes == 0 and buffers.grad_bytes() == 4 * full // world_size
            sizes = sorted(b.size for b in buf.buckets)  # one filling, one reducing at most
            bound = 4 * (sizes[-1] + sizes[-2]) if overlap else 4 * full
            assert len(sizes) == 3 and 4 * sizes[-1] <= buffers.peak_full_bytes <= bound
            for p in ref.parameters():
                p.grad = None
            for r in range(world_size):
                for j in range(m):
                    ref(xs[r, j]).pow(2).mean().div(m * world_size).backward()
            ref_params = dict(zip(model.parameters(), ref.parameters()))
            for bucket in buf.buckets:
                expected = torch.cat([ref_params[p].grad.reshape(-1) for p in bucket.params])
                expected = torch.cat([expected, expected.new_zeros(bucket.size - len(expected))])
                first, last = buffers.shard_range(bucket)
                want = expected[first - bucket.start : last - bucket.start]
                torch.testing.assert_close(buffers.owned_grads(buf, bucket), want)


def test_sharded_gradients() -> None:
    run_ranks(_check_sharded_grads, 2)


class _Stack(nn.Module):
    """Units for ZeRO-3: the root (input and output layers) and three `layers`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.layers = nn.ModuleDict(
            {str(i): nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for i in range(3)}
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


def _check_sharded_params(rank: int, world_size: int) -> None:
    """ZeRO-3: each rank stores 1/dp of the parameters; a layer's are gathered around its
    forward and its backward (the next layer's already in flight while it runs), freed after;
    kept from forward to backward, one gather per microbatch instead of two. Outputs and
    gradient shards equal the replicated model's."""
    for keep in (False, True):
        torch.manual_seed(0)
        model = _Stack()
        ref = copy.deepcopy(model)
        xs = torch.randn(world_size, 2, 5, 8)
        dp, single = Group(dist.group.WORLD, world_size, rank), Group.single()
        buffers = GradBuffers(
            [model], roles=NO_ROLES, dp=dp, tp=single, embedding=single, bucket_mb=1.0,
            shard_params=True, reshard_after_forward=not keep,
        )  # fmt: skip
        buf, gather = buffers.chunks[0], buffers.gather
        full = sum(b.size for b in buf.buckets)
        assert len(buf.buckets) == 5  # head, layers 2..0, embed: units never share a bucket
        assert buf.params.numel() * world_size == full and buffers.param_bytes() == 4 * full // 2
        second = [b for b in buf.buckets if b.params[0] is model.layers["1"][0].bias]
        seen: list[bool] = []

        def prefetched(*_, bucket=second[0], seen=seen) -> None:
            seen.append(bucket.gather is not None or bucket.users > 0)

        # Layer 0's own hook, after ParamGather's: layer 1 is prefetched, not yet held.
        model.layers["0"].register_forward_hook(prefetched)
        m = xs.shape[1]
        for j in range(m):
            if j == m - 1:
                buffers.start_final(0)
            out = model(xs[rank, j])
            torch.testing.assert_close(out, ref(xs[rank, j]))
            out.pow(2).mean().div(m).backward()
            assert gather.gathered_bytes() == 0  # every unit freed after its backward
        buffers.finish()
        assert seen == [True] * m, "layer 1 was not being gathered while layer 0 ran"
        # Reshard: at most the root and two layers at once; kept: every layer by the loss.
        assert gather.peak_bytes == 4 * full if keep else 0 < gather.peak_bytes < 4 * full
        gathers, scatters = buffers.traffic["all_gather"][0], buffers.traffic["reduce_scatter"][0]
        assert (gathers, scatters) == ((1 if keep else 2) * m * full, m * full)
        for r in range(world_size):
            for j in range(m):
                ref(xs[r, j]).pow(2).mean().div(m * world_size).backward()
        ref_params = dict(zip(model.parameters(), ref.parameters()))
        for bucket in buf.buckets:
            expected = torch.cat([ref_params[p].grad.reshape(-1) for p in bucket.params])
            expected = torch.cat([expected, expected.new_zeros(bucket.size - len(expected))])
            first, last = buffers.shard_range(bucket)
            want = expected[first - bucket.start : last - bucket.start]
            torch.testing.assert_close(buffers.owned_grads(buf, bucket), want)
            weights = torch.cat([ref_params[p].detach().reshape(-1) for p in bucket.params])
            weights = torch.cat([weights, weights.new_zeros(bucket.size - len(weights))])
            assert torch.equal(bucket.shard, weights[first - bucket.start : last - bucket.start])


def test_sharded_parameters() -> None:
    run_ranks(_check_sharded_params, 2)
