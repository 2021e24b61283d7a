"""`ptdp convert --to hf` streams: sharded safetensors files with their index, written a
layer at a time from the model's tensors alone (never the optimizer's moments), loading in
transformers with the logits of a one-file export; `--from hf` reads them back."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ptdp import checkpoint as ckpt
from ptdp.checkpoint import full_model_state
from ptdp.checkpoint import store as ckpt_store
from ptdp.config.files import apply_updates
from ptdp.config.sections import ModelConfig, RunConfig
from ptdp.convert import hf as convert_hf
from ptdp.convert.hf import export_hf, import_hf, to_hf_state
from ptdp.convert.safetensors_out import ShardWriter
from ptdp.errors import ConfigError
from ptdp.model.gpt import GPT
from ptdp.parallel.comm import Group
from tests.helpers import LLAMA

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install .[hf])")
from safetensors.torch import load_file  # noqa: E402 - after the skip

SHAPE = {"num_layers": 3, "hidden_size": 32, "num_heads": 4, "seq_length": 16, "vocab_size": 64}
MIXTRAL = LLAMA | {"num_experts": 4, "moe_top_k": 2, "moe_softmax_after_topk": True}
FAMILIES = {"gpt2": {}, "llama": LLAMA, "mixtral": MIXTRAL | {"ffn_hidden_size": 24}}
SHARD = 20_000
"""Bytes per file: a few tensors each, so these models take several files."""


def _cfg(options: dict) -> ModelConfig:
    return apply_updates(RunConfig(), {"model": SHAPE | options}, "a test").model


def _checkpoint(run_dir: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A checkpoint with AdamW moments beside the weights (which the export must not read)."""
    model = GPT(cfg, seed=3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    weights = full_model_state([model], Group.single())
    moments = {n: {"step": 1, "exp_avg": t * 2, "exp_avg_sq": t * t} for n, t in weights.items()}
    state = {"model": weights, "optimizer": {"state": moments, "param_groups": []}}
    ckpt.save_checkpoint(
        run_dir, 1, state | {"step": 1, "tokenizer": "bytes"}, replace(RunConfig(), model=cfg), None
    )
    return weights


def _logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_export_loads_with_the_logits_of_one_file(
    family: str, tmp_path: Path, monkeypatch
) -> None:
    cfg = _cfg(FAMILIES[family])
    weights = _checkpoint(tmp_path / "run", cfg)
    export_hf(tmp_path / "run", tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").glob("model*")) == ["model.safetensors"]

    asked: list[list[str]] = []
    load = ckpt_store.load_entries
    monkeypatch.setattr(
        convert_hf, "read_model_tensors", _recording(asked, convert_hf.read_model_tensors)
    )
    read_keys: list[str] = []
    monkeypatch.setattr(
        "ptdp.checkpoint.full.load_entries",
        lambda d, s, **k: read_keys.extend(s) or load(d, s, **k),
    )
    result = export_hf(tmp_path / "run", tmp_path / "many", shard_bytes=SHARD)
    out = tmp_path / "many"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) > 2 and files == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert not (out / "model.safetensors").exists()
    # Each file within the size (a lone larger tensor aside), each tensor where the index says.
    expected = to_hf_state(cfg, weights)
    held: dict[str, torch.Tensor] = {}
    for name in files:
        tensors = load_file(out / name)
        assert len(tensors) == 1 or sum(t.numel() * 4 for t in tensors.values()) <= SHARD
        assert {index["weight_map"][k] for k in tensors} == {name}
        held |= tensors
    assert held.keys() == expected.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in expected.values())
    for name, tensor in expected.items():
        assert torch.equal(held[name], tensor), name
    # Streamed: one layer per read, and the moments never read.
    assert not any(k.startswith("optimizer/state") for k in read_keys)
    layers = [{n.split(".")[1] for n in names if n.startswith("layers.")} for names in asked]
    assert all(len(layer) <= 1 for layer in layers) and len(asked) == cfg.num_layers + 2
    assert any("files" in note for note in result.notes)

    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(out, tokens), _logits(tmp_path / "one", tokens))
    # ... and they import back to the same weights.
    import_hf(out, tmp_path / "back")
    back = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "back"))["model"]
    assert back.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(back[name], value), name


def _recording(asked: list[list[str]], read):  # noqa: ANN202 - a wrapper
    def wrapper(step_dir, entries, names):  # noqa: ANN202
        asked.append(list(names))
        return read(step_dir, entries, names)

    return wrapper


def test_overwrite_replaces_an_earlier_exports_weight_files(tmp_path: Path) -> None:
    cfg = _cfg(LLAMA)
    _checkpoint(tmp_path / "run", cfg)
    out = tmp_path / "hf"
    export_hf(tmp_path / "run", out, shard_bytes=SHARD)
    (out / "README.md").write_text("mine\n")
    with pytest.raises(ConfigError, match="already holds files of another model .*--overwrite"):
        export_hf(tmp_path / "run", out)
    export_hf(tmp_path / "run", out, overwrite=True)  # one file now: the shards are stale
    names = sorted(p.name for p in out.iterdir())
    assert names == ["README.md", "config.json", "model.safetensors"]
    assert (out / "README.md").read_text() == "mine\n"


def test_a_failed_export_leaves_no_weight_file(tmp_path: Path, monkeypatch) -> None:
    cfg = _cfg(LLAMA)
    _checkpoint(tmp_path / "run", cfg)
    write, calls = ShardWriter.write, []

    def failing(self, name, tensor):  # noqa: ANN001, ANN202
        calls.append(name)
        if len(calls) == 6:
            raise OSError(5, "Input/output error")
        return write(self, name, tensor)

    monkeypatch.setattr(ShardWriter, "write", failing)
    with pytest.raises(OSError, match="Input/output error"):
        export_hf(tmp_path / "run", tmp_path / "hf", shard_bytes=SHARD)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == []  # not even a temporary
