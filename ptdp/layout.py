"""Validation of a run config against a world size, and the numbers derived from it.

`validate()` is the single place for cross-field rules (DESIGN invariant 4). It is pure
(no torch.distributed), so it runs before any process group is created, and each
message names the values involved and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ptdp.config import (
    ModelConfig,
    OnNan,
    ParallelConfig,
    PositionEmbedding,
    Recovery,
    RopeScaling,
    RunConfig,
    Schedule,
)
from ptdp.domains import FLOAT32_MAX, check_config, refuse
from ptdp.errors import ConfigError
from ptdp.layout_fp8 import fp8_rules
from ptdp.layout_moe import expert_rules, moe_rules
from ptdp.layout_speed import speed_rules
from ptdp.pipeline.partition import empty_middle, near_even_split
from ptdp.pipeline.placement import StageMap
from ptdp.pipeline.plan import PipelinePlan, build_plan
from ptdp.pipeline.schedules import SCHEDULES, check_args

ORDER = ("tp", "cp", "dp", "pp")
"""How ranks are laid out, fastest-varying first (`ptdp.parallel.mesh` builds the groups)."""
COMBINED = {"dp_cp": ("cp", "dp")}
"""Groups over several adjacent axes (fastest first); a member's index is its rank in it."""
EXPERT_AXES = ("ep", "edp")
"""The two splits of a dp_cp group under expert parallelism: "ep", ep consecutive members
that hold different experts (tokens travel between them), and "edp", the members a stride
of ep apart that hold the same experts (their gradients are reduced over it)."""


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
    """Expert-parallel size: ranks of one dp*cp group that split each layer's experts."""

    @cached_property
    def pipeline(self) -> PipelinePlan:
        """The schedule built and lowered once for (pp, vpp, microbatches); every reader of the
        schedule (runtime, verifier, simulator, memory model, log) takes it from here."""
        return build_plan(self.schedule, self.pp, self.num_microbatches, self.vpp)

    @property
    def stages(self) -> StageMap:
        """Which pipeline rank holds each virtual stage, by the schedule's placement."""
        return SCHEDULES[self.schedule].stage_map(self.pp, self.vpp)

    def describe(self) -> str:
        sp = " sp=on" if self.sequence_parallel else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        cp += f" ep={self.ep}" if self.ep > 1 else ""
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


ZERO_LEVELS = {
    0: "replicated model state",
    1: "optimizer state sharded over dp",
    2: "optimizer state and gradients sharded over dp",
    3: "optimizer state, gradients and parameters sharded over dp",
}
ZERO_BUILT = (0, 1, 2, 3)


def zero_level(cfg: RunConfig) -> int:
    """The effective ZeRO level: `parallel.zero`, or -1 resolved from `optim.distributed`
    (its old spelling: true = 1). Call after `validate`, which refuses the disagreements."""
    if cfg.parallel.zero >= 0:
        return cfg.parallel.zero
    return 1 if cfg.optim.distributed else 0


def _zero_rules(cfg: RunConfig, errors: list[str]) -> None:
    zero = cfg.parallel.zero
    if zero not in (-1, *ZERO_LEVELS):
        errors.append(
            f"parallel.zero = {zero} is not a ZeRO level; use 0 (none), 1 (optimizer state), "
            "2 (and gradients) or 3 (and parameters), or -1 to follow optim.distributed"
        )
    elif zero in ZERO_LEVELS and zero not in ZERO_BUILT:
        errors.append(
            f"parallel.zero = {zero} ({ZERO_LEVELS[zero]}) is not built yet; use "
            "--parallel.zero 2 (optimizer state and gradients sharded) or tensor and pipeline "
            "parallelism to fit the parameters"
        )
    elif zero == 3 and cfg.train.compile:
        errors.append(
            "parallel.zero = 3 gathers each layer's parameters in module hooks, which "
            "train.compile's regional compilation does not trace; set --train.compile false "
            "or use --parallel.zero 2"
        )
    elif zero == 0 and cfg.optim.distributed:
        errors.append(
            "optim.distributed = true (the old spelling of parallel.zero = 1) disagrees with "
            "parallel.zero = 0; drop optim.distributed and set --parallel.zero 1 (or 2), or "
            "set --optim.distributed false to keep the state replicated"
        )
    if not cfg.parallel.zero3_reshard_after_forward and zero_level(cfg) != 3:
        errors.append(
            "parallel.zero3_reshard_after_forward = false keeps ZeRO-3's gathered parameters "
            f"between forward and backward, but parallel.zero is {zero_level(cfg)}: nothing "
            "is gathered; set --parallel.zero 3, or drop the option"
        )
    if cfg.parallel.zero3_fp8_all_gather and zero_level(cfg) != 3:
        errors.append(
            "parallel.zero3_fp8_all_gather = true gathers ZeRO-3's parameters, but "
            f"parallel.zero = {zero_level(cfg)} gathers none; set --parallel.zero 3, or drop "
            "the option"
        )


