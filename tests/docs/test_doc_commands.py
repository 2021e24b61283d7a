"""Every command in README.md and docs/ runs as written, at a tiny size, and prints what
the page shows (the conventions are in tests/docs/pages.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.docs.pages import ROOT, Block, blocks, output_mismatch, page_env, pages, script

LINKED = ("configs", "examples", "scripts", "benchmarks")
"""Repository folders a page's commands read, linked into each page's scratch folder."""


def _scratch(tmp_path: Path, demo_files: Path) -> Path:
    shutil.copytree(demo_files, tmp_path, dirs_exist_ok=True)
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _run(block: Block, cwd: Path, warm_bin: Path | None = None) -> tuple[str | None, str]:
    """(a problem or None, what the block printed)."""
    timeout = float(block.options.get("timeout") or 180)
    try:
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script(block)], cwd=cwd, env=page_env(warm_bin),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = e.output.decode() if isinstance(e.output, bytes) else (e.output or "")
        return f"ran past its {timeout:.0f} s (doc-test: timeout=S)", out
    want = int(block.options.get("exit") or 0)
    if done.returncode != want:
        return f"exited {done.returncode}, the page expects {want}", done.stdout
    return None, done.stdout


def _tracked_changes() -> str:
    """`git status` of the tracked files: a page's commands see the repository's folders
    through links, and no command may rewrite a file it was not asked to write."""
    done = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    return done.stdout if done.returncode == 0 else ""


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


@pytest.mark.parametrize("page", pages(), ids=_ids(pages()))
def test_every_command_of_the_page_runs_and_prints_what_it_shows(
    page: Path, tmp_path: Path, demo_files: Path, warm_bin: Path | None
) -> None:
    cwd = _scratch(tmp_path, demo_files)
    before = _tracked_changes()
    problems, printed, last_ran = [], "", False
    for block in blocks(page):
        if block.is_command:
            last_ran = "skip" not in block.options
            if last_ran:
                problem, printed = _run(block, cwd, warm_bin)
                if problem:
                    tail = "\n".join(printed.splitlines()[-25:])
                    problems.append(f"{block.where}: {problem}\n{script(block)}---\n{tail}")
        elif block.is_output and last_ran:
            miss = output_mismatch(block.text, printed, exact="exact" in block.options)
            if miss:
                problems.append(f"{block.where}: {miss}\nprinted:\n{printed}")
    after = _tracked_changes()
    if after != before:
        problems.append(f"the page's commands changed tracked files:\n{after}")
    assert not problems, "\n\n".join(problems)


def test_the_pages_are_found_and_hold_commands() -> None:
    """Guards the parametrisation: the pages exist and hold command blocks."""
    counts = {str(p.relative_to(ROOT)): sum(b.is_command for b in blocks(p)) for p in pages()}
    assert counts["README.md"] >= 2
    assert len(counts) >= 10, counts
