"""Reading part of a checkpoint, each process on its own: the model weights of this rank's
chunks (any saved layout, any current one), or one scalar entry.

Generation loads this way: a pipeline stage reads only its own layers' tensors, through
the same resharding plan a training restore uses (ptdp/checkpoint/sharded.py), here
without DTensors, so no process group is needed to read and every process slices its
tensor-parallel shard from the full tensors it read. Checksums are verified over all the
files, each process checking its share when a `world` group is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ptdp.checkpoint.full import load_checkpoint, load_full_model_state
from ptdp.checkpoint.keys import MODEL
from ptdp.checkpoint.sharded import buffer_entries, copy_buffers, load_plan, unpack
from ptdp.checkpoint.store import STATE_FILE, load_entries, read_metadata, verify_files
from ptdp.errors import CheckpointError
from ptdp.parallel.comm import Group, all_gather_objects


def _check_files(step_dir: Path, metadata, world: Group) -> None:
    problems = verify_files(step_dir, metadata, world.rank, world.size)
    parts = all_gather_objects(problems, world.group, world.size)  # all agree, all raise
    problems = [p for part in parts for p in part]
    if problems:
        raise CheckpointError("; ".join(problems))


@torch.no_grad()
def load_model_weights(
    chunks: list[nn.Module], step_dir: Path, tp: Group, world: Group | None = None
) -> None:
    """Fill the parameters (and persistent buffers) of this rank's `chunks` (its shards over
    `tp`) from `step_dir`, reading only the tensors they hold. With `world`, every member
    of it must call this."""
    world = world or Group.single()
    if (step_dir / STATE_FILE).is_file():  # the earlier single-file format: read it whole
        load_full_model_state(chunks, load_checkpoint(step_dir)["model"], tp)
        return
    metadata = read_metadata(step_dir)
    _check_files(step_dir, metadata, world)
    stored = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith(MODEL)}
    entries, plan = load_plan(chunks, stored, None, tp.rank)  # full tensors, no moments
    entries |= buffer_entries(chunks, stored)
    load_entries(step_dir, entries)
    masters, _ = unpack(plan, tp.rank)
    for p, value in masters.items():
        p.copy_(value)
    copy_buffers(chunks, entries)


def read_scalar(step_dir: Path, key: str, default: Any = None) -> Any:
    """One non-tensor entry of the checkpoint (`tokenizer`, `step`, ...), or `default`."""
    if (step_dir / STATE_FILE).is_file():
        return load_checkpoint(step_dir).get(key, default)
    if key not in read_metadata(step_dir).state_dict_metadata:
        return default
    return load_entries(step_dir, {key: None})[key]
