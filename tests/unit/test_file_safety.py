"""Your files: what ptdp writes, refuses to write, and keeps (docs/fault-tolerance.md, "Your
files"). One test per class, each trying several members and comparing the files on disk
before and after, byte for byte:

- nothing is written outside what a command was asked to write (foreign files, empty or
  directory-like output paths, the --config file, the umask's permissions);
- retention after a rollback never deletes the checkpoint resumed from;
- a full disk while writing metrics, events, data or a checkpoint leaves nothing partial
  (a real small tmpfs where the machine lets a user mount one, else a write hook);
- a Hugging Face directory whose config.json disagrees with its weights is refused before
  any conversion, and generation checks the checkpoint's tokenizer.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.cli import main
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.convert.hf import export_hf, import_hf
from ptdp.data.preprocess import preprocess
from ptdp.data.tokenizers import ByteTokenizer
from ptdp.errors import CheckpointError, ConfigError, PtdpError
from ptdp.model.gpt import GPT
from ptdp.parallel.comm import Group
from ptdp.parallel.env import LaunchEnv
from ptdp.sample import sample_from_checkpoint
from ptdp.train.run import train
from tests.helpers import LLAMA, make_corpus, tiny_config

pytest.importorskip("safetensors", reason="needs safetensors (pip install .[hf])")

ROOT = Path(__file__).resolve().parents[2]
ONE = LaunchEnv(rank=0, world_size=1, local_rank=0)
SHAPE = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_length": 16}


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` by relative path: the SHA-256 of its bytes."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".filler"
    }


def _model(vocab: int, **options: object) -> ModelConfig:
    return apply_updates(RunConfig(), {"model": SHAPE | {"vocab_size": vocab} | options}, "t").model


def _checkpoint(run: Path, cfg: ModelConfig, tokenizer: Path | None = None) -> Path:
    """A step-1 checkpoint of a seeded model, recording the byte tokenizer or `tokenizer`."""
    state = {
        "model": ckpt.full_model_state([GPT(cfg, seed=3)], Group.single()),
        "step": 1,
        "tokenizer": "tokenizer.json" if tokenizer else "bytes",
    }
    return ckpt.save_checkpoint(run, 1, state, replace(RunConfig(), model=cfg), tokenizer)


# ---------------------------------------------------------------------- 4: your files


def test_nothing_is_written_outside_what_was_asked(
    tiny_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    corpus = make_corpus(tmp_path / "text", docs=3)
    hf = tmp_path / "hf"  # a Hugging Face model folder: none of it written by ptdp
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}\n')
    (hf / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}\n')
    (hf / "README.md").write_text("a model card\n")
    (cwd / "notes.txt").write_text("the user's\n")
    before = {d: _snapshot(d) for d in (hf, cwd)}

    # Preprocessing never replaces a file it did not write, and never writes into a
    # directory named as a prefix, or into the current one for an empty prefix.
    refusals = [
        (hf / "data", "bytes", "tokenizer.json: already there and not written by"),
        (hf / "data", "bpe", "tokenizer.json: already there and not written by"),
        (hf / "config", "bytes", "config.json is already there and not written by"),
        ("", "bytes", "--output-prefix is empty"),
        (f"{hf}/", "bytes", "names a directory"),
        (str(hf), "bytes", "names a directory"),
        ("out/", "bytes", "names a directory"),
    ]
    for prefix, tokenizer, message in refusals:
        with pytest.raises(PtdpError, match=message):
            preprocess(corpus, prefix, tokenizer, vocab_size=300, progress=False)
    # An empty run directory is refused before anything runs.
    with pytest.raises(ConfigError, match="train.run_dir is empty"):
        train(tiny_config(tiny_data, ""), env=ONE)  # type: ignore[arg-type]

    # `convert --to hf` into a folder holding files: refused unless told to overwrite.
    cfg = _model(257, **LLAMA)
    run = tmp_path / "run"
    _checkpoint(run, cfg)
    with pytest.raises(ConfigError, match="already holds files .*--overwrite"):
        export_hf(run, hf)
    assert main(["convert", "--to", "hf", str(run), str(hf)]) == 2
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("kept\n")
    (other / "config.json").write_text("{}\n")
    notes = _snapshot(other)["notes.txt"]
    assert main(["convert", "--to", "hf", str(run), str(other), "--overwrite"]) == 0
    assert _snapshot(other)["notes.txt"] == notes
    assert json.loads((other / "config.json").read_text())["model_type"] == "llama"
    # `convert --from hf` into a folder holding files: refused.
    with pytest.raises(ConfigError, match="already holds files"):
        import_hf(other, hf)
    assert {d: _snapshot(d) for d in (hf, cwd)} == before

    # The umask's permissions on what is exported and preprocessed.
    old = os.umask(0o027)
    try:
        export_hf(run, tmp_path / "exported")
        preprocess(corpus, tmp_path / "data" / "corpus", "bytes", progress=False)
    finally:
        os.umask(old)
    written = [*(tmp_path / "exported").iterdir(), *(tmp_path / "data").iterdir()]
    assert len(written) == 6
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == {
        p.name: oct(0o640) for p in written
    }
    # Preprocessing again into its own files is allowed (it wrote them).
    preprocess(corpus, tmp_path / "data" / "corpus", "bytes", progress=False)

    # The --config file passed to `ptdp train` is never rewritten, even when it is the run
    # directory's own config.toml (as `convert --from hf` suggests).
    imported = tmp_path / "imported"
    assert main(["convert", "--from", "hf", str(tmp_path / "exported"), str(imported)]) == 0
    config = imported / "config.toml"
    kept = config.read_bytes()
    args = ["train", "--config", str(config), "--resume", "--data.path", tiny_data]
    args += ["--train.steps", "1", "--train.micro_batch_size", "2", "--train.device", "cpu"]
    args += ["--train.global_batch_size", "2", "--train.progress", "false"]
    assert main(args) == 0
    assert config.read_bytes() == kept
    assert ckpt.find_checkpoint(imported).name == "step_00000001"
    assert _snapshot(cwd) == before[cwd]


# ---------------------------------------------------------------------- 5: retention


@pytest.fixture(scope="module")
def saved_run(tiny_data: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8-step run keeping three checkpoints: steps 4, 6 and 8."""
    run = tmp_path_factory.mktemp("retention") / "run"
    train(_retained(tiny_data, run, 8, keep=3), env=ONE)
    names = sorted(p.name for p in ckpt.checkpoint_root(run).iterdir())
    assert names == ["latest", "step_00000004", "step_00000006", "step_00000008"]
    return run


