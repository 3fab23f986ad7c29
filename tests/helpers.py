"""Paths and small builders shared by tests."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFERENCE_BASE = REPO / "models" / "reference" / "base"
REFERENCE_DECODER = REPO / "models" / "reference" / "decoder"
