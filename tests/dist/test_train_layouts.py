"""Training in parallel layouts against one process: the same losses and parameters to
float32 rounding, through the harness and through a real torchrun launch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp import checkpoint as ckpt
from ptdp.config.sections import RunConfig
from ptdp.parallel.env import LaunchEnv
from ptdp.sample import sample_from_checkpoint
from ptdp.train.run import prepare, train
from ptdp.train.step.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.helpers import LLAMA, assert_same_run, tiny_config

pytestmark = pytest.mark.dist

# A checkpoint mid-run: saving (which gathers shards) must not disturb training.
SETTINGS = {
    "train": {
        "micro_batch_size": 2, "global_batch_size": 8, "steps": 4, "save_interval": 2,
        "eval_interval": 2, "eval_iters": 2,
    }
}  # fmt: skip

LAYOUTS = {  # name: (world size, parallel section, model section)
    "dp2": (2, {}, {}),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}, {}),
    "tp2-dp2-llama": (4, {"tp": 2}, {}),
    "pp2-1f1b": (2, {"pp": 2}, {"num_layers": 4}),
    "pp2-uneven": (2, {"pp": 2, "pipeline_layers": [1, 3]}, {"num_layers": 4}),
    "pp2-gpipe": (2, {"pp": 2, "schedule": "gpipe"}, {"num_layers": 4}),
    "pp2-zb-h1": (2, {"pp": 2, "schedule": "zb-h1"}, {"num_layers": 4}),
    "pp2-vpp2-llama": (2, {"pp": 2, "vpp": 2, "schedule": "interleaved"}, {"num_layers": 4}),
    "pp4-vpp2": (4, {"pp": 4, "vpp": 2, "schedule": "interleaved"}, {"num_layers": 8}),
    "tp2-pp2-sp": (4, {"tp": 2, "pp": 2, "sequence_parallel": True}, {"num_layers": 4}),
    "tp2-pp2-dp2-zb-h1": (8, {"tp": 2, "pp": 2, "schedule": "zb-h1"}, {"num_layers": 4}),
}


def _layout_config(data: str, run_dir: Path, name: str, parallel: dict | None = None):
    # optim.eps = 1e-6: see tests/dist/test_tensor.py (rounding-level gradients, Adam).
    world, par, model = LAYOUTS.get(name, (1, {}, {}))
    model = {**model, **(LLAMA if "llama" in name else {})}
    par = {**par, **(parallel or {})}
    return tiny_config(data, run_dir, parallel=par, model=model, optim={"eps": 1e-6}, **SETTINGS)


def _check_training(rank: int, world_size: int, data: str, run_dir: str, name: str) -> None:
    cfg = _layout_config(data, Path(run_dir), name)
    result = train(cfg, env=LaunchEnv(rank, world_size, rank))
    if rank == 0:
        (Path(run_dir) / "losses.json").write_text(json.dumps(result.losses))
        (Path(run_dir) / "val_losses.json").write_text(json.dumps(result.val_losses))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(tiny_data: str, tmp_path: Path, name: str) -> None:
    reference = _layout_config(tiny_data, tmp_path / "single", name)
    reference = replace(reference, parallel=RunConfig().parallel)
    single = train(reference)
    world = LAYOUTS[name][0]
    run_ranks(_check_training, world, tiny_data, str(tmp_path / name), name)
    losses = json.loads((tmp_path / name / "losses.json").read_text())
    losses = {int(k): v for k, v in losses.items()}
    assert sorted(losses) == [1, 2, 3, 4]
    assert_same_run(tmp_path / "single", tmp_path / name, single.losses, losses)
    val = json.loads((tmp_path / name / "val_losses.json").read_text())
    assert sorted(int(k) for k in val) == [2, 4]
    for step, loss in single.val_losses.items():  # evaluation runs through the pipeline too
        assert val[str(step)] == pytest.approx(loss, rel=1e-5), step
    # The checkpoint is layout-free: one process samples from what tp ranks saved.
    assert sample_from_checkpoint(tmp_path / name, "to be", max_new_tokens=4)[0].startswith("to")


def test_torchrun_launch(tiny_data: str, tmp_path: Path) -> None:
    """The user's command: torchrun --nproc-per-node 2 -m ptdp train ... --parallel.tp 2"""
    single = train(tiny_config(tiny_data, tmp_path / "single", optim={"eps": 1e-6}, **SETTINGS))
    run_dir = tmp_path / "torchrun"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m", "ptdp", "train",
        "--data.path", tiny_data, "--model.num_layers", "2", "--model.hidden_size", "32",
        "--model.num_heads", "4", "--model.seq_length", "32", "--data.valid_fraction", "0.1",
        "--optim.lr", "3e-3", "--optim.min_lr", "3e-4", "--optim.warmup_steps", "2",
        "--optim.eps", "1e-6",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.steps", "4",
        "--train.log_interval", "1", "--train.eval_interval", "0", "--train.device", "cpu",
        "--train.run_dir", str(run_dir), "--parallel.tp", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world=2 tp=2 pp=1 dp=1" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert_same_run(tmp_path / "single", run_dir, single.losses, losses)


