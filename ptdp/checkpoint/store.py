"""Step directories on disk: where checkpoints live, which one is the latest, and
whether its files are whole.

Layout: RUN_DIR/checkpoints/step_00000100/{.metadata, __<r>_<i>.distcp..., checksums.json,
config.toml, tokenizer.json?} and RUN_DIR/checkpoints/latest (a text file naming the
newest complete step directory). The tensors are a `torch.distributed.checkpoint` (DCP)
checkpoint whose keys are layout-free (ptdp/checkpoint/keys.py). A step directory is
complete once it has DCP's `.metadata` (or `state.pt`, the earlier single-file format,
which still loads); ptdp/checkpoint/writer.py makes one appear only when it is. A
published one also has checksums.json, without which it is not loaded. When `latest` is
missing, empty or damaged (lost in a crash, or deleted), the newest complete step
directory is the latest. Reading here needs no process group.
"""

from __future__ import annotations

import json
import re
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from ptdp.config.files import load_toml
from ptdp.config.sections import RunConfig
from ptdp.errors import CheckpointError

STATE_FILE = "state.pt"  # the earlier single-writer format
METADATA = ".metadata"
CHECKSUMS = "checksums.json"
LATEST = "latest"
STEP_DIR = re.compile(r"step_\d+")

# DCP warns when it saves or loads without a process group (also from a background thread).
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    """Zero-padded, so step directories sort by name in step order (pruning relies on it)."""
    return f"step_{step:08d}"


def checksum(path: Path) -> dict[str, int]:
    """Size and CRC-32 of a data file, recorded at save and checked on load."""
    crc = 0
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return {"bytes": path.stat().st_size, "crc32": crc}


def _complete(step_dir: Path) -> bool:
    return (step_dir / METADATA).is_file() or (step_dir / STATE_FILE).is_file()


def damaged_advice(step_dir: Path) -> str:
    """What to do about a damaged checkpoint."""
    others = sorted(
        p.name
        for p in step_dir.parent.glob("step_*")
        if p != step_dir and not p.name.endswith(".tmp") and _complete(p)
    )
    example = f" (e.g. {others[-1]})" if others else ""
    return (
        f"resume from an earlier checkpoint by writing its directory name{example} into "
        f"{step_dir.parent / LATEST}, or start afresh with another --train.run_dir"
    )


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether the run directory has published a checkpoint: its `latest` pointer names
    one, or a step directory is there (`latest` lost or emptied, e.g. by a crash)."""
    root = checkpoint_root(run_dir)
    return _latest_name(root) is not None or bool(_step_dirs(root))


def _latest_name(root: Path) -> str | None:
    """The step directory `latest` names, or None when it is missing, empty or holds no
    step directory's name (damaged: ptdp writes it whole, with os.replace)."""
    file = root / LATEST
    try:
        name = file.read_text().strip() if file.is_file() else ""
    except (OSError, UnicodeDecodeError):
        name = ""
    return name if STEP_DIR.fullmatch(name) else None


def _step_dirs(root: Path) -> list[Path]:
    """Published step directories (not `.tmp`), oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if p.is_dir() and STEP_DIR.fullmatch(p.name))


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a run dir, a checkpoints dir or a step dir to a complete step directory:
    its metadata reads, its checksums.json is there and every data file it lists is there
    at full length (checksums, which read every byte, are checked when loading). With
    `latest` missing, empty or damaged, the newest complete step directory (`latest_note`
    says so)."""
    path = Path(path)
    for root in (path, path / "checkpoints"):
        name = _latest_name(root)
        if name is None and _step_dirs(root):
            return _newest_complete(root)
        if name is not None:
            step_dir = root / name
            if not _complete(step_dir):
                what = "does not exist" if not step_dir.is_dir() else f"has no {METADATA}"
                raise CheckpointError(
                    f"{root / LATEST} points to {step_dir}, which {what} (the checkpoint "
                    f"directory was modified by hand); {damaged_advice(step_dir)}"
                )
            return _check_present(step_dir)
    if _complete(path):
        return _check_present(path)
    raise CheckpointError(
        f"no checkpoint found at {path}: expected a run directory, its checkpoints/ "
        f"directory, or a step directory containing {METADATA}"
    )


def find_restart_checkpoint(run_dir: str | Path) -> tuple[Path, list[str]]:
    """For a launcher restart, where no person can choose: the checkpoint `latest` names
    if its files are whole, else the newest older complete one, and why the latest was
    skipped (a damaged checkpoint would otherwise fail every restart until the launcher
    gives up). A first launch or --resume refuses the damage instead (find_checkpoint)."""
    try:
        return find_checkpoint(run_dir), []
    except CheckpointError as exc:
        root = checkpoint_root(run_dir)
        name = _latest_name(root)
        for step_dir in reversed(_step_dirs(root)):
            if (name is None or step_dir.name < name) and not _problems(step_dir):
                return step_dir, [str(exc).split("; resume from an earlier")[0]]  # no advice
        raise


def _newest_complete(root: Path) -> Path:
    """`latest` is lost: the newest step directory whose files are all there."""
    skipped = []
    for step_dir in reversed(_step_dirs(root)):
        problems = _problems(step_dir)
        if not problems:
            return step_dir
        skipped.append(f"{step_dir.name}: {'; '.join(problems)}")
    raise CheckpointError(
        f"{root / LATEST} is missing, empty or damaged and no step directory in {root} is complete "
        f"({' | '.join(skipped)}); copy the damaged files back from a backup, or start "
        "afresh with another --train.run_dir"
    )


