"""Writing a checkpoint: every rank its own shards, in parallel, then an atomic publish.

A checkpoint is written under `step_X.tmp` by all ranks (DCP writes each distinct chunk
once, so nothing is gathered to rank 0); each rank then records the size and checksum of
the files it wrote (`written.rank<r>.json`); rank 0 merges those records into
`checksums.json` and renames the directory when every rank is done, and only then does
`latest` move (written to a temporary file and `os.replace`d), so a crash or a failed
save leaves the previous checkpoint as the latest. The files are written by several
writer threads per rank and checksummed as they are written (ptdp/checkpoint/summed.py),
so no file is read back. A synchronous save writes from the live tensors (DCP copies only
a box that is a view of a larger storage, one at a time). An asynchronous save
(`start_checkpoint(asynchronous=True)`) makes exactly one copy on the training thread
(`snapshot`: device to pinned host memory on a GPU, a CPU copy on a CPU), and plans,
writes and records it in a background thread; it is published in `finish()`; if the run
fails first, the records tell the next start that it was complete on every rank
(ptdp/checkpoint/recover.py). The directory format is ptdp/checkpoint/store.py's.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.tensor import DTensor

from ptdp.checkpoint.boxes import Boxes, host_copy
from ptdp.checkpoint.lazy import Lazy
from ptdp.checkpoint.retention import prune, set_aside_after
from ptdp.checkpoint.store import CHECKSUMS, LATEST, checkpoint_root, checksum, step_dir_name
from ptdp.checkpoint.summed import SummingWriter
from ptdp.config.files import write_config
from ptdp.config.sections import RunConfig
from ptdp.errors import CheckpointError
from ptdp.files import FULL, free_bytes, replacing, size_text, write_file
from ptdp.parallel.comm import Group, barrier, world_group

E = TypeVar("E", bound=BaseException)

SUMMED_BESIDE = ("tokenizer.json",)
"""Files written beside the shards whose size and checksum checksums.json holds too."""
WRITTEN_PREFIX = "written.rank"
"""`written.rank<r>.json`: what rank r wrote of a checkpoint (see the module docstring)."""


@dataclass
class PendingCheckpoint:
    """A checkpoint whose shards are being (or have been) written under `tmp`; `finish`
    (all ranks together) waits for this rank's write and its record, then publishes it."""

    root: Path
    final: Path
    tmp: Path
    keep: int
    distributed: bool
    nbytes: int = 0  # this rank's tensors: about what the save needs on disk
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
    tokenizer_file: Path | bytes | None,
    keep: int = 0,
    *,
    distributed: bool = False,
    asynchronous: bool = False,
    process_group: ProcessGroup | None = None,
    threads: int = 1,
) -> PendingCheckpoint:
    """Start writing this rank's flat DCP `state` (all ranks call this together when
    `distributed`) as the checkpoint of `step`, under `step_X.tmp`.

    Synchronous: the shards are written, from `state`'s own tensors, when this returns.
    `asynchronous`: the tensors are copied once to host memory (`snapshot`; training may
    change its own tensors at once) and planned and written in a background thread,
    coordinating over `process_group` (a group of its own, so its collectives never
    interleave with training's). `threads` writer threads per rank write a file each.
    Either way nothing is published until `finish()`.
    """
    world = world_group() if distributed else Group.single()
    root = checkpoint_root(run_dir)
    pending = PendingCheckpoint(
        root,
        root / step_dir_name(step),
        root / f"{step_dir_name(step)}.tmp",
        keep,
        distributed,
        _state_bytes(state),
    )
    if world.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(pending.tmp, ignore_errors=True)
        pending.tmp.mkdir()
        with _write_errors(pending):  # a full disk already here: the same message
            _write_beside(pending.tmp, cfg, tokenizer_file)
    barrier(world.group, world.size)
    write = _Write(pending.tmp, world.rank, world.size, threads, not distributed)
    with _write_errors(pending):
        if asynchronous:
            copy, ready = snapshot(state)  # the one copy the training thread makes
            del state
            pending.future = _in_background(write, copy, process_group, ready)
        else:
            write(state, None)
    return pending


