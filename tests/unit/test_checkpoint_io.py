"""Checkpoint file I/O (ptdp/checkpoint/summed.py, writer.py): the CRC-32 computed as the
files are written equals the one read back from disk, with several writer threads; an
asynchronous save writes one snapshot copy made before `start_checkpoint` returns, and
nothing else; a synchronous save writes the live tensors."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ptdp.checkpoint import summed, writer
from ptdp.checkpoint.boxes import Boxes, TensorPlace, placed_boxes
from ptdp.checkpoint.store import CHECKSUMS, checksum
from ptdp.config.sections import RunConfig
from ptdp.errors import CheckpointError


def _state() -> dict:
    """Plain tensors, the optimizer's boxes of a flat range (views of `flat`), scalars."""
    flat = torch.arange(40 * 30, dtype=torch.float32)
    place = TensorPlace((40, 30), (40, 30), (0, 0), (40, 30))
    return {
        "model/a": torch.randn(64, 32),
        "model/b": torch.arange(1000, dtype=torch.float32),
        "model/c": torch.randn(7, 3, 5),
        "optimizer/state/w/exp_avg": Boxes((40, 30), placed_boxes(place, flat[5:1100], 5)),
        "step": 3,
        "config": {"a": [1, 2]},
    }


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_crc_on_write_equals_the_files_crc(
    tmp_path: Path, threads: int, asynchronous: bool
) -> None:
    pending = writer.start_checkpoint(
        tmp_path, 3, _state(), RunConfig(), b"{}", threads=threads, asynchronous=asynchronous
    )
    step_dir = pending.finish()
    sums = json.loads((step_dir / CHECKSUMS).read_text())
    shards = sorted(step_dir.glob("__0_*.distcp"))
    assert len(shards) == threads  # one file per writer thread
    for f in shards:
        assert sums[f.name] == checksum(f), f.name


