"""repo_corpus(): a training corpus made from this repository's own text, no download.

The CPU benchmarks that train a real model on a few ranks (zero, expert_parallel,
memory_validation, prediction, step_phases, interleaving_gains --measure) share it, so
their figures come from the same tokens.
"""

from __future__ import annotations

from pathlib import Path

from ptdp.data.preprocess import preprocess

ROOT = Path(__file__).resolve().parents[2]


def repo_corpus(directory: Path) -> str:
    """This repository's Markdown and Python text as a bytes-tokenized dataset under
    `directory`; returns its prefix (directory/repo)."""
    texts = directory / "text"
    texts.mkdir(parents=True)
    for i, path in enumerate(sorted([*ROOT.glob("*.md"), *ROOT.glob("ptdp/**/*.py")])):
        (texts / f"{i:04d}.txt").write_text(path.read_text())
    preprocess([texts], directory / "repo", "bytes", progress=False)
    return str(directory / "repo")