def _retained(data: str, run: Path, steps: int, keep: int) -> RunConfig:
    train = {"steps": steps, "save_interval": 2, "keep_checkpoints": keep}
    return tiny_config(data, run, train=train)


def _truncate_a_shard(step_dir: Path) -> None:
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])


def test_retention_never_deletes_the_state_resumed_from(
    saved_run: Path, tiny_data: str, tmp_path: Path
) -> None:
    # 1. `latest` moved back by hand to step 4, resumed keeping two: the checkpoints of
    #    steps 6 and 8 are set aside whole; step 4 is kept beside the new step 6.
    run = tmp_path / "back" / "run"
    shutil.copytree(saved_run, run)
    root = ckpt.checkpoint_root(run)
    (root / ckpt.LATEST).write_text("step_00000004\n")
    before = _snapshot(root)
    result = train(_retained(tiny_data, run, 6, keep=2), resume=True, env=ONE)
    assert (result.start_step, result.final_step) == (4, 6)
    aside = root / "abandoned" / "after_step_00000004"
    after = _snapshot(root)
    for name, digest in before.items():
        if name.startswith(("step_00000006/", "step_00000008/")):
            assert after[f"abandoned/after_step_00000004/{name}"] == digest, name
        elif name.startswith("step_00000004/"):
            assert after[name] == digest, name  # the one resumed from: kept, unchanged
    assert sorted(p.name for p in root.iterdir()) == [
        "abandoned", "latest", "step_00000004", "step_00000006",
    ]  # fmt: skip
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000006"
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] != "checkpoint"]  # the saves' own records
    assert resumed[-1]["set_aside"] == [str(aside / "step_00000006"), str(aside / "step_00000008")]

    # 2. A launcher restart skips a damaged newest checkpoint (step 8): it is set aside as
    #    it is, never counted, and step 6 (resumed from) is kept beside the new step 7.
    run = tmp_path / "damaged" / "run"
    shutil.copytree(saved_run, run)
    root = ckpt.checkpoint_root(run)
    _truncate_a_shard(root / "step_00000008")
    before = _snapshot(root)
    restart = replace(ONE, restart=1)
    result = train(_retained(tiny_data, run, 7, keep=2), resume=True, env=restart)
    assert (result.start_step, result.final_step) == (6, 7)
    after = _snapshot(root)
    for name, digest in before.items():
        if name.startswith("step_00000008/"):
            assert after[f"abandoned/after_step_00000006/{name}"] == digest, name
        elif name.startswith("step_00000006/"):
            assert after[name] == digest, name
    assert sorted(p.name for p in root.iterdir()) == [
        "abandoned", "latest", "step_00000006", "step_00000007",
    ]  # fmt: skip

    # 3. A damaged checkpoint between whole ones is not one of the `keep` newest: keeping
    #    three after step 10 keeps steps 10, 8 and 4 whole, and leaves the damaged 6.
    run = tmp_path / "middle" / "run"
    shutil.copytree(saved_run, run)
    root = ckpt.checkpoint_root(run)
    _truncate_a_shard(root / "step_00000006")
    before = _snapshot(root)
    train(_retained(tiny_data, run, 10, keep=3), resume=True, env=ONE)
    after = _snapshot(root)
    assert {k: v for k, v in after.items() if k in before and k != "latest"} == {
        k: v for k, v in before.items() if k != "latest"
    }
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step_00000004", "step_00000006", "step_00000008", "step_00000010",
    ]  # fmt: skip