def _check_resume_under_tp(rank: int, world_size: int, data: str, root: str) -> None:
    common = {"optim": {"decay_steps": 6, "eps": 1e-6}, "parallel": {"tp": 2}}
    env = LaunchEnv(rank, world_size, rank)
    full = train(tiny_config(data, Path(root) / "full", **common), env=env)
    split_cfg = tiny_config(data, Path(root) / "split", train={"steps": 3}, **common)
    train(split_cfg, env=env)
    resumed_cfg = tiny_config(data, Path(root) / "split", train={"steps": 6}, **common)
    resumed = train(resumed_cfg, env=env, resume=True)
    if rank == 0:
        out = {"full": full.losses, "resumed": resumed.losses}
        (Path(root) / "losses.json").write_text(json.dumps(out))


def test_resume_under_tp_and_reshard_to_one_process(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_check_resume_under_tp, 2, tiny_data, str(tmp_path))
    losses = json.loads((tmp_path / "losses.json").read_text())
    full = {int(k): v for k, v in losses["full"].items()}
    resumed = {int(k): v for k, v in losses["resumed"].items()}
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):  # same layout: bit for bit
        assert resumed[step] == full[step], step
    # The tp=2 checkpoint of step 3, resumed by one process: the same run to rounding.
    one = tmp_path / "one" / "checkpoints"
    one.mkdir(parents=True)
    shutil.copytree(tmp_path / "split" / "checkpoints" / "step_00000003", one / "step_00000003")
    (one / "latest").write_text("step_00000003\n")
    cfg = tiny_config(
        tiny_data, tmp_path / "one", train={"steps": 6}, optim={"decay_steps": 6, "eps": 1e-6}
    )
    single = train(cfg, resume=True)
    for step in (4, 5, 6):
        assert single.losses[step] == pytest.approx(full[step], rel=1e-5), step


def _scatter_gather_config(data: str, run_dir: Path, **parallel):
    return tiny_config(
        data, run_dir, parallel=parallel, model={"num_layers": 4}, optim={"eps": 1e-6}, **SETTINGS
    )


def _check_scatter_gather(rank: int, world_size: int, data: str, root: str) -> None:
    env = LaunchEnv(rank, world_size, rank)
    out = {}
    for sg in (True, False):
        cfg = _scatter_gather_config(data, Path(root) / f"sg{sg}", tp=2, pp=2, scatter_gather=sg)
        out[str(sg)] = train(cfg, env=env).losses
    if rank == 0:
        (Path(root) / "losses.json").write_text(json.dumps(out))


def test_scatter_gather_on_and_off_are_identical(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_check_scatter_gather, 4, tiny_data, str(tmp_path))
    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses["True"] == losses["False"]  # the same numbers, moved differently
    single = train(_scatter_gather_config(tiny_data, tmp_path / "single"))
    for step, loss in single.losses.items():
        assert losses["True"][str(step)] == pytest.approx(loss, rel=1e-5)
    assert_same_run(tmp_path / "single", tmp_path / "sgTrue", single.losses, single.losses)


DEEPSEEK = LLAMA | {
    "attention": "mla", "num_query_groups": 0, "q_lora_rank": 16, "kv_lora_rank": 12,
    "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 10, "mtp_depth": 1,
}  # fmt: skip
"""Latent attention with one depth of multi-token prediction, for the 16-bit runs."""


