"""Multi-node launch for real: two hosts built from network namespaces on this machine.

Each host is a network namespace (`ip netns`, iproute2) joined to the other by a veth
pair, with its own address, its own hostname (a UTS namespace) and its own /etc/hosts
naming both hosts, the way cluster nodes resolve each other. Each runs README.md's
multi-node command ("Launching with torchrun"): `torchrun --nnodes 2 --nproc-per-node 2`
with c10d rendezvous at the first host's address. With pp=2 (tp=1, dp=2) host A holds
ranks 0-1, pipeline stage 0, and host B ranks 2-3, stage 1, so activations, their
gradients, the losses and the checkpoint's gather all cross the veth. Losses and final
parameters match one process. Needs root, `ip` and `unshare`; skipped with the reason
where the machine does not allow it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ptdp.config.files import to_toml
from ptdp.train.run import train
from tests.helpers import assert_same_run, tiny_config

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parents[2]
PORT = 29500  # README's port; free in a fresh network namespace
TIMEOUT_S = 150
# (hostname, address, veth interface). The namespaces reach nothing but each other, so
# the subnet may repeat between concurrent runs; the namespace names carry the pid.
HOSTS = (("node-a", "10.213.0.1", "ptdp-a"), ("node-b", "10.213.0.2", "ptdp-b"))
STEPS, MICRO, GLOBAL, SEQ, HIDDEN = 3, 1, 8, 32, 32  # 4 ranks, pp=2: dp=2, 4 microbatches

# Inside the host's network namespace: a new UTS and mount namespace with the host's own
# /etc/hosts and hostname, then the command. Arguments: HOSTS_FILE HOSTNAME COMMAND...
ON_HOST = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


def _on_host(host: dict, cmd: list[str]) -> list[str]:
    return [
        "ip", "netns", "exec", host["ns"], "unshare", "--uts", "--mount",
        "sh", "-c", ON_HOST, "on-host", host["hosts_file"], host["name"], *cmd,
    ]  # fmt: skip


def _ip(*args: str) -> str:
    return subprocess.run(
        ["ip", *args], check=True, capture_output=True, text=True, timeout=30
    ).stdout


def _veth_bytes(host: dict) -> tuple[int, int]:
    """(received, sent) bytes on the host's veth: its traffic with the other host."""
    stats = json.loads(_ip("-n", host["ns"], "-s", "-j", "link", "show", host["iface"]))
    stats = stats[0]["stats64"]
    return stats["rx"]["bytes"], stats["tx"]["bytes"]


