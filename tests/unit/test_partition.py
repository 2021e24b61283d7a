"""Layer ranges per pipeline stage (pure)."""

from __future__ import annotations

import pytest

from ptdp.pipeline.partition import layer_ranges
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


@pytest.mark.parametrize("layers", [(2, 3), (1, 1, 4), (0, 6)])
def test_explicit_split_never_drops_layers(layers: tuple[int, ...]) -> None:
    with pytest.raises(
        ValueError, match="must have pp\\*vpp = 2\\*1 = 2 entries, each >= 1, summing"
    ):
        layer_ranges(6, 2, 1, layers)
