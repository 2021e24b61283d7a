"""Clusters as data: the built-in TOML files, user files, and which link a group uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from ptdp.config import tomllib  # tomli on Python 3.10
from ptdp.errors import ConfigError
from ptdp.perf.costs import all_reduce_seconds, gather_seconds, group_link
from ptdp.perf.hardware import (
    BUILTIN_DIR,
    GB,
    GIB,
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
    assert any(p.endswith("*.toml") for p in data.get("ptdp.perf", []))
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
    assert group_link(s, 8, 1) is s.intra  # tensor parallel within a node
    assert group_link(s, 2, 4) is s.intra
    # Data parallel over 32 GPUs with t = 1: 8 per node drive 8 cards, capped by NVLink.
    wide = group_link(s, 32, 1)
    assert wide.achieved == pytest.approx(min(s.intra.achieved, 8 * s.inter.achieved))
    # With t = 8 each data-parallel group has one GPU per node: one card's bandwidth.
    thin = group_link(s, 4, 8)
    assert thin.achieved == pytest.approx(s.inter.achieved)


def test_ring_collectives_by_hand() -> None:
    s = load_system("a100-80gb")
    n, nbytes = 8, 1e9
    assert all_reduce_seconds(nbytes, 1, s.intra) == 0.0
    expected = s.intra.latency + 2 * 7 / 8 * nbytes / (300e9 * s.intra.efficiency)
    assert all_reduce_seconds(nbytes, n, s.intra) == pytest.approx(expected)
    assert gather_seconds(nbytes, n, s.intra) == pytest.approx(
        s.intra.latency + 7 / 8 * nbytes / s.intra.achieved
    )
