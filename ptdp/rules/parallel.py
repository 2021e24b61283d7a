"""The layout rules of `validate`: the sizes against the world, what tensor, sequence and
context parallelism need of the model, and the schedule against its model chunks. Each fix
names the launch line or the key to change."""

from __future__ import annotations

from ptdp.config.enums import Schedule
from ptdp.config.sections import ParallelConfig, RunConfig
from ptdp.pipeline.schedules import SCHEDULES
from ptdp.rules.domains import require_positive
from ptdp.rules.pipeline import pipeline_layers_rules


def parallel_rules(cfg: RunConfig, world_size: int, errors: list[str], gpus: bool) -> int:
    """Check the layout; return the data-parallel size (0 if it could not be derived).

    `gpus`: the world size is a GPU count to model (`ptdp simulate|plan --gpus N`), not a
    launch, so the fixes name --gpus instead of a launch command."""
    p, before = cfg.parallel, len(errors)
    for name in ("tp", "cp", "pp", "vpp"):
        require_positive(errors, f"parallel.{name}", getattr(p, name))
    require_positive(errors, "parallel.dp", p.dp, zero_ok=True)
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
    pipeline_layers_rules(cfg, errors)
    return dp


def chunks_fit(p: ParallelConfig) -> bool:
    """Whether vpp gives the schedule the model chunks it runs (`parallel_rules` says why not)."""
    spec = SCHEDULES[p.schedule.value]
    return p.vpp >= 2 if spec.interleaved else p.vpp == spec.chunks


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
