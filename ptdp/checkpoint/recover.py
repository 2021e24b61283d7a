"""A save that was in flight when a multi-process run failed, published at the next start
if every rank had finished writing it.

The failed run cannot publish it: publishing needs every rank, and some are gone. But
each rank records, once its shards are on disk, their sizes and CRC-32s in
`written.rank<r>.json` (ptdp/checkpoint/writer.py), after DCP's `.metadata` exists. So a
`step_X.tmp` newer than `latest` that holds the metadata, config.toml and the record of
every saving rank, each recorded file at its recorded size, was complete on every rank:
`find_unpublished` finds it from file sizes alone (no process group, nothing read but the
records), `verify_unpublished` checks one rank's share of the checksums, and
`publish_unpublished` (rank 0) publishes it as the save itself would have.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ptdp.checkpoint.retention import published_after
from ptdp.checkpoint.store import LATEST, METADATA, checkpoint_root, checksum, read_metadata
from ptdp.checkpoint.writer import WRITTEN_PREFIX, install, read_written
from ptdp.errors import CheckpointError

_TMP = re.compile(r"^step_(\d+)\.tmp$")


def _published_step(root: Path) -> int:
    """The step `latest` names; -1 when there is none (or it names no step)."""
    latest = root / LATEST
    text = latest.read_text().strip() if latest.is_file() else ""
    match = re.match(r"^step_(\d+)$", text)
    return int(match.group(1)) if match else -1


def _records(tmp: Path) -> tuple[int, dict[int, dict]]:
    """The saving world size and the records present, by rank."""
    records: dict[int, dict] = {}
    for file in tmp.glob(f"{WRITTEN_PREFIX}*.json"):
        rank = file.name.removeprefix(WRITTEN_PREFIX).removesuffix(".json")
        if rank.isdigit():
            records[int(rank)] = json.loads(file.read_text())
    world = max((r["world"] for r in records.values()), default=0)
    return world, records


def incomplete(tmp: Path) -> list[str]:
    """Why `tmp` is not a save complete on every rank (empty: it is). Sizes only."""
    if not (tmp / METADATA).is_file():
        return [f"{tmp} has no {METADATA} (the ranks had not all finished writing it)"]
    if not (tmp / "config.toml").is_file():
        return [f"{tmp} has no config.toml"]
    try:
        world, records = _records(tmp)
    except (OSError, ValueError, KeyError) as exc:
        return [f"a rank's record in {tmp} is unreadable ({exc})"]
    missing = [r for r in range(max(world, 1)) if r not in records]
    if missing:
        ranks = ", ".join(map(str, missing))
        return [f"{tmp} lacks the record of rank {ranks}, which had not finished writing it"]
    problems = []
    files = {name: info for r in records.values() for name, info in r["files"].items()}
    for name, info in sorted(files.items()):
        file = tmp / name
        if not file.is_file() or file.stat().st_size != info["bytes"]:
            have = file.stat().st_size if file.is_file() else "missing"
            problems.append(f"{file} has {have} of {info['bytes']} bytes recorded")
    try:
        storage = read_metadata(tmp).storage_data or {}
    except CheckpointError as exc:
        return [str(exc)]
    unlisted = {str(i.relative_path) for i in storage.values()} - set(files)
    problems += [f"{tmp / name} is in the metadata but no rank recorded it" for name in unlisted]
    return problems


def find_unpublished(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest `step_X.tmp` newer than `latest` that was complete on every rank (None
    if none), and why any newer one is not."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None, []
    published = _published_step(root)
    if published >= 0 and published_after(root, published):
        return None, []  # `latest` was moved back: later saves are of an abandoned future
    found = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if (m := _TMP.match(p.name))),
        reverse=True,
    )
    skipped: list[str] = []
    for step, tmp in found:
        if step <= published:
            break
        problems = incomplete(tmp)
        if not problems:
            return tmp, skipped
        skipped.append("; ".join(problems))
    return None, skipped


def verify_unpublished(tmp: Path, rank: int = 0, world: int = 1) -> list[str]:
    """Checksum mismatches in this rank's share of the recorded files (all ranks call it
    together, each reading 1/world of the files)."""
    saving_world, _ = _records(tmp)
    sums = read_written(tmp, saving_world)
    return [
        f"{tmp / name} differs from the checksum its rank recorded"
        for name in sorted(sums)[rank::world]
        if checksum(tmp / name)["crc32"] != sums[name]["crc32"]
    ]


def publish_unpublished(tmp: Path, keep: int = 0) -> Path:
    """Rank 0: publish a verified complete save as `step_X` and point `latest` at it."""
    saving_world, _ = _records(tmp)
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    install(tmp, final, read_written(tmp, saving_world), keep)
    return final
