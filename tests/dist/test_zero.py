"""ZeRO levels over dp = 2: the model state each rank measurably holds equals the memory
model's figure at every level, and checkpoints move between levels (and to tp = 2 and back)
with the optimizer state intact (moments compared tensor by tensor), a resume at the same
level bit for bit. Equivalence with one process is in the grid (tests/dist/test_grid.py)."""

from __future__ import annotations

import gc
import json
import weakref
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp import checkpoint as ckpt
from ptdp.parallel.env import LaunchEnv
from ptdp.parallel.init import ShardSpec, shard_spec
from ptdp.perf.cost.memory import estimate_memory
from ptdp.train.run import prepare
from ptdp.train.step import optim
from ptdp.train.step.trainer import Trainer
from tests.dist.harness import run_ranks
from tests.helpers import tiny_config

pytestmark = pytest.mark.dist


def _config(data: str, run_dir: Path, zero: int, tp: int = 1, **train):
    # Even sizes everywhere: no bucket padding, so the bytes are the formula's exactly.
    # Four layers: ZeRO-3 holds at most the root and two layers (module doc of zero3.py).
    return tiny_config(
        data,
        run_dir,
        model={"num_layers": 4},
        parallel={"zero": zero, "tp": tp},
        optim={"eps": 1e-6, "grad_clip": 0.5},
        train={"micro_batch_size": 2, "global_batch_size": 8, "steps": 3, **train},
    )


def _trainer(cfg, env: LaunchEnv) -> Trainer:
    cfg, layout, data = prepare(cfg, env)
    return Trainer(cfg, layout, env, data)


def _close(trainer: Trainer) -> None:
    if trainer.watchdog:
        trainer.watchdog.close()
    if trainer.owns_process_group:
        dist.destroy_process_group()


def _measure(trainer: Trainer) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state this rank holds after a step."""
    trainer.optimizer_step(trainer.forward_backward())
    grads = trainer.grads
    return {
        "params": float(grads.param_bytes()),  # ZeRO-3: nothing left gathered after a step
        "grads": float(grads.grad_bytes()),
        "optimizer": float(trainer.optimizer.state_bytes()),
        "peak_full": float(grads.peak_full_bytes),
        "peak_gathered": float(grads.gather.peak_bytes if grads.gather else 0),
    }


def _check_memory(rank: int, world: int, data: str, root: str) -> None:
    env, out = LaunchEnv(rank, world, rank), {}
    for precision in ("fp32", "bf16"):
        for zero in (0, 1, 2, 3):
            cfg = _config(data, Path(root) / f"{precision}{zero}", zero, precision=precision)
            trainer = _trainer(cfg, env)
            got = _measure(trainer)
            (est,) = estimate_memory(trainer.cfg, world, layout=trainer.layout)
            held = [weakref.ref(p) for chunk in trainer.chunks for p in chunk.parameters()]
            _close(trainer)
            del trainer
            gc.collect()  # every level's hooks leave the weights free to go with the trainer
            assert [r() for r in held] == [None] * len(held), (precision, zero)
            want = {"params": est.params, "grads": est.grads, "optimizer": est.optimizer}
            assert {k: got[k] for k in want} == want, (precision, zero, got, want)
            # ZeRO-2's full buckets in flight: here one bucket holds the whole model (ZeRO-3
            # cuts buckets at layers: fewer in flight).
            if zero < 3:
                assert got["peak_full"] == est.grad_buckets, (precision, zero, got, est)
            out[f"{precision}{zero}"] = got
    if rank == 0:
        (Path(root) / "memory.json").write_text(json.dumps(out))


def test_model_state_bytes_per_level(tiny_data: str, tmp_path: Path) -> None:
    """Each level divides what it shards by dp = 2 and keeps the rest: measured on the
    trainer's buffers and optimizer after a step, equal to `estimate_memory`."""
    run_ranks(_check_memory, 2, tiny_data, str(tmp_path))
    got = json.loads((tmp_path / "memory.json").read_text())
    for precision in ("fp32", "bf16"):
        z0, z1, z2, z3 = (got[f"{precision}{zero}"] for zero in (0, 1, 2, 3))
        assert z1["params"] == z0["params"] == z2["params"] == 2 * z3["params"]
        assert z1["optimizer"] == z2["optimizer"] == z3["optimizer"] == z0["optimizer"] / 2
        assert z1["grads"] == z0["grads"] == 2 * z2["grads"] == 2 * z3["grads"]
        assert z0["peak_full"] == z1["peak_full"] == 0 < z3["peak_full"] < z2["peak_full"]
        # Gathered parameters: never the whole model at once, more than one layer's shard.
        assert z2["peak_gathered"] == 0 < z3["params"] < z3["peak_gathered"] < z0["params"]


