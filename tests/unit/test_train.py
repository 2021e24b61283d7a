"""End-to-end training on one process: learning, logging, checkpoints, exact resume."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.cli import main
from ptdp.config.files import load_toml, to_toml
from ptdp.errors import CheckpointError, ConfigError
from ptdp.parallel.env import LaunchEnv
from ptdp.sample import sample_from_checkpoint
from ptdp.train.run import prepare, train
from ptdp.train.step.trainer import Trainer
from tests.helpers import make_corpus, tiny_config


def test_tiny_model_learns(tiny_data: str, tmp_path: Path) -> None:
    cfg = tiny_config(
        tiny_data,
        tmp_path / "run",
        train={"steps": 40, "log_interval": 10, "eval_interval": 20, "eval_iters": 2},
    )
    result = train(cfg)
    first, last = result.losses[1], sum(result.losses[s] for s in range(36, 41)) / 5
    assert first > 5.0  # ~ln(257) at initialisation
    assert last < first - 2.0, result.losses
    assert result.val_losses[40] < result.val_losses[20] < first

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [10, 20, 30, 40]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "peak_mem_gb"):
        assert all(r[key] > 0 for r in train_records), key
    assert [r["step"] for r in records if "val_loss" in r] == [20, 40]
    assert load_toml(tmp_path / "run" / "config.toml") == cfg.__class__(
        **{
            **cfg.__dict__,
            "model": cfg.model.__class__(**{**cfg.model.__dict__, "vocab_size": 257}),
        }
    )


def test_resume_is_bitwise_exact(tiny_data: str, tmp_path: Path) -> None:
    # decay_steps fixes the LR schedule, so a 3-step run is the start of the 6-step one.
    common = {"optim": {"decay_steps": 6}, "model": {"dropout": 0.1}}
    full = train(tiny_config(tiny_data, tmp_path / "full", **common))
    first = tiny_config(tiny_data, tmp_path / "split", train={"steps": 3}, **common)
    train(first)
    resumed = train(
        tiny_config(tiny_data, tmp_path / "split", train={"steps": 6}, **common), resume=True
    )
    assert resumed.start_step == 3
    for step in (4, 5, 6):
        assert resumed.losses[step] == full.losses[step]  # bitwise, not approximately
    a = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "full"))["model"]
    b = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "split"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoints_rotate_and_refuse_overwrite(tiny_data: str, tmp_path: Path) -> None:
    cfg = tiny_config(
        tiny_data, tmp_path / "run", train={"steps": 4, "save_interval": 1, "keep_checkpoints": 2}
    )
    train(cfg)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000003", "step_00000004"]
    assert (root / "latest").read_text().strip() == "step_00000004"
    with pytest.raises(CheckpointError, match="already holds checkpoints; pass --resume"):
        train(cfg)
    # A half-written checkpoint (left by a crash) is never the latest.
    (root / "step_00000005.tmp").mkdir()
    assert ckpt.find_checkpoint(tmp_path / "run").name == "step_00000004"


def test_resume_with_another_model_is_refused(tiny_data: str, tmp_path: Path) -> None:
    train(tiny_config(tiny_data, tmp_path / "run", train={"steps": 2}))
    other = tiny_config(tiny_data, tmp_path / "run", train={"steps": 4}, model={"hidden_size": 64})
    with pytest.raises(CheckpointError, match="hidden_size: 32 -> 64"):
        train(other, resume=True)
    # The refused run changed nothing: the run's recorded config is still the old one.
    assert load_toml(tmp_path / "run" / "config.toml").model.hidden_size == 32


def test_corrupt_checkpoint_is_named(tiny_data: str, tmp_path: Path) -> None:
    train(tiny_config(tiny_data, tmp_path / "run", train={"steps": 1}))
    step_dir = ckpt.find_checkpoint(tmp_path / "run")
    shard = sorted(step_dir.glob("*.distcp"))[0]  # one file per writer thread
    data = shard.read_bytes()
    shard.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match=f"{shard} is truncated"):
        ckpt.load_checkpoint(step_dir)
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same length, one bit flipped
    with pytest.raises(CheckpointError, match=f"{shard} is corrupted"):
        ckpt.load_checkpoint(step_dir)
    metadata = step_dir / ckpt.METADATA
    metadata.write_bytes(metadata.read_bytes()[:50])
    with pytest.raises(CheckpointError, match=str(metadata)):
        ckpt.load_checkpoint(step_dir)


def test_generate_from_checkpoint(tiny_data: str, tmp_path: Path) -> None:
    train(tiny_config(tiny_data, tmp_path / "run", train={"steps": 2}))
    texts = sample_from_checkpoint(
        tmp_path / "run", "to be", max_new_tokens=10, num_samples=2, seed=3
    )
    assert len(texts) == 2 and all(t.startswith("to be") for t in texts)
    again = sample_from_checkpoint(
        tmp_path / "run", "to be", max_new_tokens=10, num_samples=2, seed=3
    )
    assert texts == again


def test_a_prompt_longer_than_the_context_is_cut_with_a_note(
    tiny_data: str, tmp_path: Path, capsys
) -> None:
    train(tiny_config(tiny_data, tmp_path / "run", train={"steps": 1}))  # seq_length 32
    capsys.readouterr()
    prompt = "to be or not to be, " * 5  # 100 byte tokens
    greedy = dict(max_new_tokens=4, temperature=0.0)
    (text,) = sample_from_checkpoint(tmp_path / "run", prompt, **greedy)
    note = capsys.readouterr().err
    assert "note: the prompt has 100 tokens, more than the model's context of 32" in note
    assert "cut to its last 32 (68 dropped)" in note
    assert text.startswith(prompt[-32:]) and not text.startswith(prompt[:40])
    (fits,) = sample_from_checkpoint(tmp_path / "run", prompt[-32:], **greedy)
    assert fits == text and capsys.readouterr().err == ""  # the model read the same tokens


def test_cli_preprocess_train_generate(tmp_path: Path, capsys) -> None:
    make_corpus(tmp_path / "text", docs=4)
    prefix = str(tmp_path / "data" / "c")
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(tmp_path / "text"),
                "--output-prefix",
                prefix,
                "--tokenizer",
                "bpe",
                "--vocab-size",
                "300",
            ]
        )
        == 0
    )
    assert "4 documents" in capsys.readouterr().out
    cfg = tiny_config(prefix, tmp_path / "run", train={"steps": 2}, data={"valid_fraction": 0.2})
    config_file = tmp_path / "c.toml"
    config_file.write_text(to_toml(cfg))
    assert main(["train", "--config", str(config_file), "--train.steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "step      3 | loss" in out and "vocab_size" not in out
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(tmp_path / "run"),
                "--prompt",
                "to be",
                "--max-new-tokens",
                "5",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("to be")


def test_bf16_autocast_and_tensorboard(tiny_data: str, tmp_path: Path) -> None:
    result = train(
        tiny_config(
            tiny_data,
            tmp_path / "run",
            train={"steps": 3, "precision": "bf16", "tensorboard": True},
        )
    )
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_data_errors_before_training(tiny_data: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.path is empty"):
        train(tiny_config("", tmp_path / "run"))
    with pytest.raises(ConfigError, match="smaller than the data's vocabulary of 257"):
        train(tiny_config(tiny_data, tmp_path / "run", model={"vocab_size": 100}))
    with pytest.raises(Exception, match="ptdp preprocess"):
        train(tiny_config(str(tmp_path / "nothing"), tmp_path / "run"))


def test_cli_train_dry_run_and_errors(tiny_data: str, tmp_path: Path, capsys) -> None:
    args = [
        "train",
        "--dry-run",
        "--data.path",
        tiny_data,
        "--model.num_layers",
        "2",
        "--train.run_dir",
        str(tmp_path / "run"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "vocab_size = 257" in out and "# layout: world=1" in out
    assert main(args + ["--world-size", "3", "--parallel.dp", "2"]) == 2
    assert "does not match the world size 3" in capsys.readouterr().err
    assert main(["train", "--dry-run", "--model.num_layer", "2"]) == 2
    assert "did you mean 'num_layers'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was written by a dry run


def test_a_finished_trainer_frees_its_weights(tiny_data: str, tmp_path: Path) -> None:
    """One process may build trainer after trainer (a benchmark's models, a notebook): the
    weights and gradient buffers of each go with it, not at the process's end (a parameter's
    gradient hook holding the buffers that hold the parameter kept 7.4 GiB of a 1.3B model
    alive on a GPU beside the next model)."""
    for precision in ("fp32", "bf16"):
        env = LaunchEnv(0, 1, 0)
        cfg = tiny_config(tiny_data, tmp_path / precision, train={"precision": precision})
        cfg, layout, data = prepare(cfg, env)
        trainer = Trainer(cfg, layout, env, data)
        trainer.train_step()
        held = [weakref.ref(p) for chunk in trainer.chunks for p in chunk.parameters()]
        held += [weakref.ref(buf.grads) for buf in trainer.grads.chunks]
        if trainer.watchdog:
            trainer.watchdog.close()
        del trainer
        gc.collect()
        assert len(held) > 4 and [r() for r in held] == [None] * len(held), precision
