"""Continuing a run: whether to resume (train.resume, --resume, a launcher restart), from
which checkpoint (the published one, or a newer save that was complete on every rank when
the previous run failed), whether the new world can hold it (elastic resume), what
changed, and the record a continued run writes after its first step (events.jsonl).

A restarted job may have fewer or more processes than the one that saved: with
`parallel.dp = 0` the data-parallel size follows the world and the microbatches per step
follow dp (global batch = micro_batch_size x microbatches x dp), while step k still
consumes global samples [k*G, (k+1)*G) and the learning rate is a function of the step,
so the batches, their order and the schedule do not change (ptdp/train/step/trainer.py).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ptdp import checkpoint as ckpt
from ptdp.checkpoint.recover import find_unpublished, publish_unpublished, verify_unpublished
from ptdp.checkpoint.retention import set_aside_after
from ptdp.checkpoint.store import find_restart_checkpoint
from ptdp.config.enums import Resume
from ptdp.config.files import to_dict
from ptdp.config.sections import LAYOUT_ONLY_MODEL_KEYS, RunConfig
from ptdp.errors import CheckpointError, ConfigError
from ptdp.parallel.comm import all_gather_objects, barrier
from ptdp.parallel.env import LaunchEnv
from ptdp.rules.layout import Layout
from ptdp.train.faults.events import append_event, previous_ending, read_events
from ptdp.train.run_dir import check_init_source, refuse_previous_run


def wants_resume(mode: Resume, explicit: bool, env: LaunchEnv) -> bool:
    """--resume and `always` resume; `never` does not; `auto` resumes when the launcher
    restarted the job (a first launch continues only with --resume)."""
    if explicit or mode is Resume.ALWAYS:
        return True
    return mode is Resume.AUTO and env.is_restart


@dataclass
class ResumePlan:
    """What a run continues from, chosen on each rank before any process group exists."""

    step_dir: Path | None = None
    """The published checkpoint (latest)."""
    unpublished: Path | None = None
    """A newer save, complete on every rank when the previous run failed (`step_X.tmp`)."""
    not_complete: list[str] = field(default_factory=list)
    """Why newer unpublished saves are not taken."""
    skipped: list[str] = field(default_factory=list)
    """A launcher restart: why the checkpoint `latest` names was not taken (damaged)."""
    saved: RunConfig | None = None
    """The config of the newest of the two."""
    ending: dict[str, Any] | None = None
    """The failure or interruption that ended the previous run (events.jsonl)."""
    note: str | None = None
    """Why the checkpoint continued from was chosen when `latest` named none."""
    set_aside: list[Path] = field(default_factory=list)
    """Rank 0: the later checkpoints a rollback moved aside (publish_in_flight)."""
    previous: list[str] = field(default_factory=list)
    """A new run with train.overwrite: the previous run's files rank 0 deletes."""
    started: float = field(default_factory=time.time)

    @property
    def newest(self) -> Path | None:
        return self.unpublished or self.step_dir


def plan_resume(cfg: RunConfig, resume: bool, restart: bool = False) -> ResumePlan:
    """The checkpoint a run continues from; refuses to overwrite or mix runs. A launcher
    `restart` continues from an older complete checkpoint when the latest is damaged."""
    run_dir = Path(cfg.train.run_dir)
    has_checkpoint = ckpt.has_checkpoint(run_dir)
    if not resume:
        previous = refuse_previous_run(run_dir, cfg.train.overwrite, has_checkpoint)
        if previous and cfg.checkpoint.init_from:
            check_init_source(run_dir, cfg.checkpoint.init_from, previous)
        return ResumePlan(previous=previous)
    plan = ResumePlan(ending=previous_ending(read_events(run_dir)))
    if has_checkpoint and restart:
        plan.step_dir, plan.skipped = find_restart_checkpoint(run_dir)
    elif has_checkpoint:
        plan.step_dir = ckpt.find_checkpoint(run_dir)
    plan.unpublished, plan.not_complete = find_unpublished(run_dir)
    if plan.newest is None:
        return plan
    plan.saved = ckpt.load_config(plan.newest)
    saved, current = to_dict(plan.saved)["model"], to_dict(cfg)["model"]
    diff = [
        f"{k}: {saved.get(k)} -> {v}"
        for k, v in current.items()
        if k not in LAYOUT_ONLY_MODEL_KEYS and saved.get(k, v) != v
    ]
    if diff:
        raise CheckpointError(
            f"checkpoint {plan.newest} was trained with a different model ({'; '.join(diff)}); "
            "resume with the same model settings or use another --train.run_dir"
        )
    return plan