def _kill_leftovers(ns: str) -> None:
    """Kill what still runs in the namespace (workers of a torchrun killed at the timeout)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    for pid in out.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.fixture
def two_hosts(tmp_path: Path):
    """Two connected hosts: dicts with ns, name, addr, iface, hosts_file."""
    if os.geteuid() != 0:
        pytest.skip("multi-node test: creating network namespaces needs root")
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            pytest.skip(f"multi-node test: `{tool}` ({package}) is not installed")
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(
        "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr, _ in HOSTS)
    )
    hosts = [
        {"ns": f"ptdp-{name}-{os.getpid()}", "name": name, "addr": addr, "iface": iface,
         "hosts_file": str(hosts_file)}
        for name, addr, iface in HOSTS
    ]  # fmt: skip
    made = []
    try:
        try:
            for host in hosts:
                _ip("netns", "add", host["ns"])
                made.append(host["ns"])
            a, b = hosts
            _ip("link", "add", a["iface"], "netns", a["ns"], "type", "veth",
                "peer", "name", b["iface"], "netns", b["ns"])  # fmt: skip
            for host in hosts:
                _ip("-n", host["ns"], "addr", "add", f"{host['addr']}/24", "dev", host["iface"])
                _ip("-n", host["ns"], "link", "set", "lo", "up")
                _ip("-n", host["ns"], "link", "set", host["iface"], "up")
                probe = _on_host(host, ["hostname"])
                out = subprocess.run(probe, capture_output=True, text=True, timeout=30)
                if out.returncode != 0 or out.stdout.strip() != host["name"]:
                    raise subprocess.CalledProcessError(
                        out.returncode, probe, out.stdout, out.stderr
                    )
        except (subprocess.SubprocessError, OSError) as exc:
            detail = (getattr(exc, "stderr", None) or "").strip()
            pytest.skip(
                "multi-node test: this machine does not allow two hosts from network "
                f"namespaces (ip netns + veth + unshare --uts --mount): {exc} {detail}"
            )
        yield hosts
    finally:
        for ns in made:
            _kill_leftovers(ns)
            # The veth pair goes with its namespaces.
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


def _torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _launch(hosts: list[dict], cmd: list[str], tmp_path: Path) -> tuple[list, list[str]]:
    """Run `cmd` on every host at once (host B first: nodes start in any order);
    returns the exit codes (None: killed at the timeout) and the logs."""
    procs, logs = {}, {}
    try:
        for host in reversed(hosts):
            # LOGLEVEL=INFO: torchrun logs its rendezvous result (read below).
            env = {**os.environ, "GLOO_SOCKET_IFNAME": host["iface"], "OMP_NUM_THREADS": "1",
                   "LOGLEVEL": "INFO"}  # fmt: skip
            logs[host["name"]] = log = (tmp_path / f"{host['name']}.log").open("w+")
            procs[host["name"]] = subprocess.Popen(
                _on_host(host, cmd), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
            )
            time.sleep(1)
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
            if any(p.poll() not in (None, 0) for p in procs.values()):
                time.sleep(5)  # one host failed: give the other a moment to report, then stop
                break
            time.sleep(0.2)
    finally:
        for proc in procs.values():  # torchrun stops its workers on SIGTERM
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        texts = {}
        for name, log in logs.items():
            log.seek(0)
            texts[name] = log.read()
            log.close()
    order = [host["name"] for host in hosts]
    codes = [procs[n].returncode if n in procs else None for n in order]
    return codes, [texts.get(n, "") for n in order]


def test_two_hosts_pipeline_matches_single_process(two_hosts, tiny_data: str, tmp_path: Path):
    run_dir = tmp_path / "multinode"
    cfg = tiny_config(
        tiny_data, run_dir, model={"num_layers": 4}, optim={"eps": 1e-6},
        train={"micro_batch_size": MICRO, "global_batch_size": GLOBAL, "steps": STEPS,
               "log_interval": 1},
    )  # fmt: skip
    config = tmp_path / "config.toml"
    config.write_text(to_toml(cfg))
    single = train(replace(cfg, train=replace(cfg.train, run_dir=str(tmp_path / "single"))))

    a = two_hosts[0]
    before = [_veth_bytes(host) for host in two_hosts]
    # README.md, "Launching with torchrun", multi-node: the same command on every node.
    cmd = [
        *_torchrun(), "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a['addr']}:{PORT}",
        "--rdzv-id", f"ptdp-{os.getpid()}",
        "-m", "ptdp", "train", "--config", str(config), "--parallel.pp", "2",
    ]  # fmt: skip
    codes, logs = _launch(two_hosts, cmd, tmp_path)
    report = "".join(
        f"\n===== host {h['name']} ({h['addr']}, {h['iface']}): exit {code} =====\n{log}"
        for h, code, log in zip(two_hosts, codes, logs)
    )
    assert codes == [0, 0], f"torchrun on two hosts failed or timed out ({TIMEOUT_S} s):{report}"
    assert "world=4 tp=1 pp=2 dp=2" in logs[0], report
    assert "microbatches/step/rank=4" in logs[0], report

    # Two hosts, not one: c10d numbered the nodes by hostname (not by who came first: B
    # started first), both fetch the workers' store from host A by its name, and A holds
    # ranks 0-1 (stage 0), B ranks 2-3 (stage 1).
    for node_rank, log in enumerate(logs):
        ranks = [2 * node_rank, 2 * node_rank + 1]
        assert re.search(rf"\bgroup_rank={node_rank}\b", log), report
        assert re.search(rf"\bglobal_ranks=\[{ranks[0]}, {ranks[1]}\]", log), report
        assert re.search(rf"\bmaster_addr={a['name']}\b", log), report
    # ... and the pipeline ran over the veth: at least the activations (A to B) and their
    # gradients (B to A) of every microbatch of both pipelines crossed it.
    after = [_veth_bytes(host) for host in two_hosts]
    boundary = STEPS * (GLOBAL // MICRO) * MICRO * SEQ * HIDDEN * 4  # float32 bytes
    (a_rx, a_tx), (b_rx, b_tx) = ([x - y for x, y in zip(n, o)] for n, o in zip(after, before))
    assert min(a_tx, b_rx) >= boundary, (a_tx, b_rx, boundary)
    assert min(b_tx, a_rx) >= boundary, (b_tx, a_rx, boundary)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1)), report
    assert_same_run(tmp_path / "single", run_dir, single.losses, losses)
