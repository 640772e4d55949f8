"""Hit accounting: which tier served each block of a request, written once for every driver.

A request's prefix is served by the device pool (``gpu``), then by a load whose
plan says where it reads each block (:meth:`~kvstrata.policy.plans.LoadPlan.tiers`).
One rule is added here: a block the driver fetched from the shared remote tier
into a CPU slot for this request is read from that slot, but it is a hit of the
remote tier, not of the CPU tier. Counting it once, here, is what keeps the
library, the plugin and the replay's per-request and per-tier counts equal.

Threads: pure functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Collection, Sequence

from kvstrata.policy.tiers import GPU

if TYPE_CHECKING:
    from kvstrata.policy.manager import TierPolicy

__all__ = ["GPU", "HitCounts", "served_from", "request_counts", "count_tiers"]


def count_tiers(policy: "TierPolicy") -> tuple[str, ...]:
    """The tiers a request's hits are counted in: the device pool, the policy's lower tiers,
    and its shared tier when the deployment has one."""
    shared = policy.shared_tier
    return (GPU, *policy.lower_tiers, *((shared,) if shared else ()))


def served_from(tiers: Sequence[str], keys: Sequence[bytes], fetched: Collection[bytes] = (),
                loaded: int | None = None, *, slab: str = "", shared: str = "") -> list[str]:
    """The tier that served each of the first ``loaded`` blocks of a load (all when None):
    ``tiers`` as the load plan reads them, except that a block read from a ``slab`` slot it
    was fetched into from the ``shared`` tier (``fetched``: those keys) is a hit of that tier."""
    n = len(tiers) if loaded is None else loaded
    if not fetched:
        return list(tiers[:n])
    return [shared if t == slab and k in fetched else t for t, k in zip(tiers[:n], keys[:n])]


def request_counts(gpu_hits: int, served: Sequence[str], tiers: Sequence[str]) -> dict[str, int]:
    """One request's hits in blocks per tier of ``tiers`` (:func:`count_tiers`): ``gpu_hits``
    device-pool hits, then one for each tier in ``served`` (:func:`served_from`)."""
    counts = dict.fromkeys(tiers, 0)
    counts[GPU] = gpu_hits
    for tier in served:
        counts[tier] += 1
    return counts


class HitCounts:
    """Lookups and the blocks each tier served, over many requests. A driver keeps two, as
    vLLM keeps its own prefix-cache counts: one for new requests (the hit rate) and one for
    requests looked up again after a preemption (their prompt was counted when they first ran)."""

    __slots__ = ("blocks", "tokens", "hits")

    def __init__(self, tiers: Sequence[str]) -> None:
        self.blocks = self.tokens = 0
        self.hits = dict.fromkeys(tiers, 0)

    def query(self, num_blocks: int, num_tokens: int) -> None:
        """A request was looked up: ``num_blocks`` blocks of ``num_tokens`` tokens."""
        self.blocks += num_blocks
        self.tokens += num_tokens

    def add(self, tier: str, blocks: int) -> None:
        self.hits[tier] += blocks

    def stats(self, block_size: int) -> dict[str, Any]:
        """``queries`` and ``hits`` per tier, in blocks and tokens (the ``stats()`` shape)."""
        return {"queries": {"blocks": self.blocks, "tokens": self.tokens},
                "hits": {t: {"blocks": b, "tokens": b * block_size} for t, b in self.hits.items()}}