def latest_note(step_dir: Path) -> str | None:
    """Why `step_dir` was chosen when `latest` named nothing (None when it named it)."""
    root = step_dir.parent
    if _latest_name(root) is not None or step_dir not in _step_dirs(root):
        return None
    newer = [p for p in _step_dirs(root) if p.name > step_dir.name]
    skipped = "".join(f"; skipped {p.name}: {'; '.join(_problems(p))}" for p in newer)
    return (
        f"{root / LATEST} is missing, empty or damaged: continued from the newest complete "
        f"checkpoint, {step_dir.name} (the next save writes {LATEST} again){skipped}"
    )


def _problems(step_dir: Path) -> list[str]:
    """What makes a step directory incomplete (sizes and names only, no checksums)."""
    if (step_dir / STATE_FILE).is_file():
        return []
    if not (step_dir / METADATA).is_file():
        return [f"{step_dir / METADATA} is missing"]
    try:
        metadata = _read_metadata(step_dir)
    except Exception as exc:
        return [_unreadable(step_dir, exc)]
    return verify_files(step_dir, metadata, checksums=False)


def damage(step_dir: Path) -> list[str]:
    """What makes a step directory incomplete or damaged, from names and sizes alone (no
    checksums); empty when it is whole."""
    return _problems(step_dir)


def _check_present(step_dir: Path) -> Path:
    problems = _problems(step_dir)
    if problems:
        raise CheckpointError(f"{'; '.join(problems)}; {damaged_advice(step_dir)}")
    return step_dir


def _read_metadata(step_dir: Path):
    return dcp.FileSystemReader(step_dir).read_metadata()


def _unreadable(step_dir: Path, exc: Exception) -> str:
    return f"cannot read checkpoint file {step_dir / METADATA} ({type(exc).__name__}: {exc})"


def read_metadata(step_dir: Path):
    """The DCP metadata: every entry's key, and shape and dtype for tensors."""
    try:
        return _read_metadata(step_dir)
    except Exception as exc:
        raise CheckpointError(
            f"{_unreadable(step_dir, exc)}; the checkpoint is damaged: {damaged_advice(step_dir)}"
        ) from exc


def verify_files(
    step_dir: Path, metadata, rank: int = 0, world: int = 1, *, checksums: bool = True
) -> list[str]:
    """Problems with this rank's share of the data files: a missing file, one shorter
    than the metadata says, or (`checksums`) one whose checksum differs from the one
    recorded at save. Every checkpoint ptdp publishes has checksums.json: without it, or
    with a file it does not list, the files cannot be verified, so that is a problem too
    (named by rank 0 alone)."""
    sums, problem = _read_checksums(step_dir)
    if problem:
        return [problem] if rank == 0 else []
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    problems = []
    for name in sorted(set(ends) | set(sums))[rank::world]:
        file = step_dir / name
        if not file.is_file():
            problems.append(f"checkpoint file {file} is missing")
            continue
        if name not in sums:
            problems.append(
                f"checkpoint file {file} is not listed in {step_dir / CHECKSUMS}, so it "
                "cannot be verified (the directory was modified by hand)"
            )
            continue
        size, want = file.stat().st_size, sums[name]["bytes"]
        if size < max(want, ends.get(name, 0)):
            problems.append(
                f"checkpoint file {file} is truncated ({size} of "
                f"{max(want, ends.get(name, 0))} bytes)"
            )
        elif size != want:
            problems.append(f"checkpoint file {file} has {size} bytes, {want} were written")
        elif checksums and checksum(file)["crc32"] != sums[name]["crc32"]:
            problems.append(
                f"checkpoint file {file} is corrupted (checksum mismatch with {CHECKSUMS}); "
                f"copy it back from a backup or use an earlier checkpoint"
            )
    return problems


def verify_file(step_dir: Path, name: str) -> str | None:
    """The problem with one file written beside the shards (tokenizer.json) against
    checksums.json, or None; a checkpoint saved before checksums.json listed it passes."""
    sums, problem = _read_checksums(step_dir)
    file = step_dir / name
    if problem or name not in sums:
        return problem
    if not file.is_file():
        return f"checkpoint file {file} is missing"
    if checksum(file) != sums[name]:
        return (
            f"checkpoint file {file} differs from the size and checksum recorded in "
            f"{CHECKSUMS} (it was replaced or damaged)"
        )
    return None


def _read_checksums(step_dir: Path) -> tuple[dict[str, dict[str, int]], str | None]:
    """checksums.json as {file: {"bytes", "crc32"}}, or the problem with it."""
    file = step_dir / CHECKSUMS
    if not file.is_file():
        return {}, (
            f"checkpoint file {file} is missing, so the shards cannot be checked against the "
            "sizes and checksums recorded at save (the checkpoint was not fully copied, or "
            "was modified by hand)"
        )
    try:
        sums = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        return {}, f"checkpoint file {file} is not valid JSON ({exc})"
    valid = isinstance(sums, dict) and all(
        isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("crc32"), int)
        for v in sums.values()
    )
    if not valid:
        return {}, f"checkpoint file {file} does not map each file to its bytes and crc32"
    return sums, None


def load_entries(
    step_dir: Path, state: dict[str, Any], *, distributed: bool = False
) -> dict[str, Any]:
    """dcp.load into `state` (tensors filled in place, other entries replaced)."""
    try:
        with warnings.catch_warnings():  # "... load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                state,
                storage_reader=dcp.FileSystemReader(step_dir),
                planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=not distributed,
            )
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {step_dir}: {exc}") from exc
    return state


def load_config(step_dir: Path) -> RunConfig:
    """The resolved config the checkpoint was trained with."""
    file = step_dir / "config.toml"
    if not file.is_file():
        raise CheckpointError(
            f"{file} is missing, so the checkpoint's model is unknown; {damaged_advice(step_dir)}"
        )
    return load_toml(file)