# ---------------------------------------------------------------------- 6: a full disk


def _tmpfs_works(where: Path) -> bool:
    """Whether this machine lets a user mount a tmpfs in a namespace of its own."""
    if os.environ.get("PTDP_TEST_NO_TMPFS") or not shutil.which("unshare"):
        return False
    where.mkdir(parents=True, exist_ok=True)
    probe = ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{where}'"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


def _fill_tmpfs(disk: Path) -> Callable[[int | None], None]:
    """fill(n): a filler file takes all of the tmpfs but n bytes (whole pages); None: empty."""
    filler = disk / ".filler"

    def fill(leave: int | None) -> None:
        filler.unlink(missing_ok=True)
        if leave is None:
            return
        with filler.open("wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        os.truncate(filler, max(filler.stat().st_size - leave, 0))

    return fill


@contextmanager
def _write_hook(disk: Path) -> Iterator[Callable[[int | None], None]]:
    """Without a tmpfs: a disk of the bytes under `disk` when filled plus `leave`; writes
    there (Python file objects, os.write) that it cannot hold write what fits, then raise
    ENOSPC. Removing files frees their bytes, as on a disk."""
    capacity: list[int | None] = [None]
    fds: set[int] = set()
    real = {"open": io.open, "os_open": os.open, "os_write": os.write, "os_close": os.close}

    def used() -> int:
        return sum(p.stat().st_size for p in disk.rglob("*") if p.is_file())

    def take(n: int) -> int:
        return n if capacity[0] is None else max(0, min(n, capacity[0] - used()))

    class Limited(io.FileIO):
        def write(self, b) -> int:
            data = bytes(b)
            k = take(len(data))
            if k < len(data):
                super().write(data[:k])
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(data)

    def mine(file: object) -> bool:
        return isinstance(file, (str, os.PathLike)) and str(file).startswith(str(disk))

    def hooked_open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None,
                    closefd=True, opener=None):  # fmt: skip
        if opener is not None or not mine(file) or not any(c in mode for c in "wax+"):
            return real["open"](file, mode, buffering, encoding, errors, newline, closefd, opener)
        raw = Limited(file, mode.replace("b", "").replace("t", ""))
        buf = io.BufferedRandom(raw) if "+" in mode else io.BufferedWriter(raw)
        return buf if "b" in mode else io.TextIOWrapper(buf, encoding or "utf-8", errors, newline)

    def hooked_os_open(path, flags, mode=0o777, *, dir_fd=None):
        fd = real["os_open"](path, flags, mode, dir_fd=dir_fd)
        if mine(path) and flags & (os.O_WRONLY | os.O_RDWR):
            fds.add(fd)
        return fd

    def hooked_os_write(fd, data):
        if fd not in fds:
            return real["os_write"](fd, data)
        k = take(len(data))
        if k == 0 and len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real["os_write"](fd, bytes(data)[:k])

    def hooked_os_close(fd):
        fds.discard(fd)
        return real["os_close"](fd)

    def fill(leave: int | None) -> None:
        capacity[0] = None if leave is None else used() + leave

    patches = [(builtins, "open", hooked_open), (io, "open", hooked_open)]
    patches += [(os, "open", hooked_os_open), (os, "write", hooked_os_write)]
    patches += [(os, "close", hooked_os_close)]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    for m, name, f in patches:
        setattr(m, name, f)
    try:
        yield fill
    finally:
        for m, name, f in saved:
            setattr(m, name, f)


