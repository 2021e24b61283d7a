"""The training loop around a Trainer: steps, logging, evaluation, checkpoint saves,
the agreed stop on a signal, the on_nan policy (stop, rollback), and the final summary.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ptdp import checkpoint as ckpt
from ptdp.checkpoint.manager import NonFiniteState
from ptdp.checkpoint.store import step_dir_name
from ptdp.config.enums import OnNan, Recovery
from ptdp.config.files import to_dict
from ptdp.parallel.comm import gather_objects
from ptdp.perf.cost.flops import utilisation
from ptdp.pipeline.timeline import from_dicts, to_dicts
from ptdp.train.faults.events import append_event
from ptdp.train.faults.numerical import (
    Interrupted,
    NumericalFault,
    TrainingError,
    lost_to_interrupt,
)
from ptdp.train.faults.recovery import InProcessRecovery
from ptdp.train.metrics import MetricsWriter, format_line, peak_memory_gb
from ptdp.train.peak import Peak, device_name, resolve_peak
from ptdp.train.profile import write_timeline
from ptdp.train.progress import Progress
from ptdp.train.step.optim import lr_at

if TYPE_CHECKING:
    from ptdp.train.step.trainer import Trainer


class _IntervalTimer:
    """Training time per log interval, leaving out evaluation and checkpoint saves."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.interval, self.total = device, 0.0, 0.0
        self.clock: float | None = time.perf_counter()

    def _now(self) -> float:
        if self.device.type == "cuda":  # kernels are asynchronous: wait for them
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def pause(self) -> None:
        self.interval += self._now() - self.clock
        self.clock = None

    def resume(self) -> None:
        self.clock = time.perf_counter()

    def drop(self, seconds: float) -> None:
        """Leave the last `seconds` out of the interval (a step abandoned, recovery)."""
        if self.clock is not None:
            self.clock += seconds

    def take_interval(self) -> float:
        self.pause()
        self.resume()
        elapsed, self.interval = self.interval, 0.0
        self.total += elapsed
        return elapsed


@dataclass
class TrainResult:
    """What a run did, for callers and tests (rank 0's view)."""

    run_dir: Path
    start_step: int
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    """Mean training loss of each step (1-based step numbers)."""
    val_losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    optimizer_bytes: int = 0
    """fp32 master weights and AdamW moments held by rank 0 (after the first step)."""
    skipped_steps: int = 0
    """fp16: steps skipped for inf/NaN gradients."""
    nonfinite_skipped: int = 0
    """Steps left out for a non-finite loss or gradient norm (train.on_nan = skip)."""
    rollbacks: list[tuple[int, int]] = field(default_factory=list)
    """(checkpoint step restored, bad step) of each rollback (train.on_nan = rollback)."""
    interrupted: int = 0
    """The signal (SIGINT, SIGTERM) the run stopped for after saving; 0 if none."""


def _report_save(trainer: Trainer, step_dir: Path, *, background: bool) -> None:
    """Say a save and how long it stalled training (the time the training thread spent in
    it: with train.async_save, waiting for the previous save, the finite check and the one
    copy of the state), and record that as a `checkpoint` event (events.jsonl)."""
    stall = trainer.checkpoints.last_stall_s
    in_background = bool(trainer.cfg.train.async_save and background)
    if in_background:
        trainer.say(f"saving checkpoint {step_dir} in the background (stall {stall:.3f} s)")
    elif not trainer.cfg.train.async_save:
        trainer.say(f"saved checkpoint {step_dir} (stall {stall:.3f} s)")
    if trainer.is_main:
        append_event(
            trainer.run_dir, "checkpoint", step=trainer.step, checkpoint=str(step_dir),
            stall_s=round(stall, 6), background=in_background,
        )  # fmt: skip