def _positive(errors: list[str], name: str, value: int | float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        errors.append(f"{name} = {value} must be {bound}")


def _model_rules(cfg: RunConfig, errors: list[str]) -> None:
    m, before = cfg.model, len(errors)
    positive = ("num_layers", "hidden_size", "num_heads", "seq_length")
    for name in (*positive, "make_vocab_size_divisible_by"):
        _positive(errors, f"model.{name}", getattr(m, name))
    for name in (
        "num_query_groups",
        "head_size",
        "ffn_hidden_size",
        "vocab_size",
        "sliding_window",
    ):
        _positive(errors, f"model.{name}", getattr(m, name), zero_ok=True)
    _rope_scaling_rules(m, errors)
    if len(errors) > before:
        return
    if m.hidden_size % m.num_heads and not m.head_size:
        errors.append(
            f"model.hidden_size = {m.hidden_size} is not divisible by model.num_heads = "
            f"{m.num_heads}; choose heads that divide the width (e.g. {_divisor(m.hidden_size)})"
        )
    elif m.position_embedding is PositionEmbedding.ROPE and m.head_dim % 2:
        errors.append(
            f"rotary positions need an even head size, got {m.head_dim}; change "
            "model.head_size, or model.num_heads or model.hidden_size"
        )
    if m.num_heads % m.query_groups:
        errors.append(
            f"model.num_query_groups = {m.num_query_groups} does not divide model.num_heads = "
            f"{m.num_heads}; use a divisor of the head count (1 = multi-query)"
        )


def _rope_scaling_rules(m: ModelConfig, errors: list[str]) -> None:
    if m.rope_scaling is RopeScaling.NONE:
        return
    if m.position_embedding is not PositionEmbedding.ROPE:
        errors.append(
            f"model.rope_scaling = {m.rope_scaling.value} scales rotary positions, but "
            "model.position_embedding = learned; set model.position_embedding = rope or "
            "model.rope_scaling = none"
        )
    _positive(errors, "model.rope_original_max_positions", m.rope_original_max_positions)
    if m.rope_high_freq_factor <= m.rope_low_freq_factor:
        errors.append(
            f"model.rope_high_freq_factor = {m.rope_high_freq_factor} must exceed "
            f"model.rope_low_freq_factor = {m.rope_low_freq_factor} (Llama 3.1: 4 and 1)"
        )


def _divisor(n: int) -> int:
    return next(d for d in (8, 4, 2, 1) if n % d == 0)


def _parallel_rules(cfg: RunConfig, world_size: int, errors: list[str], gpus: bool) -> int:
    """Check the layout; return the data-parallel size (0 if it could not be derived).

    `gpus`: the world size is a GPU count to model (`ptdp simulate|plan --gpus N`), not a
    launch, so the fixes name --gpus instead of a launch command."""
    p, before = cfg.parallel, len(errors)
    for name in ("tp", "cp", "pp", "vpp"):
        _positive(errors, f"parallel.{name}", getattr(p, name))
    _positive(errors, "parallel.dp", p.dp, zero_ok=True)
    if len(errors) > before:
        return 0
    model_ranks = p.tp * p.cp * p.pp
    need = model_ranks * max(p.dp, 1)
    if world_size == 1 and need > 1 and not gpus:  # a plain `ptdp train`, not launched
        errors.append(
            f"this layout needs {need} processes (tp*cp*pp*dp = {p.tp}*{p.cp}*{p.pp}*"
            f"{max(p.dp, 1)}) "
            f"but runs as one (world size 1, not under torchrun or srun); launch it with "
            f"{_torchrun(need)}"
        )
        world_size = need  # check the rest as if launched so
    if p.dp == 0:
        if world_size % model_ranks:
            errors.append(
                f"world size {world_size} is not divisible by tp*cp*pp = {p.tp}*{p.cp}*{p.pp} = "
                f"{model_ranks}; {_launch(model_ranks, gpus, 'a multiple of ')}"
            )
            return 0
        dp = world_size // model_ranks
    else:
        dp = p.dp
        if model_ranks * dp != world_size:
            errors.append(
                f"tp*cp*pp*dp = {p.tp}*{p.cp}*{p.pp}*{dp} = {model_ranks * dp} does not match "
                "the world "
                f"size {world_size}; {_launch(model_ranks * dp, gpus)} or set --parallel.dp 0 to "
                "derive dp from the world size"
            )
    _tensor_parallel_rules(cfg, errors)
    _context_parallel_rules(cfg, errors, runtime=not gpus)
    spec = SCHEDULES[p.schedule.value]
    if p.vpp > 1 and spec.chunks == 1:
        errors.append(
            f"parallel.vpp = {p.vpp} needs a schedule with model chunks (interleaved, or zb-v "
            f"with vpp = 2), got parallel.schedule = {p.schedule.value}; set "
            "--parallel.schedule interleaved or --parallel.vpp 1"
        )
    if p.schedule is Schedule.INTERLEAVED and p.vpp < 2:
        errors.append(
            "parallel.schedule = interleaved needs parallel.vpp >= 2 model chunks per rank; "
            "set --parallel.vpp 2 or use --parallel.schedule 1f1b"
        )
    if spec.chunks not in (None, 1) and p.vpp != spec.chunks:
        errors.append(
            f"parallel.schedule = {p.schedule.value} runs {spec.chunks} model chunks per rank "
            f"(parallel.vpp = {spec.chunks}), got parallel.vpp = {p.vpp}; set --parallel.vpp "
            f"{spec.chunks}, or leave parallel.vpp out and {p.schedule.value} takes it"
        )
    _pipeline_layers_rules(cfg, errors)
    return dp


def _chunks_fit(p: ParallelConfig) -> bool:
    """Whether vpp gives the schedule the model chunks it runs (`_parallel_rules` says why not)."""
    spec = SCHEDULES[p.schedule.value]
    return p.vpp >= 2 if spec.interleaved else p.vpp == spec.chunks


def _pipeline_layers_rules(cfg: RunConfig, errors: list[str]) -> None:
    """An explicit split must cover every layer exactly, and only the first and the last
    stage may hold none; without one the split is even."""
    p, layers, stages = cfg.parallel, cfg.model.num_layers, cfg.parallel.pp * cfg.parallel.vpp
    given = p.pipeline_layers
    if not given:
        if layers > 0 and layers % stages:
            errors.append(
                f"model.num_layers = {layers} is not divisible by pp*vpp = {p.pp}*{p.vpp}; "
                f"choose a layer count that is a multiple of {stages}, or "
                f"{_split_fix(layers, stages)}"
            )
        return
    split = ",".join(map(str, given))
    fix = _split_fix(layers, stages) if layers > 0 else ""
    if len(given) != stages:
        errors.append(
            f"parallel.pipeline_layers = {split} has {len(given)} entries but pp*vpp = "
            f"{p.pp}*{p.vpp} = {stages} stages need one each; {fix or 'give one per stage'}"
            + (", or leave it empty for an even split" if layers % stages == 0 else "")
        )
    empty = empty_middle(given) if len(given) == stages else []
    if min(given) < 0:
        errors.append(f"parallel.pipeline_layers = {split} has an entry below 0")
    elif empty:
        errors.append(
            f"parallel.pipeline_layers = {split} gives stage {', '.join(map(str, empty))} no "
            "layer; only the first stage (the embedding alone) and the last one (the final "
            "norm, output layer and loss alone) may hold 0 layers" + (f"; {fix}" if fix else "")
        )
    if layers > 0 and sum(given) != layers:
        errors.append(
            f"parallel.pipeline_layers = {split} sums to {sum(given)} but model.num_layers = "
            f"{layers}; the counts must add up to the layer count (no layer is dropped): {fix}"
        )


def _split_fix(layers: int, stages: int) -> str:
    """How to split `layers` over `stages`: a split that validates (`near_even_split`), or,
    where none exists, the most stages these layers fill; never a split that cannot be met."""
    split = near_even_split(layers, stages)
    if split is None:
        return (
            f"use fewer stages: at most pp*vpp = {layers + 2} for model.num_layers = {layers} "
            "(one layer each, the first and the last stage none)"
        )
    return f"give each stage's layers, e.g. --parallel.pipeline_layers {','.join(map(str, split))}"


def _stage_layers(cfg: RunConfig) -> tuple[int, ...]:
    """The validated split: `parallel.pipeline_layers`, or the even one."""
    stages = cfg.parallel.pp * cfg.parallel.vpp
    return cfg.parallel.pipeline_layers or (cfg.model.num_layers // stages,) * stages


def _launch(processes: int, gpus: bool, some: str = "") -> str:
    """The fix for a world size: a launch of `processes` ranks, or for a modelled run
    (`gpus`) that GPU count."""
    if gpus:
        return f"model {some}{processes} GPUs (--gpus {processes})"
    return f"launch {some}{processes} processes, e.g. {_torchrun(processes)}"


def _torchrun(processes: int) -> str:
    """The launch line for `processes` ranks on one node (torchrun --nnodes for several)."""
    return (
        f"`torchrun --nproc-per-node {processes} -m ptdp train ...` "
        f"(SLURM: `srun --ntasks {processes} ptdp train ...`)"
    )


def _context_parallel_rules(cfg: RunConfig, errors: list[str], runtime: bool) -> None:
    """The sequence splits into 2*cp chunks (two per rank, load-balanced causal work).
    `runtime`: also what ptdp's own cp layers lack (dropout, compile), which a modelled
    run (`ptdp simulate|plan`) need not."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return
    if m.seq_length % (2 * p.cp):
        errors.append(
            f"model.seq_length = {m.seq_length} is not divisible by 2*parallel.cp = {2 * p.cp}: "
            "context parallelism cuts each sequence into 2*cp equal chunks; choose a sequence "
            f"length that is a multiple of {2 * p.cp} or a smaller parallel.cp"
        )
    elif p.sequence_parallel and (m.seq_length // p.cp) % p.tp:
        errors.append(
            f"model.seq_length / parallel.cp = {m.seq_length // p.cp} (a rank's part of the "
            f"sequence) is not divisible by parallel.tp = {p.tp}, which sequence parallelism "
            "needs; use a sequence length that is a multiple of 2*cp*tp or turn "
            "sequence_parallel off"
        )
    if runtime and m.dropout > 0:
        errors.append(
            f"model.dropout = {m.dropout} with parallel.cp = {p.cp}: context-parallel attention "
            "has no dropout; set --model.dropout 0 or --parallel.cp 1"
        )
    if runtime and cfg.train.compile:
        errors.append(
            f"train.compile with parallel.cp = {p.cp} is not built (ring attention's transfers "
            "are not compiled); set --train.compile false or --parallel.cp 1"
        )


def _tensor_parallel_rules(cfg: RunConfig, errors: list[str]) -> None:
    m, t = cfg.model, cfg.parallel.tp
    if cfg.parallel.sequence_parallel and t == 1:
        errors.append(
            "parallel.sequence_parallel = true needs parallel.tp > 1 (it splits the sequence "
            "over the tensor-parallel group); set --parallel.sequence_parallel false"
        )
    if t == 1 or m.num_heads <= 0 or m.hidden_size <= 0:
        return
    if m.num_heads % t:
        errors.append(
            f"model.num_heads = {m.num_heads} is not divisible by parallel.tp = {t}: tensor "
            "parallelism gives each rank whole heads; choose tp dividing the head count"
        )
    elif m.num_heads % m.query_groups == 0 and m.query_groups % t:
        errors.append(
            f"model.num_query_groups = {m.query_groups} is not divisible by parallel.tp = {t}: "
            "each rank needs whole key/value groups; use more groups or a smaller tp"
        )
    if m.ffn_size % t:
        errors.append(
            f"the MLP width {m.ffn_size} (model.ffn_hidden_size) is not divisible by "
            f"parallel.tp = {t}; choose a width that is a multiple of {t}"
        )
    if cfg.parallel.sequence_parallel and m.seq_length % t:
        errors.append(
            f"model.seq_length = {m.seq_length} is not divisible by parallel.tp = {t}, which "
            "sequence parallelism needs; use a multiple of tp or turn sequence_parallel off"
        )


def _train_rules(cfg: RunConfig, dp: int, errors: list[str]) -> int:
    t, o = cfg.train, cfg.optim
    for name in ("micro_batch_size", "global_batch_size", "steps", "log_interval"):
        _positive(errors, f"train.{name}", getattr(t, name))
    for name in ("eval_interval", "eval_iters", "save_interval", "keep_checkpoints"):
        _positive(errors, f"train.{name}", getattr(t, name), zero_ok=True)
    if t.wandb_run_name and not t.wandb_project:
        errors.append(
            "train.wandb_run_name is set but train.wandb_project is empty; set "
            "--train.wandb_project to log to Weights & Biases"
        )
    if t.eval_interval and not t.eval_iters:
        errors.append("train.eval_iters = 0 with train.eval_interval > 0; set eval_iters >= 1")
    if not t.run_dir.strip():
        errors.append(
            "train.run_dir is empty: a run writes only where it is told, never into the "
            "current directory by default; set --train.run_dir runs/NAME"
        )
    if t.on_nan is OnNan.ROLLBACK and not t.save_interval:
        errors.append(
            "train.on_nan = rollback with train.save_interval = 0 leaves no checkpoint to roll "
            "back to; set --train.save_interval (e.g. 100) or --train.on_nan stop"
        )
    if t.on_nan is OnNan.RETRY and t.recovery is not Recovery.IN_PROCESS:
        errors.append(
            "train.on_nan = retry replays the step from memory, which needs train.recovery = "
            "in_process; set --train.recovery in_process or --train.on_nan stop"
        )
    if t.recovery is Recovery.IN_PROCESS and t.async_save:
        errors.append(
            "train.recovery = in_process with train.async_save: a background save in flight "
            "at a fault would lose its process group when the groups are re-created; set "
            "--train.async_save false or --train.recovery restart"
        )
    microbatches = 0
    if dp and t.micro_batch_size > 0 and t.global_batch_size > 0:
        per_step = t.micro_batch_size * dp
        if t.global_batch_size % per_step:
            nearest = max(per_step, t.global_batch_size // per_step * per_step)
            errors.append(
                f"train.global_batch_size = {t.global_batch_size} is not divisible by "
                f"micro_batch_size*dp = {t.micro_batch_size}*{dp} = {per_step}; use a "
                f"multiple of {per_step}, e.g. {nearest}"
            )
        else:
            microbatches = t.global_batch_size // per_step
    _zero_rules(cfg, errors)
    _positive(errors, "optim.loss_scale_window", o.loss_scale_window)
    if t.device not in ("auto", "cpu", "cuda") and not t.device.startswith("cuda:"):
        errors.append(f"train.device = {t.device!r}; use auto, cpu or cuda")
    if o.min_lr > o.lr:  # each of them finite and in its range: ptdp/domains.py
        errors.append(f"optim.min_lr = {o.min_lr} must be in [0, optim.lr = {o.lr}]")
    step, decay = o.lr / (1 - o.beta1), o.lr * o.weight_decay  # AdamW's float32 scalars
    if max(step, decay) > FLOAT32_MAX:
        below = FLOAT32_MAX * min(1 - o.beta1, 1 / max(o.weight_decay, 1))
        errors.append(
            f"optim.lr = {o.lr} makes AdamW's first step size lr / (1 - beta1) = {step:.3g} or "
            f"its decay lr * weight_decay = {decay:.3g} overflow float32 (largest "
            f"{FLOAT32_MAX:.3g}); use an optim.lr below {below:.3g}"
        )
    _positive(errors, "optim.warmup_steps", o.warmup_steps, zero_ok=True)
    _positive(errors, "optim.decay_steps", o.decay_steps, zero_ok=True)
    if o.decay_steps and o.warmup_steps > o.decay_steps:
        errors.append(
            f"optim.warmup_steps = {o.warmup_steps} exceeds optim.decay_steps = "
            f"{o.decay_steps} (warm-up is part of the decay horizon); lower warmup_steps "
            "or raise decay_steps"
        )
    return microbatches


def _data_rules(cfg: RunConfig, errors: list[str]) -> None:
    d, t = cfg.data, cfg.train
    if d.reset_positions and not d.document_mask:
        errors.append(
            "data.reset_positions = true restarts positions at each document's first token, "
            "which needs document masking; set --data.document_mask true as well, or "
            "--data.reset_positions false"
        )
    if d.valid_fraction == 0 and t.eval_interval:
        errors.append(
            "data.valid_fraction = 0 leaves no validation data but train.eval_interval > 0; "
            "set --train.eval_interval 0 or a valid_fraction such as 0.05"
        )


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
    _model_rules(cfg, errors)
    moe_rules(cfg, errors, runtime=not gpus)
    speed_rules(cfg, errors, runtime=not gpus)
    dp = _parallel_rules(cfg, world_size, errors, gpus)
    expert_rules(cfg, dp, errors)
    microbatches = _train_rules(cfg, dp, errors)
    fp8_rules(cfg, errors, runtime=not gpus)
    _data_rules(cfg, errors)
    p = cfg.parallel
    if microbatches and p.pp > 1 and _chunks_fit(p):  # a mismatch is _parallel_rules' error
        try:
            check_args(p.schedule.value, p.pp, microbatches, p.vpp)
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
        _stage_layers(cfg),
        zero_level(cfg),
        p.cp,
        p.ep,
    )
