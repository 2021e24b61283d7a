"""Clusters as data: the built-in TOML files, user files, and which link a group uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from ptdp.config.files import tomllib  # tomli on Python 3.10
from ptdp.errors import ConfigError
from ptdp.perf.cost.collectives import all_reduce_seconds, gather_seconds, group_link
from ptdp.perf.cost.hardware import GB, GIB
from ptdp.perf.cost.hardware_file import (
    BUILTIN_DIR,
    list_systems,
    load_system,
    system_for_device_name,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_papers_cluster() -> None:
    s = load_system("a100-80gb")
    assert s.gpus_per_node == 8
    assert s.device.peak_flops("bf16") == 312e12
    assert s.device.memory_bytes == 80 * GIB
    assert s.intra.bandwidth == 300 * GB  # NVLink 3: 600 GB/s both directions
    # 8 x 200 Gb/s HDR per node, one per GPU: 25 GB/s per GPU per direction.
    assert s.inter.bandwidth * 8 * 8 == 8 * 200e9
    assert 0 < s.device.gemm_efficiency <= 1 and 0 < s.intra.efficiency <= 1


@pytest.mark.parametrize("name", ["h100-sxm", "h200"])
def test_hopper_clusters(name: str) -> None:
    s = load_system(name)
    assert s.device.peak_flops("bf16") == 989e12
    assert s.intra.bandwidth == 450 * GB
    assert s.inter.bandwidth == 50 * GB
    assert s.device.memory_bytes > (130 if name == "h200" else 79) * GIB


def test_builtins_are_listed_and_shipped_as_package_data() -> None:
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h200"} <= set(list_systems())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]
    package = ".".join(BUILTIN_DIR.parent.relative_to(ROOT).parts)  # where hardware_file.py lives
    assert any(p.endswith("*.toml") for p in data.get(package, []))
    assert all((BUILTIN_DIR / f"{n}.toml").is_file() for n in list_systems())


def test_a_user_file_by_path(tmp_path: Path) -> None:
    text = (BUILTIN_DIR / "a100-80gb.toml").read_text()
    mine = tmp_path / "mine.toml"
    mine.write_text(
        text.replace('name = "a100-80gb"', 'name = "mine"')
        .replace('kind = "a100" ', 'kind = "new"\npeak_tflops = { bf16 = 100.0 }\n#')
        .replace("gpus = 8", "gpus = 4")
    )
    s = load_system(mine)
    assert s.name == "mine" and s.gpus_per_node == 4
    assert s.device.peak_flops("bf16") == 100e12
    with pytest.raises(ConfigError, match="no fp32 peak"):
        s.device.peak_flops("fp32")


def test_unknown_or_broken_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="a100-80gb"):
        load_system("a100-800gb")
    broken = tmp_path / "broken.toml"
    broken.write_text("[device]\nkind = 'a100'\n")
    with pytest.raises(ConfigError, match="broken.toml"):
        load_system(broken)


def test_torch_device_names() -> None:
    assert system_for_device_name("NVIDIA A100-SXM4-80GB").name == "a100-80gb"
    assert system_for_device_name("NVIDIA H200").name == "h200"
    assert system_for_device_name("cpu") is None


def test_group_links() -> None:
    s = load_system("a100-80gb")
    assert group_link(s, 8, 1) == s.intra  # tensor parallel within a node
    assert group_link(s, 2, 4) == s.intra
    # Data parallel over 32 GPUs with t = 1: 8 per node drive 8 cards, capped by NVLink.
    wide = group_link(s, 32, 1)
    assert wide.achieved == pytest.approx(min(s.intra.achieved, 8 * s.inter.achieved))
    # With t = 8 each data-parallel group has one GPU per node: one card's bandwidth.
    thin = group_link(s, 4, 8)
    assert thin.achieved == pytest.approx(s.inter.achieved)


def test_groups_that_do_not_fit_a_node_span_nodes() -> None:
    """Which link a group uses follows from its ranks: t = 3 on 8-GPU nodes puts the group
    {6, 7, 8} across two nodes (one card on node 1), so every tp group waits for one card;
    t = 16 and 32 run their rings through 8 cards per node and pay network steps."""
    s = load_system("a100-80gb")
    assert group_link(s, 4, 1) == s.intra and group_link(s, 2, 1) == s.intra
    three = group_link(s, 3, 1)
    assert three.achieved == pytest.approx(s.inter.achieved)
    assert three.step_latency == s.inter.step_latency
    for t in (16, 32):
        wide = group_link(s, t, 1)
        assert wide.achieved == pytest.approx(min(s.intra.achieved, 8 * s.inter.achieved))
        assert wide.step_latency == pytest.approx(6.6e-6)
    # dp groups of t = 3 (stride 3, size 4: ranks 0, 3, 6, 9 span nodes 0 and 1, with three
    # members on node 0 and one on node 1): one card.
    assert group_link(s, 4, 3).achieved == pytest.approx(s.inter.achieved)


def test_tensor_parallel_latency_at_small_hidden_sizes() -> None:
    """A ~6B model (h = 4096, s = 2048, b = 1) at t = 8: each all-reduce moves 16.8 MB, whose
    14 ring steps add 35 us to the 10 us call and 126 us of bandwidth, a third more than
    bandwidth alone; at t = 16 across two nodes the steps are network hops."""
    s = load_system("a100-80gb")
    nbytes = 2048 * 4096 * 2
    bandwidth = 2 * 7 / 8 * nbytes / s.intra.achieved
    t8 = all_reduce_seconds(nbytes, 8, group_link(s, 8, 1))
    assert t8 == pytest.approx(10e-6 + 14 * 2.5e-6 + bandwidth)
    assert t8 / bandwidth > 1.3
    t16 = all_reduce_seconds(nbytes, 16, group_link(s, 16, 1))
    link = min(s.intra.achieved, 8 * s.inter.achieved)
    assert t16 == pytest.approx(10e-6 + 30 * 6.6e-6 + 2 * 15 / 16 * nbytes / link)
    assert t16 > 2 * t8


def test_ring_collectives_by_hand() -> None:
    s = load_system("a100-80gb")
    n, nbytes = 8, 1e9
    assert all_reduce_seconds(nbytes, 1, s.intra) == 0.0
    # One call's latency, 2 (n-1) ring steps of 2.5 us each, the bytes at the bus bandwidth.
    expected = 10e-6 + 14 * 2.5e-6 + 2 * 7 / 8 * nbytes / (300e9 * s.intra.efficiency)
    assert all_reduce_seconds(nbytes, n, s.intra) == pytest.approx(expected)
    assert gather_seconds(nbytes, n, s.intra) == pytest.approx(
        10e-6 + 7 * 2.5e-6 + 7 / 8 * nbytes / s.intra.achieved
    )