def run_loop(trainer: Trainer, on_first_step: Callable[[], None] | None = None) -> TrainResult:
    """Train to train.steps; `on_first_step` runs once, after this run's first step (the
    record of a resumed run, with its time from the fault to that step)."""
    t = trainer.cfg.train
    result = TrainResult(trainer.run_dir, trainer.step, trainer.step)
    writer = (
        MetricsWriter(
            trainer.run_dir,
            t.tensorboard,
            wandb_project=t.wandb_project,
            wandb_run_name=t.wandb_run_name,
            run_config=to_dict(trainer.cfg),
        )
        if trainer.is_main
        else None
    )
    peak = resolve_peak(t.peak_tflops, device_name(trainer.device), t.precision.value)
    trainer.say(peak.message)
    progress = Progress(t.steps)
    bar = tqdm(
        total=t.steps,
        initial=trainer.step,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        disable=not (trainer.is_main and t.progress and sys.stderr.isatty()),
    )
    pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    timer = _IntervalTimer(trainer.device)
    saving = False  # the save a signal asked for is being written
    recovery = InProcessRecovery(trainer) if t.recovery is Recovery.IN_PROCESS else None
    try:
        with trainer.faults.stop:  # SIGINT/SIGTERM: save at the end of the step and stop
            while trainer.step < t.steps:
                if trainer.watchdog:
                    trainer.watchdog.begin_step(trainer.step + 1)
                if recovery:
                    recovery.begin_step(trainer)
                try:
                    loss, grad_norm = trainer.train_step()
                except NumericalFault as fault:  # on every rank, at the same step
                    if t.on_nan is OnNan.RETRY:  # validated: only with recovery
                        trainer = _recover(recovery, trainer, fault, timer)
                        continue
                    _on_fault(trainer, fault, result)
                    pending = []
                    continue
                except Exception as exc:  # noqa: BLE001 - any fault of the step: agreed
                    if recovery is None:
                        raise
                    trainer = _recover(recovery, trainer, exc, timer)  # or RecoveryFallback
                    continue
                if trainer.watchdog:
                    trainer.watchdog.end_step()
                if recovery:
                    recovery.step_done(trainer)
                if on_first_step is not None:
                    on_first_step()
                    on_first_step = None
                pending.append((trainer.step, loss, grad_norm))
                bar.update(1)
                stopping = bool(trainer.faults.signum)  # agreed by all ranks
                last = trainer.step == t.steps
                if trainer.step % t.log_interval == 0 or last or stopping:
                    record = _log(trainer, pending, timer.take_interval(), result, peak)
                    record |= progress.update(trainer.step, record["step_time_s"])
                    bar.set_postfix(loss=f"{record['loss']:.3f}")
                    if writer:
                        writer.write(record)
                    trainer.say(format_line(record))
                    pending = []
                if t.eval_interval and (trainer.step % t.eval_interval == 0 or last):
                    timer.pause()
                    with trainer.around("evaluation"):
                        val = trainer.evaluate()
                    result.val_losses[trainer.step] = val
                    if writer:
                        writer.write({"step": trainer.step, "val_loss": val})
                    trainer.say(
                        f"step {trainer.step:>6} | validation loss {val:.4f} "
                        f"| perplexity {math.exp(min(val, 50)):.1f}"
                    )
                    timer.resume()
                if (t.save_interval and trainer.step % t.save_interval == 0) or last or stopping:
                    timer.pause()
                    saving = stopping
                    with trainer.around("checkpoint save"):
                        step_dir = trainer.save()
                    _report_save(trainer, step_dir, background=not stopping)
                    timer.resume()
                if stopping:
                    trainer.finish_save()
                    result.interrupted = trainer.faults.signum
                    name = signal.Signals(trainer.faults.signum).name
                    if trainer.is_main:
                        append_event(
                            trainer.run_dir, "interrupted", signal=name, step=trainer.step,
                            checkpoint=str(step_dir),
                        )  # fmt: skip
                    trainer.say(
                        f"interrupted by {name} at step {trainer.step}; saved checkpoint "
                        f"{step_dir}; resume with --resume"
                    )
                    break
        trainer.finish_save()  # the last asynchronous save is published before the run ends
    except KeyboardInterrupt as exc:  # a second SIGINT: say what it cost
        run_dir = trainer.run_dir
        last = ckpt.find_checkpoint(run_dir) if ckpt.has_checkpoint(run_dir) else None
        raise Interrupted(lost_to_interrupt(trainer.step, last, saving)) from exc
    except Exception:
        trainer.publish_save_after_failure()
        raise
    finally:
        bar.close()
        if writer:
            writer.close(failed=sys.exc_info()[0] is not None)  # in flight: failing
    result.final_step = trainer.step
    result.nonfinite_skipped = trainer.faults.skipped
    if trainer.recorder and trainer.step > result.start_step:
        _write_timeline(trainer)
    result.optimizer_bytes = trainer.optimizer.state_bytes()
    if timer.total and trainer.step > result.start_step:
        steps = trainer.step - result.start_step
        trainer.say(
            f"trained {steps} steps in {timer.total:.1f} s "
            f"({steps * trainer.tokens_per_step / timer.total:,.0f} tokens/s)"
        )
    return result


def _recover(
    recovery: InProcessRecovery, trainer: Trainer, exc: BaseException, timer: _IntervalTimer
) -> Trainer:
    """The Trainer to replay the step with; the failed attempt and the recovery are left
    out of the step times (the wall time holds them)."""
    trainer = recovery.recover(trainer, exc)
    timer.drop(time.perf_counter() - recovery.started)  # since the failed attempt began
    return trainer


