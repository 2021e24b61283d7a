"""Shared fixtures: a tiny byte-level dataset built once per session."""

from __future__ import annotations

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
