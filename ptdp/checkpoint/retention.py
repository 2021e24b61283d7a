"""Which step directories a run keeps: the `keep` newest whole ones of the history it
continues, a damaged one never counted among them, and no checkpoint of an abandoned
future deleted.

A rollback (`latest` written back by hand to an earlier step directory, or a damaged
newest checkpoint skipped by a restart) leaves step directories after the one resumed
from: the future of a history the run no longer follows. Counted by name they would be
the newest, and pruning would delete the checkpoint resumed from and every save of the
continued run instead. So when a run continues from step S while a published step
directory after S exists, and again when a checkpoint is published over such a one, every
step directory and unpublished `.tmp` save after S is set aside: moved whole into
`checkpoints/abandoned/after_step_S/`, where no `step_*` pattern finds it and nothing
prunes it. Move one back (and write its name into `latest`) to return to that future.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ptdp.checkpoint.store import damage, step_dir_name

ABANDONED = "abandoned"
"""The folder of `checkpoints/` holding the step directories set aside by rollbacks."""
_ENTRY = re.compile(r"^step_(\d+)(\.tmp)?$")


def _entries(root: Path) -> list[tuple[int, bool, Path]]:
    """(step, published, path) of every step directory and `.tmp` save in `root`."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if (m := _ENTRY.match(path.name)) and path.is_dir():
            found.append((int(m.group(1)), m.group(2) is None, path))
    return sorted(found)


def published_after(root: Path, step: int) -> bool:
    """Whether a published step directory after `step` exists: continuing from `step`
    is a rollback."""
    return any(s > step and published for s, published, _ in _entries(root))


def set_aside_after(root: Path, step: int, *, including: bool = False) -> list[Path]:
    """If a published step directory after `step` (or at it, `including`) exists, move it
    and every other step directory or `.tmp` save after `step` into
    `abandoned/after_step_<step>/` (a new folder per rollback); return where they went."""
    later = [
        (s, published, p)
        for s, published, p in _entries(root)
        if s > step or (including and s == step and published)
    ]
    if not any(published for _, published, _ in later):
        return []  # only unfinished saves after it: no rollback, nothing to set aside
    base = root / ABANDONED / f"after_{step_dir_name(step)}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}.{n}")
    folder.mkdir(parents=True)
    moved = []
    for _, _, path in later:
        path.rename(folder / path.name)
        moved.append(folder / path.name)
    return moved


def prune(root: Path, keep: int, newest: Path) -> list[Path]:
    """Remove the step directories older than the `keep` newest whole ones up to `newest`
    (the one just published); a damaged one is not counted, and one between kept ones
    stays (its files may be copied back). Returns what was removed."""
    if not keep:
        return []
    mine = [p for s, published, p in _entries(root) if published and p.name <= newest.name]
    kept: list[Path] = []
    removed = []
    for path in reversed(mine):
        if len(kept) < keep:
            if not damage(path):
                kept.append(path)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
