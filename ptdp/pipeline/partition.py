"""Which layers each pipeline stage holds (pure).

Stages are virtual: with pp ranks and vpp chunks per rank there are pp*vpp stages in model
order; which rank holds which is the schedule's `ptdp.pipeline.placement.StageMap`. The
embedding lives on stage 0, the final norm, output layer and loss on the last stage. Those
two stages may hold no transformer layer at all (an embedding-only first stage, a last one
holding only the final norm, output layer and loss), as Megatron-Core's pipeline layouts
allow, to balance the embedding and the loss against the layers; every other stage holds
at least one layer (a stage of no weights would only pass tensors on).
"""

from __future__ import annotations


def is_end(stage: int, stages: int) -> bool:
    """Whether `stage` is the first or the last of `stages`: the two that may hold 0 layers."""
    return stage in (0, stages - 1)


def empty_middle(layers: tuple[int, ...]) -> list[int]:
    """The stages of a split, other than the first and the last, that hold no layer."""
    return [s for s, n in enumerate(layers) if n < 1 and not is_end(s, len(layers))]


def is_split(layers: tuple[int, ...], num_layers: int, stages: int) -> bool:
    """Whether `layers` splits `num_layers` over `stages`: one count per stage, none below 0,
    only the first and the last stage at 0, summing to `num_layers`."""
    return (
        len(layers) == stages
        and min(layers) >= 0
        and not empty_middle(layers)
        and sum(layers) == num_layers
    )


def split_problems(layers: tuple[int, ...], stages: int) -> list[str]:
    """What makes `layers` no split over `stages` (any layer count): empty if it is one."""
    given = ",".join(map(str, layers))
    problems = []
    if len(layers) != stages:
        problems.append(f"{given} has {len(layers)} entries for {stages} stages")
    if min(layers, default=0) < 0:
        problems.append(f"{given} has an entry below 0")
    elif empty_middle(layers):
        where = ", ".join(map(str, empty_middle(layers)))
        problems.append(
            f"{given} gives stage {where} no layer; only the first and the last stage may hold 0"
        )
    if layers and sum(layers) < 1:
        problems.append(f"{given} holds no layer at all")
    return problems


def near_even_split(num_layers: int, stages: int) -> tuple[int, ...] | None:
    """A split of `num_layers` over `stages` as even as it gets, the layers left over going to
    the middle stages first, then to the first stage, the last one (output layer and loss)
    lightest: 14 over 4 is 3,4,4,3, 2 over 4 is 0,1,1,0. None where no split exists (fewer
    layers than the stages between the first and the last)."""
    if stages < 1 or num_layers < max(stages - 2, 1):
        return None
    base, extra = divmod(num_layers, stages)
    order = list(range(1, stages - 1)) + [0, stages - 1][: min(stages, 2)]
    split = [base] * stages
    for s in order[:extra]:
        split[s] += 1
    return tuple(split)


def layer_ranges(
    num_layers: int, pp: int, vpp: int = 1, layers: tuple[int, ...] | None = None
) -> list[range]:
    """Layers of each virtual stage, in stage order: `layers[s]` consecutive layers for stage s
    (`parallel.pipeline_layers`), or an even split when `layers` is empty or None; never
    drops a layer (an error instead)."""
    stages = pp * vpp
    if layers:
        if not is_split(tuple(layers), num_layers, stages):
            raise ValueError(
                f"pipeline_layers = {list(layers)} must have pp*vpp = {pp}*{vpp} = {stages} "
                f"entries, each >= 1 (the first and the last may be 0), summing to "
                f"num_layers = {num_layers}"
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
