"""Sharded checkpoints, written in parallel, with an atomic `latest` pointer.

Layout: RUN_DIR/checkpoints/step_00000100/{.metadata, __<r>_<i>.distcp..., checksums.json,
config.toml, tokenizer.json?} and RUN_DIR/checkpoints/latest (a text file naming the
newest complete step directory). The tensors are a `torch.distributed.checkpoint` (DCP)
checkpoint: every rank writes its own shards (DCP writes each distinct chunk once), so
nothing is gathered to rank 0. Keys are layout-free (see ptdp/parallel/sharded_state.py):
`model/<name>`, `optimizer/state/<name>/<moment>`, `optimizer/step`,
`optimizer/param_groups`, `rng/rank<r>/<device>` and the scalars of the run.

A checkpoint is written under `step_X.tmp` by all ranks, checksummed, renamed by rank 0
when every rank is done, and only then does `latest` move (written to a temporary file
and `os.replace`d), so a crash or a failed save leaves the previous checkpoint as the
latest. An asynchronous save (`start_checkpoint(asynchronous=True)`) copies the state
to CPU memory, writes it in a background thread and publishes it in `finish()`.
`load_checkpoint` rebuilds the full single-process state dict in one process
(no process group); checkpoints of the earlier single-file format (`state.pt`) still load.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ptdp.config import RunConfig, load_toml, to_toml
from ptdp.errors import CheckpointError
from ptdp.parallel.comm import all_gather_objects

STATE_FILE = "state.pt"  # the earlier single-writer format
METADATA = ".metadata"
CHECKSUMS = "checksums.json"
LATEST = "latest"
MODEL, MOMENTS, RNG = "model/", "optimizer/state/", "rng/"

# DCP warns when it saves or loads without a process group (also from a background thread).
warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# ---------------------------------------------------------------------- writing


@dataclass
class PendingCheckpoint:
    """A checkpoint whose shards are being (or have been) written under `tmp`; `finish`
    (all ranks together) waits for this rank's write, then checksums and publishes it."""

    root: Path
    final: Path
    tmp: Path
    cfg: RunConfig
    tokenizer_file: Path | None
    keep: int
    distributed: bool
    future: Future | None = None  # the background write of an asynchronous save

    def finish(self) -> Path:
        with _write_errors(self):
            if self.future is not None:
                future, self.future = self.future, None
                future.result()  # this rank's shards are on disk (or its error raises)
            return _publish(self)


def start_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    cfg: RunConfig,
    tokenizer_file: Path | None,
    keep: int = 0,
    *,
    distributed: bool = False,
    asynchronous: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> PendingCheckpoint:
    """Start writing this rank's flat DCP `state` (all ranks call this together when
    `distributed`) as the checkpoint of `step`, under `step_X.tmp`.

    Synchronous: the shards are written when this returns. `asynchronous`: DCP copies the
    tensors to new CPU memory (a snapshot; training may change its own tensors at once)
    and writes them in a background thread, coordinating over `process_group` (a group of
    its own, so its collectives never interleave with training's). Either way nothing is
    published until `finish()`.
    """
    rank = dist.get_rank() if distributed else 0
    root = checkpoint_root(run_dir)
    pending = PendingCheckpoint(
        root,
        root / f"step_{step:08d}",
        root / f"step_{step:08d}.tmp",
        cfg,
        tokenizer_file,
        keep,
        distributed,
    )
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(pending.tmp, ignore_errors=True)
        pending.tmp.mkdir()
    if distributed:
        dist.barrier()
    kwargs = {
        "storage_writer": dcp.FileSystemWriter(pending.tmp, thread_count=1),
        "planner": DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        "no_dist": not distributed,
    }
    # "assuming the intent is to save in a single process"
    with warnings.catch_warnings(), _write_errors(pending):
        warnings.simplefilter("ignore", UserWarning)
        if asynchronous:
            pending.future = dcp.async_save(state, process_group=process_group, **kwargs)
        else:
            dcp.save(state, **kwargs)
    return pending


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write: DCP wraps each rank's error (as a pair with its
    traceback) in a CheckpointException, itself maybe the cause of another error."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            todo.extend(pair[0] for pair in e.failures.values())
        todo.extend((e.__cause__, e.__context__))
    return None


@contextmanager
def _write_errors(p: PendingCheckpoint) -> Iterator[None]:
    """Turn a failed write into a CheckpointError that names the directory and says that
    `latest` still names the previous checkpoint; drop the half-written `step_X.tmp`.

    With several ranks, only a single process removes it (others may still be writing);
    a leftover `.tmp` is never taken for a checkpoint and the next save of that step
    replaces it."""
    try:
        yield
    except (Exception, CheckpointException) as exc:
        error = _os_error(exc)
        if error is None:
            raise
        if not p.distributed:
            shutil.rmtree(p.tmp, ignore_errors=True)
        latest = p.root / LATEST
        previous = (
            f"{latest} still names {latest.read_text().strip()}"
            if latest.is_file()
            else "no earlier checkpoint was published"
        )
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            problem = f"the disk is full (no space left on device) writing checkpoint {p.tmp}"
            fix = (
                f"free space on the disk holding {p.root}, or keep fewer checkpoints "
                "(--train.keep_checkpoints 2)"
            )
        else:
            problem = f"writing checkpoint {p.tmp} failed: {error}"
            fix = f"check that {p.root} is writable"
        raise CheckpointError(
            f"{problem}; the checkpoint of this step was not saved and {previous}; {fix}, "
            "then --resume"
        ) from error


