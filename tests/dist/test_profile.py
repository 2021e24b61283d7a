"""`train.profile_timeline`: the last step's measured actions of every pipeline rank,
written beside the schedule replayed at the measured action times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ptdp.parallel.env import LaunchEnv
from ptdp.train.run import train
from tests.dist.harness import run_ranks
from tests.helpers import tiny_config

pytestmark = pytest.mark.dist


def _config(data: str, run_dir: Path, pp: int):
    return tiny_config(
        data,
        run_dir,
        model={"num_layers": 4},
        parallel={"pp": pp, "schedule": "zb-h1" if pp > 1 else "1f1b"},
        train={"steps": 2, "micro_batch_size": 2, "profile_timeline": True},
    )


def _train(rank: int, world_size: int, data: str, run_dir: str) -> None:
    train(_config(data, Path(run_dir), world_size), env=LaunchEnv(rank, world_size, rank))


def _events(run_dir: Path) -> dict[str, list[dict]]:
    trace = json.loads((run_dir / "timeline.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    by_source: dict[str, list[dict]] = {}
    for e in trace:
        if e["ph"] == "X":
            by_source.setdefault(names[e["pid"]].rsplit(" rank", 1)[0], []).append(e)
    return by_source


@pytest.mark.parametrize("pp", [1, 2])
def test_timeline_of_the_last_step(tiny_data: str, tmp_path: Path, pp: int) -> None:
    if pp == 1:
        train(_config(tiny_data, tmp_path, 1))
    else:
        run_ranks(_train, pp, tiny_data, str(tmp_path))
    assert (tmp_path / "timeline.png").stat().st_size > 0
    sources = _events(tmp_path)
    assert set(sources) == {"measured", "schedule at measured action times"}
    m = 4  # global batch 8 / micro batch 2
    kinds = ("F", "B", "W") if pp > 1 else ("F", "BW")
    for events in sources.values():  # one step: every action of every stage exactly once
        names = sorted(e["name"] for e in events if e["cat"] in kinds)
        expected = sorted(f"{k} s{s} mb{j}" for k in kinds for s in range(pp) for j in range(m))
        assert names == expected
        assert all(e["dur"] >= 0 for e in events)
