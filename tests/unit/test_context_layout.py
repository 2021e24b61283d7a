"""Context parallelism without processes: the load-balanced split, the block plan it makes
(what is skipped, half-computed and fused) and the layouts refused before launch."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from ptdp.config.enums import CpComm
from ptdp.config.files import apply_updates
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.model.positions import TokenPositions
from ptdp.parallel import context
from ptdp.parallel.comm import Group
from ptdp.parallel.context import Kind, context_attention, local_index, plan_block, split_sequence
from ptdp.rules.layout import validate


def test_rank_i_holds_chunks_i_and_2cp_minus_1_minus_i() -> None:
    assert local_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    parts = torch.cat([local_index(24, 4, r) for r in range(4)])
    assert sorted(parts.tolist()) == list(range(24))  # a partition of the window
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 8"):
        local_index(20, 4, 0)


def test_split_keeps_original_positions_and_documents() -> None:
    tokens = torch.arange(32).view(2, 16)
    docs = (torch.arange(16) >= 6).long().expand(2, 16)
    full = TokenPositions(torch.arange(16), None, docs)
    t, labels, pos = split_sequence(tokens, tokens + 1, full, Group(None, 2, 1))
    assert t[1].tolist() == list(range(20, 28)) and labels[0, 0] == 5
    assert pos.index.tolist() == list(range(4, 12))
    assert pos.document[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    same = split_sequence(tokens, tokens, None, Group.single())
    assert same[0] is tokens and same[2] is None


@pytest.mark.parametrize("cp", [2, 4])
def test_balanced_split_gives_equal_work_and_no_masks(cp: int) -> None:
    """Rank i reads its own keys causally, earlier ranks' first chunk with all its queries
    and later ranks' keys with its second chunk only: the same work on every rank."""
    seq, half = 8 * cp, 4
    pos = [TokenPositions(local_index(seq, cp, r)) for r in range(cp)]
    work = []
    for i in range(cp):
        blocks = [plan_block(pos[i], pos[j], 0) for j in range(cp)]
        assert blocks[i].kind is Kind.CAUSAL and blocks[i].rows == slice(0, 2 * half)
        for j, block in enumerate(blocks):
            if j < i:  # all queries, the source's early chunk
                assert (block.kind, block.rows, block.cols) == (
                    Kind.FULL, slice(0, 2 * half), slice(0, half)
                )  # fmt: skip
            elif j > i:  # the late queries, every key of the source
                assert (block.kind, block.rows, block.cols) == (
                    Kind.FULL, slice(half, 2 * half), slice(0, 2 * half)
                )  # fmt: skip
        work.append(
            sum((b.rows.stop - b.rows.start) * (b.cols.stop - b.cols.start) for b in blocks)
        )
    assert len(set(work)) == 1


def test_plan_from_sorted_indices_equals_the_plan_from_the_mask() -> None:
    """Causal order alone is planned from the indices (no s x s mask); one document over
    the window takes the mask path: both give the same blocks."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        q, k = (torch.randperm(40, generator=gen)[:12].sort().values for _ in range(2))
        fast = plan_block(TokenPositions(q), TokenPositions(k), 0)
        one_doc = torch.zeros(1, 12, dtype=torch.long)
        slow = plan_block(TokenPositions(q, None, one_doc), TokenPositions(k, None, one_doc), 0)
        assert (fast is None) == (slow is None)
        if fast is not None:
            assert (fast.kind, fast.rows, fast.cols) == (slow.kind, slow.rows, slow.cols)
            if fast.kind is Kind.MASKED:
                assert torch.equal(fast.mask, slow.mask)


def test_documents_and_windows_make_masked_or_skipped_blocks() -> None:
    index = torch.arange(16)
    docs = torch.stack([index >= 6, index >= 10]).long()  # a document break per sample
    full = TokenPositions(index, None, docs)
    q, k = full.select(local_index(16, 2, 0)), full.select(local_index(16, 2, 1))
    block = plan_block(q, k, 0)  # the late queries read keys 6..11 (sample 0), 10..11 (1)
    assert block.kind is Kind.MASKED and (block.rows, block.cols) == (slice(4, 8), slice(2, 8))
    assert block.mask[:, 0, 0].tolist() == [[True] * 6, [False] * 4 + [True] * 2]
    early = TokenPositions(torch.arange(4))
    late = TokenPositions(torch.arange(12, 16))
    assert plan_block(early, late, 0) is None  # the future: skipped
    assert plan_block(late, early, 4) is None  # out of the window: skipped


@pytest.mark.parametrize("comm", list(CpComm))
def test_a_microbatch_is_planned_once_for_all_its_layers(monkeypatch, comm: CpComm) -> None:
    """Two attention layers, forward, recomputed forward and backward, plan the ring's blocks
    (or the all-gather's mask) once; the next microbatch's split plans anew. A ring of one
    rank runs the same code with no transfers."""
    planned = []
    for name in ("plan_block", "_window_mask"):
        real = getattr(context, name)
        monkeypatch.setattr(context, name, lambda *a, f=real: planned.append(1) or f(*a))
    docs = (torch.arange(16) >= 6).long().expand(2, 16)
    window = TokenPositions(torch.arange(16), None, docs)
    gen = torch.Generator().manual_seed(0)
    for microbatch in (1, 2):
        mine = replace(window, keys=(window.select(torch.arange(16)),))  # what a split makes
        leaves = [torch.randn(2, 4, 16, 8, generator=gen, requires_grad=True) for _ in range(3)]
        x = leaves[0]
        for _ in range(2):  # layers
            attend = partial(context_attention, cp=Group.single(), comm=comm, window=5)
            x = checkpoint(attend, x, *leaves[1:], mine, use_reentrant=False)
        x.sum().backward()
        assert len(planned) == microbatch, comm
        assert all(leaf.grad.abs().sum() > 0 for leaf in leaves)
    assert "plans" not in repr(mine) and mine == mine and replace(mine).plans == {}
    assert len(mine.plans) == 1 and hash(mine) == hash(replace(mine))


def _cfg(updates: dict, **parallel) -> RunConfig:
    model = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 256}
    sections = {"model": model, "parallel": parallel}
    for section, values in updates.items():
        sections[section] = sections.get(section, {}) | values
    return apply_updates(RunConfig(), sections, "the test")


@pytest.mark.parametrize(
    "updates, world, needle",
    [
        (
            {"model": {"seq_length": 20}},
            4,
            "model.seq_length = 20 is not divisible by 2*parallel.cp = 8",
        ),
        ({"model": {"dropout": 0.1}}, 2, "set --model.dropout 0 or --parallel.cp 1"),
        ({"train": {"compile": True}}, 2, "set --train.compile false"),
        (
            {"model": {"seq_length": 20}, "parallel": {"tp": 4, "sequence_parallel": True}},
            8,
            "model.seq_length / parallel.cp = 10",
        ),
    ],
)
def test_bad_cp_layouts_are_refused_before_launch(updates: dict, world: int, needle: str) -> None:
    cp = world // updates.get("parallel", {}).get("tp", 1)
    cfg = _cfg(updates, cp=cp)
    with pytest.raises(ConfigError, match=needle.replace("*", "\\*").replace(".", "\\.")):
        validate(cfg, world)


def test_good_cp_layout_is_accepted() -> None:
    updates = {"model": {"seq_length": 32}, "train": {"global_batch_size": 16}}
    cfg = _cfg(updates, cp=2, tp=2, sequence_parallel=True)
    layout = validate(cfg, 8)
    assert (layout.cp, layout.tp, layout.dp) == (2, 2, 2)
    assert "cp=2" in layout.describe()
