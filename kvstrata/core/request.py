"""One request as every driver follows it: the one object that holds a request's state.

A driver makes one per request (a subclass adds what only that driver needs, such
as the vLLM request object) and hands it to :class:`~kvstrata.core.driver.DriverCore`,
which fills in the rest as the request goes through the step protocol. Nothing
about a request is kept anywhere else, so finishing it is one ``pop``.

Threads: owned by the driver's one owner thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.identity.groups import KVGroups

if TYPE_CHECKING:
    from kvstrata.policy.plans import FetchPlan, LoadPlan

__all__ = ["RequestState"]


class RequestState:
    """``hashes``: the request's block keys so far (a driver may extend the list).
    ``resumed``: looked up again after a preemption (counted apart).
    ``gpu_hits``: blocks of the last lookup served by the device pool.
    ``load``: its load plan, from planning until the load completed or was cancelled.
    ``load_lost``: ``(tier, key)`` the executors could not read for that load.
    ``fetch``: its remote fetch plan, planned or running.
    ``fetched``: keys fetched from the remote tier for it (remote hits, not CPU hits).
    ``sources``: the tier each block of its load is planned to come from.
    ``hits``: blocks per tier of its last lookup, complete once its load completed.
    ``group_keys``: its keys in the KV-cache groups after the first (a driver with groups).
    ``decision``: the tiers of its last lookup's hit and how many of them are worth loading.
    ``ends``: where a later hit of its blocks can end (with groups: its last lookup's last
    hit point and how far its full-attention prefix reached; :meth:`KVGroups.stored`).
    """

    __slots__ = ("req_id", "hashes", "resumed", "gpu_hits", "load", "load_lost", "fetch", "fetched", "sources",
                 "hits", "group_keys", "decision", "ends")

    def __init__(self, req_id: str, hashes: list[bytes] | None = None) -> None:
        self.req_id = req_id
        self.hashes: list[bytes] = hashes if hashes is not None else []
        self.resumed = False
        self.gpu_hits = 0
        self.load: LoadPlan | None = None
        self.load_lost: set[tuple[str, bytes]] = set()
        self.fetch: FetchPlan | None = None
        self.fetched: set[bytes] = set()
        self.sources: list[str] = []
        self.hits: dict[str, int] = {}
        self.group_keys: dict[int, list[bytes]] = {}
        self.decision: tuple[list[str], int] | None = None
        self.ends: tuple[int, ...] = ()

    def group_key(self, g: int, i: int) -> bytes:
        """The key of block ``i`` in KV-cache group ``g`` (the chain's for group 0)."""
        if g == 0:
            return self.hashes[i]
        keys = self.group_keys.setdefault(g, [])
        while len(keys) <= i:
            keys.append(KVGroups.key(g, self.hashes[len(keys)]))
        return keys[i]

    def keys_of(self, g: int, lo: int, hi: int) -> list[bytes]:
        """Group ``g``'s keys of blocks ``lo .. hi - 1`` (:meth:`group_key`)."""
        if g == 0 or hi <= lo:
            return self.hashes[lo:hi]
        self.group_key(g, hi - 1)
        return self.group_keys[g][lo:hi]

    def __repr__(self) -> str:
        return f"RequestState({self.req_id!r}, {len(self.hashes)} blocks, hits={self.hits})"
