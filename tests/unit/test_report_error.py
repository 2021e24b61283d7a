"""ptdp's one-line error reaches stderr in one write, so that ranks sharing torchrun's
stderr cannot splice two errors into one line (each rank of a refused resume prints one)."""

from __future__ import annotations

import json
import sys

import pytest

from ptdp.errors import report_error


class Recorder:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_the_line_and_its_newline_are_one_write(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    stderr = Recorder()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    report_error("ptdp train: error: rank 2: cannot resume")
    assert stderr.writes == ["ptdp train: error: rank 2: cannot resume\n"]
    record = json.loads((tmp_path / "error.json").read_text())
    assert record["message"] == "ptdp train: error: rank 2: cannot resume"
