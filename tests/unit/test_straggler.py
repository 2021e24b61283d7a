"""The straggler report and its setting (ptdp/train/faults/straggler.py)."""

from __future__ import annotations

import pytest

from ptdp.train.faults.straggler import straggler_report


def test_straggler_report_names_the_rank_that_is_computing() -> None:
    beats = [
        {"step": 6, "action": "action 0BW0", "waiting": "the gradient of mb 0", "for_s": 3.9},
        {"step": 6, "action": "action 1BW0", "waiting": "the gradient of mb 0", "for_s": 3.8},
        {"step": 6, "action": "action 2BW0", "waiting": "", "for_s": 3.8},
        {"step": 6, "action": "action 3BW1", "waiting": "the activation of mb 2", "for_s": 3.0},
    ]
    text = straggler_report(6, 4.0, 0.2, beats)
    assert text.splitlines()[0] == (
        "watchdog: step 6 has run 4.0 s, 20.0 x the median 0.20 s; behind: rank 2"
    )
    assert "  rank 2: step 6, action 2BW0 for 3.8 s" in text
    beats[2]["step"] = 5
    assert "behind: rank 2" in straggler_report(6, 4.0, 0.2, beats)
    for b in beats:  # all in the same collective: no rank stands out
        b.update(step=6, waiting="")
    assert "behind: ranks 0, 1, 2, 3" in straggler_report(6, 4.0, 0.2, beats)


@pytest.mark.parametrize("factor", [0.5, 1.0])
def test_straggler_factor_must_exceed_one(factor: float, tmp_path) -> None:
    from ptdp.config.files import apply_updates
    from ptdp.config.sections import RunConfig
    from ptdp.errors import ConfigError
    from ptdp.rules.layout import validate

    cfg = apply_updates(RunConfig(), {"train": {"straggler_factor": factor}}, "a test")
    with pytest.raises(ConfigError, match="straggler_factor"):
        validate(cfg, 1)