def check_world(cfg: RunConfig, world_size: int) -> None:
    """Before validation, for a run that resumes: a new world that cannot hold the config's
    tp*cp*pp, that a fixed dp no longer matches, or whose stage ranks (tp*cp*dp) ep*etp no
    longer divides, is refused naming the checkpoint and the fix (files are read only when the
    world does not fit). Experts saved at any ep and etp load at the new ones."""
    p = cfg.parallel
    model_ranks = p.tp * p.cp * p.pp
    if world_size == 1 or model_ranks <= 0:
        return
    stage = world_size // model_ranks * p.cp * p.tp  # the ranks the experts fold over
    folds = p.ep * p.etp
    ep_fits = folds <= 1 or (stage and not stage % folds)
    if not world_size % model_ranks and (not p.dp or p.dp * model_ranks == world_size) and ep_fits:
        return
    run_dir = Path(cfg.train.run_dir)
    newest = find_unpublished(run_dir)[0] or (
        ckpt.find_checkpoint(run_dir) if ckpt.has_checkpoint(run_dir) else None
    )
    if newest is None:
        return  # a fresh start: validation's own message
    saved = ckpt.load_config(newest).parallel
    extra = "".join(
        f" {k}={getattr(saved, k)}" for k in ("cp", "ep", "etp") if getattr(saved, k) > 1
    )
    was = f"{newest} (saved with tp={saved.tp} pp={saved.pp}{extra})"
    if world_size % model_ranks:
        axes = ("tp", "pp") if p.cp == 1 else ("tp", "cp", "pp")
        product = f"{'*'.join(axes)} = {'*'.join(str(getattr(p, a)) for a in axes)}"
        raise ConfigError(
            f"cannot resume {was} with {world_size} processes: {product} = "
            f"{model_ranks} processes hold one copy of the model and {world_size} is not a "
            f"multiple of {model_ranks}; a restart may change the number of processes only "
            f"by whole copies (data parallelism): launch a multiple of {model_ranks}, or "
            f"change {' and '.join(f'parallel.{a}' for a in axes)}"
        )
    if not ep_fits and (not p.dp or p.dp * model_ranks == world_size):
        fits = max(e for e in range(1, p.ep + 1) if not stage % (e * p.etp) and not p.ep % e)
        raise ConfigError(
            f"cannot resume {was} with {world_size} processes: parallel.ep * parallel.etp = "
            f"{p.ep} * {p.etp} does not divide the {stage} ranks of a pipeline stage "
            f"(tp*cp*dp) this world holds; resume with --parallel.ep {fits} (the experts "
            f"are re-split on load), or launch a multiple of "
            f"{model_ranks * folds // math.gcd(folds, p.tp * p.cp)} processes"
        )
    raise ConfigError(
        f"cannot resume {was} with {world_size} processes: parallel.dp = {p.dp} is fixed "
        f"and needs {p.dp * model_ranks}; set --parallel.dp 0 so that the data-parallel "
        "size follows the world (the global batch stays the same)"
    )


def publish_in_flight(
    plan: ResumePlan, rank: int, world_size: int, keep: int, say: Callable[[str], None]
) -> Path | None:
    """Collective, after the process group exists: verify the unpublished save's checksums
    (each rank a share), publish it (rank 0) and return it; else the published checkpoint.
    If published checkpoints after it exist (a rollback), rank 0 sets them aside
    (ptdp/checkpoint/retention.py) so that keeping the newest never deletes this one."""
    step_dir = _continue_from(plan, rank, world_size, keep, say)
    match = re.fullmatch(r"step_(\d+)", step_dir.name) if step_dir else None
    if match is None:
        return step_dir
    plan.note = ckpt.latest_note(step_dir)  # before the newer ones it names move
    if rank == 0:
        plan.set_aside = set_aside_after(step_dir.parent, int(match.group(1)))
    barrier(None, world_size)
    if plan.set_aside:
        folder = plan.set_aside[0].parent
        say(
            f"rollback: continuing from {step_dir.name} while later checkpoints exist; set "
            f"aside {', '.join(p.name for p in plan.set_aside)} in {folder} (not counted as "
            "kept, never pruned; move one back to return to it)"
        )
    return step_dir


