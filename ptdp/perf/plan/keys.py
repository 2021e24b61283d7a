"""The config keys `ptdp plan` searches, and how its command line pins them.

A searched key given on the command line (`--parallel.tp 8`) fixes it in `plan`'s search;
keys not given, and a TOML file's layout, are searched over. The old spellings of `plan`'s
first options (`--tp 8`) stand for config keys.
"""

from __future__ import annotations

from ptdp.config.enums import Schedule
from ptdp.config.files import parse_overrides
from ptdp.config.sections import RunConfig
from ptdp.errors import ConfigError
from ptdp.rules.zero import ZERO_LEVELS

SEARCHED: dict[str, str] = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.cp": "cp",
    "parallel.cp_comm": "cp_comm",
    "parallel.ep": "ep",
    "parallel.etp": "etp",
    "parallel.moe_overlap": "moe_overlap",
    "parallel.zero": "zero",
    "parallel.vpp": "vpp",
    "parallel.schedule": "schedules",
    "parallel.recompute": "recompute",
    "parallel.sequence_parallel": "sequence_parallel",
    "train.micro_batch_size": "micro_batch",
}
"""Config keys the planner searches, and the `plan` argument that fixes each."""


def plan_request(
    base: RunConfig, overrides: list[str], top: int = 1
) -> tuple[RunConfig, dict[str, object]]:
    """`ptdp plan`'s base config (resolved from `--model`, `--config` and `overrides`, its
    `--section.key` options) and the keys it pins; `top`, the layouts to list, checked before
    the search."""
    if top < 1:
        raise ConfigError(f"--top {top}: the number of layouts to list must be 1 or more")
    given = parse_overrides(overrides)
    if "global_batch_size" not in given.get("train", {}):
        raise ConfigError("the planner needs --train.global_batch_size B (or --global-batch B)")
    return base, pinned(base, given)


def pinned(cfg: RunConfig, given: dict[str, dict[str, str]]) -> dict[str, object]:
    """`plan` keyword arguments fixing the searched keys that `given` names (the command line's
    `--section.key` overrides, parsed), at their values in `cfg`; 0 leaves a size to the search.

    Keys of `cfg` not given (defaults, or a TOML file's layout) are searched over.
    """
    if "dp" in given.get("parallel", {}) and cfg.parallel.dp:
        raise ConfigError(
            f"parallel.dp = {cfg.parallel.dp}: the planner derives d = gpus / (t p); "
            "fix --parallel.tp and --parallel.pp instead"
        )
    values: dict[str, object] = {}
    for key, arg in SEARCHED.items():
        section, name = key.split(".")
        if name not in given.get(section, {}):
            continue
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, Schedule):
            value = (value.value,)
        elif type(value) is int and name != "zero" and value < 0:
            raise ConfigError(
                f"--{key} {value}: a size must be 1 or more, or 0 to leave it to the search"
            )
        elif name == "zero" and value not in (-1, *ZERO_LEVELS):
            raise ConfigError(
                f"--{key} {value} is not a ZeRO level; use one of "
                f"{', '.join(map(str, ZERO_LEVELS))}, or -1 to search the levels"
            )
        elif type(value) is int and value == (-1 if name == "zero" else 0):
            value = None  # 0 sizes and zero = -1 (follow optim.distributed) are searched
        values[arg] = value
    return values


PLAN_DESCRIPTION = (
    "Search tensor, pipeline and data-parallel sizes, micro-batch, schedule and "
    "recomputation for a model on N GPUs, keep the layouts that fit in memory, "
    "simulate each and rank them; explains the choice with the paper's guidelines "
    "(tensor parallel inside a node, pipeline across nodes, micro-batch from its "
    "equation (1))."
)

PLAN_EPILOG = (
    " A searched key ({searched}) given on the command line fixes it: --parallel.tp 8 "
    "searches only t = 8 (0 = search); keys not given, and a TOML file's layout, are "
    "searched over. The old spellings stand for config keys: --tp 8 is --parallel.tp 8."
).format(searched=", ".join(SEARCHED))
"""`ptdp plan --help`: how searched keys and pins combine."""

OLD_PLAN_FLAGS = {
    "--global-batch": "train.global_batch_size",
    "--vocab-size": "model.vocab_size",
    "--precision": "train.precision",
    "--tp": "parallel.tp",
    "--pp": "parallel.pp",
    "--vpp": "parallel.vpp",
    "--micro-batch": "train.micro_batch_size",
    "--recompute": "parallel.recompute",
    "--sequence-parallel": "parallel.sequence_parallel",
}
"""`ptdp plan`'s first options, kept as other spellings of config keys (README, BENCHMARKS)."""
