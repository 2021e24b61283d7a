"""docs/configuration.md: generated from the config dataclasses, and current."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from ptdp.cli import main
from ptdp.config.files import field_docs
from ptdp.config.reference import COMMAND, _cell, render
from ptdp.config.sections import SECTIONS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_page_is_the_generators_output() -> None:
    assert PAGE.read_text(encoding="utf-8") == render(), (
        f"docs/configuration.md is out of date with ptdp/config/sections.py; run `{COMMAND}` and "
        "commit the page"
    )


def test_every_key_has_a_meaning_and_a_row() -> None:
    page = render()
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        assert f"## `[{section}]`" in page
        for f in fields(cls):
            assert docs.get(f.name, "").strip(), f"{section}.{f.name} has no docstring"
            assert f"\n| `{section}.{f.name}` | " in page, f"the page lacks {section}.{f.name}"


def test_rows_show_type_default_and_allowed_values() -> None:
    rows = {line.split(" | ")[0][3:-1]: line for line in render().splitlines() if "| `" in line}
    assert rows["model.num_layers"].startswith("| `model.num_layers` | int | `4` |  | ")
    schedule = "`gpipe`, `1f1b`, `interleaved`, `zb-h1`, `zb-h2`, `zb-v`, `dualpipev`"
    assert f'| str | `"1f1b"` | {schedule} |' in rows["parallel.schedule"]
    assert "| list[str] | `[]` |  |" in rows["data.paths"]
    assert "| bool | `false` | `true`, `false` |" in rows["train.compile"]
    assert "2\\*cp-1-i" in rows["parallel.cp"]  # not emphasis
    assert _cell("a|b `x*y|z` 2*3") == "a\\|b `x*y\\|z` 2\\*3"


def test_the_command_prints_and_writes_the_page(tmp_path: Path, capsys) -> None:
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == render()
    out = tmp_path / "configuration.md"
    assert main(["config-reference", "--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render()
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert main(["config-reference", "--output", str(tmp_path / "no" / "x.md")]) == 2
    assert "cannot write" in capsys.readouterr().err
