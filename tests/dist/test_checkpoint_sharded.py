"""Sharded checkpoints (torch.distributed.checkpoint): every rank writes its own shards,
a resume in the same layout is bit for bit, and a checkpoint restores in other layouts
(and in one process) to the loss the saving layout would have reached."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ptdp import checkpoint as ckpt
from ptdp.config.sections import CheckpointConfig
from ptdp.errors import CheckpointError
from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import train
from tests.dist.harness import run_ranks
from tests.helpers import LLAMA, tiny_config

pytestmark = pytest.mark.dist

SAVED = "step_00000003"


def _config(data: str, run_dir: Path, steps: int, parallel: dict, model: dict, **extra):
    optim = {"decay_steps": 6, "eps": 1e-6, "distributed": True} | extra.pop("optim", {})
    return tiny_config(
        data,
        run_dir,
        train={"steps": steps, "micro_batch_size": 2, **extra.pop("train", {})},
        optim=optim,
        parallel=parallel,
        model={"num_layers": 4, **model},
    )


def _copy_saved(source: Path, target: Path) -> None:
    """A run dir holding only `source`'s step-3 checkpoint, to resume from."""
    root = target / "checkpoints"
    root.mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / SAVED, root / SAVED)
    (root / "latest").write_text(SAVED + "\n")


def _write(root: str, name: str, rank: int, losses: dict) -> None:
    if rank == 0:
        (Path(root) / f"{name}.json").write_text(json.dumps(losses))


def _read(root: Path, name: str) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((root / f"{name}.json").read_text()).items()}


def _save_and_resume(rank: int, world: int, data: str, root: str, par: dict, model: dict):
    """Dropout on: an uninterrupted run, and one stopped at step 3 and resumed."""
    env, root_ = LaunchEnv(rank, world, rank), Path(root)
    drop = {**model, "dropout": 0.1}
    full = train(_config(data, root_ / "full", 6, par, drop), env=env)
    train(_config(data, root_ / "split", 3, par, drop), env=env)
    resumed = train(_config(data, root_ / "split", 6, par, drop), env=env, resume=True)
    _write(root, "full", rank, full.losses)
    _write(root, "resumed", rank, resumed.losses)
    # Dropout off: the reference run and its step-3 checkpoint for the resharding tests.
    ref = train(_config(data, root_ / "ref", 4, par, model, train={"save_interval": 3}), env=env)
    _write(root, "ref", rank, ref.losses)


def _resume_in(rank: int, world: int, data: str, root: str, name: str, par: dict, model: dict):
    env, run_dir = LaunchEnv(rank, world, rank), Path(root) / name
    result = train(_config(data, run_dir, 4, par, model), env=env, resume=True)
    _write(root, name, rank, result.losses)


def _check_resharding(tmp: Path, data: str, source: Path, targets: dict, model: dict) -> None:
    """Step 4 after restoring `source`'s step-3 checkpoint in each target layout equals
    the saving layout's step 4."""
    expected = _read(tmp, "ref")[4]
    for name, (world, par) in targets.items():
        _copy_saved(source, tmp / name)
        if world == 1:
            result = train(_config(data, tmp / name, 4, par, model), resume=True)
            losses = result.losses
        else:
            run_ranks(_resume_in, world, data, str(tmp), name, par, model)
            losses = _read(tmp, name)
        assert sorted(losses) == [4], name
        assert losses[4] == pytest.approx(expected, rel=1e-5), name


TP2_PP2_DP2 = {"tp": 2, "pp": 2}


