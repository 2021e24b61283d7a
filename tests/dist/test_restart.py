"""Runs that continue by themselves (issue 21): torchrun restarts a run whose rank died and
it resumes without --resume; a restart with fewer processes keeps the global batch, the
data order and the schedule (elastic); a save in flight when a run failed is published
at the next start when every rank had finished writing it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.fault_tolerance.failures import launch, train_args
from ptdp import checkpoint as ckpt
from ptdp.parallel.env import LaunchEnv
from ptdp.train.faults.events import read_events
from ptdp.train.run import train
from ptdp.train.step.trainer import Trainer
from tests.dist.harness import RankError, run_ranks
from tests.dist.test_rank_death import _assert_matches_one_process
from tests.helpers import tiny_config

pytestmark = pytest.mark.dist


MOE_EP2 = (
    {"num_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01, "moe_bias_update_rate": 0.01},
    {"ep": 2},
)
"""A mixture of experts split over 2 expert-parallel ranks (and its balancing bias)."""


def _config(data: str, run_dir: Path, steps: int, moe: bool = False, **train_):
    model, parallel = MOE_EP2 if moe else ({}, {})
    return tiny_config(
        data,
        run_dir,
        train={"steps": steps, "micro_batch_size": 2, "keep_checkpoints": 0, **train_},
        optim={"decay_steps": 6, "distributed": True},  # the schedule does not follow steps
        # No biases: the key bias's true gradient is zero, so AdamW scales rounding noise
        # into updates of the learning rate's size, in any two layouts alike.
        model={"bias": False, **model},
        parallel=parallel,
    )


def test_torchrun_restart_resumes_by_itself(tiny_data: str, tmp_path: Path) -> None:
    """tp=2, pp=2 under `torchrun --max-restarts 1`: rank 2 is SIGKILLed in step 4 (once);
    torchrun restarts the four ranks, which resume from step 2 without --resume and finish;
    events.jsonl names the failure and the restart (cause, failed rank, steps lost, time
    from the fault to the first step), and the losses equal one uninterrupted process."""
    args = train_args(tiny_data, 2, 2, 6, save_interval=2)
    run = launch(tmp_path, args, "kill:2:4", torchrun=True, max_restarts=1)
    try:
        assert run.wait(limit_s=240), run.output(0)[-3000:]
        assert run.procs[0].returncode == 0, run.output(0)[-3000:]
    finally:
        run.kill_all()
    events = [e for e in read_events(run.run_dir) if e["event"] != "checkpoint"]  # saves
    assert [e["event"] for e in events] == ["failure", "restart"], events
    failure, restart = events
    assert failure["rank"] == 2 and failure["how"] == "no heartbeat" and failure["step"] == 4
    assert restart["launch"] == "torchrun restart 1" and restart["failed_rank"] == 2
    assert "no heartbeat" in restart["cause"]
    assert (restart["step"], restart["fault_step"], restart["steps_lost"]) == (2, 4, 1)
    assert 0 < restart["detection_s"] < restart["fault_to_first_step_s"] < 120
    fault_at = run.fault_at()  # written by the dying rank just before SIGKILL
    assert abs(failure["fault_time"] - fault_at) < 1.0
    log = run.output(0)
    assert "restart (torchrun restart 1): rank 2 failed (no heartbeat" in log, log[-3000:]
    assert "1 completed step lost; first step" in log
    _assert_matches_one_process(args, run.run_dir, tmp_path / "one")


def _elastic(rank: int, world: int, data: str, root: str, moe: bool) -> None:
    """4 ranks: dp=4 trains steps 1-3 and saves. 2 ranks (a restart with fewer processes):
    resume to step 6 at dp=2, and the same config trained at dp=2 from the start."""
    env = LaunchEnv(rank, world, rank, restart=int(world == 2))
    steps = 6 if world == 2 else 3
    losses = {"elastic": train(_config(data, Path(root) / "elastic", steps, moe), env=env).losses}
    if world == 2:
        losses["dp2"] = train(
            _config(data, Path(root) / "dp2", 6, moe), env=LaunchEnv(rank, world, rank)
        ).losses
    if rank == 0:
        Path(root, f"losses{world}.json").write_text(json.dumps(losses))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-ep2"])
def test_elastic_restart_into_a_smaller_world(
    tiny_data: str, tmp_path: Path, capfd, moe: bool
) -> None:
    """Saved at dp=4 (distributed optimizer: moments sharded over 4), restarted on 2
    processes: dp=2 with twice the microbatches per step; losses, weights and AdamW
    moments match a dp=2 run from the start to float32 rounding. With experts split over
    ep=2, their state is sharded over their 2 replicas at dp=4 and over none at dp=2."""
    run_ranks(_elastic, 4, tiny_data, str(tmp_path), moe)
    run_ranks(_elastic, 2, tiny_data, str(tmp_path), moe)
    first = json.loads((tmp_path / "losses4.json").read_text())["elastic"]
    runs = json.loads((tmp_path / "losses2.json").read_text())
    assert sorted(map(int, runs["elastic"])) == [4, 5, 6]
    reference = runs["dp2"]
    for step, loss in {**first, **runs["elastic"]}.items():
        assert loss == pytest.approx(reference[step], rel=1e-5), step
    a = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "elastic"))
    b = ckpt.load_checkpoint(ckpt.find_checkpoint(tmp_path / "dp2"))
    assert a["step"] == b["step"] == 6
    for name, weight in b["model"].items():
        torch.testing.assert_close(a["model"][name], weight, rtol=1e-5, atol=1e-6, msg=name)
    for name, moments in b["optimizer"]["state"].items():
        for key, value in moments.items():
            got = a["optimizer"]["state"][name][key]
            torch.testing.assert_close(got, value, rtol=1e-4, atol=1e-9, msg=f"{name} {key}")
    restart = [e for e in read_events(tmp_path / "elastic") if e["event"] != "checkpoint"][-1]
    assert restart["event"] == "restart" and restart["step"] == 3
    ep = " ep=2" if moe else ""
    assert f"world=4 tp=1{ep} pp=1 dp=4" in restart["layout_saved"]
    assert restart["layout_saved"].endswith("microbatches/step/rank=1")
    assert f"world=2 tp=1{ep} pp=1 dp=2" in restart["layout"]
    assert restart["layout"].endswith("microbatches/step/rank=2")
    out = capfd.readouterr().out
    assert (
        "elastic resume: saved with world=4 dp=4 microbatches/step/rank=1, now world=2 dp=2 "
        "microbatches/step/rank=2 (gradient accumulation x2); global batch 8 samples, data "
        "order and learning-rate schedule unchanged"
    ) in out, out[-3000:]


def _fail_with_a_save_in_flight(rank: int, world: int, data: str, root: str) -> None:
    """Asynchronous saves every step; in step 3 each rank waits until its write of step 2
    is on disk (as a background write that finished in time), then rank 1 raises: step
    2's save was never published."""
    original = Trainer.forward_backward

    def forward_backward(self):
        if self.step + 1 == 3:
            self.checkpoints._pending.future.result()
            if rank == 1:
                raise RuntimeError("injected fault on rank 1 at step 3")
        return original(self)

    Trainer.forward_backward = forward_backward
    cfg = _config(data, Path(root) / "run", 6, save_interval=1, async_save=True)
    train(cfg, env=LaunchEnv(rank, world, rank))


