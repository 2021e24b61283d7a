"""Sharded safetensors files written tensor by tensor, as `transformers` lays them out.

The safetensors format is an 8-byte little-endian header length, a JSON header giving
each tensor's dtype, shape and [begin, end) offsets in the data, then the data. Knowing
every tensor's shape beforehand (the export converts the model on the meta device first),
the header is written when a file is opened and each tensor's bytes as soon as it is
converted, so the export holds one piece of the model at a time, however large the model
(the `safetensors` library writes only from a dict of every tensor of a file).

One file is `model.safetensors`; more are `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json` mapping each tensor to its file, as `save_pretrained` names
them. Every file is written under a temporary name and renamed only when all of them are
whole, so a failed export leaves no file of it (ptdp/files.py `replacing`).
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from ptdp.convert.hf_files import WEIGHTS_FILE, weight_names
from ptdp.files import replacing

DEFAULT_SHARD_BYTES = 5 * 10**9
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """A size such as 5GB, 500MB, 2GiB or 1000000 (bytes), as transformers' max_shard_size."""
    number = text.strip().upper()
    digits = number.rstrip("KMGTIB ")
    unit = number[len(digits) :].strip()
    try:
        value = float(digits) * SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(
            f"{text!r} is not a size: write a number with a unit, e.g. 5GB, 500MB or 2GiB"
        ) from None
    if value < 1:
        raise ValueError(f"{text!r}: a shard holds at least one byte")
    return int(value)


"""`save_pretrained`'s default max_shard_size, "5GB"."""


@dataclass(frozen=True)
class Entry:
    """A tensor to write: float32 (what ptdp exports) of `shape`."""

    name: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)


def plan_shards(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive entries grouped into files of at most `max_bytes` each (a tensor larger
    than that gets a file of its own), in order, as `save_pretrained` splits them."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_FILE]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def header_bytes(entries: list[Entry]) -> bytes:
    """A file's length-prefixed header, padded with spaces to 8 bytes as safetensors does."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    at = 0
    for e in entries:
        offsets = [at, at + e.nbytes]
        header[e.name] = {"dtype": "F32", "shape": list(e.shape), "data_offsets": offsets}
        at += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


class ShardWriter:
    """Writes the planned files of `shards` into `out`; `write` takes the tensors in the
    plan's order. Use as a context manager: the files appear (renamed from temporary
    names) when it exits without an error, and none of them otherwise."""

    def __init__(self, out: Path, shards: list[list[Entry]]) -> None:
        self.out, self.shards = out, shards
        self.names = shard_names(len(shards))
        self.order = [(k, e) for k, shard in enumerate(shards) for e in shard]
        self._next = 0
        self._stack = ExitStack()
        self._file: BinaryIO | None = None

    def __enter__(self) -> ShardWriter:
        self._stack.__enter__()
        return self

    def __exit__(self, *exc: object) -> bool | None:
        if self._file is not None:
            self._file.close()
        if exc[0] is None and self._next != len(self.order):
            missing = self.order[self._next][1].name
            exc = (RuntimeError, RuntimeError(f"export ended before writing {missing}"), None)
        return self._stack.__exit__(*exc)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard, entry = self.order[self._next]
        if name != entry.name or tuple(tensor.shape) != entry.shape:
            raise RuntimeError(f"export wrote {name} {tuple(tensor.shape)}, planned {entry}")
        if self._next == 0 or self.order[self._next - 1][0] != shard:
            self._open(shard)
        data = tensor.detach().to(torch.float32).contiguous()
        assert self._file is not None
        self._file.write(data.view(torch.uint8).numpy().data if data.numel() else b"")
        self._next += 1

    def _open(self, shard: int) -> None:
        if self._file is not None:
            self._file.close()
        entries = self.shards[shard]
        needed = len(header_bytes(entries)) + sum(e.nbytes for e in entries)
        tmp = self._stack.enter_context(replacing(self.out / self.names[shard], needed))
        self._file = tmp.open("wb")
        self._file.write(header_bytes(entries))

    def index(self) -> dict[str, object] | None:
        """`model.safetensors.index.json`'s content, or None for a single file."""
        if len(self.shards) == 1:
            return None
        total = sum(e.nbytes for _, e in self.order)
        weight_map = {e.name: self.names[k] for k, e in self.order}
        return {"metadata": {"total_size": total}, "weight_map": weight_map}


def stale_weight_files(out: Path, written: list[str]) -> list[Path]:
    """Weight files of an earlier export in `out` that this one did not write (its
    shards, its single file, its index), to remove once the new files are in place."""
    ours = weight_names([p.name for p in out.iterdir() if p.is_file()])
    return sorted(out / name for name in ours if name not in written)
