"""Step directories on disk: where checkpoints live, which one is the latest, and
whether its files are whole.

Layout: RUN_DIR/checkpoints/step_00000100/{.metadata, __<r>_<i>.distcp..., checksums.json,
config.toml, tokenizer.json?} and RUN_DIR/checkpoints/latest (a text file naming the
newest complete step directory). The tensors are a `torch.distributed.checkpoint` (DCP)
checkpoint whose keys are layout-free (ptdp/checkpoint/keys.py). A step directory is
complete once it has DCP's `.metadata` (or `state.pt`, the earlier single-file format,
which still loads); ptdp/checkpoint/writer.py makes one appear only when it is. Reading
here needs no process group.
"""

from __future__ import annotations

import json
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from ptdp.config import RunConfig, load_toml
from ptdp.errors import CheckpointError

STATE_FILE = "state.pt"  # the earlier single-writer format
METADATA = ".metadata"
CHECKSUMS = "checksums.json"
LATEST = "latest"

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
    """Whether the run directory has published a checkpoint (its `latest` pointer exists)."""
    return (checkpoint_root(run_dir) / LATEST).is_file()


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a run dir, a checkpoints dir or a step dir to a complete step directory:
    its metadata reads and every data file it lists is there at full length (checksums,
    which read every byte, are checked when loading)."""
    path = Path(path)
    for root in (path, path / "checkpoints"):
        if (root / LATEST).is_file():
            step_dir = root / (root / LATEST).read_text().strip()
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


def _check_present(step_dir: Path) -> Path:
    if (step_dir / STATE_FILE).is_file():
        return step_dir
    problems = verify_files(step_dir, read_metadata(step_dir), checksums=False)
    if problems:
        raise CheckpointError(f"{'; '.join(problems)}; {damaged_advice(step_dir)}")
    return step_dir


def read_metadata(step_dir: Path):
    """The DCP metadata: every entry's key, and shape and dtype for tensors."""
    try:
        return dcp.FileSystemReader(step_dir).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"cannot read checkpoint file {step_dir / METADATA} ({type(exc).__name__}: {exc}); "
            f"the checkpoint is damaged: {damaged_advice(step_dir)}"
        ) from exc


def verify_files(
    step_dir: Path, metadata, rank: int = 0, world: int = 1, *, checksums: bool = True
) -> list[str]:
    """Problems with this rank's share of the data files: a missing file, one shorter
    than the metadata says, or (`checksums`) one whose checksum differs from the one
    recorded at save."""
    sums_file = step_dir / CHECKSUMS
    try:
        sums = json.loads(sums_file.read_text()) if sums_file.is_file() else {}
    except ValueError as exc:
        return [f"checkpoint file {sums_file} is not valid JSON ({exc})"]
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
        size = file.stat().st_size
        want = sums[name]["bytes"] if name in sums else ends.get(name, 0)
        if size < want:
            problems.append(f"checkpoint file {file} is truncated ({size} of {want} bytes)")
        elif name in sums and size != want:
            problems.append(f"checkpoint file {file} has {size} bytes, {want} were written")
        elif checksums and name in sums and checksum(file)["crc32"] != sums[name]["crc32"]:
            problems.append(
                f"checkpoint file {file} is corrupted (checksum mismatch with {CHECKSUMS}); "
                f"copy it back from a backup or use an earlier checkpoint"
            )
    return problems


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
