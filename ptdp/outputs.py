"""Output directories (a run directory, a simulation's --out, a conversion's OUT, a
preprocessing prefix's folder): made, or refused with the path, the reason and the fix
before any work is done, instead of an OSError from deep inside a writer. An empty name is
refused, never taken for the current directory; `check_output_dir` checks a directory
can be made and written without making it, so a command refused later leaves no empty
folder behind. Files are written through ptdp/files.py."""

from __future__ import annotations

import tempfile
from pathlib import Path

from ptdp.errors import ConfigError


def refuse_empty(value: str | Path | None, name: str) -> None:
    """An output path given as "" (or left out) is refused: ptdp never writes into the
    current directory unless it is named."""
    if value is None or not str(value).strip():
        raise ConfigError(
            f"{name} is empty: ptdp writes only where it is told, never into the current "
            f"directory by default; give {name} a path (e.g. runs/NAME)"
        )


def make_output_dir(path: str | Path, name: str, value: str | Path | None = None) -> Path:
    """Create `path` (and its parents) and check that a file can be written in it.
    `name` is what the user set it with, e.g. "train.run_dir" or "--out", and `value` what
    they gave (`path` by default; a preprocessing prefix, whose folder `path` is)."""
    refuse_empty(path if value is None else value, name)
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise _unwritable(path, name, value, exc) from None
    return path


def check_output_dir(path: str | Path, name: str, value: str | Path | None = None) -> Path:
    """What `make_output_dir` checks, making nothing: `path` is a writable directory, or
    its nearest existing parent is one (so that it can be made there)."""
    refuse_empty(path if value is None else value, name)
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is not a directory")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise _unwritable(path, name, value, exc) from None
    return path


def check_output_file(path: str | Path, name: str) -> Path:
    """A file to write: not a directory, in a directory that can be made and written."""
    refuse_empty(path, name)
    if str(path).endswith(("/", "\\")) or Path(path).is_dir():
        raise ConfigError(
            f"{name} = '{path}' is a directory; give the path of a file, e.g. {Path(path) / 'out'}"
        )
    check_output_dir(Path(path).parent, name, path)
    return Path(path)


def _unwritable(path: Path, name: str, value: str | Path | None, exc: OSError) -> ConfigError:
    return ConfigError(
        f"{name} = '{path if value is None else value}' cannot be written: the directory "
        f"{path} cannot be made or written to ({_reason(path, exc)}); choose a directory "
        f"you can write to with {name}"
    )


def _reason(path: Path, exc: OSError) -> str:
    """What is in the way: a file where a directory must be, or the system's reason."""
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            return f"{part} is a file, not a directory"
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"
