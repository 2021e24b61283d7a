"""The smallest and largest token id in a dataset's `.bin`, read in chunks and cached.

Checked against model.vocab_size before launch (ptdp/train/data_setup.py), so an id the
embedding has no row for is refused with the file named, whatever the dataset's sidecar
says, instead of failing inside the embedding at the step that first reads it. The scan
reads every token, CHUNK_TOKENS at a time (numpy, about 10 GB/s from the page cache; a
cold disk sets the pace). For a `.bin` of CACHE_MIN_BYTES or more the result is kept in
the user's cache directory ($XDG_CACHE_HOME/ptdp/token-range, default ~/.cache/...), one
small JSON file per `.bin` keyed by its resolved path, size and modification time, so a
later start (and every other rank on a machine sharing that directory) reads it instead
of the corpus; a changed `.bin` is scanned again. Smaller files are scanned each time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from ptdp.data.indexed import IndexedDataset

CHUNK_TOKENS = 1 << 26
"""Tokens read per numpy reduction (128 MiB of uint16)."""
CACHE_MIN_BYTES = 1 << 30
"""`.bin` files this large or larger have their range cached (1 GiB: a scan of ~0.1 s)."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ptdp" / "token-range"


def token_range(
    indexed: IndexedDataset,
    *,
    cache_dir: Path | None = None,
    cache_min_bytes: int = CACHE_MIN_BYTES,
) -> tuple[int, int]:
    """(smallest, largest) token id of the whole `.bin`, (0, -1) when it is empty; the
    smallest is 0 for an unsigned token type, which cannot hold a negative id."""
    path = indexed.bin_path.resolve()
    stat = path.stat()
    key = {"path": str(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    cache = None
    if stat.st_size >= cache_min_bytes:
        name = hashlib.sha256(str(path).encode()).hexdigest()[:32] + ".json"
        cache = (cache_dir or default_cache_dir()) / name
        found = _read(cache, key)
        if found is not None:
            return found
    low, high = _scan(indexed.tokens)
    if cache is not None:
        _write(cache, key | {"min": low, "max": high})
    return low, high


def _scan(tokens: np.ndarray) -> tuple[int, int]:
    if not len(tokens):
        return 0, -1
    low, high = None, None
    signed = tokens.dtype.kind != "u"  # unsigned ids cannot be negative: one pass only
    for start in range(0, len(tokens), CHUNK_TOKENS):
        chunk = tokens[start : start + CHUNK_TOKENS]
        top = int(chunk.max())
        high = top if high is None else max(high, top)
        if signed:
            bottom = int(chunk.min())
            low = bottom if low is None else min(low, bottom)
    return low or 0, high


def _read(cache: Path, key: dict) -> tuple[int, int] | None:
    """The cached range if it was recorded for this very file (same path, size, mtime)."""
    try:
        record = json.loads(cache.read_text())
        if all(record.get(k) == v for k, v in key.items()):
            return int(record["min"]), int(record["max"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # no cache yet, or an unreadable one: scan again
    return None


def _write(cache: Path, record: dict) -> None:
    """Best effort, atomically (ranks may write the same record at once)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        part = cache.with_name(f"{cache.name}.{os.getpid()}.part")
        part.write_text(json.dumps(record, sort_keys=True))
        os.replace(part, cache)
    except OSError:
        pass  # a read-only home: the next start scans again
