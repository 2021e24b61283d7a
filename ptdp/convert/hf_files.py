"""The weight files of a Hugging Face model directory, checked before they are read.

A safetensors file is an 8-byte little-endian header length n, an n-byte JSON header
giving each tensor's `data_offsets` [begin, end) in the data that follows, then the
data. So whether a file is whole is known from its header and its size alone, without
reading the tensors: a download or copy cut short is named as truncated, with the sizes,
instead of surfacing as the reader's "incomplete metadata" error. Used by `ptdp convert
--from hf` and `checkpoint.init_from` (both through ptdp/convert/hf.py's reader), which
also compare the tensors' shapes in the headers with what config.json implies
(ptdp/convert/hf_check.py). And the export's folder: empty, new, or --overwrite.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, NoReturn

import torch

from ptdp.config.sections import ModelConfig
from ptdp.convert.hf_check import check_config_numbers
from ptdp.convert.hf_config import model_config_from_hf
from ptdp.errors import CheckpointError, ConfigError
from ptdp.outputs import check_output_dir

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = f"{WEIGHTS_FILE}.index.json"
MAX_HEADER_BYTES = 100_000_000
"""The safetensors format's own limit on the JSON header."""
FIX = "download or export the model again"


EXPORTED = (WEIGHTS_FILE, "config.json", "tokenizer.json", "tokenizer_config.json")
"""The files `ptdp convert --to hf` writes (with --overwrite, only these are replaced)."""


def check_export_dir(out: Path, overwrite: bool) -> None:
    """OUT is empty or new; with `overwrite`, files there are allowed (only EXPORTED are
    replaced, the others left as they are)."""
    check_output_dir(out, "OUT")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ConfigError(
            f"OUT = '{out}' already holds files ({shown}), which an export would replace or "
            "mix with; choose a new or empty directory, or pass --overwrite to replace "
            f"{', '.join(EXPORTED)} there (other files are left alone)"
        )


def read_hf_json(directory: Path) -> dict[str, Any]:
    """A directory's config.json as a dict; a missing or unreadable one is named."""
    file = directory / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{directory} has no config.json: not a Hugging Face model")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _unreadable(file, exc) from None
    if not isinstance(config, dict):
        raise _unreadable(file, TypeError("not a JSON object"))
    return config


def read_hf_config(directory: Path, seq_length: int = 0) -> ModelConfig:
    """The model of a directory's config.json; a missing or unreadable one is named, and
    one whose heads do not divide its width, or key/value heads its heads, is refused."""
    config = read_hf_json(directory)
    check_config_numbers(directory, config)
    try:
        return model_config_from_hf(config, seq_length)
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, ZeroDivisionError) as exc:
        raise _unreadable(directory / "config.json", exc) from None


def _unreadable(file: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"cannot read the Hugging Face model config {file} ({type(exc).__name__}: {exc}); "
        "is it a transformers config.json (save_pretrained output)?"
    )


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of `directory` (one, or those its index names), each present
    and whole; [] when it has neither (a pytorch_model.bin, or no weights at all)."""
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"].values()
            files = [directory / str(name) for name in sorted(set(names))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"cannot read the weights index {index} ({type(exc).__name__}: {exc}); it "
                f"must map each tensor name to its file under 'weight_map': {FIX}"
            ) from None
    else:
        return []
    for file in files:
        check_safetensors(file)
    return files


def weight_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers (files checked whole first) or
    pytorch_model.bin (mapped, not read); {} when there are no weights."""
    files = weight_files(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with file.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        shapes |= {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    if not files and (directory / "pytorch_model.bin").is_file():
        state = torch.load(directory / "pytorch_model.bin", mmap=True, weights_only=True)
        shapes = {k: tuple(v.shape) for k, v in state.items()}
    return shapes


def check_safetensors(file: Path) -> None:
    """Refuse a missing, truncated or malformed safetensors file, naming it."""
    if not file.is_file():
        raise CheckpointError(f"Hugging Face weights file {file} is missing: {FIX}")
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            _truncated(file, size, 8, "the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            _malformed(file, f"its header length {n} is not that of a safetensors file")
        if size < 8 + n:
            _truncated(file, size, 8 + n, f"its {n}-byte header")
        try:
            header = json.loads(f.read(n))
            ends = [
                int(info["data_offsets"][1])
                for name, info in header.items()
                if name != "__metadata__"
            ]
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            _malformed(file, f"its header is not a safetensors header ({exc})")
    want = 8 + n + max(ends, default=0)
    if size < want:
        _truncated(file, size, want, "the tensors its header lists")


def _truncated(file: Path, size: int, want: int, what: str) -> NoReturn:
    raise CheckpointError(
        f"Hugging Face weights file {file} is truncated ({size} of {want} bytes, the end of "
        f"{what}): the download or copy was cut short; {FIX}"
    )


def _malformed(file: Path, problem: str) -> NoReturn:
    raise CheckpointError(f"Hugging Face weights file {file} is damaged: {problem}; {FIX}")
