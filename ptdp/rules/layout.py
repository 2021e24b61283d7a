"""The numbers a valid run config derives (`Layout`), and the order of the mesh's axes.

`validate()` checks every cross-field rule of a config against a world size and returns its
`Layout`: it is the single place for those rules (DESIGN invariant 4), one module per topic
beside this one, and it is pure (no torch.distributed), so it runs before any process group
is created. Each message names the values involved and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.plan import PipelinePlan, build_plan
from ptdp.pipeline.schedules import SCHEDULES, check_args
from ptdp.rules.domains import check_config, refuse
from ptdp.rules.fp8 import fp8_rules
from ptdp.rules.model import model_rules, mtp_rules
from ptdp.rules.moe import expert_rules, moe_rules
from ptdp.rules.parallel import chunks_fit, parallel_rules
from ptdp.rules.pipeline import moe_overlap_rules, schedule_rules, stage_layers
from ptdp.rules.speed import speed_rules
from ptdp.rules.train import data_rules, train_rules
from ptdp.rules.zero import zero_level

ORDER = ("tp", "cp", "dp", "pp")
"""How ranks are laid out, fastest-varying first (`ptdp.parallel.mesh` builds the groups)."""
COMBINED = {"dp_cp": ("cp", "dp")}
"""Groups over several adjacent axes (fastest first); a member's index is its rank in it."""
EXPERT_AXES = ("etp", "ep", "edp")
"""The mixture-of-experts layers' own split of one pipeline stage's tp*cp*dp ranks (parallel
folding, fastest first): "etp", consecutive ranks that split each expert's matrices; "ep",
ranks etp apart that hold different experts (tokens travel between them); "edp", ranks
etp*ep apart that hold the same experts (their gradients are reduced over it)."""


@dataclass(frozen=True)
class Layout:
    """Derived numbers of one run; never written back into the config."""

    world_size: int
    tp: int
    pp: int
    dp: int
    vpp: int
    num_microbatches: int
    """Microbatches per optimizer step on each data-parallel rank."""

    sequence_parallel: bool = False
    schedule: str = "1f1b"
    """The pipeline schedule's name (`parallel.schedule`)."""
    stage_layers: tuple[int, ...] = ()
    """Layers of each virtual stage (pp * vpp entries): `parallel.pipeline_layers`, or the
    even split; every reader (model chunks, simulator, memory model) takes it from here."""
    zero: int = 0
    """The ZeRO level (`zero_level`): what of the model state is sharded over dp."""
    cp: int = 1
    """Context-parallel size: ranks that split each sequence."""
    ep: int = 1
    """Expert-parallel size: ranks of one stage's tp*cp*dp that split each layer's experts."""
    etp: int = 1
    """Expert tensor-parallel size: ranks that split each expert's matrices; a dense
    model's is tp (no expert layout apart from attention's)."""
    moe_overlap: bool = False
    """`parallel.moe_overlap`: the schedule's variant with paired forwards and backwards."""

    @property
    def folded(self) -> bool:
        """The experts are laid out apart from attention (their own etp, ep, edp groups)."""
        return self.ep > 1 or self.etp != self.tp

    @cached_property
    def pipeline(self) -> PipelinePlan:
        """The schedule built and lowered once for (pp, vpp, microbatches); every reader of the
        schedule (runtime, verifier, simulator, memory model, log) takes it from here."""
        m, paired = self.num_microbatches, self.moe_overlap
        return build_plan(self.schedule, self.pp, m, self.vpp, paired=paired)

    @property
    def stages(self) -> StageMap:
        """Which pipeline rank holds each virtual stage, by the schedule's placement."""
        return SCHEDULES[self.schedule].stage_map(self.pp, self.vpp)

    def describe(self) -> str:
        sp = " sp=on" if self.sequence_parallel else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        cp += f" ep={self.ep}" if self.ep > 1 else ""
        cp += f" etp={self.etp}" if self.etp != self.tp else ""
        uneven = len(set(self.stage_layers)) > 1
        split = f" layers={','.join(map(str, self.stage_layers))}" if uneven else ""
        zero = f" zero={self.zero}" if self.zero else ""  # absent at 0, as before the levels
        return (
            f"world={self.world_size} tp={self.tp}{sp}{cp} pp={self.pp} dp={self.dp} vpp={self.vpp}"
            f"{split}{zero} microbatches/step/rank={self.num_microbatches}"
        )

    @property
    def shards_optimizer(self) -> bool:
        """fp32 masters and AdamW moments hold 1/dp per rank (ZeRO-1 and up)."""
        return self.zero >= 1

    @property
    def shards_grads(self) -> bool:
        """Gradients kept as each rank's 1/dp, full buckets freed after reduction (ZeRO-2)."""
        return self.zero >= 2

    @property
    def shards_params(self) -> bool:
        """Parameters kept as each rank's 1/dp, all-gathered per layer when used (ZeRO-3)."""
        return self.zero >= 3


def validate(cfg: RunConfig, world_size: int = 1, *, gpus: bool = False) -> Layout:
    """Check every cross-field rule; raise one ConfigError listing all problems.

    `gpus`: `world_size` is the GPU count `ptdp simulate|plan` model, not this launch's."""
    if world_size < 1:
        raise ConfigError(
            f"world size {world_size} must be >= 1 (the number of processes; --gpus N for "
            "simulate and plan)"
        )
    check_config(cfg)  # NaN, infinities, ranges: the rules below assume them
    errors: list[str] = []
    model_rules(cfg, errors)
    mtp_rules(cfg, errors)
    moe_rules(cfg, errors)
    speed_rules(cfg, errors, runtime=not gpus)
    dp = parallel_rules(cfg, world_size, errors, gpus)
    expert_rules(cfg, dp, errors)
    microbatches = train_rules(cfg, dp, errors)
    fp8_rules(cfg, errors, runtime=not gpus)
    data_rules(cfg, errors)
    p = cfg.parallel
    moe_overlap_rules(cfg, errors)
    few = chunks_fit(p) and schedule_rules(cfg, dp, microbatches, errors)
    if microbatches and p.pp > 1 and chunks_fit(p) and not few:  # else an error above
        try:
            check_args(p.schedule.value, p.pp, microbatches, p.vpp, paired=p.moe_overlap)
        except ValueError as exc:
            per_mb = cfg.train.micro_batch_size * dp
            fits = -(-microbatches // p.pp) * p.pp * per_mb
            errors.append(
                f"parallel.schedule = {p.schedule.value} with {microbatches} microbatches per "
                f"step (global_batch_size / (micro_batch_size * dp)): {exc}; e.g. "
                f"--train.global_batch_size {fits}"
            )
    refuse(errors)
    return Layout(
        world_size,
        p.tp,
        p.pp,
        dp,
        p.vpp,
        microbatches,
        p.sequence_parallel,
        p.schedule.value,
        stage_layers(cfg),
        zero_level(cfg),
        p.cp,
        p.ep,
        p.etp if cfg.model.num_experts else p.tp,
        p.moe_overlap,
    )