def _continue_from(
    plan: ResumePlan, rank: int, world_size: int, keep: int, say: Callable[[str], None]
) -> Path | None:
    """The checkpoint to continue from, an unpublished save published first."""
    tmp = plan.unpublished
    for reason in plan.skipped:
        name = plan.step_dir.name if plan.step_dir else "nothing"
        say(f"the latest checkpoint is damaged: continuing from {name} instead ({reason})")
    for reason in plan.not_complete:
        say(f"an unfinished save is not published: {reason}")
    if tmp is None:
        return plan.step_dir
    parts = all_gather_objects(verify_unpublished(tmp, rank, world_size), None, world_size)
    problems = [p for part in parts for p in part]
    if problems:
        say(f"an unfinished save is not published: {'; '.join(problems)}")
        return plan.step_dir
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if rank == 0:
        publish_unpublished(tmp, keep)
    barrier(None, world_size)
    say(
        f"published {final.name}: its save was in flight when the previous run stopped, and "
        "every rank had finished writing it (records and checksums agree)"
    )
    return final


def _fields(layout: str) -> dict[str, str]:
    return dict(token.split("=", 1) for token in layout.split() if "=" in token)


def layout_change(saved_layout: str, layout: Layout, saved: RunConfig | None, cfg: RunConfig):
    """A line saying what a resume in another layout changed, or None if nothing did."""
    before, now = _fields(saved_layout), _fields(layout.describe())
    changed = [k for k in now if k in before and before[k] != now[k]]
    if not changed:
        return None
    mb = "microbatches/step/rank"
    text = (
        f"elastic resume: saved with {' '.join(f'{k}={before[k]}' for k in changed)}, now "
        f"{' '.join(f'{k}={now[k]}' for k in changed)}"
    )
    if mb in changed and before[mb].isdigit():
        ratio = layout.num_microbatches / int(before[mb])
        text += f" (gradient accumulation x{ratio:g})"
    g = cfg.train.global_batch_size
    if saved is not None and saved.train.global_batch_size != g:
        return text + (
            f"; train.global_batch_size changed from {saved.train.global_batch_size} to {g}: "
            "the batches and their order differ from the saved run's"
        )
    return text + f"; global batch {g} samples, data order and learning-rate schedule unchanged"


def record_continued(
    run_dir: Path,
    env: LaunchEnv,
    plan: ResumePlan,
    step_dir: Path | None,
    resumed_step: int,
    layouts: tuple[str, str],
) -> tuple[dict[str, Any], str]:
    """Rank 0, after the first step of a resumed or restarted run: the events.jsonl record
    (cause, failed rank, steps lost, seconds from the fault to this first step) and its line."""
    now, end = time.time(), plan.ending or {}
    fault_time = end.get("fault_time") or end.get("time")
    interrupted = end.get("event") == "interrupted"
    step = end.get("step")
    done = None if step is None else step if interrupted else end.get("done", step - 1)
    lost = None if done is None else max(0, done - resumed_step)
    cause = (
        f"interrupted by {end.get('signal')}"
        if interrupted
        else f"rank {end['rank']} failed ({end.get('error')})"
        if end
        else None
    )
    record = append_event(
        run_dir,
        "restart" if env.is_restart else "resume",
        launch=env.restart_text(),
        checkpoint=str(step_dir) if step_dir else None,
        step=resumed_step,
        cause=cause,
        failed_rank=None if interrupted else end.get("rank"),
        fault_step=step,
        steps_lost=lost,
        detection_s=_seconds(end.get("time"), fault_time),
        fault_to_first_step_s=_seconds(now, fault_time),
        start_to_first_step_s=_seconds(now, plan.started),
        layout_saved=layouts[0] or None,
        layout=layouts[1],
        skipped=plan.skipped or None,
        set_aside=[str(p) for p in plan.set_aside] or None,
    )
    line = (
        f"{record['event']} ({env.restart_text()}): "
        + (cause or "no failure recorded by the previous run")
        + f"; resumed from {step_dir.name if step_dir else 'nothing (step 0)'} at step "
        f"{resumed_step}"
        + (f", {lost} completed step{'s' * (lost != 1)} lost" if lost is not None else "")
        + (
            f"; first step {record['fault_to_first_step_s']:.1f} s after the fault"
            if record["fault_to_first_step_s"] is not None
            else ""
        )
        + f" ({record['start_to_first_step_s']:.1f} s after this start)"
    )
    return record, line


def _seconds(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else round(later - earlier, 3)