class LazySavePlanner(DefaultSavePlanner):
    """DCP's planner, reading each `Lazy` value (ptdp/checkpoint/lazy.py) only when the
    writer asks for its bytes, so a conversion holds about one tensor at a time.

    DCP's writer keeps every tensor it wrote to a file referenced until the file is closed
    (torch/distributed/checkpoint/filesystem.py `tensor_dict`), so the copies a save makes
    (a `Lazy` value read, or the compact copy of a view such as one of `Boxes`' chunks)
    would pile up to the whole file. So each writer thread's copy is freed when that thread
    asks for its next tensor: its writer reads items one at a time (`SummingWriter` sets no
    read-ahead), so by then the copy is in the file. A whole host tensor is neither copied
    nor freed: a synchronous save on a CPU writes the live tensors as they are; from a GPU
    it holds one host copy per writer thread."""

    def __init__(self, lazy: dict[str, Lazy], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lazy = lazy
        self._last = threading.local()

    def resolve_data(self, write_item: WriteItem) -> Any:
        previous = getattr(self._last, "copy", None)
        if previous is not None:
            previous.untyped_storage().resize_(0)  # written: its file holds it now
            self._last.copy = None
        source = self.lazy.get(write_item.index.fqn)
        data = super().resolve_data(write_item) if source is None else source.full()
        if not isinstance(data, torch.Tensor):
            return data  # bytes
        if data.device.type != "cpu":
            data = data.to("cpu")  # the host copy, ours alone
        elif source is not None or data.untyped_storage().nbytes() != data.nbytes:
            data = data.clone()  # ours alone: a view's compact copy, or a read's
        else:
            return data  # a whole live (or snapshot) tensor: written as it is
        self._last.copy = data
        return data


def _placeholders(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Lazy]]:
    """`state` with each `Lazy` value replaced, for planning, by a float32 tensor of its
    shape that holds no memory (one element, expanded), and the lazy values by key."""
    lazy = {k: v for k, v in state.items() if isinstance(v, Lazy)}
    if not lazy:
        return state, lazy
    held = {k: torch.zeros(()).expand(v.shape) for k, v in lazy.items()}
    return state | held, lazy


@dataclass(frozen=True)
class _Write:
    """One rank's DCP write of a checkpoint's tensors into `tmp` and its record."""

    tmp: Path
    rank: int
    world: int
    threads: int
    no_dist: bool

    def __call__(self, state: dict[str, Any], process_group: ProcessGroup | None) -> None:
        writer = SummingWriter(self.tmp, self.threads)
        state, lazy = _placeholders(state)
        planner = LazySavePlanner(lazy, flatten_state_dict=False, flatten_sharded_tensors=False)
        # No warnings.catch_warnings here: it is not thread-safe, and store.py filters
        # DCP's "assuming the intent is to save in a single process" for every thread.
        dcp.save(
            state,
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            no_dist=self.no_dist,
        )
        record_written(self.tmp, self.rank, self.world, writer.sums)


def snapshot(state: dict[str, Any]) -> tuple[dict[str, Any], torch.cuda.Event | None]:
    """A copy of `state` that training cannot change: every tensor (and every box of the
    optimizer's `Boxes`) copied once into host memory (pinned, asynchronously, from a GPU:
    the event says when the copies are done), other entries deep-copied (they are small).
    The only copy an asynchronous save makes, so its memory is about 1x the rank's state."""
    on_gpu = any(_device(v).type == "cuda" for v in state.values() if torch.is_tensor(v))
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Boxes):
            out[key] = value.snapshot(pinned=on_gpu)
        elif isinstance(value, DTensor):
            out[key] = value  # not written by ptdp's saves; DCP copies its local shard
        elif torch.is_tensor(value):
            out[key] = host_copy(value.detach(), pinned=on_gpu)
        else:
            out[key] = copy.deepcopy(value)
    if not on_gpu:
        return out, None
    ready = torch.cuda.Event()
    ready.record()
    return out, ready


def _device(value: torch.Tensor) -> torch.device:
    if isinstance(value, Boxes):
        return value.boxes[0][1].device if value.boxes else torch.device("cpu")
    return value.device


def _in_background(
    write: _Write,
    state: dict[str, Any],
    process_group: ProcessGroup | None,
    ready: torch.cuda.Event | None,
) -> Future:
    """Plan, write and record `state` in a thread of its own (DCP's planning collectives
    over `process_group`, never training's); the future is done once the record is on
    disk. The thread holds the only reference to the copy, freed when it ends."""
    done: Future = Future()

    def run(state: dict[str, Any]) -> None:
        try:
            if ready is not None:
                ready.synchronize()  # the device-to-host copies have landed
            write(state, process_group)
            done.set_result(None)
        except BaseException as exc:
            done.set_exception(exc)

    thread = threading.Thread(target=run, args=(state,), name="ptdp-checkpoint-save")
    thread.start()
    return done


