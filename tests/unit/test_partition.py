"""Layer ranges per pipeline stage (pure)."""

from __future__ import annotations

import pytest

from ptdp.pipeline.partition import is_split, layer_ranges, near_even_split
from ptdp.pipeline.placement import StageMap


@pytest.mark.parametrize(("layers", "pp", "vpp"), [(8, 1, 1), (8, 2, 1), (8, 2, 2), (24, 4, 3)])
def test_every_layer_exactly_once_in_order(layers: int, pp: int, vpp: int) -> None:
    ranges = layer_ranges(layers, pp, vpp)
    assert [i for r in ranges for i in r] == list(range(layers))
    assert len(ranges) == pp * vpp and len({len(r) for r in ranges}) == 1


def test_interleaved_ownership() -> None:
    # The paper's example: 4 devices, 2 chunks each; device 1 holds stages 1 and 5.
    assert StageMap(4, 2).stages_of(1) == [1, 5]
    assert [StageMap(4, 2).rank(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert list(layer_ranges(16, 4, 2)[5]) == [10, 11]


def test_uneven_split_is_an_error() -> None:
    with pytest.raises(ValueError, match="10 layers do not split evenly over pp\\*vpp = 4\\*1"):
        layer_ranges(10, 4)


def test_explicit_split() -> None:
    ranges = layer_ranges(6, 2, 1, (2, 4))
    assert [list(r) for r in ranges] == [[0, 1], [2, 3, 4, 5]]
    ranges = layer_ranges(6, 2, 2, (1, 2, 2, 1))
    assert [list(r) for r in ranges] == [[0], [1, 2], [3, 4], [5]]
    assert layer_ranges(8, 2, 2, ()) == layer_ranges(8, 2, 2)  # empty = even


@pytest.mark.parametrize("layers", [(2, 3), (1, 1, 4), (-1, 7)])
def test_explicit_split_never_drops_layers(layers: tuple[int, ...]) -> None:
    with pytest.raises(
        ValueError, match="must have pp\\*vpp = 2\\*1 = 2 entries, each >= 1 \\(the first"
    ):
        layer_ranges(6, 2, 1, layers)


def test_first_and_last_stage_may_hold_no_layer() -> None:
    # The embedding alone first, the final norm, output layer and loss alone last.
    assert layer_ranges(6, 2, 1, (0, 6)) == [range(0, 0), range(0, 6)]
    ranges = layer_ranges(4, 2, 2, (0, 2, 2, 0))
    assert [list(r) for r in ranges] == [[], [0, 1], [2, 3], []]
    with pytest.raises(ValueError, match="the first and the last may be 0"):
        layer_ranges(4, 2, 2, (1, 0, 3, 0))  # a middle stage of no layer: never


@pytest.mark.parametrize(
    ("layers", "stages", "split"),
    [
        (14, 4, (3, 4, 4, 3)),  # the ends, holding the embedding and the loss, lightest
        (6, 4, (1, 2, 2, 1)),
        (7, 4, (2, 2, 2, 1)),  # then the first stage before the last (the output layer)
        (8, 4, (2, 2, 2, 2)),
        (2, 4, (0, 1, 1, 0)),
        (3, 4, (1, 1, 1, 0)),
        (1, 2, (1, 0)),
        (1, 3, (0, 1, 0)),
        (5, 1, (5,)),
        (1, 4, None),  # a middle stage would hold no layer
        (0, 1, None),
    ],
)
def test_near_even_split(layers: int, stages: int, split: tuple[int, ...] | None) -> None:
    assert near_even_split(layers, stages) == split
    if split is not None:
        assert is_split(split, layers, stages)
        assert [i for r in layer_ranges(layers, stages, 1, split) for i in r] == list(range(layers))
