"""A config in and out of text: `[section]` TOML files and `--section.key value` overrides
applied in layers on the defaults (`resolve`), a resolved config written back as TOML that
must read back the same (`write_config`), and the `--help` text from the dataclasses' field
docstrings. The dataclasses themselves are in `ptdp.config.sections`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import inspect
import json
import math
import sys
import textwrap
from dataclasses import fields, replace
from functools import cache
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from ptdp.config.sections import SECTIONS, DataConfig, ParallelConfig, RunConfig
from ptdp.errors import ConfigError
from ptdp.files import write_file

# --------------------------------------------------------------------------- loading


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(options)}"


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Turn a TOML value or a command-line string into the field's annotated type."""
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        options = [m.value for m in typ]
        if isinstance(value, typ):
            return value
        if str(value) not in options:
            raise ConfigError(f"{where} = {value!r} is not valid{_suggest(str(value), options)}")
        return typ(str(value))
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where} = {value!r} is not a boolean; use true or false")
    if typ is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where} = {value!r} is not an integer; use a whole number")
        try:
            return int(value)
        except (ValueError, TypeError):  # TypeError: a TOML array, table or date
            raise ConfigError(
                f"{where} = {value!r} is not an integer; use a whole number"
            ) from None
    if typ is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r} is not a number; use e.g. 0.5 or 3e-4")
        try:
            return float(value)
        except (ValueError, TypeError):
            raise ConfigError(
                f"{where} = {value!r} is not a number; use e.g. 0.5 or 3e-4"
            ) from None
    if get_origin(typ) is tuple:  # tuple[int, ...]: a TOML array or "3,4,4,3"
        if isinstance(value, str):
            text = value.strip().strip("[]()")
            value = [part for part in text.replace(" ", ",").split(",") if part]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r} is not a list; use e.g. 3,4,4,3")
        return tuple(_coerce(v, get_args(typ)[0], f"{where}[{i}]") for i, v in enumerate(value))
    if typ is str:
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where} = {value!r} is not a string")
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {typ}")  # pragma: no cover


def apply_updates(cfg: RunConfig, updates: dict[str, dict[str, Any]], source: str) -> RunConfig:
    """Return `cfg` with `{section: {key: value}}` applied; unknown names are errors."""
    new_sections = {}
    for section, values in updates.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown config section '{section}' in {source}{_suggest(section, list(SECTIONS))}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"'{section}' in {source} must be a table of key = value pairs")
        cls = SECTIONS[section]
        hints = get_type_hints(cls)
        names = [f.name for f in fields(cls)]
        changes = {}
        for key, value in values.items():
            if key not in names:
                raise ConfigError(
                    f"unknown key '{section}.{key}' in {source}{_suggest(key, names)}"
                )
            changes[key] = _coerce(value, hints[key], f"{section}.{key}")
        current = new_sections.get(section, getattr(cfg, section))
        new_sections[section] = replace(current, **changes)
    return _one_data_source(replace(cfg, **new_sections), updates.get("data", {}), source)


DATA_SOURCES = ("path", "paths")
"""The two spellings of the training data (one dataset, a blend): one setting, so a later
layer naming one replaces an earlier layer's other."""


def _one_data_source(cfg: RunConfig, data: dict[str, Any], source: str) -> RunConfig:
    """`cfg` with the data source `data` names (data.path or data.paths, not empty) in place
    of the other, which an earlier layer (a --config file under the command line) may have
    set; naming both in one layer is refused, since neither can win."""
    named = [key for key in DATA_SOURCES if key in data and getattr(cfg.data, key)]
    if len(named) == 2:
        raise ConfigError(
            f"data.path and data.paths are both set in one place ({source}); give "
            "data.path for one dataset or data.paths for a weighted blend (e.g. "
            "0.7,a/prefix,0.3,b/prefix), not both"
        )
    if not named:
        return cfg
    (other,) = set(DATA_SOURCES) - set(named)
    return replace(cfg, data=replace(cfg.data, **{other: getattr(DataConfig(), other)}))


