"""Output directories (a run directory, a simulation's --out, a conversion's OUT, a
preprocessing prefix's folder): made, or refused with the path, the reason and the fix
before any work is done, instead of an OSError from deep inside a writer."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ptdp.errors import ConfigError


def make_output_dir(path: str | Path, name: str, value: str | Path | None = None) -> Path:
    """Create `path` (and its parents) and check that a file can be written in it.
    `name` is what the user set it with, e.g. "train.run_dir" or "--out", and `value` what
    they gave (`path` by default; a preprocessing prefix, whose folder `path` is)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{name} = '{path if value is None else value}' cannot be written: the directory "
            f"{path} cannot be made or written to ({_reason(path, exc)}); choose a directory "
            f"you can write to with {name}"
        ) from None
    return path


def _reason(path: Path, exc: OSError) -> str:
    """What is in the way: a file where a directory must be, or the system's reason."""
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            return f"{part} is a file, not a directory"
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"
