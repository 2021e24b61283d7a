"""The ZeRO rules of `validate`: which levels exist, what each shards, what each cannot
combine with, and the effective level of a config."""

from __future__ import annotations

from ptdp.config.sections import RunConfig

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


def zero_rules(cfg: RunConfig, errors: list[str]) -> None:
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