def load_toml(path: str | Path, cfg: RunConfig | None = None) -> RunConfig:
    """Apply a TOML file of `[section]` tables on top of `cfg` (defaults if None)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; see configs/ for examples")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"config file {path} is not valid TOML (UTF-8 text of [section] tables of key = "
            f"value lines): {exc}; see configs/ for examples"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        return apply_updates(cfg or RunConfig(), data, str(path))
    except ConfigError as exc:  # a value of the wrong type: say which file holds it
        if str(path) in str(exc):
            raise
        raise ConfigError(f"{exc} (in {path})") from None


def parse_overrides(args: list[str]) -> dict[str, dict[str, str]]:
    """Parse `--section.key value` and `--section.key=value` pairs into nested dicts."""
    updates: dict[str, dict[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"unexpected argument '{arg}'; config overrides look like --section.key value"
            )
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value, e.g. {arg} 2 or {arg}=2")
            name, value = arg[2:], args[i + 1]
            i += 2
        section, key = name.split(".", 1)
        updates.setdefault(section, {})[key] = value
    return updates


def resolve(
    config_path: str | None, overrides: list[str], base: RunConfig | None = None
) -> RunConfig:
    """Defaults (or `base`, e.g. a model preset) < TOML file < command line; then an option
    left unset that has one valid value under the others takes it (`_implied`)."""
    cfg = base or RunConfig()
    if config_path:
        cfg = load_toml(config_path, cfg)
    cfg = apply_updates(cfg, parse_overrides(overrides), "the command line")
    return _implied(cfg, given_keys(config_path, overrides))


def _implied(cfg: RunConfig, given: frozenset[str]) -> RunConfig:
    """`cfg` with parallel.vpp at the one value its schedule runs (zb-v: 2) when neither the
    TOML file nor the command line gave it and it is still the default: `--parallel.schedule
    zb-v` alone works. An explicit other value stays, for `validate` to refuse with its fix."""
    from ptdp.pipeline.schedules import implied_vpp  # pure; imported late to keep this light

    vpp = implied_vpp(cfg.parallel.schedule.value)
    if vpp is None or "parallel.vpp" in given or cfg.parallel.vpp != ParallelConfig().vpp:
        return cfg
    return replace(cfg, parallel=replace(cfg.parallel, vpp=vpp))


def given_keys(config_path: str | None, overrides: list[str]) -> frozenset[str]:
    """The `section.key` names a TOML file or the command line sets, as opposed to those
    left at their defaults (checkpoint.init_from refuses only given model keys)."""
    data = tomllib.loads(Path(config_path).read_text()) if config_path else {}
    given = {f"{s}.{k}" for s, values in data.items() if isinstance(values, dict) for k in values}
    return frozenset(given | {f"{s}.{k}" for s, v in parse_overrides(overrides).items() for k in v})


# --------------------------------------------------------------------------- writing, help


def to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        values = dataclasses.asdict(getattr(cfg, section))
        out[section] = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in values.items()}
    return out


def from_dict(data: dict[str, dict[str, Any]]) -> RunConfig:
    return apply_updates(RunConfig(), data, "a saved config")


def to_toml(cfg: RunConfig) -> str:
    """TOML text of the resolved config, for every value a field can hold: TOML's `nan` and
    `inf` for non-finite floats, escapes for the control characters of a string. Text that
    is not Unicode cannot be written (`ptdp.rules.domains` refuses it before a run)."""
    lines = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {toml_value(v, f'{section}.{key}')}" for key, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any, where: str) -> str:
    """One value of a config field as TOML spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)  # a float's shortest round-trip form: 0.0003, 1e-05, 10000.0
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v, f"{where}[{i}]") for i, v in enumerate(value)) + "]"
    if isinstance(value, str):
        return _toml_string(value, where)
    raise ConfigError(f"{where} = {value!r} has no TOML spelling")  # pragma: no cover


def _toml_string(text: str, where: str) -> str:
    """A TOML basic string: quote and backslash escaped, control characters (DEL included) as
    \\uXXXX, everything else as itself (json.dumps would write an emoji as two surrogate
    escapes, which TOML forbids)."""
    out = []
    for ch in text:
        code = ord(ch)
        if 0xD800 <= code <= 0xDFFF:
            raise ConfigError(f"{where} = {text!r} holds characters that are not Unicode")
        out.append(
            "\\" + ch if ch in '"\\' else f"\\u{code:04x}" if code < 0x20 or code == 0x7F else ch
        )
    return '"' + "".join(out) + '"'


def write_config(path: Path, cfg: RunConfig) -> None:
    """Write the resolved config as TOML and read the file back: it must parse and hold the
    same config, or the run stops here rather than leave a checkpoint nobody can resume."""
    text = to_toml(cfg)
    write_file(path, text)  # atomic; a full disk named
    try:
        back = to_toml(from_dict(tomllib.loads(path.read_text(encoding="utf-8"))))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, ConfigError) as exc:
        raise ConfigError(f"{path} does not read back as the config written: {exc}") from None
    if back != text:
        changed = sorted(set(back.splitlines()) ^ set(text.splitlines()))
        raise ConfigError(f"{path} reads back otherwise than written: {'; '.join(changed)}")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a config dataclass (the string after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text() -> str:
    """Every option of every section with its default and docstring, for --help."""
    lines = [
        "Configuration: defaults < --model NAME|FILE (a preset or a TOML file) < --config FILE "
        "(TOML) < --section.key value overrides.",
        "Every option below can be set in the TOML file as `key = value` under `[section]`,",
        "or on the command line as --section.key value or --section.key=value.",
        "",
    ]
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        docs = field_docs(cls)
        for f in fields(cls):
            default = getattr(cls(), f.name)
            if isinstance(default, enum.Enum):
                choices = "|".join(m.value for m in type(default))
                default_text = f"{default.value} ({choices})"
            else:
                default_text = json.dumps(default)
            lines.append(f"  --{section}.{f.name} (default {default_text})")
            lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)