def test_sharded_save_resume_and_reshard(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_save_and_resume, 8, tiny_data, str(tmp_path), TP2_PP2_DP2, {}, timeout_s=400)
    full, resumed = _read(tmp_path, "full"), _read(tmp_path, "resumed")
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):  # same layout, per-rank random streams restored: bit for bit
        assert resumed[step] == full[step], step
    # Every rank that holds distinct data wrote its own file; nothing went through rank 0.
    step_dir = tmp_path / "split" / "checkpoints" / SAVED
    files = sorted(step_dir.glob("*.distcp"))
    assert len(files) > 1
    writers = [f.name.split("_")[2] for f in files]  # __<rank>_<i>.distcp: one per thread
    assert len(set(writers)) > 1
    assert all(writers.count(r) <= CheckpointConfig().writer_threads for r in writers)
    # The layout-free view in one process holds every parameter once, at full shape.
    state = ckpt.load_checkpoint(step_dir)
    assert state["step"] == 3 and "output.weight" not in state["model"]  # tied copy
    assert set(state["optimizer"]["state"]) == set(state["model"])
    targets = {
        "tp1-pp4-dp2": (8, {"pp": 4}),
        "tp4-dp2": (8, {"tp": 4}),
        "one": (1, {}),
    }
    _check_resharding(tmp_path, tiny_data, tmp_path / "ref", targets, {})
    # The other way: a one-process checkpoint restored under tp=2, pp=2.
    _check_resharding(tmp_path, tiny_data, tmp_path / "one", {"from-one": (4, TP2_PP2_DP2)}, {})


def _llama_save(rank: int, world: int, data: str, root: str) -> None:
    env = LaunchEnv(rank, world, rank)
    cfg = _config(data, Path(root) / "ref", 4, {"tp": 2}, LLAMA, train={"save_interval": 3})
    _write(root, "ref", rank, train(cfg, env=env).losses)


def test_swiglu_and_untied_output_reshard(tiny_data: str, tmp_path: Path) -> None:
    """SwiGLU's [gate; up] weight (each block split on its own) and an untied output
    layer, saved at tp=2 dp=2, restore in one process and at tp=4 pp=2 (not at tp=4:
    two query groups)."""
    run_ranks(_llama_save, 4, tiny_data, str(tmp_path))
    step_dir = tmp_path / "ref" / "checkpoints" / SAVED
    keys = ckpt.read_metadata(step_dir).state_dict_metadata
    assert any(k.endswith("fc1.weight@parts2dim0") for k in keys)  # stored (2, f, h)
    full = ckpt.load_checkpoint(step_dir)["model"]
    assert "output.weight" in full and all("@" not in k for k in full)
    targets = {"one": (1, {}), "pp2-dp2": (4, {"pp": 2})}
    _check_resharding(tmp_path, tiny_data, tmp_path / "ref", targets, LLAMA)


def test_damaged_shard_is_named(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_llama_save, 4, tiny_data, str(tmp_path))
    step_dir = tmp_path / "ref" / "checkpoints" / SAVED
    shard = sorted(step_dir.glob("*.distcp"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard} is truncated"):
        ckpt.load_checkpoint(step_dir)
    _copy_saved(tmp_path / "ref", tmp_path / "resume")
    with pytest.raises(CheckpointError, match="is truncated"):
        train(_config(tiny_data, tmp_path / "resume", 4, {}, LLAMA), resume=True)
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=f"{shard} is corrupted"):
        ckpt.load_checkpoint(step_dir)


UNEVEN = {"pp": 2, "pipeline_layers": [0, 4]}
"""The first stage holds the embedding alone."""


def _uneven_save(rank: int, world: int, data: str, root: str) -> None:
    env = LaunchEnv(rank, world, rank)
    cfg = _config(data, Path(root) / "ref", 4, UNEVEN, {}, train={"save_interval": 3})
    _write(root, "ref", rank, train(cfg, env=env).losses)


