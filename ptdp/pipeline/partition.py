"""Which layers each pipeline stage holds (pure).

Stages are virtual: with pp ranks and vpp chunks per rank there are pp*vpp stages, and
rank r holds stages r, r + pp, r + 2pp, ... (Megatron's interleaving, so consecutive
layers hop across ranks). The embedding lives on stage 0, the final norm, output layer
and loss on the last stage.
"""

from __future__ import annotations

# Which rank holds a stage is part of the schedule's vocabulary; re-exported here so that
# model-splitting code has one place to look.
from ptdp.pipeline.schedules import stage_to_rank, stages_of_rank

__all__ = ["layer_ranges", "stage_to_rank", "stages_of_rank"]


def layer_ranges(num_layers: int, pp: int, vpp: int = 1) -> list[range]:
    """Layers of each virtual stage, in stage order; an even split or an error."""
    stages = pp * vpp
    if num_layers % stages:
        raise ValueError(
            f"{num_layers} layers do not split evenly over pp*vpp = {pp}*{vpp} = {stages} "
            f"stages; use a layer count that is a multiple of {stages}"
        )
    per = num_layers // stages
    return [range(s * per, (s + 1) * per) for s in range(stages)]