def _state_bytes(state: dict[str, Any]) -> int:
    """The bytes of this rank's tensors in `state` (an optimizer's boxes: their chunks)."""
    total = 0
    for value in state.values():
        if isinstance(value, Boxes):
            total += sum(t.numel() * t.element_size() for _, t in value.boxes)
        elif isinstance(value, DTensor):
            total += value.to_local().numel() * value.element_size()
        elif torch.is_tensor(value):
            total += value.numel() * value.element_size()
        elif isinstance(value, Lazy):
            total += value.nbytes
    return total


def _write_beside(tmp: Path, cfg: RunConfig, tokenizer_file: Path | bytes | None) -> None:
    """config.toml and tokenizer.json, written first so that a save complete on every rank
    is a whole checkpoint even if nobody could publish it; config.toml is read back (a config
    that does not parse as written would make the checkpoint impossible to resume)."""
    write_config(tmp / "config.toml", cfg)
    if isinstance(tokenizer_file, bytes):
        (tmp / "tokenizer.json").write_bytes(tokenizer_file)
    elif tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")


def written_record(rank: int) -> str:
    """The name of the file in which `rank` records what it wrote."""
    return f"{WRITTEN_PREFIX}{rank}.json"


def record_written(
    tmp: Path, rank: int, world: int, sums: dict[str, dict[str, int]] | None = None
) -> None:
    """This rank's shards are on disk (DCP names them `__<rank>_<i>.distcp`): record their
    sizes and CRC-32s and the saving world size, atomically (a record that exists is
    whole). `sums`: those computed as the files were written (`SummingWriter`); a file
    they lack is read back for its sum."""
    sums = sums or {}
    files = {
        f.name: sums[f.name] if f.name in sums else checksum(f)
        for f in sorted(tmp.glob(f"__{rank}_*.distcp"))
    }
    record = json.dumps({"world": world, "files": files}, sort_keys=True)
    write_file(tmp / written_record(rank), record)


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write."""
    return find_cause(exc, OSError)


def find_cause(exc: BaseException, kind: type[E]) -> E | None:
    """The first `kind` error behind `exc`: DCP wraps each rank's error (as a pair with its
    traceback) in a CheckpointException, itself maybe the cause of another error."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kind):
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
        if error.errno in FULL:
            free = free_bytes(p.root)
            problem = (
                f"the disk is full (no space left on device) writing checkpoint {p.tmp} "
                f"(about {size_text(p.nbytes)} needed on rank {_rank(p)}"
                + (f", {size_text(free)} free" if free is not None else "")
                + "); its partial files were removed"
            )
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
    """Once every rank has written and recorded its shards, rank 0 merges the records into
    checksums.json, renames `tmp` and moves `latest`."""
    world = world_group() if p.distributed else Group.single()
    barrier(world.group, world.size)  # every rank's shards and record are written
    if world.rank == 0:
        install(p.tmp, p.final, read_written(p.tmp, world.size), p.keep)
    barrier(world.group, world.size)
    return p.final


def read_written(tmp: Path, world: int) -> dict[str, dict[str, int]]:
    """The size and checksum of every file the `world` saving ranks recorded."""
    sums: dict[str, dict[str, int]] = {}
    for rank in range(world):
        sums |= json.loads((tmp / written_record(rank)).read_text())["files"]
    return sums


def install(tmp: Path, final: Path, sums: dict[str, dict[str, int]], keep: int) -> list[Path]:
    """Rank 0: write checksums.json (the shards' and tokenizer.json's), set aside the
    checkpoints of an abandoned future (ptdp/checkpoint/retention.py), rename `tmp` to
    `final`, move `latest` to it, prune; returns what was set aside. Both files are
    written before anything is renamed, so a full disk leaves `latest` and every step
    directory as they were."""
    summed = {n: checksum(tmp / n) for n in SUMMED_BESIDE if (tmp / n).is_file()}
    write_file(tmp / CHECKSUMS, json.dumps(sums | summed, indent=1, sort_keys=True) + "\n")
    for record in tmp.glob(f"{WRITTEN_PREFIX}*"):
        record.unlink()
    root = final.parent
    with replacing(root / LATEST) as pointer:
        pointer.write_text(final.name + "\n")
        step = int(final.name.removeprefix("step_"))
        moved = set_aside_after(root, step, including=True)
        shutil.rmtree(final, ignore_errors=True)  # a leftover that is no checkpoint
        os.replace(tmp, final)
    prune(root, keep, final)
    return moved


def _rank(p: PendingCheckpoint) -> int:
    return world_group().rank if p.distributed else 0
