"""Which pipeline rank holds each virtual stage: the one place that maps a stage to its rank.

With pp ranks and vpp model chunks per rank there are pp * vpp virtual stages, numbered in
model order (stage 0 embeds, the last computes the loss). Two placements:

- looped (Megatron's interleaving): rank r holds stages r, r + pp, r + 2 pp, ...; every
  transfer goes to the next rank, the last rank wrapping round to rank 0.
- v (ZB-V, Qi et al., arXiv 2401.10241, section 6): two chunks per rank, rank r holds
  stages r and 2 pp - 1 - r. Forwards go down the ranks on chunk 0 and back up on chunk 1,
  so the first and the last stage share rank 0 and the turn (stage pp - 1 to pp) stays on
  rank pp - 1, with no transfer.

Pure: no torch import. The schedules, the verifier, the dry run, the runtime, the model
split and the performance model all ask a `StageMap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Placement(str, Enum):
    LOOPED = "looped"
    V = "v"


@dataclass(frozen=True)
class StageMap:
    """Stage <-> rank for `pp` ranks with `vpp` chunks each, placed by `placement`."""

    pp: int
    vpp: int = 1
    placement: Placement = Placement.LOOPED

    def __post_init__(self) -> None:
        if self.placement is Placement.V and self.vpp != 2:
            raise ValueError(
                f"the V placement holds 2 model chunks per rank, got vpp = {self.vpp}; "
                "set parallel.vpp = 2"
            )

    @property
    def stages(self) -> int:
        return self.pp * self.vpp

    @property
    def last(self) -> int:
        return self.stages - 1

    def rank(self, stage: int) -> int:
        """Pipeline rank that runs global virtual `stage`."""
        if self.placement is Placement.V and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        """Global virtual stages on `rank`, in chunk order (chunk 0 first)."""
        if self.placement is Placement.V:
            return [rank, 2 * self.pp - 1 - rank]
        return [chunk * self.pp + rank for chunk in range(self.vpp)]

    def chunk(self, stage: int) -> int:
        """Index of `stage` among its rank's chunks."""
        return self.stages_of(self.rank(stage)).index(stage)

    def same_rank(self, stage: int, other: int) -> bool:
        return self.rank(stage) == self.rank(other)

    def neighbours(self, rank: int) -> set[int]:
        """Ranks that `rank` exchanges boundary tensors with (itself excluded)."""
        peers = set()
        for s in self.stages_of(rank):
            for t in (s - 1, s + 1):
                if 0 <= t < self.stages and self.rank(t) != rank:
                    peers.add(self.rank(t))
        return peers
