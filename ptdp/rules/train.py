"""The training rules of `validate`: batch sizes against the data-parallel size, intervals,
fault policies, the optimizer's numbers (AdamW's float32 scalars), and the data keys."""

from __future__ import annotations

from ptdp.config.enums import OnNan, Recovery
from ptdp.config.sections import RunConfig
from ptdp.rules.domains import FLOAT32_MAX, require_positive
from ptdp.rules.zero import zero_rules


def train_rules(cfg: RunConfig, dp: int, errors: list[str]) -> int:
    t, o = cfg.train, cfg.optim
    for name in ("micro_batch_size", "global_batch_size", "steps", "log_interval"):
        require_positive(errors, f"train.{name}", getattr(t, name))
    for name in ("eval_interval", "eval_iters", "save_interval", "keep_checkpoints"):
        require_positive(errors, f"train.{name}", getattr(t, name), zero_ok=True)
    require_positive(errors, "checkpoint.writer_threads", cfg.checkpoint.writer_threads)
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
    zero_rules(cfg, errors)
    require_positive(errors, "optim.loss_scale_window", o.loss_scale_window)
    if t.device not in ("auto", "cpu", "cuda") and not t.device.startswith("cuda:"):
        errors.append(f"train.device = {t.device!r}; use auto, cpu or cuda")
    if o.min_lr > o.lr:  # each of them finite and in its range: ptdp/rules/domains.py
        errors.append(f"optim.min_lr = {o.min_lr} must be in [0, optim.lr = {o.lr}]")
    step, decay = o.lr / (1 - o.beta1), o.lr * o.weight_decay  # AdamW's float32 scalars
    if max(step, decay) > FLOAT32_MAX:
        below = FLOAT32_MAX * min(1 - o.beta1, 1 / max(o.weight_decay, 1))
        errors.append(
            f"optim.lr = {o.lr} makes AdamW's first step size lr / (1 - beta1) = {step:.3g} or "
            f"its decay lr * weight_decay = {decay:.3g} overflow float32 (largest "
            f"{FLOAT32_MAX:.3g}); use an optim.lr below {below:.3g}"
        )
    require_positive(errors, "optim.warmup_steps", o.warmup_steps, zero_ok=True)
    require_positive(errors, "optim.decay_steps", o.decay_steps, zero_ok=True)
    if o.decay_steps and o.warmup_steps > o.decay_steps:
        errors.append(
            f"optim.warmup_steps = {o.warmup_steps} exceeds optim.decay_steps = "
            f"{o.decay_steps} (warm-up is part of the decay horizon); lower warmup_steps "
            "or raise decay_steps"
        )
    return microbatches


def data_rules(cfg: RunConfig, errors: list[str]) -> None:
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
