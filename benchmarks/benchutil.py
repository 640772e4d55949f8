"""Helpers shared by the benchmark scripts (importable as ``benchutil`` when a script runs)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from throttled_disk import drop_page_cache  # noqa: E402

__all__ = ["drop_page_cache"]
