"""Rank <-> (tp, cp, dp, pp) coordinates and groups: pure logic, no processes."""

from __future__ import annotations

from itertools import product

import pytest

from ptdp.parallel.mesh import MeshShape, ParallelMesh
from ptdp.rules.layout import COMBINED, ORDER

SHAPES = [MeshShape(t, d, p) for t, d, p in product([1, 2, 4], [1, 2, 3], [1, 2, 4])]
SHAPES += [MeshShape(t, d, p, c) for t, d, p, c in product([1, 2], [1, 2], [1, 2], [2, 4])]


def test_order_is_tensor_then_context_then_data_then_pipeline() -> None:
    assert ORDER == ("tp", "cp", "dp", "pp")
    shape = MeshShape(tp=2, dp=2, pp=2)
    # rank = tp + t * (dp + d * pp)
    assert [tuple(shape.coords(r).values()) for r in range(8)] == [
        (0, 0, 0, 0),
        (1, 0, 0, 0),
        (0, 0, 1, 0),
        (1, 0, 1, 0),
        (0, 0, 0, 1),
        (1, 0, 0, 1),
        (0, 0, 1, 1),
        (1, 0, 1, 1),
    ]
    assert shape.group_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.group_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.group_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.embedding_group_ranks() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert MeshShape(tp=1, dp=1, pp=4).embedding_group_ranks() == [[0, 3]]
    assert MeshShape(tp=2, dp=1, pp=1).embedding_group_ranks() == [[0], [1]]


def test_context_axis_sits_between_tensor_and_data() -> None:
    # rank = tp + t * (cp + c * (dp + d * pp))
    shape = MeshShape(tp=2, dp=2, pp=1, cp=2)
    assert shape.world_size == 8
    assert shape.coords(5) == {"tp": 1, "cp": 0, "dp": 1, "pp": 0}
    assert shape.group_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.group_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # gradients reduce once over every replica: cp and dp together, cp fastest
    assert shape.group_ranks("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    mesh = ParallelMesh(shape, rank=6)
    assert (mesh.size("dp_cp"), mesh.coord("dp_cp")) == (4, 3)
    assert MeshShape(tp=2, dp=2).group_ranks("dp_cp") == MeshShape(tp=2, dp=2).group_ranks("dp")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_coordinates_round_trip_and_groups_partition(shape: MeshShape) -> None:
    for rank in range(shape.world_size):
        assert shape.rank_of(**shape.coords(rank)) == rank
    for axis in (*ORDER, *COMBINED):
        groups = shape.group_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(shape.world_size))
        assert all(len(g) == shape.size_of(axis) for g in groups)
        if axis in COMBINED:
            continue
        for g in groups:  # members differ only along `axis`
            others = {tuple(v for a, v in shape.coords(r).items() if a != axis) for r in g}
            assert len(others) == 1


def test_two_meshes_coexist_and_describe_themselves() -> None:
    a = ParallelMesh(MeshShape(2, 2, 1), rank=3)
    b = ParallelMesh(MeshShape(1, 4, 1), rank=3)
    assert (a.coord("tp"), a.coord("dp")) == (1, 1)
    assert (b.coord("tp"), b.coord("dp")) == (0, 3)
    assert str(a) == "TP(1/2)-CP(0/1)-DP(1/2)-PP(0/1)-Rank(3)"
    single = ParallelMesh.single()
    assert single.axis("tp").size == 1 and single.axis("dp").rank == 0
    with pytest.raises(ValueError, match="rank 4 outside a mesh of 4"):
        MeshShape(2, 2, 1).coords(4)