def test_uneven_stages_reshard(tiny_data: str, tmp_path: Path) -> None:
    """Layers are keyed by global index: a checkpoint saved with stages of 0 and 4 layers
    (the embedding alone, then every layer and the loss) restores in one process, under
    stages of 3 and 1, and under the opposite split (the last stage the loss alone)."""
    run_ranks(_uneven_save, 2, tiny_data, str(tmp_path))
    full = ckpt.load_checkpoint(tmp_path / "ref" / "checkpoints" / SAVED)["model"]
    assert {k.split(".")[1] for k in full if k.startswith("layers.")} == {"0", "1", "2", "3"}
    targets = {
        "one": (1, {}),
        "pp2-3-1": (2, {"pp": 2, "pipeline_layers": [3, 1]}),
        "pp2-4-0": (2, {"pp": 2, "pipeline_layers": [4, 0]}),
    }
    _check_resharding(tmp_path, tiny_data, tmp_path / "ref", targets, {})


MOE = {
    **LLAMA, "bias": True, "num_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01,
    "moe_bias_update_rate": 0.01, "moe_shared_experts": 1,
}  # fmt: skip
"""SwiGLU experts with biases: fc1 [e, 2f, h] split on dim 1 in two blocks, its bias
[e, 2f] alike, fc2 [e, h, f] split on dim 2; the routers' balancing biases (buffers)."""


def _moe_save(rank: int, world: int, data: str, root: str, par: dict | None = None) -> None:
    env, par = LaunchEnv(rank, world, rank), par or {"tp": 2, "etp": 2}
    cfg = _config(data, Path(root) / "ref", 4, par, MOE, train={"save_interval": 3})
    _write(root, "ref", rank, train(cfg, env=env).losses)


def test_moe_experts_and_biases_reshard(tiny_data: str, tmp_path: Path) -> None:
    """Grouped expert weights saved at tp=2 (each expert split like the MLP) restore in one
    process, at pp=2 and folded (experts whole, ep over the tensor ranks), and a
    one-process checkpoint at tp=2, each to the saving layout's next loss (the routing, and
    so the loss, depends on the restored balancing biases)."""
    run_ranks(_moe_save, 2, tiny_data, str(tmp_path))
    step_dir = tmp_path / "ref" / "checkpoints" / SAVED
    keys = ckpt.read_metadata(step_dir).state_dict_metadata
    assert "model/layers.0.mlp.experts.fc1.weight@parts2dim1" in keys  # stored (e, 2, f, h)
    assert "model/layers.0.mlp.router.expert_bias" in keys
    full = ckpt.load_checkpoint(step_dir)["model"]
    assert full["layers.0.mlp.experts.fc2.weight"].shape == (4, 32, 128)
    assert full["layers.0.mlp.router.expert_bias"].abs().sum() > 0
    targets = {"one": (1, {}), "pp2": (2, {"pp": 2}), "folded": (2, {"tp": 2, "ep": 2})}
    _check_resharding(tmp_path, tiny_data, tmp_path / "ref", targets, MOE)
    targets = {"from-one": (2, {"tp": 2, "etp": 2})}
    _check_resharding(tmp_path, tiny_data, tmp_path / "one", targets, MOE)


def test_folded_experts_reshard_to_unfolded(tiny_data: str, tmp_path: Path) -> None:
    """Experts saved folded (ep = 2 over the two tensor ranks, each expert whole, its state
    and the shared MLP's split differently) restore split like the MLP (etp = tp = 2) and
    whole on both tensor ranks (etp = 1, ep = 1), each to the saving layout's next loss."""
    run_ranks(_moe_save, 2, tiny_data, str(tmp_path), {"tp": 2, "ep": 2})
    targets = {"unfolded": (2, {"tp": 2, "etp": 2}), "replicated": (2, {"tp": 2})}
    _check_resharding(tmp_path, tiny_data, tmp_path / "ref", targets, MOE)


def _ep_save(rank: int, world: int, data: str, root: str) -> None:
    env = LaunchEnv(rank, world, rank)
    cfg = _config(data, Path(root) / "ref", 5, {"ep": 2}, MOE, train={"save_interval": 3})
    _write(root, "ref", rank, train(cfg, env=env).losses)


