"""Joining a launch made by SLURM's `srun` alone (no torchrun): each task's rank, world size
and local rank from the variables srun sets, and where rank 0 hosts the key-value store.

Pure apart from `first_host`, which asks `scontrol show hostnames` when it is installed:
- rank, world size, local rank, node: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID;
- address: MASTER_ADDR if set, else the first host of the step's node list
  (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST), where srun places task 0;
- port: MASTER_PORT if set, else `port_for_job(SLURM_JOB_ID)`, the same on every task of
  the job without any communication.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from ptdp.errors import ConfigError

PORT_BASE, PORT_SPAN = 15000, 16384
"""Derived ports lie in [15000, 31384): below Linux's ephemeral range (32768-60999), so an
outgoing connection on the node cannot already hold the port."""

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class SlurmTask:
    """One srun task's place in the launch."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    master_addr: str
    master_port: int


def is_srun_task(environ: Mapping[str, str]) -> bool:
    """srun sets SLURM_PROCID and SLURM_NTASKS in every task it starts."""
    return bool(environ.get("SLURM_PROCID")) and bool(environ.get("SLURM_NTASKS"))


def read_slurm_task(environ: Mapping[str, str]) -> SlurmTask:
    """The task's place from srun's variables (see the module docstring); a value that
    cannot work is refused with the variable's name, before any process group."""
    rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(
            f"SLURM_PROCID={rank} with SLURM_NTASKS={world} is not a valid srun task (need "
            "0 <= SLURM_PROCID < SLURM_NTASKS); start the processes with srun, which sets both"
        )
    local_rank, node = _int(environ, "SLURM_LOCALID", 0), _int(environ, "SLURM_NODEID", 0)
    if world == 1:  # one process: no store to meet at
        return SlurmTask(rank, world, local_rank, node, "", 0)
    return SlurmTask(rank, world, local_rank, node, _master_addr(environ), _master_port(environ))


def _master_addr(environ: Mapping[str, str]) -> str:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    name = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if environ.get(n)), "")
    if not name:
        raise ConfigError(
            "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set, so rank 0's host is unknown; "
            "launch with srun inside a job (sbatch, salloc), or set MASTER_ADDR to rank 0's host"
        )
    host = first_host(environ[name])
    here = environ.get("SLURMD_NODENAME", "")
    if environ["SLURM_PROCID"].strip() == "0" and here and here != host:
        raise ConfigError(
            f"rank 0 runs on {here} but the first host of {name} is {host} (a task "
            "distribution that does not put task 0 first); set MASTER_ADDR to rank 0's host"
        )
    return host


def _master_port(environ: Mapping[str, str]) -> int:
    if environ.get("MASTER_PORT"):
        port = _int(environ, "MASTER_PORT")
        if not 0 < port < 65536:
            raise ConfigError(f"MASTER_PORT={port} is not a port; set it to 1-65535")
        return port
    if not environ.get("SLURM_JOB_ID"):
        raise ConfigError(
            "neither MASTER_PORT nor SLURM_JOB_ID is set, so the ranks cannot agree on a port; "
            "launch with srun inside a job, or set MASTER_PORT"
        )
    return port_for_job(_int(environ, "SLURM_JOB_ID"))


def port_for_job(job_id: int) -> int:
    """The store's port for a job: the same on every task, different for jobs whose ids
    differ by less than PORT_SPAN (two jobs sharing a node; MASTER_PORT settles a clash)."""
    return PORT_BASE + job_id % PORT_SPAN


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `scontrol show hostnames` when installed (it
    knows every syntax SLURM accepts), else our own `expand_nodelist`."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            out = []
        if out:
            return out[0]
    return expand_nodelist(nodelist)[0]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list, in its order: `node[01-03,07],gpu5` is
    node01, node02, node03, node07, gpu5 (zero padding kept; several bracket groups in one
    name, `r[1-2]n[1-2]`, expand first group slowest)."""
    hosts = [h for part in _top_level(nodelist) for h in _expand_name(part, nodelist)]
    if not hosts:
        raise _bad(nodelist, "it names no host")
    return hosts


def _top_level(nodelist: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(nodelist):
        depth += (c == "[") - (c == "]")
        if depth not in (0, 1):
            raise _bad(nodelist, "its brackets are unbalanced or nested")
        if c == "," and depth == 0:
            parts.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise _bad(nodelist, "a bracket is not closed")
    return [p.strip() for p in [*parts, nodelist[start:]] if p.strip()]


def _expand_name(name: str, nodelist: str) -> list[str]:
    if "[" not in name:
        if "]" in name:
            raise _bad(nodelist, f"{name!r} has ']' without '['")
        return [name]
    head, rest = name.split("[", 1)
    inside, tail = rest.split("]", 1)
    numbers = [n for r in inside.split(",") for n in _expand_range(r.strip(), nodelist)]
    return [head + n + t for n in numbers for t in _expand_name(tail, nodelist)]


def _expand_range(text: str, nodelist: str) -> list[str]:
    match = _RANGE.match(text)
    if not match:
        raise _bad(nodelist, f"{text!r} is not a number or a range lo-hi")
    lo, hi = match.group(1), match.group(2) or match.group(1)
    if int(hi) < int(lo):
        raise _bad(nodelist, f"the range {text} runs backwards")
    return [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]


def _bad(nodelist: str, why: str) -> ConfigError:
    return ConfigError(
        f"cannot read the SLURM node list {nodelist!r}: {why}; set MASTER_ADDR to rank 0's host"
    )


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name, "").strip()
    if not value and default is not None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={value!r} is not an integer; unset it, or start the "
            "processes with srun, which sets SLURM's variables"
        ) from None
