"""ZeRO-3's fp8 all-gather (parallel.zero3_fp8_all_gather) over dp = 2: the same training,
bit for bit, as gathering the 16-bit weights, with the float8 buckets moving half the bytes
and their 16-bit full weights never allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import prepare
from ptdp.train.step.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.dist.test_zero import _close
from tests.helpers import tiny_config

pytestmark = pytest.mark.dist


DP2 = {"recompute": "full"}
"""dp = 2 with full recomputation: a recomputed forward inside backward uses the gathered
float8 weights too."""
WORLD4 = {
    "tp-sp": {"tp": 2, "sequence_parallel": True},
    "pp-zb": {"pp": 2, "schedule": "zb-h1"},
}
"""dp = 2 under tp = 2 with sequence parallelism, and under a zero-bubble pipeline (the
weight gradients of the float8 GEMMs computed at W, after B released nothing early)."""


def _train(data: str, run_dir: Path, env: LaunchEnv, on: bool, parallel: dict) -> dict:
    """Three steps of a 2-layer fp8 model under ZeRO-3 over dp = 2."""
    cfg = tiny_config(
        data,
        run_dir,
        model={"seq_length": 16},
        parallel={"zero": 3, "bucket_mb": 0.01, "zero3_fp8_all_gather": on, **parallel},
        optim={"eps": 1e-6, "grad_clip": 0.5},
        train={"micro_batch_size": 2, "global_batch_size": 8, "precision": "fp8"},
    )
    cfg, layout, run_data = prepare(cfg, env)
    trainer = Trainer(cfg, layout, env, run_data)
    gather, gathers, whole16 = trainer.grads.gather, [], []
    count = gather.count

    def counted(kind, tensor, times=1):
        gathers.append((kind, tensor.dtype.itemsize, tensor.numel(), tensor.nbytes))
        count(kind, tensor, times)

    gather.count = counted
    fp8_buckets = [b for b in gather.buckets if b.whole8 is not None]
    layer = next(iter(trainer.chunks[0].layers.values()))  # while it is gathered
    layer.register_forward_hook(
        lambda *_: whole16.append([b.whole.untyped_storage().nbytes() for b in fp8_buckets])
    )
    losses, norms = [], []
    for _ in range(3):
        loss = trainer.forward_backward()
        norm, _ = trainer.optimizer_step(loss)
        losses.append(loss.item())
        norms.append(norm.item())
    names = {p: n for chunk in trainer.chunks for n, p in chunk.named_parameters()}
    masters = {names[p]: w.tolist() for p, w in trainer.optimizer.master_weights().items()}
    _close(trainer)
    return {
        "losses": losses,
        "norms": norms,
        "masters": masters,
        "buckets": len(gather.buckets),
        "gathers": gathers,
        "fp8_buckets": len(fp8_buckets),
        "fp8_elems": sum(b.size for b in fp8_buckets),
        "whole16": whole16,
    }


def _both(rank: int, world: int, data: str, root: str, layouts: dict[str, dict]) -> None:
    env = LaunchEnv(rank, world, rank)
    for name, parallel in layouts.items():
        got = [_train(data, Path(root) / name / str(on), env, on, parallel) for on in (0, 1)]
        (Path(root) / f"{name}-rank{rank}.json").write_text(json.dumps(got))


def test_fp8_all_gather_trains_bitwise_alike_and_halves_the_bytes(
    tiny_data: str, tmp_path: Path
) -> None:
    pytest.importorskip("torchao")
    run_ranks(_both, 2, tiny_data, str(tmp_path), {"dp2": DP2})
    for rank in (0, 1):
        off, on = json.loads((tmp_path / f"dp2-rank{rank}.json").read_text())
        # The same scales and float8 bytes as each GEMM's own cast: bitwise the same run.
        assert on["losses"] == off["losses"] and on["norms"] == off["norms"]
        assert on["masters"] == off["masters"]  # every weight after the last update
        assert off["fp8_buckets"] == 0 < on["fp8_buckets"] < on["buckets"]
        # The same elements gathered (in more, smaller buckets: cut where float8 begins and
        # ends); float8 ones 1 byte an element, 16-bit ones 2.
        gathered = [g for g in on["gathers"] if g[0] == "all_gather"]
        assert sum(g[2] for g in gathered) == sum(g[2] for g in off["gathers"])
        assert {tuple(g[1:2]) for g in off["gathers"]} == {(2,)}
        eight = [g for g in gathered if g[1] == 1]
        assert eight and all(g[3] == g[2] for g in eight)
        assert all(g[3] == 2 * g[2] for g in gathered if g[1] == 2)
        # One amax all-reduce per step: a float32 per fp8 weight (4 a layer here).
        reduces = [g for g in on["gathers"] if g[0] == "all_reduce"]
        assert reduces == [["all_reduce", 4, 8, 32]] * 3
        # Layer 0's forward (and recomputed forward) ran with its float8 weights gathered
        # and the 16-bit full weights of the fp8 buckets empty.
        assert on["whole16"] and all(x == [0] * on["fp8_buckets"] for x in on["whole16"])


def test_fp8_all_gather_with_tensor_and_pipeline_parallelism(
    tiny_data: str, tmp_path: Path
) -> None:
    """The same training with the fp8 all-gather on, under tp = 2 with sequence parallelism
    (each rank's tensor-parallel shard scaled alone, as without it) and under the
    zero-bubble schedule ZB-H1. To float32 rounding: the first step's losses are equal, but
    the buckets are cut where the float8 weights begin and end, so each rank's part of the
    gradient norm sums other elements (another order), which reaches the clipped update."""
    pytest.importorskip("torchao")
    run_ranks(_both, 4, tiny_data, str(tmp_path), WORLD4, timeout_s=300)
    for name in WORLD4:
        for rank in range(4):
            off, on = json.loads((tmp_path / f"{name}-rank{rank}.json").read_text())
            assert on["losses"][0] == off["losses"][0], name
            assert on["losses"] == pytest.approx(off["losses"], rel=1e-6), name
            assert on["norms"] == pytest.approx(off["norms"], rel=1e-6), name
            assert on["masters"].keys() == off["masters"].keys()
            for key, want in off["masters"].items():
                got, want = torch.tensor(on["masters"][key]), torch.tensor(want)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=key)
            assert on["fp8_buckets"] > 0 and on["whole16"], name
            assert all(x == [0] * on["fp8_buckets"] for x in on["whole16"]), name