def test_a_save_in_flight_at_a_failure_is_published_when_whole(
    tiny_data: str, tmp_path: Path, capsys
) -> None:
    """Two ranks fail with step 2's background save written but unpublished: the next
    start publishes it from the ranks' records and checksums and resumes from step 2; the
    same directory with rank 1's record missing resumes from step 1 instead, saying why."""
    with pytest.raises(RankError, match="rank 1 failed"):
        run_ranks(_fail_with_a_save_in_flight, 2, tiny_data, str(tmp_path), timeout_s=90)
    run_dir, partial = tmp_path / "run", tmp_path / "partial"
    root = run_dir / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000001"
    assert (root / "step_00000002.tmp" / "written.rank1.json").is_file()
    shutil.copytree(run_dir, partial)
    (partial / "checkpoints" / "step_00000002.tmp" / "written.rank1.json").unlink()
    full = train(_config(tiny_data, tmp_path / "full", 6, save_interval=1))
    capsys.readouterr()
    resumed = train(_config(tiny_data, run_dir, 6, save_interval=1), resume=True)
    assert resumed.start_step == 2
    assert "published step_00000002: its save was in flight" in capsys.readouterr().out
    assert not (root / "step_00000002.tmp").exists()
    fallback = train(_config(tiny_data, partial, 6, save_interval=1), resume=True)
    assert fallback.start_step == 1
    out = capsys.readouterr().out
    assert "not published" in out and "lacks the record of rank 1" in out
    for result in (resumed, fallback):
        for step, loss in result.losses.items():
            assert loss == pytest.approx(full.losses[step], rel=1e-5), step


def test_rank0_death_without_torchrun_is_named_as_rank0(tiny_data: str, tmp_path: Path) -> None:
    """pp=2 launched by hand (rank 0 hosts the store): rank 0 is SIGKILLed in step 4. Rank
    1 names rank 0 as the rank that failed first (pid, host, last step), says the store it
    hosted is gone, exits within the timeout and records the failure in events.jsonl."""
    run = launch(tmp_path, train_args(tiny_data, 1, 2, 60), "kill:0:4", world=2)
    try:
        exited = run.wait(limit_s=120)
        assert 1 in exited and run.procs[1].returncode != 0, run.output(1)[-3000:]
        assert exited[1] - run.fault_at() < 12.0
    finally:
        run.kill_all()
    text = run.output(1)
    assert "rank 0 (pid" in text and "failed first, " in text, text[-3000:]
    assert "store is unreachable" in text and "rank 0 at 127.0.0.1:" in text
    failure = [e for e in read_events(run.run_dir) if e["event"] != "checkpoint"][-1]
    assert (failure["event"], failure["rank"], failure["how"]) == ("failure", 0, "store lost")
    assert failure["step"] == 4 and "pid" in failure
