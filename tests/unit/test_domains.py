"""Non-finite and out-of-range numbers never pass: every float key of every config section,
and every number of a hardware file, refuses NaN, the infinities and a value outside its
range, naming the key, the value and the fix, before any process starts (ptdp/rules/domains.py)."""

from __future__ import annotations

import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import torch.distributed as dist

from ptdp.cli import main
from ptdp.config.files import resolve, toml_value
from ptdp.config.sections import SECTIONS
from ptdp.errors import ConfigError
from ptdp.perf.cost.hardware_file import BUILTIN_DIR, NUMBERS, RULES, load_system
from ptdp.rules.domains import CONFIG_RULES
from ptdp.rules.layout import validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NON_FINITE = ("nan", "inf", "-inf")


def _float_keys() -> list[str]:
    return [
        f"{section}.{f.name}"
        for section, cls in SECTIONS.items()
        for f in fields(cls)
        if get_type_hints(cls)[f.name] is float
    ]


def _bad_values(rule) -> list[str]:
    return [*NON_FINITE, "1e39", *(repr(v) for v in rule.outside)]  # 1e39: beyond float32


def test_every_float_key_has_a_rule_its_default_keeps() -> None:
    keys = _float_keys()
    assert len(keys) >= 25 and sorted(CONFIG_RULES) == sorted(keys)
    for key, rule in CONFIG_RULES.items():
        section, name = key.split(".")
        default = getattr(SECTIONS[section](), name)
        assert rule.holds(default), key
        assert rule.outside and not any(rule.holds(v) for v in rule.outside), key


def _refusal(key: str, value: str, text: str) -> str | None:
    """What is wrong with the refusal `text` of `key` = `value`, or None."""
    section, name = key.split(".")
    shown = {"nan": "= nan", "inf": "= inf", "-inf": "= -inf"}.get(value, f"= {float(value)}")
    default = getattr(SECTIONS[section](), name)
    wanted = [f"{key} {shown}", f"--{key} {default} (its default)"]
    wanted += ["float32" if CONFIG_RULES[key].holds(float(value)) else CONFIG_RULES[key].text]
    missing = [w for w in wanted if w not in text]
    return f"{key} = {value}: {missing} not in {text!r}" if missing else None


def test_every_float_key_refuses_nan_infinity_and_out_of_range(tmp_path: Path) -> None:
    """From the command line and from a TOML file, each with its key, value, range and fix."""
    problems = []
    for key, rule in CONFIG_RULES.items():
        section, name = key.split(".")
        for value in _bad_values(rule):
            toml = tmp_path / "c.toml"
            toml.write_text(f"[{section}]\n{name} = {value}\n")
            for cfg in (resolve(None, [f"--{key}", value]), resolve(str(toml), [])):
                try:
                    validate(cfg)
                    problems.append(f"{key} = {value} passed")
                except ConfigError as exc:
                    problem = _refusal(key, value, str(exc))
                    if problem:
                        problems.append(problem)
    assert not problems, "\n".join(problems)


def test_adamw_scalars_fit_float32() -> None:
    """A finite learning rate whose first AdamW step would overflow float32 (torch: "value
    cannot be converted to type float without overflow") is refused with the largest one."""
    for args, below in (
        (["--optim.lr", "1e38"], "use an optim.lr below 3.4e+37"),
        (["--optim.lr", "1e37", "--optim.weight_decay", "100"], "use an optim.lr below 3.4e+36"),
        (["--optim.lr", "1e37", "--optim.beta1", "0.99"], "use an optim.lr below 3.4e+36"),
    ):
        with pytest.raises(ConfigError, match="overflow float32") as info:
            validate(resolve(None, args))
        assert below in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--dry-run"],
        ["train"],
        ["simulate", "--device", "a100-80gb"],
        ["plan", "--gpus", "8", "--device", "a100-80gb", "--train.global_batch_size", "64"],
    ],
    ids=["train-dry-run", "train", "simulate", "plan"],
)
def test_every_command_refuses_before_any_process(
    command: list[str],
    tiny_data: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    base = ["--data.path", tiny_data, "--train.run_dir", str(run), "--model.vocab_size", "64"]
    bad = ["--optim.lr", "nan", "--model.dropout", "inf", "--optim.beta2", "1.5"]
    assert main([*command, *base, *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ptdp {command[0]}: error: invalid configuration:"), err
    for fragment in ("optim.lr = nan", "model.dropout = inf", "optim.beta2 = 1.5 must be"):
        assert fragment in err, err
    assert "--optim.lr 0.0003 (its default)" in err and "Traceback" not in err
    assert not dist.is_initialized() and not run.exists()


def test_sampling_options_refuse_non_finite(tiny_data: str) -> None:
    from ptdp.sample import check_sampling

    for options in ({"temperature": math.inf}, {"temperature": math.nan}, {"top_p": math.nan}):
        args = {"temperature": 0.8, "top_p": 0.95} | options
        with pytest.raises(ConfigError, match="--(temperature|top-p) (nan|inf)"):
            check_sampling("", 4, args["temperature"], 0, args["top_p"], 1)


# ------------------------------------------------------------------ hardware files

EXTRA = {  # numbers of a hardware file beyond NUMBERS' keys, with a valid value each
    ("device.achieved", "attention_efficiency"): 0.6,
    ("device.achieved", "attention_backward_ratio"): 2.5,
    ("device.achieved", "gemm_curve_flops"): [1e9, 1e12],
    ("device.achieved", "gemm_curve_efficiency"): [0.5, 0.8],
    ("device.achieved", "layer_overhead_us"): [10.0, 20.0],
    ("device.peak_tflops", "bf16"): 312.0,
}


def _toml(data: dict[str, Any], prefix: str = "") -> str:
    """A TOML file of nested tables (ptdp.config.files.toml_value spells each value)."""
    scalars = [f"{k} = {toml_value(v, k)}" for k, v in data.items() if not isinstance(v, dict)]
    lines = ([f"[{prefix}]"] if prefix else []) + scalars + [""]
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(_toml(v, f"{prefix}.{k}".lstrip(".")))
    return "\n".join(lines)


def _table(data: dict[str, Any], dotted: str) -> dict[str, Any]:
    for part in dotted.split("."):
        data = data.setdefault(part, {})
    return data


def test_every_hardware_number_refuses_nan_infinity_and_out_of_range(tmp_path: Path) -> None:
    base = tomllib.loads((BUILTIN_DIR / "a100-80gb.toml").read_text())
    cases: list[tuple[str, str, Any, str]] = []  # table, key, bad value, what the message says
    for table, key, rule, _ in NUMBERS:
        for bad in (math.nan, math.inf, -math.inf, *RULES[rule].outside):
            cases.append((table, key, bad, f"[{table}] {key} = "))
    for (table, key), good in EXTRA.items():
        for bad in (math.nan, math.inf):
            value = [good[0], bad] if isinstance(good, list) else bad
            cases.append((table, key, value, "not a finite number" if value is not bad else ""))
    problems = []
    for table, key, bad, said in cases:
        data = tomllib.loads(_toml(base))
        _table(data, table)[key] = bad
        path = tmp_path / "hw.toml"
        path.write_text(_toml(data))
        try:
            load_system(path)
            problems.append(f"[{table}] {key} = {bad} passed")
        except ConfigError as exc:
            text = str(exc)
            if not (f"hardware file {path}" in text and key in text and said in text):
                problems.append(f"[{table}] {key} = {bad}: {text}")
    assert len(cases) > 150 and not problems, "\n".join(problems)