def _attempt(disk: Path, fill: Callable, leave: int, write: Callable[[], object]) -> dict:
    """Files before, `write()` on a disk with `leave` bytes free, the error, files after."""
    before = _snapshot(disk)
    fill(leave)
    try:
        write()
        error, kind = "", ""
    except Exception as exc:  # reported to the test, which names what it expects
        error, kind = str(exc), type(exc).__name__
    finally:
        fill(None)
    return {"before": before, "after": _snapshot(disk), "error": error, "type": kind}


def full_disk_report(disk: Path, data: str, corpus: Path, fill: Callable) -> dict[str, dict]:
    """Each writer against a full `disk` (run in a tmpfs namespace, or under the hook)."""
    from ptdp.files import append_line
    from ptdp.train.faults.events import append_event
    from ptdp.train.metrics import MetricsWriter

    run = disk / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "events.jsonl"):  # whole pages: a record needs a new one
        (run / name).write_text(json.dumps({"step": 0, "pad": "x" * 4070}) + "\n")
    record = {"step": 1, "loss": 2.5, "lr": 1e-3}

    def dataset(prefix: Path) -> Callable[[], object]:
        return lambda: preprocess([corpus], prefix, "bytes", progress=False)

    report = {
        "metrics": _attempt(disk, fill, 0, lambda: MetricsWriter(run, False).write(record)),
        # A 10 kB record with one page free: the write stops partway, and is cut back off.
        "events": _attempt(
            disk, fill, 4096, lambda: append_event(run, "failure", error="e" * 10_000)
        ),
        "append": _attempt(disk, fill, 0, lambda: append_line(run / "new.jsonl", "{}")),
    }
    dataset(disk / "data" / "old")()
    report["data"] = _attempt(disk, fill, 32768, dataset(disk / "data" / "new"))
    report["fresh data"] = _attempt(disk, fill, 32768, dataset(disk / "fresh" / "x"))
    cfg = replace(RunConfig(), train=replace(RunConfig().train, run_dir=str(disk / "ckpt")))
    small = {"w": torch.zeros(64), "step": 1}
    ckpt.start_checkpoint(disk / "ckpt", 1, small, cfg, None).finish()
    big = {"w": torch.randn(256 * 1024), "step": 2}  # 1 MiB
    report["checkpoint"] = _attempt(
        disk, fill, 65536, lambda: ckpt.start_checkpoint(disk / "ckpt", 2, big, cfg, None).finish()
    )
    report["checkpoint"]["latest"] = (disk / "ckpt" / "checkpoints" / "latest").read_text()
    # A training run whose save does not fit: the error, and the failure in events.jsonl.
    train_cfg = tiny_config(data, disk / "train", train={"steps": 2, "save_interval": 2})
    report["train"] = _attempt(disk, fill, 65536, lambda: train(train_cfg, env=ONE))
    for name in ("events.jsonl", "metrics.jsonl"):
        report["train"][name] = (disk / "train" / name).read_text()
    return report


