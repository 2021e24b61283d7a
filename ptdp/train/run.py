"""`train()`: the entry point of `ptdp train`, one process or one rank of a launch.

Every check that can fail runs before any process group exists (`prepare`), then the
trainer is built, resumed, run, and the ranks leave together; on a failure the watchdog
names the rank that failed first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ptdp.config.files import to_toml, write_config
from ptdp.config.sections import RunConfig
from ptdp.errors import CheckpointError
from ptdp.outputs import make_output_dir
from ptdp.parallel.comm import all_gather_objects, barrier
from ptdp.parallel.env import LaunchEnv, destroy_process_group
from ptdp.rules.layout import Layout, validate
from ptdp.train.data_setup import RunData, open_data, resolve_vocab
from ptdp.train.faults.events import append_event, wall_ms
from ptdp.train.init_from import InitSource, load_initial_weights, resolve_init
from ptdp.train.loop import TrainResult, run_loop
from ptdp.train.metrics import check_wandb
from ptdp.train.resume import (
    ResumePlan,
    check_world,
    layout_change,
    plan_resume,
    publish_in_flight,
    record_continued,
    wants_resume,
)
from ptdp.train.run_dir import delete_previous_run, hold_run_dir
from ptdp.train.step.trainer import Trainer


def _prepare(
    cfg: RunConfig, env: LaunchEnv, given: frozenset[str] | None, resume: bool = False
) -> tuple[RunConfig, Layout, RunData, InitSource | None]:
    cfg, source = resolve_init(cfg, given)  # the model of init_from
    if resume:
        check_world(cfg, env.world_size)  # an elastic restart's world, named with its checkpoint
    layout = validate(cfg, env.world_size)
    check_wandb(cfg.train.wandb_project)
    data = open_data(cfg)  # names a missing or damaged file before anything else
    return resolve_vocab(cfg), layout, data, source


def prepare(
    cfg: RunConfig,
    env: LaunchEnv,
    *,
    given: frozenset[str] | None = None,
) -> tuple[RunConfig, Layout, RunData]:
    """Every check that can fail, before any process group exists. `given`: the config
    keys the user set (config.given_keys), which checkpoint.init_from checks against its
    model; None counts those that differ from their defaults."""
    return _prepare(cfg, env, given)[:3]


def dry_run(cfg: RunConfig, env: LaunchEnv, *, given: frozenset[str] | None = None) -> str:
    """`ptdp train --dry-run`: the resolved config, the layout and the data, checked."""
    cfg, layout, data = prepare(cfg, env, given=given)
    return (
        f"{to_toml(cfg)}\n# layout: {layout.describe()}\n"
        f"# data: {len(data.train):,} training samples, tokenizer {data.tokenizer_spec}"
    )


def _same_checkpoint_everywhere(step_dir: Path | None, env: LaunchEnv) -> None:
    """Each rank chose the checkpoint to resume from on its own, before the process group
    existed; they differ when train.run_dir is not on a filesystem all nodes share."""
    seen = all_gather_objects(str(step_dir or ""), None, env.world_size)
    if len(set(seen)) == 1:
        return
    ranks: dict[str, list[int]] = {}
    for rank, name in enumerate(seen):
        ranks.setdefault(name or "no checkpoint", []).append(rank)
    views = "; ".join(
        f"rank {r[0]} sees {name}" if len(r) == 1 else f"ranks {', '.join(map(str, r))} see {name}"
        for name, r in ranks.items()
    )
    raise CheckpointError(
        f"the ranks do not see the same checkpoint to resume from ({views}); put "
        "train.run_dir on a filesystem every node shares"
    )


def train(
    cfg: RunConfig,
    *,
    resume: bool = False,
    env: LaunchEnv | None = None,
    given: frozenset[str] | None = None,
    config_file: str | Path | None = None,
) -> TrainResult:
    """Train as one process, or as one rank of a torchrun launch (`given`: see prepare).
    `resume`: --resume; train.resume and a launcher restart may also make the run resume
    (ptdp/train/resume.py). `config_file`: the --config file, never rewritten."""
    env = env or LaunchEnv.from_environ()
    resume = wants_resume(cfg.train.resume, resume, env)
    cfg, layout, data, source = _prepare(cfg, env, given, resume)
    run_dir = Path(cfg.train.run_dir)
    make_output_dir(run_dir, "--train.run_dir")  # before any process group
    lock = hold_run_dir(run_dir, env.rank)  # refuses a directory a live run holds
    try:
        if lock and lock.unsupported:
            why = f"{run_dir} cannot be locked ({lock.unsupported})"
            print(f"note: {why}: nothing stops a second training into it")
        plan = plan_resume(cfg, resume, restart=env.is_restart)  # refuses a previous run
        if plan.previous and env.rank == 0:  # train.overwrite
            delete_previous_run(run_dir, plan.previous)
            print(f"train.overwrite: deleted the previous run's {', '.join(plan.previous)}")
        return _run(cfg, layout, data, source, env, plan, resume, config_file)
    finally:
        if lock:
            lock.release()


def _run(
    cfg: RunConfig,
    layout: Layout,
    data: RunData,
    source: InitSource | None,
    env: LaunchEnv,
    plan: ResumePlan,
    resume: bool,
    config_file: str | Path | None = None,
) -> TrainResult:
    """`train` once the run directory is this run's: build, restore, train, leave."""
    run_dir = Path(cfg.train.run_dir)
    trainer = None
    try:
        trainer = Trainer(cfg, layout, env, data)  # creates the process group if none
        _same_checkpoint_everywhere(plan.newest, env)
        keep = cfg.train.keep_checkpoints
        step_dir = publish_in_flight(plan, env.rank, env.world_size, keep, trainer.say)
        if step_dir is not None:
            trainer.restore(step_dir)
            how = f" ({env.restart_text()})" if env.is_restart else ""
            trainer.say(f"resumed from {step_dir} at step {trainer.step}{how}")
            if note := plan.note:  # `latest` was lost: say which was taken
                trainer.say(note)
            saved_layout = trainer.checkpoints.restored_layout
            change = layout_change(saved_layout, layout, plan.saved, cfg)
            if change:
                trainer.say(change)
            if cfg.checkpoint.init_from:
                trainer.say(
                    f"checkpoint.init_from = {cfg.checkpoint.init_from} not loaded: --resume "
                    "continues this run from its own checkpoint"
                )
        elif source is not None:
            for note in load_initial_weights(trainer.checkpoints, source, cfg.model):
                trainer.say(f"checkpoint.init_from: {note}")
            trainer.say(
                f"initialised the weights from {source.describe()}: fresh optimizer, step 0, "
                "data from the start" + (f" (--resume: no checkpoint in {run_dir} yet)" * resume)
            )
        elif resume:
            trainer.say(f"no checkpoint in {run_dir}; starting from step 0")
        if trainer.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            if step_dir is None:
                (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            _write_config(run_dir, cfg, config_file, trainer.say)
        n_params, n_local = (trainer.parameter_count(full=f) for f in (True, False))
        split = layout.tp * layout.pp > 1  # n_local also counts padded vocabulary rows
        local = f" ({n_local / 1e6:.2f}M on this rank)" if split else ""
        if layout.pp > 1:
            trainer.say(layout.pipeline.summary())
        trainer.say(
            f"ptdp | {layout.describe()} | device {trainer.device} | "
            f"{n_params / 1e6:.2f}M parameters{local} | {len(data.train):,} training samples of "
            f"{cfg.model.seq_length} tokens | {cfg.train.precision.value}"
        )
        sharded = f", sharded over dp={layout.dp}" if trainer.grads.shard else ""
        trainer.say(
            f"optimizer | AdamW | {trainer.optimizer.planned_state_bytes() / 2**20:.1f} MiB of "
            f"master weights and moments on rank 0{sharded} | "
            f"{sum(len(b.buckets) for b in trainer.grads.chunks)} gradient buckets on rank 0"
            + (", reduced during backward" if cfg.parallel.overlap_grad_reduce else "")
        )
        first_step = None
        if trainer.is_main and (step_dir is not None or env.is_restart):
            first_step = _recorder(trainer, plan, step_dir)
        result = run_loop(trainer, on_first_step=first_step)
        if trainer.watchdog:
            trainer.watchdog.close()
        barrier(None, env.world_size)  # leave together (see destroy_process_group)
        if trainer.owns_process_group:
            destroy_process_group()
        return result
    except BaseException as exc:
        # Name the rank that failed first. The process group is left alone: destroying it
        # can block on a dead peer (NCCL), and the command line exits the process.
        if trainer is not None and env.world_size == 1 and isinstance(exc, Exception):
            _record_failure(trainer, exc)
        if trainer is None or trainer.watchdog is None:
            raise
        error = trainer.watchdog.failed(exc)
        trainer.watchdog.close()
        if error is exc:
            raise
        raise error from exc


def _recorder(trainer: Trainer, plan: ResumePlan, step_dir: Path | None) -> Callable[[], None]:
    """Rank 0's record of a resumed or restarted run, written after its first step."""
    start, layouts = trainer.step, (trainer.checkpoints.restored_layout, trainer.layout.describe())

    def record() -> None:
        _, line = record_continued(trainer.run_dir, trainer.env, plan, step_dir, start, layouts)
        trainer.say(line)

    return record


def _write_config(
    run_dir: Path, cfg: RunConfig, config_file: str | Path | None, say: Callable[[str], None]
) -> None:
    """RUN_DIR/config.toml, the resolved config; unless it is the --config file the user
    passed (e.g. the one `ptdp convert --from hf` wrote), which is never rewritten: the
    resolved config is in every checkpoint's config.toml too."""
    target = run_dir / "config.toml"
    if config_file and target.exists() and target.samefile(config_file):
        if target.read_text() != to_toml(cfg):
            say(
                f"{target} is the --config file: left as it is (the overrides are in each "
                "checkpoint's config.toml)"
            )
        return
    write_config(target, cfg)


def _record_failure(trainer: Trainer, exc: Exception) -> None:
    """One process has no watchdog: its failure goes to events.jsonl here, if the disk
    can still hold it (the failure itself may be a full disk): the error matters more."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    try:
        append_event(
            trainer.run_dir, "failure", rank=0, how="raised", error=text,
            step=trainer.step + 1, done=trainer.step, fault_time=wall_ms(),
        )  # fmt: skip
    except OSError as record_error:
        trainer.say(f"the failure could not be recorded in events.jsonl: {record_error}")
