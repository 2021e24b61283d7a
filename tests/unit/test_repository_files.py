"""No binaries in the repository: every tracked file over 1 MB must be on an explicit
allow-list (none today), so a wheel, a dataset or a checkpoint committed by accident fails
CI instead of staying in the history of every clone."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIMIT = 1 << 20
"""Bytes above which a tracked file needs a reason."""
ALLOWED: dict[str, str] = {}
"""Tracked files allowed over LIMIT, each with why it must be in git."""


def oversized(sizes: dict[str, int], allowed: dict[str, str], limit: int = LIMIT) -> list[str]:
    """The files of `sizes` (path -> bytes) over `limit` that `allowed` does not name."""
    return sorted(
        f"{p} ({n / 1e6:.1f} MB)" for p, n in sizes.items() if n > limit and p not in allowed
    )


def _tracked_sizes() -> dict[str, int]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True
    ).stdout.decode()
    paths = [p for p in out.split("\0") if p]
    return {p: (REPO / p).stat().st_size for p in paths if (REPO / p).is_file()}


def _in_git_checkout() -> bool:
    return shutil.which("git") is not None and (REPO / ".git").exists()


@pytest.mark.skipif(not _in_git_checkout(), reason="not a git checkout: no tracked files")
def test_no_tracked_file_over_1_mb_unless_allowed() -> None:
    sizes = _tracked_sizes()
    assert "pyproject.toml" in sizes and len(sizes) > 100  # the listing is the real one
    big = oversized(sizes, ALLOWED)
    assert not big, (
        "tracked files over 1 MB: " + ", ".join(big) + "; remove them (`git rm --cached`, "
        "add the pattern to .gitignore) or, if git must hold one, add it to ALLOWED with why"
    )
    stale = sorted(set(ALLOWED) - set(sizes))
    assert not stale, f"ALLOWED names files no longer tracked: {stale}"


def test_a_large_file_is_refused_unless_allowed() -> None:
    sizes = {"ptdp/cli.py": 20_000, "ruff-0.17.6.whl": 10_645_279, "ref.png": 2 * LIMIT}
    assert oversized(sizes, {}) == ["ref.png (2.1 MB)", "ruff-0.17.6.whl (10.6 MB)"]
    assert oversized(sizes, {"ref.png": "a figure the docs show"}) == ["ruff-0.17.6.whl (10.6 MB)"]
    assert oversized({"edge": LIMIT}, {}) == []  # at the limit is allowed; above is not
