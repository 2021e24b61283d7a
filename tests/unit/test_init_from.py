"""checkpoint.init_from in one process: a ptdp run's or a Hugging Face model's weights with
a fresh optimizer, step 0 and the data from its start; the model taken from the source,
conflicting keys and tokenizers refused, damaged sources named, and --resume beside it."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.cli import main
from ptdp.config.files import load_toml
from ptdp.convert.hf import import_hf
from ptdp.data.preprocess import preprocess
from ptdp.errors import CheckpointError, ConfigError
from ptdp.parallel.env import LaunchEnv
from ptdp.train.init_from import load_initial_weights, open_source
from ptdp.train.run import prepare, train
from ptdp.train.step.trainer import Trainer
from tests.helpers import LLAMA, make_corpus, save_tiny_hf, tiny_config

FIXED_LR = {"decay_steps": 4}  # the schedule of a 2-step run is the start of a 4-step one


@pytest.fixture(scope="module")
def source(tiny_data: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run trained 4 steps: its checkpoint holds AdamW moments and step 4."""
    run_dir = tmp_path_factory.mktemp("init_from") / "src"
    train(tiny_config(tiny_data, run_dir, train={"steps": 4}))
    return run_dir


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(ckpt.find_checkpoint(run_dir))["model"]


def _weights_only(source: Path, run_dir: Path) -> None:
    """A run dir whose only checkpoint is `source`'s weights at step 0, no optimizer state:
    what init_from must amount to, written by hand."""
    state = ckpt.load_checkpoint(ckpt.find_checkpoint(source))
    fresh = {"model": state["model"], "optimizer": {"state": {}, "param_groups": []}}
    fresh |= {"step": 0, "rng": {}, "tokenizer": state["tokenizer"]}
    ckpt.save_checkpoint(run_dir, 0, fresh, ckpt.load_config(ckpt.find_checkpoint(source)), None)


def test_run_starts_at_step_0_with_fresh_optimizer(
    tiny_data: str, source: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(tiny_data, tmp_path / "ft", checkpoint={"init_from": str(source)})
    # Right after the load: the source's weights, step 0, no AdamW state.
    env = LaunchEnv(0, 1, 0)
    ready, layout, data = prepare(cfg, env)
    trainer = Trainer(ready, layout, env, data)
    load_initial_weights(trainer.checkpoints, open_source(str(source)), ready.model)
    saved = _weights(source)
    loaded = ckpt.full_model_state(trainer.chunks, trainer.tp)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert trainer.step == 0 and trainer.optimizer.moments() == ({}, 0)

    result = train(cfg)
    assert (result.start_step, result.final_step) == (0, 6)
    # The same as resuming a step-0, optimizer-free copy of the source's weights.
    _weights_only(source, tmp_path / "ref")
    ref = train(tiny_config(tiny_data, tmp_path / "ref"), resume=True)
    assert ref.start_step == 0
    assert result.losses == ref.losses
    a, b = _weights(tmp_path / "ft"), _weights(tmp_path / "ref")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # It continues from the source, far below a fresh model's first loss.
    fresh = train(tiny_config(tiny_data, tmp_path / "fresh", train={"steps": 1}))
    assert result.losses[1] < fresh.losses[1] - 0.3
    # The run's own config.toml records where its weights came from.
    assert load_toml(tmp_path / "ft" / "config.toml").checkpoint.init_from == str(source)


def test_shorter_context_keeps_the_first_positions(
    tiny_data: str, source: Path, tmp_path: Path
) -> None:
    cfg = tiny_config(
        tiny_data,
        tmp_path / "ft",
        model={"seq_length": 16},
        checkpoint={"init_from": str(source)},
    )
    env = LaunchEnv(0, 1, 0)
    ready, layout, data = prepare(cfg, env)
    assert ready.model.seq_length == 16
    trainer = Trainer(ready, layout, env, data)
    load_initial_weights(trainer.checkpoints, open_source(str(source)), ready.model)
    saved, loaded = _weights(source), ckpt.full_model_state(trainer.chunks, trainer.tp)
    assert torch.equal(loaded["position.weight"], saved["position.weight"][:16])
    assert all(torch.equal(loaded[k], saved[k]) for k in saved if k != "position.weight")


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "mixtral", "qwen3_moe"])
def test_hf_model_equals_converting_then_loading(
    family: str, tiny_data: str, tmp_path: Path
) -> None:
    pytest.importorskip("transformers", reason="needs transformers (pip install .[hf])")
    hf = tmp_path / "hf"
    save_tiny_hf(hf, family, positions=64)  # 64 positions, trained at 32
    files = sorted(p.name for p in hf.iterdir())
    import_hf(hf, tmp_path / "imported", seq_length=32)
    imported = load_toml(tmp_path / "imported" / "config.toml").model
    ref_cfg = tiny_config(tiny_data, tmp_path / "imported", train={"steps": 3})
    ref = train(replace(ref_cfg, model=imported), resume=True)

    model = {"gpt2": {}, "qwen2": {**LLAMA, "tie_embeddings": True}}.get(family, LLAMA)
    cfg = tiny_config(tiny_data, tmp_path / "ft", model=model, checkpoint={"init_from": str(hf)})
    cfg = replace(cfg, train=replace(cfg.train, steps=3))
    result = train(cfg)
    assert result.start_step == 0
    assert result.losses == ref.losses
    a, b = _weights(tmp_path / "ft"), _weights(tmp_path / "imported")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in hf.iterdir()) == files  # nothing written beside the model