def _publish(p: PendingCheckpoint) -> Path:
    """Checksum the written shards, then (rank 0) rename `tmp` and move `latest`."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if p.distributed else (0, 1)
    if p.distributed:
        dist.barrier()  # every rank's shards (and DCP's .metadata) are written
    files = sorted(f.name for f in p.tmp.glob("*.distcp"))
    sums = {name: _checksum(p.tmp / name) for name in files[rank::world]}
    sums = {k: v for part in all_gather_objects(sums, None, world) for k, v in part.items()}
    if rank == 0:
        (p.tmp / CHECKSUMS).write_text(json.dumps(sums, indent=1, sort_keys=True) + "\n")
        (p.tmp / "config.toml").write_text(to_toml(p.cfg))
        if p.tokenizer_file is not None:
            shutil.copyfile(p.tokenizer_file, p.tmp / "tokenizer.json")
        shutil.rmtree(p.final, ignore_errors=True)
        os.replace(p.tmp, p.final)
        pointer = p.root / f"{LATEST}.tmp"
        pointer.write_text(p.final.name + "\n")
        os.replace(pointer, p.root / LATEST)
        if p.keep:
            _prune(p.root, p.keep)
    if p.distributed:
        dist.barrier()
    return p.final


def flatten_state(state: dict[str, Any]) -> dict[str, Any]:
    """A full single-process state dict (load_checkpoint's form) as flat DCP entries."""
    flat: dict[str, Any] = {}
    for key, value in state.items():
        if key == "model":
            flat.update({MODEL + k: v.detach() for k, v in value.items()})
        elif key == "optimizer":
            steps = [int(e["step"]) for e in value.get("state", {}).values() if "step" in e]
            flat["optimizer/step"] = steps[0] if steps else 0
            flat["optimizer/param_groups"] = value.get("param_groups", [])
            for name, entry in value.get("state", {}).items():
                for k, v in entry.items():
                    if torch.is_tensor(v) and v.dim():
                        flat[f"{MOMENTS}{name}/{k}"] = v
        elif key == "rng":
            flat.update({f"{RNG}rank0/{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: dict[str, Any],
    cfg: RunConfig,
    tokenizer_file: Path | None,
    keep: int = 0,
) -> Path:
    """Write a full single-process `state` as the checkpoint of `step` (one process)."""
    return start_checkpoint(run_dir, step, flatten_state(state), cfg, tokenizer_file, keep).finish()


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _checksum(path: Path) -> dict[str, int]:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return {"bytes": path.stat().st_size, "crc32": crc}


# ---------------------------------------------------------------------- reading


def _complete(step_dir: Path) -> bool:
    return (step_dir / METADATA).is_file() or (step_dir / STATE_FILE).is_file()


def _earlier(step_dir: Path) -> str:
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
                    f"directory was modified by hand); {_earlier(step_dir)}"
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
        raise CheckpointError(f"{'; '.join(problems)}; {_earlier(step_dir)}")
    return step_dir


def read_metadata(step_dir: Path):
    """The DCP metadata: every entry's key, and shape and dtype for tensors."""
    try:
        return dcp.FileSystemReader(step_dir).read_metadata()
    except Exception as exc:
        raise CheckpointError(
            f"cannot read checkpoint file {step_dir / METADATA} ({type(exc).__name__}: {exc}); "
            f"the checkpoint is damaged: {_earlier(step_dir)}"
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
        elif checksums and name in sums and _checksum(file)["crc32"] != sums[name]["crc32"]:
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


def load_checkpoint(step_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint's full single-process state, in one process; a damaged file is
    named in the error."""
    if (step_dir / STATE_FILE).is_file():
        file = step_dir / STATE_FILE
        try:
            return torch.load(file, map_location=map_location, weights_only=True)
        except Exception as exc:  # torch raises several types for damaged zip archives
            raise CheckpointError(f"cannot read checkpoint file {file}: {exc}") from exc
    metadata = read_metadata(step_dir)
    problems = verify_files(step_dir, metadata)
    if problems:
        raise CheckpointError(f"{'; '.join(problems)}; {_earlier(step_dir)}")
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            flat[key] = None
    load_entries(step_dir, flat)
    return _unflatten(flat, map_location)


def _full(key: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Undo a `@parts<k>dim<d>` view: (k, rows / k, ...) at dim d back to the rows."""
    base, _, suffix = key.partition("@parts")
    if not suffix:
        return key, value
    dim = int(suffix.split("dim")[1])
    return base, value.flatten(dim, dim + 1)


def _unflatten(flat: dict[str, Any], map_location) -> dict[str, Any]:
    state: dict[str, Any] = {"model": {}, "optimizer": {"state": {}, "param_groups": []}}
    opt_step = flat.get("optimizer/step", 0)
    rng: dict[str, torch.Tensor] = {}
    for key, value in flat.items():
        if torch.is_tensor(value):
            value = value.to(map_location)
        if key.startswith(MODEL):
            name, value = _full(key[len(MODEL) :], value)
            state["model"][name] = value
        elif key.startswith(MOMENTS):
            rest, value = _full(key[len(MOMENTS) :], value)
            name, moment = rest.rsplit("/", 1)
            entry = state["optimizer"]["state"].setdefault(name, {"step": opt_step})
            entry[moment] = value
        elif key == "optimizer/param_groups":
            state["optimizer"]["param_groups"] = value
        elif key.startswith(f"{RNG}rank0/"):
            rng[key.rsplit("/", 1)[1]] = value
        elif not key.startswith(RNG) and key not in ("optimizer/step", "layout"):
            state[key] = value
    state["rng"] = rng
    return state


def load_config(step_dir: Path) -> RunConfig:
    """The resolved config the checkpoint was trained with."""
    file = step_dir / "config.toml"
    if not file.is_file():
        raise CheckpointError(
            f"{file} is missing, so the checkpoint's model is unknown; {_earlier(step_dir)}"
        )
    return load_toml(file)
