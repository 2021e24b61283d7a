"""Checkpoint conversion to and from other libraries' formats (`ptdp convert`)."""

from ptdp.convert.hf import export_hf, import_hf

__all__ = ["export_hf", "import_hf"]
