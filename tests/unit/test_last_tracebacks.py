"""The last raw tracebacks on bad input are messages: damaged Parquet and Arrow files, a BPE
vocabulary the trainer could not allocate, a second Ctrl-C (what it lost, and the first one
saying at once that a checkpoint is coming). Each is one `ptdp CMD: ...` line, no
traceback, and the files on disk are what the message says."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ptdp import checkpoint as ckpt
from ptdp.checkpoint.manager import CheckpointManager
from ptdp.cli import main
from ptdp.data import tokenizers
from ptdp.train.step.trainer import Trainer
from tests.helpers import make_corpus
from tests.unit.test_run_dir import _cli

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

TABLE = {"text": [f"document {i}: " + "to be or not to be " * 8 for i in range(2000)]}


def _tables(root: Path) -> dict[str, Path]:
    """A Parquet file, an Arrow IPC file, an Arrow stream and a saved dataset, undamaged."""
    table = pa.table(TABLE)
    paths = {k: root / n for k, n in (("parquet", "t.parquet"), ("file", "t.arrow"))}
    pq.write_table(table, paths["parquet"], row_group_size=400)
    paths["stream"] = root / "s" / "t.arrow"
    paths["stream"].parent.mkdir()
    for key, new in (("file", pa.ipc.new_file), ("stream", pa.ipc.new_stream)):
        with pa.OSFile(str(paths[key]), "wb") as f, new(f, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=400):
                writer.write_batch(batch)
    paths["saved"] = root / "saved"
    datasets.Dataset.from_dict(TABLE).save_to_disk(str(paths["saved"]))
    return paths


def _damage(path: Path, how: str) -> None:
    if path.is_dir():  # a saved dataset: damage its Arrow data
        path = next(path.glob("*.arrow"))
    data = path.read_bytes()
    mid = len(data) // 2
    damaged = {
        "cut-in-half": data[:mid],
        "cut-short": data[:-7],
        "empty": b"",
        "bytes-flipped": data[:mid]
        + bytes(b ^ 0xFF for b in data[mid : mid + 4096])
        + data[mid + 4096 :],
        "footer-flipped": data[:-74] + bytes(b ^ 0xFF for b in data[-74:-10]) + data[-10:],
    }[how]
    path.write_bytes(damaged)


def test_damaged_tables_are_named_not_traced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    problems = []
    for kind in ("parquet", "file", "stream", "saved"):
        for how in ("cut-in-half", "cut-short", "empty", "bytes-flipped", "footer-flipped"):
            if kind == "saved" and how == "empty":
                continue
            case = tmp_path / f"{kind}-{how}"
            case.mkdir()
            path = _tables(case)[kind]
            _damage(path, how)
            for tokenizer in ("bytes", "bpe"):
                out = case / f"out-{tokenizer}" / "data"
                args = ["preprocess", "--input", str(path), "--output-prefix", str(out)]
                code = main([*args, "--tokenizer", tokenizer, "--vocab-size", "300"])
                err = capsys.readouterr().err.strip().splitlines()  # after progress bars
                said, err = f"ptdp preprocess: error: {path}", err[-1] if err else ""
                if code != 2 or not err.startswith(said) or "Traceback" in err:
                    problems.append(f"{kind} {how} {tokenizer}: exit {code}: {err[-300:]}")
                elif not any(w in err for w in ("damaged or cut short", "not an Arrow IPC")):
                    problems.append(f"{kind} {how} {tokenizer}: {err}")
                if out.with_suffix(".bin").exists():
                    problems.append(f"{kind} {how} {tokenizer}: a .bin was written")
    assert not problems, "\n".join(problems)


def test_bpe_vocabulary_is_checked_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sizes ids cannot hold, or whose table the trainer (which reserves the size asked at
    once) cannot allocate, are refused before training, naming what the corpus can teach;
    a size beyond what the corpus teaches is cut to it: the same tokenizer, no 66 GiB."""
    files = make_corpus(tmp_path / "text")
    corpus = sum(f.stat().st_size for f in files)
    arrow = _tables(tmp_path)["stream"]  # its text size is unknown until read
    capsys.readouterr()
    monkeypatch.setattr(tokenizers, "_memory_bytes", lambda: 16 * 2**30)
    teaches = f"; these inputs teach at most {corpus + 257:,} tokens;"
    for size, source, why in (
        (2**31, tmp_path / "text", "the most token ids a dataset can store (int32)" + teaches),
        (2**64, tmp_path / "text", "the most token ids a dataset can store (int32)" + teaches),
        (10**9, arrow, "reserve 66.0 GiB, more than this machine's 16.0 GiB of memory"),
    ):
        out = tmp_path / f"out-{size}" / "data"
        args = ["--input", str(source), "--output-prefix", str(out)]
        assert main(["preprocess", *args, "--vocab-size", str(size)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ptdp preprocess: error: vocab_size {size:,}"), err
        assert why in err and "use a smaller --vocab-size" in err, err
        assert list(out.parent.iterdir()) == []  # no tokenizer.json, no data
    made = {}
    for size in (4096, 10**9):
        out = tmp_path / f"fits-{size}" / "data"
        args = ["--input", str(tmp_path / "text"), "--output-prefix", str(out)]
        assert main(["preprocess", *args, "--vocab-size", str(size)]) == 0
        made[size] = (out.parent / "tokenizer.json").read_bytes()
    assert made[4096] == made[10**9]


def _interrupt(
    monkeypatch: pytest.MonkeyPatch, at: int, twice: bool, in_save: bool = False
) -> None:
    """SIGINT in step `at`, and a second one in that step or in the save it asked for."""
    real_step, real_save = Trainer.train_step, CheckpointManager.save

    def train_step(self: Trainer):
        if self.step + 1 == at:
            signal.raise_signal(signal.SIGINT)
            if twice and not in_save:
                signal.raise_signal(signal.SIGINT)
        return real_step(self)

    def save(self: CheckpointManager, step: int) -> Path:
        if in_save and step == at:
            signal.raise_signal(signal.SIGINT)
        return real_save(self, step)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(CheckpointManager, "save", save)


NOTICE = (
    "SIGINT received: the step in progress finishes, a checkpoint of it is saved, then the "
    "run stops; Ctrl-C again stops at once, losing the steps since the last checkpoint"
)


@pytest.mark.parametrize(
    ("save_interval", "in_save", "lost"),
    [
        (2, False, "in step 3, before the checkpoint the first one asked for was written; the "
                   "last checkpoint is {root}/step_00000002 (step 2), no completed step is lost; "
                   "--resume continues from it"),
        (0, False, "in step 3, before the checkpoint the first one asked for was written; no "
                   "checkpoint was saved, so all 2 completed steps are lost"),
        (2, True, "while the checkpoint of step 3 that the first one asked for was being "
                  "written (it is not published); the last checkpoint is {root}/step_00000002 "
                  "(step 2), step 3 is lost; --resume continues from it"),
    ],
    ids=["mid-step", "mid-step-no-checkpoint", "mid-save"],
)  # fmt: skip
def test_a_second_ctrl_c_says_what_it_lost(
    save_interval: int,
    in_save: bool,
    lost: str,
    tiny_data: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = tmp_path / "run"
    _interrupt(monkeypatch, at=3, twice=True, in_save=in_save)
    args = ["--train.steps", "8", "--train.save_interval", str(save_interval)]
    assert main(_cli(tiny_data, run, *args)) == 130
    out, err = capsys.readouterr()
    assert NOTICE in out
    root = ckpt.checkpoint_root(run)
    said = "ptdp train: interrupted: a second SIGINT stopped the run at once "
    assert err == said + lost.format(root=root) + "\n", err
    assert _published(run) == (["step_00000002"] if save_interval else [])


def _published(run: Path) -> list[str]:
    root = ckpt.checkpoint_root(run)
    return sorted(p.name for p in root.glob("step_*") if not p.name.endswith(".tmp"))


def test_the_first_ctrl_c_says_at_once_that_a_checkpoint_is_coming(
    tiny_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    run = tmp_path / "run"
    _interrupt(monkeypatch, at=3, twice=False)
    assert main(_cli(tiny_data, run, "--train.steps", "8")) == 130
    out = capsys.readouterr().out
    notice = out.index(NOTICE)
    assert notice < out.index("step      3 | loss")  # said before the step ended
    assert out.index("interrupted by SIGINT at step 3; saved checkpoint") > notice
    assert _published(run) == ["step_00000003"]
