"""Shared fixtures: a tiny byte-level dataset built once per session; the `serial` mark."""

from __future__ import annotations

from pathlib import Path

import pytest

from ptdp.data.preprocess import preprocess
from tests.helpers import make_corpus


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Prefix of a ~20k-token byte-level dataset."""
    root = tmp_path_factory.mktemp("tiny_data")
    make_corpus(root / "text")
    prefix = root / "tiny"
    preprocess([root / "text"], prefix, "bytes", progress=False)
    return str(prefix)


SERIAL = {
    "dist/test_chaos.py",
    "dist/test_checkpoint_atomic.py",
    "dist/test_faults.py",
    "dist/test_harness.py",
    "dist/test_multinode.py",
    "dist/test_rank_death.py",
    "dist/test_recovery.py",
    "dist/test_restart.py",
    "unit/test_straggler.py",
    "unit/test_watchdog.py",
}
"""Tests whose faults are timed (collective timeouts of a few seconds, stopped ranks, silent
heartbeats, a fixed port): `scripts/test.sh` runs them alone, after the rest has run on two
pytest-xdist workers, so that another test's load cannot fire a timeout they do not inject."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if item.path.relative_to(tests).as_posix() in SERIAL:
            item.add_marker(pytest.mark.serial)
