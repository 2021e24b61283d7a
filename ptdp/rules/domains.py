"""The domain of every number a user gives ptdp, in one table: each float key of each config
section (`CONFIG_RULES`) and each number of a hardware file (`ptdp.perf.cost.hardware_file`)
is finite and in its range (> 0, >= 0, a fraction, ...).

`check_config(cfg)` is what `ptdp.rules.layout.validate` (and `ptdp plan`, before its search)
checks first, so every command that takes a config (train, simulate, plan, generate)
refuses NaN, an infinity or a value out of its range before any process starts, naming the
key, the value and the fix. It also refuses what the resolved config.toml could not hold:
an integer beyond TOML's 64 bits, text that is not Unicode. Pure Python, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from ptdp.config.sections import SECTIONS, RunConfig
from ptdp.errors import ConfigError

INT64 = (-(2**63), 2**63 - 1)
"""TOML's integers (and torch's seeds, steps, sizes)."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a config float becomes a float32 scalar in some kernel (torch raises
"value cannot be converted to type float without overflow" beyond it)."""


@dataclass(frozen=True)
class Rule:
    """A range a number must lie in, besides being finite; `text` completes "must be ..."."""

    text: str
    test: Callable[[float], bool]
    outside: tuple[float, ...]
    """Values outside the range, for the tests."""
    hint: str = ""
    """What a special value means (e.g. "0 = no clipping"), said with the fix."""

    def holds(self, value: float) -> bool:
        return math.isfinite(value) and self.test(value)

    def meaning(self, hint: str) -> Rule:
        return replace(self, hint=hint)


POSITIVE = Rule("> 0", lambda v: v > 0, (0.0, -1.0))
NON_NEGATIVE = Rule(">= 0", lambda v: v >= 0, (-1.0,))
FRACTION = Rule("a fraction in (0, 1]", lambda v: 0 < v <= 1, (0.0, 1.5))
BELOW_ONE = Rule("in [0, 1)", lambda v: 0 <= v < 1, (1.0, -0.1))
COUNT = Rule("a whole number >= 1", lambda v: v >= 1 and float(v).is_integer(), (0.0, 1.5))
OFF_OR_ABOVE_ONE = Rule("0 (off) or > 1", lambda v: v == 0 or v > 1, (0.5, -1.0))

CONFIG_RULES: dict[str, Rule] = {
    "model.rope_theta": POSITIVE,
    "model.rope_scaling_factor": POSITIVE,
    "model.rope_low_freq_factor": POSITIVE,
    "model.rope_high_freq_factor": POSITIVE,
    "model.rope_beta_fast": POSITIVE,
    "model.rope_beta_slow": POSITIVE,
    "model.rope_mscale": NON_NEGATIVE.meaning("0 = not set"),
    "model.rope_mscale_all_dim": NON_NEGATIVE.meaning("0 = not set"),
    "model.norm_eps": POSITIVE,
    "model.dropout": BELOW_ONE,
    "model.init_std": POSITIVE,
    "model.moe_routed_scaling": POSITIVE.meaning("1 = unscaled"),
    "model.moe_aux_loss_coeff": NON_NEGATIVE.meaning("0 = off"),
    "model.moe_z_loss_coeff": NON_NEGATIVE.meaning("0 = off"),
    "model.moe_bias_update_rate": NON_NEGATIVE.meaning("0 = off"),
    "model.moe_capacity_factor": NON_NEGATIVE.meaning("0 = dropless"),
    "model.mtp_loss_weight": NON_NEGATIVE,
    "parallel.bucket_mb": POSITIVE,
    "data.valid_fraction": BELOW_ONE,
    "optim.lr": POSITIVE,
    "optim.min_lr": NON_NEGATIVE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.beta1": BELOW_ONE,
    "optim.beta2": BELOW_ONE,
    "optim.eps": POSITIVE,
    "optim.grad_clip": NON_NEGATIVE.meaning("0 = no clipping"),
    "optim.initial_loss_scale": POSITIVE,
    "train.peak_tflops": NON_NEGATIVE.meaning(
        "0 = look the device up, else one device's dense peak (989 for an H100 SXM in bf16)"
    ),
    "train.collective_timeout_s": POSITIVE,
    "train.straggler_factor": OFF_OR_ABOVE_ONE.meaning(
        "0 = off, else a multiple of the median step time, e.g. 3"
    ),
}
"""The range of every float key, by "section.key" (tests/unit/test_domains.py checks that
every float field of every section has one, and that its default lies in it)."""


def number_problem(where: str, value: Any, rule: Rule) -> str | None:
    """The message `where = value must be ...` when `value` is NaN, infinite or outside
    `rule`; None when it lies in it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{where} = {value!r} is not a number"
    if rule.holds(value):
        return None
    if math.isnan(value):
        return f"{where} = nan is not a number; it must be a finite number {rule.text}"
    if math.isinf(value):
        return f"{where} = {value} is not finite; it must be a finite number {rule.text}"
    return f"{where} = {value} must be {rule.text}"


def _fix(key: str, default: Any, rule: Rule) -> str:
    hint = f"; {rule.hint}" if rule.hint else ""
    return f"set e.g. --{key} {default} (its default){hint}"


def config_problems(cfg: RunConfig) -> list[str]:
    """What is out of range in `cfg`, one message per key: every float key against its rule,
    every integer against TOML's 64 bits, every text against Unicode."""
    problems = []
    for section, cls in SECTIONS.items():
        values, defaults = getattr(cfg, section), cls()
        for f in fields(cls):
            key, value = f"{section}.{f.name}", getattr(values, f.name)
            rule = CONFIG_RULES.get(key)
            if rule is not None:
                problem = number_problem(key, value, rule)
                if not problem and abs(value) > FLOAT32_MAX:
                    problem = f"{key} = {value} exceeds float32's largest number, {FLOAT32_MAX:.4g}"
                if problem:
                    problems.append(f"{problem}; {_fix(key, getattr(defaults, f.name), rule)}")
                continue
            for item in value if isinstance(value, tuple) else (value,):
                problem = _other_problem(key, item)
                if problem:
                    problems.append(problem)
    return problems


def check_config(cfg: RunConfig) -> None:
    """Raise one ConfigError listing `config_problems(cfg)`, if any."""
    refuse(config_problems(cfg))


def refuse(errors: list[str]) -> None:
    """Raise one ConfigError listing `errors`, if any (`ptdp.rules.layout.validate`'s format)."""
    if errors:
        bullet = "\n  - "
        raise ConfigError(f"invalid configuration:{bullet}{bullet.join(errors)}")


def _other_problem(key: str, value: Any) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool):
        if not INT64[0] <= value <= INT64[1]:
            return f"{key} = {value} does not fit in a 64-bit integer; use a smaller number"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return (
                f"{key} = {value!r} holds characters that are not Unicode (an undecodable "
                "file name?); give it in UTF-8 (rename the file or folder)"
            )
    return None


def require_positive(
    errors: list[str], name: str, value: int | float, zero_ok: bool = False
) -> None:
    """Append to `errors` why a size or count `name` is out of its range (> 0, or >= 0)."""
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        errors.append(f"{name} = {value} must be {bound}")


def non_finite(data: Any, where: str = "") -> list[str]:
    """The places (`where` + .key or [i]) of NaN and infinite floats in nested tables and
    lists, e.g. a parsed TOML file."""
    if isinstance(data, float) and not math.isfinite(data):
        return [f"{where} = {data}"]
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in non_finite(v, f"{where}.{k}".lstrip("."))]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in non_finite(v, f"{where}[{i}]")]
    return []
