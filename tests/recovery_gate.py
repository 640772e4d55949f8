"""Holding back the SSD tier's recovery walk in a test, so that a tier is reliably seen
while it recovers. The walk itself stays real (its child process, the rebuild); only its
start waits."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from kvstrata.tiers.ssd import recovery


def hold_walks(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every recovery walk waits until the returned event is set (or it is cancelled)."""
    opened = threading.Event()
    real = recovery.walk

    def gated(path: Path, blocks_size: int, cancel: Any = None, **kw: Any) -> Any:
        while not opened.wait(0.01):
            if cancel is not None and cancel.event.is_set():
                break
        return real(path, blocks_size, cancel, **kw)
    monkeypatch.setattr(recovery, "walk", gated)
    return opened
