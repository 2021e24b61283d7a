"""Errors a user can act on. Each message names the problem and the fix."""

from __future__ import annotations


class PtdpError(Exception):
    """Base class: the CLI prints these without a traceback."""


class ConfigError(PtdpError, ValueError):
    """A configuration that cannot work, found before any process group exists."""


class DataError(PtdpError):
    """A dataset, index or tokenizer file that is missing, truncated or inconsistent."""


class CheckpointError(PtdpError):
    """A checkpoint that is missing, incomplete or does not match the model."""
