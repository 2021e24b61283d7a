"""What ZeRO-2 and ZeRO-3 hold in memory beyond their shard of the model state: ZeRO-2's
full-size gradients of the buckets being filled or reduced, ZeRO-3's gathered 16-bit
weights (their linear layers' 8-bit under the fp8 all-gather), per pipeline rank (how:
`ptdp.perf.cost.memory`'s module doc; their communication: `ptdp.perf.cost.zero`)."""

from __future__ import annotations

from ptdp.config.enums import Precision
from ptdp.config.sections import RunConfig
from ptdp.perf.cost.parameters import (
    element_bytes,
    layer_parameters,
    linear_weights,
    parameters_per_rank,
    parameters_per_stage,
)
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.rules.layout import Layout


def grad_bucket_bytes(cfg: RunConfig, layout: Layout) -> list[float]:
    """ZeRO-2's full-size gradients in flight on each pipeline rank (`cost.memory`); 0 below."""
    if not layout.shards_grads or layout.dp * layout.cp == 1:
        return [0.0] * layout.pp
    model, tp, pp, vpp, split = cfg.model, layout.tp, layout.pp, layout.vpp, layout.stage_layers
    per_stage = parameters_per_stage(model, tp, pp, vpp, split, layout.ep, layout.etp)
    whole = not cfg.parallel.overlap_grad_reduce or SCHEDULES[layout.schedule].splits_backward
    bucket = max(1, int(cfg.parallel.bucket_mb * 2**20 / 4))
    tied = model.tie_embeddings and pp * vpp > 1
    out = [0.0] * pp
    for stage, count in enumerate(per_stage):
        embedding = 0
        if tied and stage in (0, pp * vpp - 1):
            embedding = model.padded_vocab_size(tp) // tp * model.hidden_size
        # One bucket filling while the one before it reduces (`GradBuffers._retire`).
        held = count if whole else embedding + 2 * min(count - embedding, bucket)
        out[layout.stages.rank(stage)] += 4.0 * held
    return out


def reshard_after_forward(cfg: RunConfig) -> bool:
    """ZeRO-3 frees gathered weights after each forward and gathers them again for the backward
    unless `parallel.zero3_reshard_after_forward` (when the runtime has it) says false."""
    return bool(getattr(cfg.parallel, "zero3_reshard_after_forward", True))


def fp8_gathered_weights(cfg: RunConfig, layout: Layout) -> int:
    """Elements of one layer's weights that ZeRO-3 gathers in float8, 1 byte each, under
    `parallel.zero3_fp8_all_gather` (read where the config has it): its linear layers'
    weights (fp8 refuses experts: every layer is dense); 0 when off."""
    on = getattr(cfg.parallel, "zero3_fp8_all_gather", False)
    fp8 = on and cfg.train.precision is Precision.FP8 and layout.zero >= 3
    return linear_weights(cfg.model, layout.tp) if fp8 else 0


def gathered_bytes(cfg: RunConfig, layout: Layout) -> list[float]:
    """ZeRO-3's gathered weights on each pipeline rank (`cost.memory`): 16-bit, their fp8
    linear weights 8-bit under the fp8 all-gather (plus the float8 shard cast for the layer
    in flight); 0 below level 3."""
    if layout.zero < 3 or layout.dp * layout.cp == 1:
        return [0.0] * layout.pp
    model, tp, e = cfg.model, layout.tp, element_bytes(cfg.train.precision)
    per_rank = parameters_per_rank(
        model,
        tp,
        layout.pp,
        layout.vpp,
        layout.stage_layers,
        layout.stages.placement,
        layout.ep,
        layout.etp,
    )
    fp8 = fp8_gathered_weights(cfg, layout)
    saved = (e - 1) * fp8  # bytes fewer a gathered layer
    cast = fp8 / (layout.dp * layout.cp)  # the float8 shard of the layer being gathered
    if not reshard_after_forward(cfg):
        layers = [0] * layout.pp
        for stage, count in enumerate(layout.stage_layers):
            layers[layout.stages.rank(stage)] += count
        return [e * count - saved * n + cast * bool(n) for count, n in zip(per_rank, layers)]
    rows = model.padded_vocab_size(tp) // tp * model.hidden_size
    units = range(model.num_layers) if model.num_experts else [None]
    sizes = [e * layer_parameters(model, tp, i, layout.ep, layout.etp) - saved for i in units]
    unit = max(*sizes, e * rows)
    return [2.0 * min(unit, e * count) + cast for count in per_rank]
