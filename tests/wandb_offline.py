"""Weights & Biases in offline mode for tests, and a reader of what an offline run wrote:
shared by tests/unit/test_train_logging.py and tests/dist/test_train_logging.py."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest


def offline_env(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    """Point every wandb directory into `root` and keep it offline and quiet; the runs go
    under the returned $WANDB_DIR (spawned ranks inherit the environment)."""
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root / "wandb_dir"),
        "WANDB_CONFIG_DIR": str(root / "wandb_config"),
        "WANDB_CACHE_DIR": str(root / "wandb_cache"),
        "WANDB_DATA_DIR": str(root / "wandb_data"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
    }.items():
        monkeypatch.setenv(key, value)
    (root / "wandb_dir").mkdir()
    return root / "wandb_dir"


def offline_runs(wandb_dir: Path) -> list[Path]:
    return sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))


def _records(path: Path) -> list:
    """The protobuf records of an offline run file: a 7-byte W&B header, then a LevelDB
    log (32 KiB blocks of records with a 7-byte header: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, out, parts = path.read_bytes(), 32768, 7, [], b""
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def read_run(path: Path, timeout_s: float = 60) -> tuple[object, dict[int, dict], int]:
    """(the run record: project, display_name, config, ...; {step: every key logged at it};
    the exit code).

    wandb's service process may still be writing the file when `finish()` returns (seen on
    a loaded machine): wait for the run's exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = _records(path)
        kinds = [r.WhichOneof("record_type") for r in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "exit" in kinds, f"{path} has no exit record after {timeout_s} s: {kinds}"
    (run,) = [r.run for r, kind in zip(records, kinds) if kind == "run"]
    history: dict[int, dict] = {}
    for r, kind in zip(records, kinds):
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            history.setdefault(items["_step"], {}).update(items)
    (exit_code,) = [r.exit.exit_code for r, kind in zip(records, kinds) if kind == "exit"]
    return run, history, exit_code