def _moments(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Masters and AdamW moments by parameter name, all-gathered to tensor-local shape."""
    names = {p: n for chunk in trainer.chunks for n, p in chunk.named_parameters()}
    moments, step = trainer.optimizer.moments()
    masters = trainer.optimizer.master_weights()
    return {names[p]: {"master": masters[p], **moments[p], "step": step} for p in moments}


def _specs(trainer: Trainer) -> dict[str, ShardSpec | None]:
    """Each parameter's tensor-parallel split, None when the layout has no tp."""
    params = [(n, p) for chunk in trainer.chunks for n, p in chunk.named_parameters()]
    return {n: shard_spec(p) if trainer.layout.tp > 1 else None for n, p in params}


def _same(saved: dict, saved_specs: dict, loaded: dict, loaded_specs: dict, rank: int) -> None:
    """Every master and moment equal, the tp = 1 side sliced as the tp = 2 side holds it."""
    assert loaded.keys() == saved.keys()
    for name, state in saved.items():
        spec = saved_specs[name] or loaded_specs[name]
        for key, value in state.items():
            other = loaded[name][key]
            if key == "step":
                assert other == value, name
                continue
            if spec is not None:  # one of the two layouts splits it over tp (rank = tp rank)
                value = value if saved_specs[name] else spec.shard(value, rank)
                other = other if loaded_specs[name] else spec.shard(other, rank)
            assert torch.equal(other, value), (name, key)


@contextmanager
def _no_gather():
    """The optimizer's all-gather over dp (what `master_weights` uses) fails if called."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a checkpoint save all-gathered the optimizer's shards")

    saved = optim.all_gather_flat
    optim.all_gather_flat = refuse
    try:
        yield
    finally:
        optim.all_gather_flat = saved


def _check_checkpoints(rank: int, world: int, data: str, root: str) -> None:
    """Save at one level, restore at the others: the same masters and moments, and the next
    step's loss as the saving level reaches it. "tp": the same ranks as tp = 2 instead."""
    env, root_ = LaunchEnv(rank, world, rank), Path(root)
    levels = {0: (0, 1), 1: (1, 1), 2: (2, 1), 3: (3, 1), "tp": (0, 2)}
    for source, targets in ((2, (0, 1)), (0, (2,)), (3, (0, 2, 3, "tp")), (1, (3,)), ("tp", (3,))):
        saver = _trainer(_config(data, root_ / f"save{source}", *levels[source]), env)
        for _ in range(2):
            saver.train_step()
        with _no_gather():  # a save writes each rank's shards where they are
            path = saver.save()
        saver.finish_save()
        saved, saved_specs = _moments(saver), _specs(saver)
        next_loss = saver.train_step()[0].item()
        _close(saver)
        for target in targets:
            cfg = _config(data, root_ / f"load{source}-{target}", *levels[target])
            loader = _trainer(cfg, env)
            loader.restore(path)
            assert loader.step == 2 and loader.layout.zero == levels[target][0]
            _same(saved, saved_specs, _moments(loader), _specs(loader), rank)
            loss = loader.train_step()[0].item()
            rel = 1e-5 if "tp" in (source, target) else 1e-6  # tp sums in another order
            assert loss == pytest.approx(next_loss, rel=rel), (source, target)
            if source == target:  # a resume in the same layout continues bit for bit
                assert loss == next_loss and torch.equal(
                    torch.cat([x.master.detach() for x in loader.optimizer.pieces]),
                    torch.cat([x.master.detach() for x in saver.optimizer.pieces]),
                ), source
            _close(loader)
    if rank == 0:
        (root_ / "done").write_text("ok")


def test_checkpoints_move_between_levels(tiny_data: str, tmp_path: Path) -> None:
    run_ranks(_check_checkpoints, 2, tiny_data, str(tmp_path))
    assert (tmp_path / "done").read_text() == "ok"
    assert ckpt.find_checkpoint(tmp_path / "save2") is not None
