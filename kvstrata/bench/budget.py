"""How many distinct blocks a ``kvstrata bench`` analysis can hold in the memory available now,
and how many cores its processes may take.

The analysis keeps a fixed number of bytes per distinct block of the trace
(its id map, the replay's per-block state, the miss-ratio pass's stack and
histogram) and nothing per request or access, so the distinct blocks decide
whether it fits. :data:`BYTES_PER_DISTINCT_BLOCK` is that cost on hash-id
traces with headroom: 135-180 bytes were measured (the processes' summed
proportional set size, Mooncake conversation trace repeated 1, 10 and 30
times with fresh ids), plus the slack of arrays and maps caught mid-growth.
Token traces (``kvstrata`` format) key each block by its tokens, 8 more bytes
per token of block size.

A hybrid model's KV-cache groups (``model.groups``) multiply the blocks: each
group of a position is a block of its own in the device pool and the tiers
below. Each further group costs :data:`GROUP_BYTES_PER_BLOCK` per distinct
block, and the grouped pool's rows :data:`GROUPED_GPU_BYTES_PER_BLOCK` each.
"""

from __future__ import annotations

import os

from kvstrata.system.machine import available_memory_bytes, default_max_memory
from kvstrata.policy.tiers import GPU, KNOWN

__all__ = ["BYTES_PER_DISTINCT_BLOCK", "GPU_BYTES_PER_BLOCK", "GROUP_BYTES_PER_BLOCK", "GROUPED_GPU_BYTES_PER_BLOCK",
           "available_memory_bytes", "bytes_per_distinct_block", "default_max_distinct_blocks", "check_memory",
           "deployment_bytes", "cores"]

BYTES_PER_DISTINCT_BLOCK = 250
_BASE_BYTES = 256 << 20   # interpreter, numpy, the tiers' fixed state and the batches in flight
_USABLE = 0.8             # of the available memory: headroom for the page cache and other processes


GPU_BYTES_PER_BLOCK = 160    # the replay's device pool per block: ~115 measured, with headroom
#: the grouped device pool (hybrid models) per row once it caches a group's block: 120 bytes
#: built and ~400 more filled were measured (10 and 100 full-attention groups, 200,000 rows)
GROUPED_GPU_BYTES_PER_BLOCK = 640
#: each KV-cache group beyond the first, per distinct block of the trace (its key, its place
#: in the tiers' indexes): ~70 bytes measured (100 groups, 24,000 distinct blocks), with headroom
GROUP_BYTES_PER_BLOCK = 100


def deployment_bytes(capacity_blocks: dict[str, int], payload_block_bytes: int | None = None,
                     groups: int = 1) -> dict[str, int]:
    """What replaying a deployment of these tier capacities (blocks) costs in memory, per
    tier: the device pool's bookkeeping (for its whole size, each row filled: with ``groups``
    above 1, the grouped pool's), and with ``payload`` the host pool's and the slab tiers'
    (DRAM) bytes. The lower tiers' indexes and the modelled shared tier grow with the blocks the
    trace brings (:func:`bytes_per_distinct_block`), which ``--max-distinct-blocks`` bounds."""
    gpu = capacity_blocks.get(GPU, 0)
    slabs = {t: n for t, n in capacity_blocks.items() if t in KNOWN and KNOWN[t].slab}
    out = {GPU: gpu * (GPU_BYTES_PER_BLOCK if groups <= 1 else GROUPED_GPU_BYTES_PER_BLOCK),
           **dict.fromkeys(slabs, 0)}
    if payload_block_bytes:
        out[GPU] += gpu * payload_block_bytes
        for t, n in slabs.items():
            out[t] += n * payload_block_bytes
    return out


def bytes_per_distinct_block(fmt: str = "mooncake", block_size: int = 0, groups: int = 1) -> int:
    """What a distinct block of a ``fmt`` trace (``block_size`` tokens a block) costs the
    analysis, with ``groups`` KV-cache groups."""
    return (BYTES_PER_DISTINCT_BLOCK + (8 * block_size + 40 if fmt == "kvstrata" else 0)
            + (max(groups, 1) - 1) * GROUP_BYTES_PER_BLOCK)


def default_max_distinct_blocks(fmt: str = "mooncake", block_size: int = 0, groups: int = 1) -> int | None:
    """Distinct blocks of a ``fmt`` trace (``block_size`` tokens a block, ``groups`` KV-cache
    groups) that the memory available now holds; None when it cannot be read (no limit)."""
    avail = available_memory_bytes()
    if avail is None:
        return None
    per_block = bytes_per_distinct_block(fmt, block_size, groups)
    floor = (1 << 20) * BYTES_PER_DISTINCT_BLOCK // per_block
    return max(floor, int((avail * _USABLE - _BASE_BYTES) // per_block))


def cores() -> int:
    """The cores this process may run on (its affinity; the machine's where that is not known)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _capacity_key(tier: str) -> str:
    """The config key that sizes ``tier`` (the device pool, or a tier below it)."""
    return "gpu.num_blocks or gpu.capacity" if tier == GPU else f"{KNOWN[tier].where()}.capacity"


def check_memory(capacity_blocks: dict[str, int], payload_block_bytes: int | None, limit: int | None,
                 groups: int = 1) -> None:
    """Refuse (a ConfigError naming the key to lower), before anything is built, a deployment
    whose replay would cost more memory than ``limit`` (None: half the machine's), its
    ``groups`` KV-cache groups counted: a recording's header is trusted no more than ``--set``."""
    from kvstrata.config.schema import format_size
    from kvstrata.errors import ConfigError

    limit = limit if limit is not None else default_max_memory()
    parts = deployment_bytes(capacity_blocks, payload_block_bytes, groups)
    need = sum(parts.values())
    if limit is None or need <= limit:
        return
    tier = max(parts, key=lambda t: parts[t])
    of = f" of {groups} KV-cache groups (model.groups)" if groups > 1 and tier == GPU else ""
    key = _capacity_key(tier)
    raise ConfigError(f"{key}: replaying this deployment needs ~{format_size(need)} of memory "
                      f"({capacity_blocks.get(tier, 0):,} {tier} blocks{of} cost {format_size(parts[tier])}), more "
                      f"than --max-memory {format_size(limit)}; lower {key} or raise --max-memory")