def _full_disk_in_tmpfs(disk: Path, data: str, corpus: Path) -> dict[str, dict]:
    code = (
        "import json, sys; from pathlib import Path; import tests.unit.test_file_safety as t; "
        "d = Path(sys.argv[1]); "
        "print(json.dumps(t.full_disk_report(d, sys.argv[2], Path(sys.argv[3]), t._fill_tmpfs(d))))"
    )
    script = 'mount -t tmpfs -o size=4m tmpfs "$1" && cd "$2" && exec "$3" -c "$4" "$1" "$5" "$6"'
    args = [str(disk), str(ROOT), sys.executable, code, data, str(corpus)]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *args],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_full_disk_leaves_nothing_partial(tiny_data: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(["to be or not"] * 400) for _ in range(8)))
    disk = tmp_path / "disk"
    if _tmpfs_works(tmp_path / "probe"):
        disk.mkdir()
        report = _full_disk_in_tmpfs(disk, tiny_data, corpus)
    else:
        disk.mkdir()
        with _write_hook(disk) as fill:
            report = full_disk_report(disk, tiny_data, corpus, fill)
    for name in ("metrics", "events", "append", "data", "fresh data", "checkpoint"):
        r = report[name]
        assert r["after"] == r["before"], name  # byte for byte: nothing partial, no temporary
        assert "the disk is full (no space left on device) writing" in r["error"], name
    for name, path in (("metrics", "run/metrics.jsonl"), ("events", "run/events.jsonl")):
        assert report[name]["type"] == "OutputError"
        assert f"{disk / path} (" in report[name]["error"] and "needed" in report[name]["error"]
    assert "new.bin" in report["data"]["error"] and "tokens written" in report["data"]["error"]
    assert "x.bin" in report["fresh data"]["error"]
    text = report["checkpoint"]["error"]
    assert report["checkpoint"]["type"] == "CheckpointError"
    assert f"writing checkpoint {disk}/ckpt/checkpoints/step_00000002.tmp (about 1.0 MiB" in text
    assert "latest still names step_00000001" in text
    assert report["checkpoint"]["latest"] == "step_00000001\n"
    # The run that could not save: its message, whole metrics lines, no temporary file, and
    # the failure recorded in events.jsonl once the partial checkpoint was removed.
    r = report["train"]
    assert r["type"] == "CheckpointError" and "disk is full" in r["error"]
    files = [n for n in r["after"] if n.startswith("train/")]
    assert sorted(files) == ["train/config.toml", "train/events.jsonl", "train/metrics.jsonl"]
    assert [json.loads(line)["step"] for line in r["metrics.jsonl"].splitlines()] == [1, 2]
    failure = json.loads(r["events.jsonl"].splitlines()[-1])
    assert failure["event"] == "failure" and "the disk is full" in failure["error"]


# ---------------------------------------------------------------------- 7: imports


def _hf_dir(tmp_path: Path, name: str, cfg: ModelConfig) -> Path:
    run = tmp_path / f"{name}-run"
    _checkpoint(run, cfg)
    export_hf(run, tmp_path / name)
    return tmp_path / name


