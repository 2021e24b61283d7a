"""Checkpoints: sharded, written in parallel, published atomically, loadable in any layout.

Modules: store.py (step directories, `latest`, checksums, reading entries), writer.py
(parallel and background writes, atomic publish), keys.py (the layout-free key scheme),
sharded.py (a rank's DCP/DTensor entries and resharding on load), full.py (the full
single-process state used by convert and inspect), partial.py (one rank's model weights,
read by each process alone, for generate), manager.py (a training run's save and restore),
recover.py (a save in flight when a run failed, published when every rank wrote it),
retention.py (the newest whole checkpoints kept; after a rollback, later ones set aside),
inspect.py (`ptdp inspect`). Only ptdp/parallel/comm.py issues collectives; this package
uses DCP, DTensor and DeviceMesh directly.
"""

from __future__ import annotations

from ptdp.checkpoint.full import (
    full_model_state,
    load_checkpoint,
    load_full_model_state,
    save_checkpoint,
)
from ptdp.checkpoint.inspect import describe_checkpoint
from ptdp.checkpoint.manager import CheckpointManager
from ptdp.checkpoint.store import (
    LATEST,
    METADATA,
    STATE_FILE,
    checkpoint_root,
    find_checkpoint,
    has_checkpoint,
    latest_note,
    load_config,
    read_metadata,
)
from ptdp.checkpoint.writer import PendingCheckpoint, start_checkpoint

__all__ = [
    "LATEST",
    "METADATA",
    "STATE_FILE",
    "CheckpointManager",
    "PendingCheckpoint",
    "checkpoint_root",
    "describe_checkpoint",
    "find_checkpoint",
    "has_checkpoint",
    "latest_note",
    "full_model_state",
    "load_checkpoint",
    "load_config",
    "load_full_model_state",
    "read_metadata",
    "save_checkpoint",
    "start_checkpoint",
]
