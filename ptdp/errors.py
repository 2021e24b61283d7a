"""Errors a user can act on, each message naming the problem and the fix, and how one is
reported (`report_error`: one line, also handed to torchrun's agent)."""

from __future__ import annotations

import json
import os
import sys
import time


class PtdpError(Exception):
    """Base class: the CLI prints these without a traceback."""


class ConfigError(PtdpError, ValueError):
    """A configuration that cannot work, found before any process group exists."""


class DataError(PtdpError):
    """A dataset, index or tokenizer file that is missing, truncated or inconsistent."""


class CheckpointError(PtdpError):
    """A checkpoint that is missing, incomplete or does not match the model."""


def report_error(line: str) -> None:
    """Print ptdp's one-line error; under torchrun also hand it to the agent (the error file
    it names in TORCHELASTIC_ERROR_FILE), whose failure summary, printed after this line,
    then shows it as the failed rank's `traceback` instead of a pointer to its docs."""
    # One write: print() writes the newline apart, and ranks sharing torchrun's stderr then
    # interleave two errors on one line. A pipe keeps a write under 4 KiB whole.
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the summary then points to torchrun's docs, as without this