def _on_fault(trainer: Trainer, fault: NumericalFault, result: TrainResult) -> None:
    """A step with a non-finite loss or gradient norm under on_nan = stop or rollback.

    stop: save the last good state (the step before the bad one, whose update was not
    applied) unless it is saved already, and raise TrainingError naming it.
    rollback: restore the last checkpoint (step k) and continue with the step after the
    bad one (b): the step counter decides the batch, so the batches of steps k+1..b are
    skipped. Replaying them would only reproduce the fault: the run is deterministic."""
    trainer.finish_save()  # an earlier step's save is good: publish it
    has_checkpoint = ckpt.has_checkpoint(trainer.run_dir)
    good = ckpt.find_checkpoint(trainer.run_dir) if has_checkpoint else None
    policy = trainer.cfg.train.on_nan
    if policy is OnNan.STOP:
        where = f"the last good checkpoint is {good}"
        if good is None or good.name != step_dir_name(trainer.step):
            try:
                good = trainer.save()  # trainer.step: the last good step, nothing applied since
            except NonFiniteState as bad:  # its weights are not: an earlier update broke them
                raise TrainingError(
                    f"{fault}; stopped (train.on_nan = stop); no good state to save: the "
                    f"weights after step {trainer.step} already hold a NaN or an infinity, so "
                    f"nothing was written and {bad.where} (continue from it with --resume, or "
                    "start again). Lower optim.lr or raise optim.warmup_steps"
                ) from None
            trainer.finish_save()
            where = (
                f"saved the last good step {trainer.step} (the bad update not applied) as {good}"
            )
        raise TrainingError(
            f"{fault}; stopped (train.on_nan = stop); {where} (continue from it with "
            "--resume). Lower optim.lr or raise optim.warmup_steps, or set --train.on_nan "
            "skip or rollback"
        )
    if good is None:
        raise TrainingError(
            f"{fault}; no checkpoint was saved before it to roll back to (train.on_nan = "
            "rollback); set --train.save_interval"
        )
    trainer.restore(good)
    restored, trainer.step = trainer.step, fault.step
    result.rollbacks.append((restored, fault.step))
    for values in (result.losses, result.grad_norms):
        for step in [s for s in values if s > restored]:
            del values[step]
    if trainer.is_main:  # events.jsonl names it beside the restarts
        append_event(
            trainer.run_dir, "rollback", step=fault.step, restored=restored,
            checkpoint=str(good), steps_lost=fault.step - 1 - restored, error=str(fault),
        )  # fmt: skip
    trainer.say(
        f"{fault}: rolled back to {good} (step {restored}) and skipped the batches of "
        f"steps {restored + 1}..{fault.step} (train.on_nan = rollback)"
    )
    if trainer.step >= trainer.cfg.train.steps:  # the bad step was the last: save the result
        step_dir = trainer.save()
        if trainer.finish_save() is None:  # an asynchronous save says so when published
            trainer.say(f"saved checkpoint {step_dir}")


def _write_timeline(trainer: Trainer) -> None:
    """Gather the first replica's pipeline ranks' events; rank 0 writes them."""
    if trainer.mesh.coord("tp") or trainer.mesh.coord("dp"):
        return
    parts = gather_objects(to_dicts(trainer.recorder.events), trainer.pp)
    if trainer.is_main:
        events = [e for part in parts for e in from_dicts(part)]
        trace, png = write_timeline(
            trainer.run_dir, trainer.cfg, trainer.layout, events, trainer.device
        )
        trainer.say(f"timeline of the last step: {trace} (open in ui.perfetto.dev), {png}")


def _log(trainer: Trainer, pending, elapsed: float, result: TrainResult, peak: Peak) -> dict:
    """Turn a log interval's losses into one record (one host sync per interval).

    MFU is per device: the job's model FLOP/s / world size / one device's peak."""
    steps = [s for s, _, _ in pending]
    losses = torch.stack([loss for _, loss, _ in pending]).tolist()
    norms = torch.stack([n.float() for _, _, n in pending]).tolist()
    result.losses.update(zip(steps, losses))
    result.grad_norms.update(zip(steps, norms))
    n = len(pending)
    record = {
        "step": trainer.step,
        "loss": sum(losses) / n,
        "lr": lr_at(trainer.step - 1, trainer.cfg.optim, trainer.cfg.train.steps),
        "grad_norm": norms[-1],
        "tokens_per_s": n * trainer.tokens_per_step / elapsed,
        "step_time_s": elapsed / n,
        "tflops_per_device": n * trainer.flops_per_step / elapsed / trainer.env.world_size / 1e12,
        "mfu": (
            utilisation(
                n * trainer.model_flops_per_step, elapsed, trainer.env.world_size, peak.flops
            )
            if peak.flops
            else None
        ),
        "peak_mem_gb": peak_memory_gb(trainer.device),
    }
    m = trainer.cfg.model
    if m.num_experts:  # collective over the pipeline group: every rank logs at this step
        record |= trainer.moe.log_record(m.moe_capacity_factor > 0, m.moe_z_loss_coeff > 0)
    record |= trainer.mtp_log_record()
    if trainer.scaler:
        record |= {"loss_scale": trainer.scaler.scale, "skipped_steps": trainer.scaler.skipped}
        result.skipped_steps = trainer.scaler.skipped
    return record