def test_imports_check_shapes_before_they_convert(tiny_data: str, tmp_path: Path) -> None:
    llama = _hf_dir(tmp_path, "llama", _model(64, **LLAMA))  # 4 heads in 2 key/value groups
    gpt2 = _hf_dir(tmp_path, "gpt2", _model(64))
    embed = r"model.embed_tokens.weight is \[64, 32\] but config.json implies "
    cases = [  # (directory, config.json change (None: key removed), what the refusal names)
        (llama, {"num_attention_heads": 5, "head_dim": None},
         "num_attention_heads = 5 does not divide hidden_size = 32"),
        (llama, {"num_attention_heads": 6},  # head_dim 8 kept: 6 heads of 8 in [48, 32]
         r"q_proj.weight is \[32, 32\] but config.json implies \[48, 32\]: from .*heads = 6"),
        (llama, {"num_key_value_heads": 3},
         "num_key_value_heads = 3 does not divide num_attention_heads = 4"),
        (llama, {"vocab_size": 100}, embed + r"\[100, 32\]: vocab_size = 100 disagrees"),
        (llama, {"hidden_size": 48}, embed + r"\[64, 48\]: hidden_size = 48 disagrees"),
        (llama, {"intermediate_size": 40}, r"gate_proj.weight is \[128, 32\] .*size = 40"),
        (llama, {"num_hidden_layers": 3}, "num_hidden_layers = 3 but the weights hold 2 layers"),
        (gpt2, {"n_head": 5}, "n_head = 5 does not divide n_embd = 32"),
        (gpt2, {"vocab_size": 50}, r"transformer.wte.weight is \[64, 32\] .*vocab_size = 50"),
        (gpt2, {"n_positions": 32}, r"transformer.wpe.weight is \[16, 32\] .*n_positions = 32"),
    ]  # fmt: skip
    for directory, change, named in cases:
        original = (directory / "config.json").read_text()
        changed = {k: v for k, v in (json.loads(original) | change).items() if v is not None}
        (directory / "config.json").write_text(json.dumps(changed))
        before = _snapshot(directory)
        out = tmp_path / "out"
        with pytest.raises(ConfigError, match=named):
            import_hf(directory, out)
        assert not out.exists()  # no empty folder left
        # The same check guards checkpoint.init_from, before the run directory exists.
        init = {"init_from": str(directory)}
        with pytest.raises(ConfigError, match=named):
            train(tiny_config(tiny_data, tmp_path / "init", checkpoint=init), env=ONE)
        assert not (tmp_path / "init").exists()
        assert _snapshot(directory) == before
        (directory / "config.json").write_text(original)
    assert import_hf(llama, tmp_path / "fine").family == "llama"  # unchanged: it converts

    # `ptdp generate` checks the checkpoint's tokenizer as training does: the model's
    # vocabulary holds it, and checksums.json (which lists it) says it is the one saved.
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(ByteTokenizer().to_json())  # 257 tokens for a 64-token model
    step_dir = _checkpoint(tmp_path / "small", _model(64), tokenizer)
    sums = json.loads((step_dir / "checksums.json").read_text())
    assert sums["tokenizer.json"]["bytes"] == tokenizer.stat().st_size
    with pytest.raises(CheckpointError, match="has 257 tokens but the model's .*vocab_size is 64"):
        sample_from_checkpoint(step_dir, "to be", max_new_tokens=2)
    text = ByteTokenizer().to_json()
    (step_dir / "tokenizer.json").write_text(text.replace("0", "1", 1))  # same size, replaced
    with pytest.raises(CheckpointError, match="tokenizer.json differs from the size and checksum"):
        sample_from_checkpoint(step_dir, "to be", max_new_tokens=2)
    with pytest.raises(CheckpointError, match="tokenizer.json is corrupted"):
        ckpt.load_checkpoint(step_dir)
    (step_dir / "tokenizer.json").write_text(text + "\n")  # another size: found at once
    with pytest.raises(CheckpointError, match=r"tokenizer.json has \d+ bytes, \d+ were written"):
        sample_from_checkpoint(step_dir, "to be", max_new_tokens=2)
