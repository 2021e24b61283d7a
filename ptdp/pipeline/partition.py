"""Which layers each pipeline stage holds (pure).

Stages are virtual: with pp ranks and vpp chunks per rank there are pp*vpp stages in model
order; which rank holds which is the schedule's `ptdp.pipeline.placement.StageMap`. The
embedding lives on stage 0, the final norm, output layer and loss on the last stage.
"""

from __future__ import annotations


def layer_ranges(
    num_layers: int, pp: int, vpp: int = 1, layers: tuple[int, ...] | None = None
) -> list[range]:
    """Layers of each virtual stage, in stage order: `layers[s]` consecutive layers for stage s
    (`parallel.pipeline_layers`), or an even split when `layers` is empty or None; never
    drops a layer (an error instead)."""
    stages = pp * vpp
    if layers:
        if len(layers) != stages or min(layers) < 1 or sum(layers) != num_layers:
            raise ValueError(
                f"pipeline_layers = {list(layers)} must have pp*vpp = {pp}*{vpp} = {stages} "
                f"entries, each >= 1, summing to num_layers = {num_layers}"
            )
        starts = [sum(layers[:s]) for s in range(stages + 1)]
        return [range(starts[s], starts[s + 1]) for s in range(stages)]
    if num_layers % stages:
        raise ValueError(
            f"{num_layers} layers do not split evenly over pp*vpp = {pp}*{vpp} = {stages} "
            f"stages; use a layer count that is a multiple of {stages} or set "
            "parallel.pipeline_layers"
        )
    per = num_layers // stages
    return [range(s * per, (s + 1) * per) for s in range(stages)]
