"""ptdp/parallel/slurm.py and how LaunchEnv uses it: SLURM's compressed node lists, the
derived store address and port, torchrun's variables winning, and bad values refused."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptdp.errors import ConfigError
from ptdp.parallel.env import LaunchEnv, Launcher, init_process_group
from ptdp.parallel.slurm import (
    PORT_BASE,
    PORT_SPAN,
    expand_nodelist,
    first_host,
    port_for_job,
    read_slurm_task,
)

LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID", "SLURMD_NODENAME",
)  # fmt: skip

TASK = {  # task 5 of 8, the second on the second node, of job 123456
    "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[003-004,010],login1", "SLURM_JOB_ID": "123456",
}  # fmt: skip


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("solo", ["solo"]),
        ("n[9-11]", ["n9", "n10", "n11"]),  # no padding: plain numbers
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padding kept, then outgrown
        ("a,b[2],c", ["a", "b2", "c"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[3,1]", ["x3", "x1"]),  # SLURM's order, not sorted: task 0 is on the first
        ("gpu-a100-[1-2].cluster", ["gpu-a100-1.cluster", "gpu-a100-2.cluster"]),
    ],
)
def test_nodelists_expand_in_order(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    ("nodelist", "why"),
    [
        ("", "names no host"),
        ("node[01-04", "a bracket is not closed"),
        ("node01]", "unbalanced"),
        ("n[[1-2]]", "unbalanced or nested"),
        ("n[4-2]", "the range 4-2 runs backwards"),
        ("n[a-b]", "'a-b' is not a number or a range"),
        ("n[1-2-3]", "'1-2-3' is not a number or a range"),
    ],
)
def test_bad_nodelists_are_refused_with_the_fix(nodelist: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand_nodelist(nodelist)
    assert why in str(info.value) and "set MASTER_ADDR" in str(info.value)


def _fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    exe = tmp_path / "bin" / "scontrol"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\n{script}\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}")


def test_first_host_asks_scontrol_when_installed(tmp_path, monkeypatch) -> None:
    # It prints the hosts of the list it is given, one a line.
    _fake_scontrol(
        tmp_path, monkeypatch, 'test "$1 $2" = "show hostnames" && echo "$3"-x && echo b'
    )
    assert first_host("node[01-02]") == "node[01-02]-x"


def test_first_host_parses_when_scontrol_fails(tmp_path, monkeypatch) -> None:
    _fake_scontrol(tmp_path, monkeypatch, "exit 1")
    assert first_host("node[07-08],gpu1") == "node07"
    monkeypatch.setenv("PATH", "")
    assert first_host("node[07-08],gpu1") == "node07"


def test_port_is_derived_from_the_job_id() -> None:
    assert port_for_job(123456) == PORT_BASE + 123456 % PORT_SPAN == 23768
    ports = {port_for_job(j) for j in range(10_000, 10_000 + PORT_SPAN)}
    assert len(ports) == PORT_SPAN and min(ports) == 15000 and max(ports) < 32768


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch):
    """Set launch variables on a cleared launch environment (no scontrol on PATH)."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", "")

    def set_vars(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_vars


def test_srun_task_alone(environ) -> None:
    environ(**TASK)
    env = LaunchEnv.from_environ()
    assert env == LaunchEnv(
        rank=5,
        world_size=8,
        local_rank=1,
        node_rank=1,
        master_addr="gpu003",
        master_port=23768,
        launcher=Launcher.SLURM,
    )
    assert env.store_host() == "rank 0 at gpu003:23768"


def test_master_addr_and_port_override_the_derived_ones(environ) -> None:
    environ(**TASK, MASTER_ADDR="10.1.2.3", MASTER_PORT="29400")
    env = LaunchEnv.from_environ()
    assert (env.launcher, env.rank, env.master_addr, env.master_port) == (
        Launcher.SLURM, 5, "10.1.2.3", 29400
    )  # fmt: skip


def test_the_step_node_list_comes_first(environ) -> None:
    environ(**TASK, SLURM_STEP_NODELIST="gpu[010,003]")  # `srun --nodelist` on a subset
    assert LaunchEnv.from_environ().master_addr == "gpu010"


def test_torchrun_variables_win(environ) -> None:
    # srun launching torchrun: its workers inherit srun's variables beside torchrun's.
    environ(**TASK, RANK="3", WORLD_SIZE="16", LOCAL_RANK="3", GROUP_RANK="0")
    environ(MASTER_ADDR="head", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="7")
    env = LaunchEnv.from_environ()
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == (Launcher.ENV, 3, 16, 3)
    assert env.store_host() == "the torchrun agent at head:29500 (the first node)"


def test_one_task_needs_no_store(environ) -> None:
    environ(SLURM_PROCID="0", SLURM_NTASKS="1")  # `srun -n 1 ptdp train`, no job id needed
    assert LaunchEnv.from_environ() == LaunchEnv(0, 1, 0, launcher=Launcher.SLURM)


def test_without_srun_one_process(environ) -> None:
    environ(SLURM_NTASKS="8", SLURM_JOB_ID="1")  # an salloc shell: no task of its own
    assert LaunchEnv.from_environ() == LaunchEnv(0, 1, 0)


@pytest.mark.parametrize(
    ("values", "fragments"),
    [
        (
            {"SLURM_PROCID": "8"},
            ("SLURM_PROCID=8 with SLURM_NTASKS=8", "0 <= SLURM_PROCID < SLURM_NTASKS", "srun"),
        ),
        ({"SLURM_NTASKS": "eight"}, ("SLURM_NTASKS='eight' is not an integer", "srun")),
        ({"SLURM_LOCALID": "x"}, ("SLURM_LOCALID='x' is not an integer",)),
        (
            {"SLURM_JOB_NODELIST": ""},
            ("neither MASTER_ADDR nor SLURM_JOB_NODELIST is set", "set MASTER_ADDR"),
        ),
        ({"SLURM_JOB_NODELIST": "gpu[1-"}, ("cannot read the SLURM node list", "MASTER_ADDR")),
        (
            {"SLURM_JOB_ID": ""},
            ("neither MASTER_PORT nor SLURM_JOB_ID is set", "set MASTER_PORT"),
        ),
        ({"MASTER_PORT": "70000"}, ("MASTER_PORT=70000 is not a port",)),
        (
            {"SLURM_PROCID": "0", "SLURMD_NODENAME": "gpu010"},
            ("rank 0 runs on gpu010 but the first host", "is gpu003", "set MASTER_ADDR"),
        ),
        (  # an sbatch recipe's `export WORLD_SIZE=$SLURM_NTASKS`
            {"WORLD_SIZE": "8"},
            ("WORLD_SIZE=8 is set but RANK", "under srun, unset WORLD_SIZE"),
        ),
    ],
    ids=[
        "procid-out-of-range", "ntasks-not-int", "localid-not-int", "no-nodelist",
        "bad-nodelist", "no-job-id", "port-out-of-range", "rank0-elsewhere", "world-size-leak",
    ],
)  # fmt: skip
def test_bad_srun_environments_are_refused(environ, values, fragments) -> None:
    environ(**{**TASK, **values})
    with pytest.raises(ConfigError) as info:
        LaunchEnv.from_environ()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in: {info.value}"


def test_read_slurm_task_reads_the_mapping_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    task = read_slurm_task({**TASK, "SLURM_PROCID": "0", "SLURMD_NODENAME": "gpu003"})
    assert (task.rank, task.master_addr) == (0, "gpu003")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_task_left_alone_says_how_to_launch(rank: int) -> None:
    """`ptdp train` run in the batch script itself, not under srun: SLURM_NTASKS says 2, but
    no other rank comes. Rank 0 hosts the store and waits; rank 1 finds no store."""
    with socket.socket() as s:  # a port free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = LaunchEnv(rank, 2, 0, master_addr="127.0.0.1", master_port=port, launcher=Launcher.SLURM)
    with pytest.raises(ConfigError) as info:
        init_process_group(env, torch.device("cpu"), timeout_s=1)
    text = str(info.value)
    assert f"rank {rank} of 2 (node 0) could not meet the others at the store of rank 0 at" in text
    assert "within 1 s" in text and "start all SLURM_NTASKS=2 tasks with srun" in text
    assert not dist.is_initialized()