def test_model_comes_from_the_source_and_conflicts_are_refused(
    tiny_data: str, source: Path, tmp_path: Path, capsys
) -> None:
    base = ["train", "--data.path", tiny_data, "--train.run_dir", str(tmp_path / "ft")]
    base += ["--checkpoint.init_from", str(source), "--dry-run"]
    # Unset model keys come from the source (2 layers, h=32, not the defaults 4 and 256);
    # a key set to the source's value is fine, and so is a free key (dropout).
    assert main([*base, "--model.hidden_size", "32", "--model.dropout", "0.1"]) == 0
    out = capsys.readouterr().out
    for line in ("num_layers = 2", "hidden_size = 32", "seq_length = 32", "dropout = 0.1"):
        assert line in out
    assert f'init_from = "{source}"' in out
    # Given at another value, on the command line or in a config built in code: refused.
    assert main([*base, "--model.hidden_size", "64"]) == 2
    err = capsys.readouterr().err
    assert "model.hidden_size = 64 where it has 32" in err and str(source) in err
    cfg = tiny_config(tiny_data, tmp_path / "ft", model={"num_layers": 3, "seq_length": 64})
    with pytest.raises(ConfigError) as info:
        train(replace(cfg, checkpoint=replace(cfg.checkpoint, init_from=str(source))))
    assert "model.num_layers = 3 where it has 2" in str(info.value)
    assert "model.seq_length = 64 exceeds its 32 learned positions" in str(info.value)
    # The default value given explicitly still conflicts (the command line says it was set).
    assert main([*base, "--model.num_layers", "4"]) == 2
    assert "model.num_layers = 4 where it has 2" in capsys.readouterr().err


def test_another_tokenizer_is_refused(source: Path, tmp_path: Path) -> None:
    make_corpus(tmp_path / "text")
    prefix = tmp_path / "bpe" / "bpe"
    preprocess([tmp_path / "text"], prefix, "bpe", vocab_size=300, progress=False)
    cfg = tiny_config(str(prefix), tmp_path / "ft", checkpoint={"init_from": str(source)})
    with pytest.raises(ConfigError) as info:
        train(cfg)
    message = str(info.value)
    # Every checkpoint holds its tokenizer.json, the byte tokenizer's too.
    assert "step_00000004/tokenizer.json (vocabulary 257)" in message
    assert f"{prefix.parent / 'tokenizer.json'} (vocabulary 300)" in message


def test_missing_or_damaged_source_is_named(tiny_data: str, source: Path, tmp_path: Path) -> None:
    def start(path: Path) -> None:
        train(tiny_config(tiny_data, tmp_path / "ft", checkpoint={"init_from": str(path)}))

    with pytest.raises(CheckpointError, match=f"init_from = '{tmp_path / 'nowhere'}' does not"):
        start(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds neither a ptdp checkpoint"):
        start(tmp_path / "empty")
    # A ptdp checkpoint: a shard with flipped bytes, then a missing config.toml.
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    step_dir = ckpt.find_checkpoint(copy)
    shard = sorted(step_dir.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard} is corrupted"):
        start(copy)
    (step_dir / "config.toml").unlink()
    with pytest.raises(CheckpointError, match=f"{step_dir / 'config.toml'} is missing"):
        start(copy)
    # A Hugging Face model: a truncated weights file, then an unreadable config.json.
    pytest.importorskip("transformers", reason="needs transformers (pip install .[hf])")
    hf = tmp_path / "hf"
    save_tiny_hf(hf, "gpt2", positions=32)
    weights = hf / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=f"weights file {weights}"):
        start(hf)
    (hf / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=f"model config {hf / 'config.json'}"):
        start(hf)


def test_resume_beside_init_from(tiny_data: str, source: Path, tmp_path: Path, capsys) -> None:
    """--resume with init_from: the run's own checkpoint wins once there is one (a restarted
    fine-tune continues); before that, init_from is loaded."""
    copy = tmp_path / "src"
    shutil.copytree(source, copy)

    def run(name: str, steps: int, resume: bool):
        cfg = tiny_config(
            tiny_data,
            tmp_path / name,
            train={"steps": steps},
            optim=FIXED_LR,
            checkpoint={"init_from": str(copy)},
        )
        return train(cfg, resume=resume)

    whole = run("whole", 4, resume=False)
    first = run("ft", 2, resume=True)  # nothing to resume yet: starts from init_from
    assert first.start_step == 0
    assert "initialised the weights from checkpoint" in capsys.readouterr().out
    shutil.rmtree(copy)  # the restart needs only the run's own checkpoint
    again = run("ft", 4, resume=True)
    out = capsys.readouterr().out
    assert again.start_step == 2
    assert "resumed from" in out and "init_from" in out and "not loaded" in out
    assert {s: again.losses[s] for s in (3, 4)} == {s: whole.losses[s] for s in (3, 4)}
    with pytest.raises(CheckpointError, match="already holds checkpoints; pass --resume"):
        run("ft", 4, resume=False)
