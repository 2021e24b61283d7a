"""A flat slice of a tensor as boxes (ptdp/checkpoint/boxes.py): exactly its elements, in
order, padding left out, placed at the shard's offset; and a DCP save of boxes loads back
as the tensor they cut."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ptdp.checkpoint.boxes import Boxes, TensorPlace, flat_boxes, placed_boxes


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (4, 1, 3)])
def test_flat_boxes_cover_exactly_the_range_in_order(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    for lo, hi in itertools.combinations_with_replacement(range(n + 1), 2):
        seen = torch.zeros(shape, dtype=torch.long)
        at = lo
        for box in flat_boxes(shape, lo, hi):
            assert box.start == at  # contiguous, in order
            seen[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] += 1
            at += math.prod(box.sizes)
        assert at == hi
        flat = seen.reshape(-1)
        assert flat[lo:hi].eq(1).all() and flat[:lo].eq(0).all() and flat[hi:].eq(0).all()
        assert len(flat_boxes(shape, lo, hi)) <= 2 * len(shape) - 1


def test_placed_boxes_leave_padding_out_and_move_to_the_shard() -> None:
    """A [4, 3] tensor-local shard whose last row is padding, rows 6..8 of a [9, 3] tensor."""
    local = torch.arange(12, dtype=torch.float32).view(4, 3)
    place = TensorPlace(shape=(4, 3), valid=(3, 3), offsets=(6, 0), size=(9, 3))
    full = torch.full((9, 3), -1.0)
    for lo, hi in [(0, 12), (2, 11), (4, 5), (9, 12)]:
        full.fill_(-1.0)
        for box, data in placed_boxes(place, local.reshape(-1)[lo:hi], lo):
            assert data.untyped_storage().data_ptr() == local.data_ptr()  # a view: no copy
            copy = Boxes(place.size, [(box, data)]).snapshot().boxes[0][1]
            assert copy.untyped_storage().nbytes() == data.nbytes  # its elements alone
            full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] = data
        want = torch.full((9, 3), -1.0)
        mask = torch.zeros(12, dtype=torch.bool)
        mask[lo:hi] = True
        want[6:9] = torch.where(mask.view(4, 3), local, -1.0)[:3]
        assert torch.equal(full, want), (lo, hi)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_boxes_save_and_load_as_the_tensor(tmp_path: Path) -> None:
    """Two slices of one tensor (as two dp ranks would own them), saved as boxes in one
    process, load back as the whole tensor and as any part of it."""
    value = torch.randn(5, 6)
    place = TensorPlace((5, 6), (5, 6), (0, 0), (5, 6))
    flat = value.reshape(-1)
    boxes = placed_boxes(place, flat[:13], 0) + placed_boxes(place, flat[13:], 13)
    dcp.save({"w": Boxes((5, 6), boxes)}, checkpoint_id=tmp_path, no_dist=True)
    whole = {"w": torch.zeros(5, 6)}
    dcp.load(whole, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(whole["w"], value)
    with pytest.raises(RuntimeError, match="checkpoint chunks only"):
        Boxes((5, 6), boxes) + 1