def _ep_resume(rank: int, world: int, data: str, root: str, name: str, par: dict) -> None:
    env, run_dir = LaunchEnv(rank, world, rank), Path(root) / name
    _write(
        root, name, rank, train(_config(data, run_dir, 5, par, MOE), env=env, resume=True).losses
    )


def test_expert_parallel_checkpoints_reshard(tiny_data: str, tmp_path: Path) -> None:
    """Experts saved at ep=2 (each rank its 2 of 4, ZeRO-1 state) restore in one process,
    whose own checkpoint restores at ep=4 and at tp=2 with ep=2: each continues to the loss
    the ep=2 run reached (the routing, and so the loss, reads every expert and bias)."""
    run_ranks(_ep_save, 2, tiny_data, str(tmp_path))
    ref = _read(tmp_path, "ref")
    full = ckpt.load_checkpoint(tmp_path / "ref" / "checkpoints" / SAVED)
    for key in ("weight", "bias"):  # all 4 experts, weights and AdamW moments
        assert full["model"][f"layers.1.mlp.experts.fc2.{key}"].shape[0] == 4
        moments = full["optimizer"]["state"][f"layers.1.mlp.experts.fc1.{key}"]
        assert moments["exp_avg_sq"].shape[0] == 4  # both ranks' experts, each trained
        assert (moments["exp_avg_sq"].flatten(1).sum(1) > 0).all()
    _copy_saved(tmp_path / "ref", tmp_path / "one")  # ep = 2 -> 1
    one = train(_config(tiny_data, tmp_path / "one", 4, {}, MOE), resume=True)
    assert one.losses == {4: pytest.approx(ref[4], rel=1e-5)}
    saved = "step_00000004"
    for name, par in {"ep4": {"ep": 4}, "tp2-ep2": {"tp": 2, "ep": 2}}.items():  # 1 -> 4
        root = tmp_path / name / "checkpoints"
        root.mkdir(parents=True)
        shutil.copytree(tmp_path / "one" / "checkpoints" / saved, root / saved)
        (root / "latest").write_text(saved + "\n")
        run_ranks(_ep_resume, 4, tiny_data, str(tmp_path), name, par)
        assert _read(tmp_path, name) == {5: pytest.approx(ref[5], rel=1e-5)}, name


MTP = MOE | {"bias": False, "mtp_depth": 2, "mtp_loss_weight": 0.3, "moe_first_dense_layers": 1}
"""Two depths of multi-token prediction after the last layer (MoE layers, as the last)."""


def _mtp_save(rank: int, world: int, data: str, root: str) -> None:
    env = LaunchEnv(rank, world, rank)
    cfg = _config(data, Path(root) / "ref", 4, {"pp": 2}, MTP, train={"save_interval": 3})
    _write(root, "ref", rank, train(cfg, env=env).losses)


def test_multi_token_prediction_reshards(tiny_data: str, tmp_path: Path) -> None:
    """Multi-token prediction's modules saved at pp = 2 (on the last stage, beside its copy
    of the embedding, which is not saved) restore in one process, at tp = 2 and with the
    experts over ep = 2, each to the saving layout's next loss (its MTP losses included)."""
    run_ranks(_mtp_save, 2, tiny_data, str(tmp_path))
    step_dir = tmp_path / "ref" / "checkpoints" / SAVED
    keys = ckpt.read_metadata(step_dir).state_dict_metadata
    assert (
        "model/mtp.2.eh_proj.weight" in keys and "model/mtp.1.layer.mlp.router.expert_bias" in keys
    )
    assert not any("mtp_embedding" in k for k in keys)  # a tied copy: loads from stage 0's
    targets = {"one": (1, {}), "tp2": (2, {"tp": 2}), "ep2": (2, {"ep": 2})}
    _check_resharding(tmp_path, tiny_data, tmp_path / "ref", targets, MTP)
