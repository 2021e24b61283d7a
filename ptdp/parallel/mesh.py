"""The process mesh: rank <-> (tp, cp, dp, pp) coordinates and one process group per axis.

Ranks are laid out tensor-parallel fastest, then context-parallel, then data-parallel,
then pipeline (rank = tp + t*(cp + c*(dp + d*pp))), so a tensor-parallel group shares a
node, the context-parallel ring (heavy key/value traffic) sits next to it, and pipeline
stages cross nodes, as the paper recommends. `ptdp.rules.layout.ORDER` is the one place that says
so (torch-free, so the performance model reads it too). `ptdp.rules.layout.COMBINED` names groups
spanning several adjacent axes: "dp_cp" reduces the gradients of the parameters replicated
over both (context-parallel ranks hold the same weights).
The coordinate logic is pure; `ParallelMesh.build` creates the groups once, and the
mesh is passed explicitly to whatever needs a group (no module-level state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import product

import torch.distributed as dist

from ptdp.parallel.comm import Group
from ptdp.rules.layout import COMBINED, EXPERT_AXES, ORDER


@dataclass(frozen=True)
class MeshShape:
    tp: int = 1
    dp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert-parallel size (`ptdp.rules.layout.EXPERT_AXES`): adds no rank."""
    etp: int = 1
    """Expert tensor-parallel size: with ep, folds over each stage's tp*cp*dp ranks."""

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage (tp*cp*dp): what the experts' axes split."""
        return self.tp * self.cp * self.dp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in ORDER}

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of `rank` along each axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a mesh of {self.world_size} ranks")
        out = {}
        for axis in ORDER:
            size = getattr(self, axis)
            out[axis], rank = rank % size, rank // size
        return out

    def rank_of(self, **coords: int) -> int:
        rank, stride = 0, 1
        for axis in ORDER:
            rank += coords.get(axis, 0) * stride
            stride *= getattr(self, axis)
        return rank

    def size_of(self, axis: str) -> int:
        """Ranks in one group along `axis` (a mesh axis or a `COMBINED` one)."""
        return math.prod(getattr(self, a) for a in COMBINED.get(axis, (axis,)))

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group along `axis`: ranks that differ only in that coordinate (in those
        coordinates for a `COMBINED` axis, ordered by global rank)."""
        inner = COMBINED.get(axis, (axis,))
        others = [a for a in ORDER if a not in inner]
        groups = []
        for fixed in product(*(range(getattr(self, a)) for a in others)):
            base = dict(zip(others, fixed))
            members = product(*(range(getattr(self, a)) for a in inner))
            groups.append(sorted(self.rank_of(**base, **dict(zip(inner, c))) for c in members))
        return sorted(groups)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """`rank`'s place in its stage's expert layout: etp fastest, then ep, then edp."""
        i = rank % self.stage_size  # pp is the slowest axis: a stage's ranks are contiguous
        return {
            "etp": i % self.etp,
            "ep": i // self.etp % self.ep,
            "edp": i // (self.etp * self.ep),
        }

    def expert_size(self, axis: str) -> int:
        return {"etp": self.etp, "ep": self.ep}.get(axis) or self.stage_size // (self.etp * self.ep)

    def expert_group_ranks(self, axis: str) -> list[list[int]]:
        """Every "etp", "ep" or "edp" group: the ranks of a stage that differ only in that
        coordinate of `expert_coords`."""
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.expert_coords(rank)
            key = (rank // self.stage_size, *(v for a, v in c.items() if a != axis))
            groups.setdefault(key, []).append(rank)
        return sorted(groups.values())

    def embedding_group_ranks(self) -> list[list[int]]:
        """Pairs of ranks holding the first and last pipeline stage at the same (tp, dp):
        they share the tied input embedding / output layer and sum its gradient."""
        if self.pp == 1:
            return [[r] for r in range(self.world_size)]
        return [[g[0], g[-1]] for g in self.group_ranks("pp")]


@dataclass
class ParallelMesh:
    """One rank's view of the mesh: its coordinates and its group along each axis."""

    shape: MeshShape
    rank: int = 0
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)

    @classmethod
    def single(cls) -> ParallelMesh:
        """The one-process mesh (no process group needed)."""
        axes = (*ORDER, *COMBINED, *EXPERT_AXES, "embedding")
        return cls(MeshShape(), 0, {axis: None for axis in axes})

    @classmethod
    def build(cls, shape: MeshShape, rank: int, timeout: timedelta | None = None) -> ParallelMesh:
        """Create every axis group; all ranks must call this in the same order. `timeout`:
        how long a collective of these groups may wait (torch's default otherwise: 30 min
        on gloo, whatever the default group's)."""
        groups: dict[str, dist.ProcessGroup | None] = {}
        axes = {axis: shape.group_ranks(axis) for axis in (*ORDER, *COMBINED)}
        axes.update({axis: shape.expert_group_ranks(axis) for axis in EXPERT_AXES})
        axes["embedding"] = shape.embedding_group_ranks()
        made: dict[str, list[list[int]]] = {}
        for axis, all_ranks in axes.items():
            same = next((a for a, r in made.items() if r == all_ranks), None)
            made[axis] = all_ranks
            if same is not None:  # e.g. edp = dp_cp when the experts are not folded
                groups[axis] = groups[same]
                continue
            groups[axis] = None
            for ranks in all_ranks:
                # new_group is collective over the world: every rank creates every group.
                group = (
                    dist.new_group(ranks, timeout=timeout)
                    if shape.world_size > 1 and len(ranks) > 1
                    else None
                )
                if rank in ranks:
                    groups[axis] = group
        return cls(shape, rank, groups)

    def coord(self, axis: str) -> int:
        if axis == "embedding":  # 0 on the first stage, 1 on the last
            return 0 if self.shape.coords(self.rank)["pp"] == 0 else min(self.size(axis) - 1, 1)
        if axis in COMBINED:
            return next(g.index(self.rank) for g in self.shape.group_ranks(axis) if self.rank in g)
        if axis in EXPERT_AXES:
            return self.shape.expert_coords(self.rank)[axis]
        return self.shape.coords(self.rank)[axis]

    def size(self, axis: str) -> int:
        if axis == "embedding":  # 2 on the first and last stage of a pipeline, else 1
            pp = self.shape.coords(self.rank)["pp"]
            return 2 if self.shape.pp > 1 and pp in (0, self.shape.pp - 1) else 1
        if axis in EXPERT_AXES:
            return self.shape.expert_size(axis)
        return self.shape.size_of(axis)

    def axis(self, axis: str) -> Group:
        """This rank's group along `axis`, with its size and rank, for the comm ops."""
        return Group(self.groups[axis], self.size(axis), self.coord(axis))

    def __str__(self) -> str:
        c = self.shape.coords(self.rank)
        return (
            "-".join(f"{a.upper()}({c[a]}/{self.size(a)})" for a in ORDER) + f"-Rank({self.rank})"
        )
