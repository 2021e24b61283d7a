"""scripts/test.sh runs the suite in two parts (the one-process folders on every core, then
the multi-process one alone): every folder of tests must be in one of them, so a new folder
cannot be skipped by CI without anyone noticing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pytest_runs(script: str) -> list[list[str]]:
    """The test folders each `python -m pytest` line of the script names."""
    return [re.findall(r"tests/\w+", line) for line in script.splitlines() if "-m pytest" in line]


def test_every_test_folder_is_run_by_scripts_test_sh() -> None:
    folders = {
        str(p.parent.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if ".venv" not in p.parts
    }
    runs = _pytest_runs((ROOT / "scripts/test.sh").read_text())
    named = [f for run in runs for f in run]
    assert folders == {"tests/unit", "tests/docs", "tests/dist"}, folders
    assert sorted(named) == sorted(folders), (named, folders)  # each once
    assert runs[-1] == ["tests/dist"]  # the multi-process tests last, alone


def test_the_parser_reads_folders_off_pytest_lines() -> None:
    script = "x\npython -m pytest -q -n 2 tests/unit tests/docs || s=$?\necho tests/no\n"
    assert _pytest_runs(script) == [["tests/unit", "tests/docs"]]