def _bf16_config(
    data: str,
    run_dir: Path,
    zero: int = 0,
    precision: str = "bf16",
    cp: int = 1,
    ep: int = 0,
    deepseek: bool = False,
):
    # No clipping: the norm's summation order differs between layouts, the update does not.
    optim = {"eps": 1e-6, "grad_clip": 0.0}
    train_ = {"precision": precision, "steps": 4}
    parallel = {"bucket_mb": 0.01, "zero": zero, "cp": cp, "ep": max(ep, 1)}
    model = {"num_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01} if ep else {}
    model |= DEEPSEEK if deepseek else {}
    return tiny_config(data, run_dir, optim=optim, train=train_, parallel=parallel, model=model)


def _check_bf16_sharded(rank: int, world_size: int, data: str, root: str) -> None:
    env = LaunchEnv(rank, world_size, rank)
    cfg, layout, run_data = prepare(_bf16_config(data, Path(root) / "steps", 1), env)
    trainer = Trainer(cfg, layout, env, run_data)
    pieces = trainer.optimizer.pieces
    assert 0 < sum(x.hi - x.lo for x in pieces) < trainer.parameter_count(full=False)
    assert any(x.lo > 0 or x.hi < x.param.numel() for x in pieces)  # some split parameters
    for _ in range(2):
        trainer.optimizer_step(trainer.forward_backward())
    masters = trainer.optimizer.master_weights()  # all-gathered over dp
    for p, master in masters.items():  # every rank's weights: its own and gathered slices
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
    assert any(not torch.equal(m, m.bfloat16().float()) for m in masters.values())
    if trainer.watchdog:
        trainer.watchdog.close()
    if trainer.owns_process_group:
        dist.destroy_process_group()
    out = {}
    runs = [("bf16", z) for z in (0, 1, 2, 3)] + [("fp16", z) for z in (0, 2, 3)]
    for precision, zero in runs:
        cfg = _bf16_config(data, Path(root) / f"{precision}-zero{zero}", zero, precision)
        result = train(cfg, env=env)
        out[f"{precision}-zero{zero}"] = [result.losses, result.optimizer_bytes]
    for precision in ("bf16", "fp16"):  # context parallelism in 16 bits: fp32 merges
        cfg = _bf16_config(data, Path(root) / f"{precision}-cp2", 0, precision, cp=2)
        out[f"{precision}-cp2"] = [train(cfg, env=env).losses, 0]
        for ep in (1, 2):  # a mixture of experts, its experts split over the 2 ranks or not
            cfg = _bf16_config(
                data, Path(root) / f"{precision}-moe-ep{ep}", precision=precision, ep=ep
            )
            out[f"{precision}-moe-ep{ep}"] = [train(cfg, env=env).losses, 0]
    cfg = _bf16_config(data, Path(root) / "bf16-deepseek-zero1", 1, deepseek=True)
    out["bf16-deepseek-zero1"] = [train(cfg, env=env).losses, 0]
    if rank == 0:
        (Path(root) / "losses.json").write_text(json.dumps(out))


def test_bf16_distributed_optimizer(tiny_data: str, tmp_path: Path) -> None:
    """bf16 weights, fp32 masters sharded over dp = 2 in small buckets: each rank writes its
    slices of the masters back into the bf16 weights and all-gathers them, so after every
    step each weight is its master rounded to bf16. Sharded and replicated runs sum the same
    two fp32 gradients and apply the same elementwise AdamW: they agree bit for bit, and
    with one process (which accumulates its microbatches' bf16 gradients) to bf16 rounding.
    ZeRO-2 reduces each microbatch's gradients apart and sums the reduced ones: to fp32
    rounding of ZeRO-1's sums. fp16 (loss scaling, unscaled and checked on the shards) too.
    ZeRO-3 (16-bit gathers of the shards, fp32 masters) computes what ZeRO-2 does: the same
    losses, bit for bit, in bf16 and fp16. Context parallelism (cp = 2, ring attention with
    its partial results merged in fp32) matches one process to 16-bit rounding, and a
    mixture of experts with its experts split over ep = 2 (16-bit rows through the
    all-to-all) the same model at ep = 1. Latent attention with multi-token prediction,
    ZeRO-1 over dp = 2, matches one process to 16-bit rounding too."""
    run_ranks(_check_bf16_sharded, 2, tiny_data, str(tmp_path))
    got = json.loads((tmp_path / "losses.json").read_text())
    (replicated, full_bytes), (sharded, shard_bytes) = got["bf16-zero0"], got["bf16-zero1"]
    assert sorted(sharded) == ["1", "2", "3", "4"] and sharded == replicated
    assert shard_bytes == pytest.approx(full_bytes / 2, rel=0.05)  # masters and moments halved
    a = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "bf16-zero0"))["model"]
    b = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "bf16-zero1"))["model"]
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for zero2, other in (("bf16-zero2", sharded), ("fp16-zero2", got["fp16-zero0"][0])):
        losses, state_bytes = got[zero2]
        assert state_bytes == shard_bytes
        for step, loss in other.items():
            assert losses[step] == pytest.approx(loss, rel=1e-4), (zero2, step)
    for precision in ("bf16", "fp16"):
        assert got[f"{precision}-zero3"] == got[f"{precision}-zero2"], precision
    single = train(_bf16_config(tiny_data, tmp_path / "single"))
    for step, loss in single.losses.items():
        assert sharded[str(step)] == pytest.approx(loss, rel=1e-4), step
        assert got["bf16-cp2"][0][str(step)] == pytest.approx(loss, rel=2e-3), step
    for precision in ("bf16", "fp16"):
        split, whole = got[f"{precision}-moe-ep2"][0], got[f"{precision}-moe-ep1"][0]
        assert sorted(split) == ["1", "2", "3", "4"] and split["1"] == whole["1"]
        for step, loss in whole.items():
            assert split[step] == pytest.approx(loss, rel=2e-3), (precision, step)
    deepseek = train(_bf16_config(tiny_data, tmp_path / "single-deepseek", deepseek=True))
    for step, loss in deepseek.losses.items():
        assert got["bf16-deepseek-zero1"][0][str(step)] == pytest.approx(loss, rel=1e-4), step
    fp16 = train(_bf16_config(tiny_data, tmp_path / "single-fp16", precision="fp16"))
    for step, loss in fp16.losses.items():
        assert got["fp16-cp2"][0][str(step)] == pytest.approx(loss, rel=2e-3), step
