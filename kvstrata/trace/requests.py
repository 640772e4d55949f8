"""What a trace reader yields: one :class:`Request` per line, a whole :class:`Trace` in
memory, and :class:`TraceInfo` (what a streamed read found).

Threads: plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Request", "Trace", "TraceInfo"]


@dataclass(slots=True)
class Request:
    """One request of a trace.

    ``blocks``: dense block ids of the prompt in prefix order. ``hittable``:
    how many leading blocks may be served from cache (all of them for hash-id
    traces; for token traces the last prompt token is always computed, so at
    most ``(input_length - 1) // block_size``). ``token_based``: the prompt's
    length is ``input_length`` (given by tokens, or by hashes whose last block
    may be partial) rather than ``len(blocks)`` full blocks.
    """

    timestamp: float
    blocks: list[int]
    input_length: int
    output_length: int
    hittable: int
    line: int = 0
    token_based: bool = False
    output_blocks: list[int] = field(default_factory=list)  # full blocks its output completed (recordings)
    duration: float = -1.0  # seconds from arrival to finish when recorded (< 0: unknown)
    # recorded preemptions: (preempted, resumed) seconds after arrival, tokens looked up again
    preemptions: list[tuple[float, float, int]] = field(default_factory=list)


@dataclass
class TraceInfo:
    """What a pass over a trace has counted (all of it once the pass is over)."""

    name: str
    format: str
    block_size: int
    num_requests: int = 0
    num_accesses: int = 0
    num_distinct_blocks: int = 0
    id_bound: int = 0
    token_based: bool = False
    first_timestamp: float = 0.0
    last_timestamp: float = 0.0
    skipped_lines: int = 0
    first_skipped: str | None = None
    header: dict[str, Any] | None = None     # the kvstrata header (a recording's: its deployment)
    notes: list[str] = field(default_factory=list)  # what was skipped and why (files, a cut-off line)
    measured: dict[str, Any] | None = None   # a whole recording's measured counters (its sidecar)

    @property
    def duration_s(self) -> float:
        return self.last_timestamp - self.first_timestamp if self.num_requests else 0.0


@dataclass
class Trace:
    """A whole trace in memory.

    ``num_distinct_blocks``: distinct block ids; every id is ``< id_bound``
    (ids are 0, 1, 2, ... in order of first use, so the two are equal).
    """

    name: str
    format: str
    block_size: int
    requests: list[Request]
    num_distinct_blocks: int
    id_bound: int
    token_based: bool = False
    skipped_lines: int = 0
    first_skipped: str | None = None
    header: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    measured: dict[str, Any] | None = None

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_accesses(self) -> int:
        return sum(len(r.blocks) for r in self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].timestamp - self.requests[0].timestamp if self.requests else 0.0

    @property
    def info(self) -> TraceInfo:
        reqs = self.requests
        return TraceInfo(self.name, self.format, self.block_size, len(reqs), self.num_accesses,
                         self.num_distinct_blocks, self.id_bound, self.token_based,
                         reqs[0].timestamp if reqs else 0.0, reqs[-1].timestamp if reqs else 0.0,
                         self.skipped_lines, self.first_skipped, self.header, list(self.notes), self.measured)