def test_sums_come_from_the_writes_not_a_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording a save reads no shard back for its checksum (only tokenizer.json)."""
    read: list[str] = []

    def counted(path: Path) -> dict[str, int]:
        read.append(Path(path).name)
        return checksum(path)

    monkeypatch.setattr(writer, "checksum", counted)
    writer.start_checkpoint(tmp_path, 1, _state(), RunConfig(), b"{}", threads=2).finish()
    assert read == ["tokenizer.json"]


def test_async_save_writes_one_snapshot_taken_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background thread writes exactly the tensors of the one copy made on the
    training thread: changing the live tensors at once changes nothing saved."""
    state = _state()
    live = state["model/a"].clone()
    written: list[dict] = []
    call = writer._Write.__call__

    def spy(self, s: dict, group) -> None:
        written.append(s)
        call(self, s, group)

    monkeypatch.setattr(writer._Write, "__call__", spy)
    pending = writer.start_checkpoint(
        tmp_path, 2, state, RunConfig(), None, asynchronous=True, threads=2
    )
    state["model/a"].add_(1.0)  # training goes on
    for _, data in state["optimizer/state/w/exp_avg"].boxes:
        data.zero_()
    step_dir = pending.finish()
    (copy,) = written
    assert copy["model/a"].untyped_storage().data_ptr() != state["model/a"].data_ptr()
    for (_, a), (_, b) in zip(
        copy["optimizer/state/w/exp_avg"].boxes, state["optimizer/state/w/exp_avg"].boxes
    ):
        assert a.untyped_storage().nbytes() == a.nbytes  # compact: only the box's elements
        assert a.data_ptr() != b.data_ptr()
    loaded = {"model/a": torch.empty(64, 32), "model/b": torch.empty(1000)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    assert torch.equal(loaded["model/a"], live)
    assert torch.equal(loaded["model/b"], torch.arange(1000, dtype=torch.float32))


def test_sync_save_boxes_are_views_of_the_live_tensor() -> None:
    """No copy on the training thread for a synchronous save: the boxes view the range."""
    flat = torch.arange(40 * 30, dtype=torch.float32)
    place = TensorPlace((40, 30), (40, 30), (0, 0), (40, 30))
    for _, data in placed_boxes(place, flat[5:1100], 5):
        assert data.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failing_writer_thread_fails_the_save_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asynchronous: bool
) -> None:
    """DCP's extra writer threads only print their exceptions: a disk full in one of them
    (not the thread that called the save) must still fail the save, name the disk, and
    leave no step directory or .tmp behind."""
    real_save = torch.save
    caller: list[threading.Thread] = []

    def save(obj, f, *args, **kwargs):
        if threading.current_thread() is not caller[0] and hasattr(f, "write"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    pending = writer.start_checkpoint(
        tmp_path, 3, {}, RunConfig(), b"{}", threads=1, asynchronous=False
    )
    pending.finish()  # one thread: the caller's, so it writes
    caller.append(threading.main_thread())
    with pytest.raises(CheckpointError, match="disk is full"):
        writer.start_checkpoint(
            tmp_path, 4, _state(), RunConfig(), b"{}", threads=3, asynchronous=asynchronous
        ).finish()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003"]


def test_after_close_no_writer_stream_is_open_or_opened(tmp_path: Path) -> None:
    """The mechanism a failed save relies on before it removes its .tmp: `close()` waits
    for a stream another thread still writes, and refuses any new one."""
    fs = summed._SummingFileSystem()
    opened, release = threading.Event(), threading.Event()

    def slow_writer() -> None:
        with fs.create_stream(tmp_path / "a.distcp", "wb") as f:
            opened.set()
            release.wait(5)
            f.write(b"x" * 10)

    writer_thread = threading.Thread(target=slow_writer)
    writer_thread.start()
    opened.wait(5)
    closer = threading.Thread(target=fs.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the open stream
    release.set()
    closer.join(5)
    writer_thread.join(5)
    assert not closer.is_alive() and fs.sums["a.distcp"]["bytes"] == 10
    with pytest.raises(OSError, match="another writer failed"):
        with fs.create_stream(tmp_path / "b.distcp", "wb"):
            pass
    assert not (tmp_path / "b.distcp").exists()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_each_save_records_its_stall_as_a_checkpoint_event(
    tiny_data: str, tmp_path: Path, asynchronous: bool
) -> None:
    """Every save is a `checkpoint` event (events.jsonl) with the training thread's stall;
    metrics.jsonl keeps one record per logged step."""
    from ptdp.train.faults.events import read_events
    from ptdp.train.run import train
    from tests.helpers import tiny_config

    train_section = {"steps": 4, "save_interval": 2, "async_save": asynchronous}
    train(tiny_config(tiny_data, tmp_path / "run", train=train_section))
    saves = [e for e in read_events(tmp_path / "run") if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [2, 4]
    assert all(e["stall_s"] > 0 for e in saves)  # measured, not asserted against a time
    # With async_save both writes run in a thread (the run waits for the last at its end).
    assert [e["background"] for e in saves] == [asynchronous, asynchronous]
    assert saves[-1]["checkpoint"].endswith("step_00000004")
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3, 4]


@pytest.mark.parametrize("threads", [1, 2])
def test_each_copy_a_save_makes_is_freed_once_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """DCP keeps every tensor of a file referenced until the file closes: the copies of the
    optimizer's chunks (views of one flat tensor) are freed as the next is asked for, so at
    most one per writer thread holds memory; the live tensors are untouched and the saved
    values are right."""
    flat = torch.arange(40 * 30, dtype=torch.float32)
    place = TensorPlace((40, 30), (40, 30), (0, 0), (40, 30))
    part = flat[5:1100]  # elements 5 to 1099 of the global tensor: three boxes
    state = {"optimizer/state/w/exp_avg": Boxes((40, 30), placed_boxes(place, part, 5))}
    state["model/a"] = live = torch.randn(64, 32)
    given: list[torch.Tensor] = []
    resolve = writer.LazySavePlanner.resolve_data

    def spy(self, item):
        data = resolve(self, item)
        if isinstance(data, torch.Tensor):
            given.append(data)
        return data

    monkeypatch.setattr(writer.LazySavePlanner, "resolve_data", spy)
    before = live.clone()
    step_dir = writer.start_checkpoint(
        tmp_path, 1, state, RunConfig(), b"{}", threads=threads
    ).finish()
    copies = [t for t in given if t is not live]
    assert len(copies) == len(state["optimizer/state/w/exp_avg"].boxes) > threads
    held = [t for t in copies if t.untyped_storage().nbytes() > 0]
    assert len(held) <= threads  # the last copy of each thread, until the save ends
    assert any(t is live for t in given) and torch.equal(live, before)
    assert flat.untyped_storage().nbytes() == 40 * 30 * 4  # the live flat tensor is whole
    loaded = {"model/a": torch.empty(64, 32)}
    loaded["optimizer/state/w/exp_avg"] = torch.zeros(40, 30)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(step_dir), no_dist=True)
    assert torch.equal(loaded["optimizer/state/w/exp_avg"].flatten()[5:1100], part)
    assert torch.equal(loaded["model/a"], live)
