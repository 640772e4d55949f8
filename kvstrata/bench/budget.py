"""How many distinct blocks a ``kvstrata bench`` analysis can hold in the memory available now.

The analysis keeps a fixed number of bytes per distinct block of the trace
(its id map, the replay's per-block state, the miss-ratio pass's stack and
histogram) and nothing per request or access, so the distinct blocks decide
whether it fits. :data:`BYTES_PER_DISTINCT_BLOCK` is that cost on hash-id
traces with headroom: 135-180 bytes were measured (the processes' summed
proportional set size, Mooncake conversation trace repeated 1, 10 and 30
times with fresh ids), plus the slack of arrays and maps caught mid-growth.
Token traces (``kvstrata`` format) key each block by its tokens, 8 more bytes
per token of block size.
"""

from __future__ import annotations

from kvstrata.machine import available_memory_bytes

__all__ = ["BYTES_PER_DISTINCT_BLOCK", "GPU_BYTES_PER_BLOCK", "available_memory_bytes", "default_max_distinct_blocks",
           "deployment_bytes", "largest_part"]

BYTES_PER_DISTINCT_BLOCK = 250
_BASE_BYTES = 256 << 20   # interpreter, numpy, the tiers' fixed state and the batches in flight
_USABLE = 0.8             # of the available memory: headroom for the page cache and other processes


GPU_BYTES_PER_BLOCK = 160    # the replay's device pool per block: ~115 measured, with headroom


def deployment_bytes(capacity_blocks: dict[str, int], payload_block_bytes: int | None = None) -> dict[str, int]:
    """What replaying a deployment of these tier capacities (blocks) costs in memory before a
    single request, per tier: the device pool's bookkeeping (allocated for its whole size),
    and with ``payload`` the host pool's and the CPU slab's bytes. The lower tiers' indexes
    and the modelled remote tier grow with the blocks the trace brings, which
    ``--max-distinct-blocks`` bounds."""
    gpu, cpu = capacity_blocks.get("gpu", 0), capacity_blocks.get("cpu", 0)
    out = {"gpu": gpu * GPU_BYTES_PER_BLOCK, "cpu": 0}
    if payload_block_bytes:
        out["gpu"] += gpu * payload_block_bytes
        out["cpu"] += cpu * payload_block_bytes
    return out


def largest_part(parts: dict[str, int]) -> str:
    """The tier that costs the most (the one to shrink)."""
    return max(parts, key=lambda t: parts[t])


def default_max_distinct_blocks(fmt: str = "mooncake", block_size: int = 0) -> int | None:
    """Distinct blocks of a ``fmt`` trace (``block_size`` tokens a block) that the memory available
    now holds; None when it cannot be read (no limit)."""
    avail = available_memory_bytes()
    if avail is None:
        return None
    per_block = BYTES_PER_DISTINCT_BLOCK + (8 * block_size + 40 if fmt == "kvstrata" else 0)
    return max(1 << 20, int((avail * _USABLE - _BASE_BYTES) // per_block))
