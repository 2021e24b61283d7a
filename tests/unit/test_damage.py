"""Damaged run directories, data files and imports, tried as a user would (issue 21, item
5): a lost `latest` costs no work, damage is refused with the file named, and a refused
run changes nothing in its run directory. The table of single bad inputs and their
messages is tests/unit/test_bad_inputs.py; this file holds what needs more than one run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import ptdp.checkpoint as ckpt
from ptdp.cli import main
from ptdp.convert.hf import export_hf
from ptdp.convert.hf_files import check_safetensors
from ptdp.data import token_range as token_range_module
from ptdp.data.indexed import IndexedDataset, IndexedWriter
from ptdp.data.token_range import token_range
from ptdp.errors import CheckpointError
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import train
from tests.helpers import tiny_config

ONE = LaunchEnv(rank=0, world_size=1, local_rank=0)


@pytest.fixture(scope="module")
def saved_run(tiny_data: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("damage") / "run"
    train(_config(tiny_data, run, 4), env=ONE)
    root = ckpt.checkpoint_root(run)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    return run


def _config(data: str, run: Path, steps: int):
    return tiny_config(data, run, train={"steps": steps, "save_interval": 2})


def _snapshot(run: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and modification time, by relative path."""
    return {
        str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


def _damaged_copy(saved: Path, tmp_path: Path, latest: str | None) -> Path:
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    pointer = ckpt.checkpoint_root(run) / ckpt.LATEST
    pointer.unlink() if latest is None else pointer.write_text(latest)
    return run


@pytest.mark.parametrize(
    "latest", [None, "", " \n", "../../x\n"], ids=["missing", "empty", "blank", "damaged"]
)
def test_lost_latest_resumes_from_the_newest_complete_checkpoint(
    latest: str | None,
    saved_run: Path,
    tiny_data: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = _damaged_copy(saved_run, tmp_path, latest)
    before = _snapshot(run)
    # Without --resume: refused, and not one byte of the run directory changes.
    with pytest.raises(CheckpointError, match="already holds checkpoints; pass --resume"):
        train(_config(tiny_data, run, 6), env=ONE)
    assert _snapshot(run) == before
    # With --resume: from step 4, the newest complete one, saying why.
    result = train(_config(tiny_data, run, 6), resume=True, env=ONE)
    assert (result.start_step, result.final_step) == (4, 6)
    out = capsys.readouterr().out
    assert (
        "latest is missing, empty or damaged: continued from the newest complete checkpoint, "
        in out
    )
    assert "step_00000004" in out
    root = ckpt.checkpoint_root(run)
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000006"  # written again
    assert (
        _snapshot(run)["checkpoints/step_00000004/__0_0.distcp"]
        == (before["checkpoints/step_00000004/__0_0.distcp"])
    )


def test_lost_latest_skips_a_damaged_newer_checkpoint(
    saved_run: Path, tiny_data: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newest step directory lacks its checksums: it is skipped, named, and the run
    resumes from the one before it."""
    run = _damaged_copy(saved_run, tmp_path, None)
    newest = ckpt.checkpoint_root(run) / "step_00000004"
    (newest / "checksums.json").unlink()
    assert ckpt.find_checkpoint(run) == newest.with_name("step_00000002")
    result = train(_config(tiny_data, run, 3), resume=True, env=ONE)
    assert result.start_step == 2
    out = capsys.readouterr().out
    assert "continued from the newest complete checkpoint, step_00000002" in out
    assert f"skipped step_00000004: checkpoint file {newest / 'checksums.json'} is missing" in out


def test_missing_checksums_is_refused_everywhere(saved_run: Path, tmp_path: Path) -> None:
    """With `latest` naming it, a checkpoint without checksums.json is loaded by nothing:
    not by --resume (test_bad_inputs), a full load (convert, sample), nor inspect."""
    run = _damaged_copy(saved_run, tmp_path, "step_00000004\n")
    step_dir = ckpt.checkpoint_root(run) / "step_00000004"
    (step_dir / "checksums.json").unlink()
    before = _snapshot(run)
    for load in (
        lambda: ckpt.find_checkpoint(run),
        lambda: ckpt.load_checkpoint(step_dir),
        lambda: ckpt.describe_checkpoint(run),
        lambda: export_hf(step_dir, tmp_path / "hf"),
    ):
        with pytest.raises(CheckpointError) as info:
            load()
        assert f"{step_dir / 'checksums.json'} is missing" in str(info.value)
    assert _snapshot(run) == before


def test_resume_equals_the_uninterrupted_run(
    saved_run: Path, tiny_data: str, tmp_path: Path
) -> None:
    """Resuming after `latest` was lost costs nothing: the weights at step 6 equal those of
    a run resumed through an intact `latest`."""
    damaged = _damaged_copy(saved_run, tmp_path / "a", None)
    intact = _damaged_copy(saved_run, tmp_path / "b", "step_00000004\n")
    for run in (damaged, intact):
        train(_config(tiny_data, run, 6), resume=True, env=ONE)
    a, b = (ckpt.load_checkpoint(ckpt.find_checkpoint(r))["model"] for r in (damaged, intact))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------------- token ids


def _dataset(prefix: Path, docs: list[list[int]], dtype=np.uint16) -> IndexedDataset:
    with IndexedWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    return IndexedDataset(prefix)


def test_token_range_reads_every_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_range_module, "CHUNK_TOKENS", 7)
    docs = [[1, 2, 3] * 10, [4] * 20 + [900], [5] * 13]  # the largest id in a middle chunk
    assert token_range(_dataset(tmp_path / "d", docs)) == (0, 900)  # unsigned: min 0
    signed = _dataset(tmp_path / "s", [[3] * 30 + [-2] + [8] * 10], np.int32)
    assert token_range(signed) == (-2, 8)


def test_token_range_is_cached_by_size_and_mtime(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = _dataset(tmp_path / "d", [[1, 2, 3, 40]])
    assert token_range(data, cache_dir=cache, cache_min_bytes=10**9) == (0, 40)
    assert not cache.exists()  # small files are scanned every time
    assert token_range(data, cache_dir=cache, cache_min_bytes=0) == (0, 40)
    (record,) = cache.iterdir()
    saved = json.loads(record.read_text())
    assert (saved["min"], saved["max"], saved["bytes"]) == (0, 40, 8)
    # A later start reads the record, not the file: a doctored record shows it.
    record.write_text(json.dumps(saved | {"max": 77}))
    assert token_range(data, cache_dir=cache, cache_min_bytes=0) == (0, 77)
    # A .bin changed in place (same size, new mtime) is scanned again.
    tokens = np.memmap(data.bin_path, dtype=np.uint16, mode="r+")
    tokens[0] = 500
    tokens.flush()
    del tokens
    os.utime(data.bin_path, ns=(saved["mtime_ns"] + 10**9,) * 2)
    again = token_range(IndexedDataset(tmp_path / "d"), cache_dir=cache, cache_min_bytes=0)
    assert again == (0, 500)


# ---------------------------------------------------------------------- safetensors


def test_truncated_safetensors_named_at_every_cut(saved_run: Path, tmp_path: Path) -> None:
    weights = export_hf(saved_run, tmp_path / "hf").path / "model.safetensors"
    check_safetensors(weights)  # whole
    data = weights.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    for keep, what in ((0, "8-byte header length"), (header - 1, "header"), (len(data) - 1, "")):
        cut = tmp_path / f"cut{keep}.safetensors"
        cut.write_bytes(data[:keep])
        with pytest.raises(CheckpointError) as info:
            check_safetensors(cut)
        assert f"is truncated ({keep} of " in str(info.value) and what in str(info.value)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="header length .* is not that of a safetensors"):
        check_safetensors(junk)


# ---------------------------------------------------------------------- the command line


def _cli_cases(tmp: Path, saved: Path) -> list[tuple[list[str], str]]:
    (tmp / "bad.toml").write_text("[model]\nhidden_size = [32]\n")
    (tmp / "hw.toml").write_text("[device]\nkind = 'a100'\nmemory_gib = 80\n")
    (tmp / "a_file").write_text("")
    bad_prompt = "ab" + b"\xff".decode("utf-8", "surrogateescape")
    model = ["--model", "gpt-1.7b"]
    return [
        (["simulate", *model, "--gpus", "0", "--out", str(tmp / "sim")], "world size 0"),
        (["plan", *model, "--gpus", "-1", "--global-batch", "64"], "--gpus -1"),
        (
            ["plan", *model, "--gpus", "8", "--train.global_batch_size", "0"],
            "global_batch_size = 0",
        ),
        (["plan", *model, "--gpus", "8", "--global-batch", "64", "--top", "0"], "--top 0"),
        (["simulate", *model, "--device", str(tmp / "hw.toml")], "memory_bandwidth_gb_s"),
        (["simulate", *model, "--out", str(tmp / "a_file")], "is a file, not a directory"),
        (["train", "--config", str(tmp / "bad.toml"), "--dry-run"], "hidden_size = [32]"),
        (["generate", "--checkpoint", str(saved), "--max-new-tokens", "0"], "1 or more"),
        (["generate", "--checkpoint", str(saved), "--prompt", bad_prompt], "not valid UTF-8"),
        (["generate", "--checkpoint", str(saved), "--pp", "0"], "--pp 0"),
        (["generate", "--checkpoint", str(saved), "--device", "tpu"], "device 'tpu'"),
        (["inspect", str(tmp / "a_file")], "no checkpoint found"),
        (["convert", "--to", "hf", str(saved), str(tmp / "a_file" / "x")], "is a file"),
        (
            ["preprocess", "--input", str(tmp / "bad.toml"), "--output-prefix", "/proc/x/y"],
            "--output-prefix = '/proc/x/y' cannot be written",
        ),
    ]


def test_cli_names_bad_values_without_a_traceback(
    saved_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each as a user types it: exit code 2 and one line naming the value, no traceback."""
    for args, message in _cli_cases(tmp_path, saved_run):
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert err.startswith(f"ptdp {args[0]}: error: ") and message in err, (args, err)
        assert "Traceback" not in err
