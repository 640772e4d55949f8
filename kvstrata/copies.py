"""What the copier moves and tracks: the rows interface, and its queued stores and loads.

:class:`CopyRows` is what a device offers the copier (whole blocks as host rows);
:class:`Finished` is what :meth:`kvstrata.copier.Copier.poll` reports;
:class:`PendingStore` and :class:`PendingLoad` are the copier's records of plans in flight.

Threads: the copier's owner thread.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from kvstrata.executor import LoadResult, Lost
from kvstrata.policy.plans import LoadPlan, StorePlan
from kvstrata.streams import Event, elapsed_s

__all__ = ["CopyRows", "Finished", "PendingStore", "PendingLoad"]


class CopyRows(Protocol):
    """Whole device blocks copied as host rows of ``block_nbytes`` bytes (device work:
    called inside :meth:`Stream.submit`)."""

    block_nbytes: int

    def gather(self, block_ids: Sequence[int], dst: np.ndarray, dst_rows: Sequence[int]) -> None:
        """``dst[dst_rows[i]] = block block_ids[i]``."""

    def scatter(self, src: np.ndarray, src_rows: Sequence[int], block_ids: Sequence[int]) -> None:
        """``block block_ids[i] = src[src_rows[i]]``."""

    def staging(self, n: int) -> np.ndarray:
        """Host rows ``[n, block_nbytes]`` uint8 (pinned on a GPU)."""


@dataclass
class Finished:
    """What :meth:`Copier.poll` found complete: store plan ids, blocks lost (``(tier, key)``,
    for the policy to forget), and finished loads by request id."""

    stored: list[int] = field(default_factory=list)
    lost: Lost = field(default_factory=list)
    loads: dict[str, LoadResult] = field(default_factory=dict)
    fetched: dict[int, int] = field(default_factory=dict)  # fetch plan id -> blocks that arrived


@dataclass
class PendingStore:
    """A store plan the copier queued: its gather, its I/O, the staging it holds."""

    plan: StorePlan
    gathered: Event
    io: "Future[Lost]"
    staged: int             # staging bytes held until ``io`` is done
    lost: Lost
    started: float
    nbytes: int
    copied: bool = False


@dataclass
class PendingLoad:
    """A load the copier queued: its staging rows, its SSD reads, the slab writes it waits on."""

    plan: LoadPlan
    staging: np.ndarray
    ok: list[bool]
    lost: Lost
    io: "Future[Lost] | None"          # the SSD reads (None: no SSD block)
    waits_on: list["Future[Any]"]      # I/O jobs writing slab slots this load reads
    after: Event | None = None         # the compute stream when the load was queued
    scattered: Event | None = None
    loaded: int = 0
    started: float = 0.0
    cut: threading.Event = field(default_factory=threading.Event)  # read no more SSD blocks
    io_s: list[float] = field(default_factory=lambda: [0.0])     # the SSD reads' seconds (set by them)
    scatter_s: float = 0.0             # the copies into the device blocks (inline streams: their time)
    scatter_start: Event | None = None  # a timed event before them (a device that keeps times measures them)

    def seconds(self) -> float:
        """What the load took once it is done: its SSD reads, then its copies into the device
        blocks (the device's own time between two timed events where it keeps times)."""
        device_s = elapsed_s(self.scatter_start, self.scattered) \
            if self.scatter_start is not None and self.scattered is not None else None
        return self.io_s[0] + (self.scatter_s if device_s is None else device_s)
