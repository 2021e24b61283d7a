"""The configuration reference page (docs/configuration.md), generated from the config
dataclasses: every key's type, default, allowed values and meaning come from the code
(`ptdp.config.files.field_docs`, the same docstrings `ptdp train --help` prints), so the page
cannot drift from it. `ptdp config-reference --output docs/configuration.md` writes it, and
tests/unit/test_config_reference.py checks that the committed page is current.
"""

from __future__ import annotations

import enum
import inspect
import json
import sys
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from ptdp.config.files import field_docs
from ptdp.config.sections import SECTIONS
from ptdp.errors import PtdpError
from ptdp.rules.domains import CONFIG_RULES

COMMAND = "ptdp config-reference --output docs/configuration.md"
"""The command that writes the committed page."""

DESCRIPTION = (
    "Print every key of every config section with its type, default, allowed values and "
    "meaning, as the Markdown page docs/configuration.md, generated from the config "
    "dataclasses and their docstrings."
)

INTRO = f"""\
# Configuration reference

Every key that `ptdp train`, `ptdp simulate` and `ptdp plan` read, by section.

Generated from the config dataclasses in `ptdp/config/sections.py` (their attribute docstrings,
which `ptdp train --help` prints too) by

    {COMMAND}

Change a docstring and run it again rather than editing this page:
`tests/unit/test_config_reference.py` fails while the two differ.

**Setting a key.** In a TOML file, `key = value` under its `[section]` (`--config FILE`);
on the command line, `--section.key value` or `--section.key=value`. Lists are TOML arrays
(`[3, 4, 4, 3]`) or comma-separated on the command line (`3,4,4,3`). Precedence, lowest
first: the defaults below < `--model NAME|FILE` (a preset or a TOML file) < `--config FILE`
< command-line overrides. Unknown keys are rejected with a suggestion; every cross-field
rule (heads dividing the width, batch sizes dividing evenly, the layout matching the number
of processes, ...) is checked before any process group is created, and all problems are
reported at once with their fix.
"""


def type_name(typ: Any) -> str:
    """How a field's value is written: int, float, str, bool, list[int] or list[str]; an
    enum is a str (its values go in the `allowed` column)."""
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        return "str"
    if get_origin(typ) is tuple:
        return f"list[{type_name(get_args(typ)[0])}]"
    return typ.__name__


def allowed(typ: Any, key: str = "") -> str:
    """The values a field takes when they can be listed (an enum's, a bool's), or a float's
    range (ptdp/rules/domains.py); "" otherwise, where the meaning states the range."""
    if key in CONFIG_RULES:
        return f"finite, {CONFIG_RULES[key].text}"
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        return ", ".join(f"`{m.value}`" for m in typ)
    if typ is bool:
        return "`true`, `false`"
    return ""


def default_text(f: Field[Any]) -> str:
    """The default as TOML spells it (`to_toml`'s spelling)."""
    value = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
    if isinstance(value, enum.Enum):
        value = value.value
    text = str(value).lower() if isinstance(value, bool) else json.dumps(value)
    return f"`{text}`"


def _cell(text: str) -> str:
    """`text` safe in a table cell: `|` escaped everywhere (GitHub's tables split on it even
    in code), `*` outside code spans (`2*cp-1-i` would start emphasis)."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("*", "\\*") for i, p in enumerate(parts))


def section_table(section: str, cls: type) -> str:
    """One section: its heading, its class docstring and a row per key."""
    hints, docs = get_type_hints(cls), field_docs(cls)
    lines = [f"## `[{section}]`", ""]
    if cls.__doc__:
        lines += [" ".join(inspect.cleandoc(cls.__doc__).split()), ""]
    lines += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for f in fields(cls):
        typ = hints[f.name]
        cells = (
            f"`{section}.{f.name}`",
            type_name(typ),
            default_text(f),
            allowed(typ, f"{section}.{f.name}"),
            docs.get(f.name, ""),
        )
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render() -> str:
    """The whole page, Markdown, ending in a newline."""
    contents = " · ".join(f"[`[{s}]`](#{s})" for s in SECTIONS)
    parts = [INTRO, f"Sections: {contents}\n"]
    parts += [section_table(section, cls) for section, cls in SECTIONS.items()]
    return "\n".join(parts)


def write(output: str | None) -> None:
    """Print the page, or write it to `output` (a path the user named)."""
    text = render()
    if not output:
        sys.stdout.write(text)
        return
    try:
        Path(output).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise PtdpError(
            f"cannot write {output}: {exc.strerror}; give --output a path in an existing, "
            "writable directory"
        ) from None
    print(f"wrote {output}")
