"""The documentation runner's own rules: what it runs, and that a wrong output fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.pages import ROOT, Block, blocks, output_mismatch, script

PRINTED = """\
ptdp | world=2 tp=1 pp=1 dp=2
step      1 | loss 7.7966 | lr 1.00e-03 | 2,142 tok/s
step      2 | loss 7.5012 | lr 1.00e-03 | 2,210 tok/s
validation loss 5.7882 | perplexity 326.4
"""


def test_numbers_vary_spacing_varies_and_dots_stand_for_anything() -> None:
    shown = "step 1 | loss 9.1 | ...\n...\nvalidation loss 6.0 | perplexity 400"
    assert output_mismatch(shown, PRINTED) is None


def test_a_missing_line_a_wrong_word_and_a_wrong_order_fail() -> None:
    assert "is not printed" in output_mismatch("step 1 | accuracy 3", PRINTED)
    assert output_mismatch("validation loss 5.7882\nstep 1 | loss 7.7966 ...", PRINTED)


def test_exact_outputs_keep_their_numbers() -> None:
    assert output_mismatch("validation loss 5.7882 | perplexity 326.4", PRINTED, exact=True) is None
    assert output_mismatch("validation loss 5.7883 | perplexity 326.4", PRINTED, exact=True)


def test_args_go_to_each_ptdp_command_before_its_comment(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        '<!-- doc-test: args="--train.steps 2" exit=2 -->\n```bash\n'
        "# a comment line\nptdp train --config a.toml   # trains\n"
        "torchrun --nproc-per-node 2 -m ptdp train \\\n    --parallel.tp 2\n"
        'echo "# not a comment"\n```\n'
    )
    (block,) = blocks(page)
    assert block.options == {"args": "--train.steps 2", "exit": "2"}
    assert script(block) == (
        "ptdp train --config a.toml --train.steps 2\n"
        "torchrun --nproc-per-node 2 -m ptdp train      --parallel.tp 2 --train.steps 2\n"
        'echo "# not a comment"\n'
    )


def test_a_skip_needs_its_reason_and_keys_are_known(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text('<!-- doc-test: skip="" -->\n```bash\nls\n```\n')
    with pytest.raises(ValueError, match="needs its reason"):
        blocks(page)
    page.write_text("<!-- doc-test: skp=1 -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="unknown doc-test key 'skp'"):
        blocks(page)


def test_every_page_parses() -> None:
    """A directive typo anywhere fails here, with its page and line."""
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        assert all(isinstance(b, Block) for b in blocks(page))
