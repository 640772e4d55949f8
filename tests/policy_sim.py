"""A simulated executor for tier-policy tests: plans applied to dicts instead of bytes.

The slab maps a CPU slot to the key whose bytes it holds, the disk maps an SSD key to
the key whose bytes its record holds, and a device block offered for key k holds k's
bytes. Each plan runs in the order the plan contract gives (spills, SSD evictions,
copies); which plans run, and in what order, is the test's choice.
"""

from __future__ import annotations

from typing import Iterable

from kvstrata.policy import LoadPlan, StorePlan, TierPolicy
from kvstrata.policy.holdings import TOMBSTONE_PREFIX

__all__ = ["SimExecutor", "TOMBSTONE_PREFIX"]


class SimExecutor:
    """Runs plans over a dict slab and a dict SSD tier.

    ``strict``: a spill or a load that reads bytes other than its own key's fails an
    assertion at once (for tests that run plans in the contract's order); otherwise
    loads report what they read, so that a test can show what an executor running
    plans out of order would get.
    """

    def __init__(self, ssd: Iterable[bytes] = (), strict: bool = False) -> None:
        self.slab: dict[int, bytes] = {}
        self.disk: dict[bytes, bytes | None] = {k: k for k in ssd}
        self.strict = strict

    def run(self, plan: StorePlan | LoadPlan) -> list[bytes | None]:
        """Execute ``plan``; for a load, the bytes each of its device blocks received."""
        for spill in plan.spills:
            slot, key = spill.slot, spill.key
            self._expect(self.slab.get(slot), key, f"spill of {key!r} from slot {slot}")
            self.disk[key] = self.slab.get(slot)
        for key in plan.evictions.get("ssd", ()):
            self.disk.pop(key, None)
        if isinstance(plan, StorePlan):
            to_ssd = set(plan.goes_to("ssd"))
            for i, (key, slot) in enumerate(zip(plan.keys, plan.slots)):
                if slot >= 0:
                    self.slab[slot] = key
                if i in to_ssd:
                    self.disk[key] = key
            return []
        from_ssd = [t == "ssd" and s < 0 for t, s in zip(plan.sources, plan.slots)]
        return [self._load_one(*row) for row in zip(plan.keys, plan.slots, from_ssd, plan.promote_slots)]

    def _load_one(self, key: bytes, slot: int, from_ssd: bool, promote: int) -> bytes | None:
        if slot >= 0:
            got = self.slab.get(slot)
            self._expect(got, key, f"load of {key!r} from slot {slot}")
        elif from_ssd:
            got = self.disk.get(key)
            self._expect(got, key, f"load of {key!r} from the SSD")
            if promote >= 0:
                self.slab[promote] = got
        else:
            got = None
        return got

    def _expect(self, got: bytes | None, key: bytes, what: str) -> None:
        if self.strict:
            assert got == key, f"{what} found {got!r}"

    def misplaced(self, policy: TierPolicy) -> list[tuple[str, bytes]]:
        """``(tier, key)`` the policy holds whose bytes are not where it says."""
        out = [("cpu", k) for k in (policy.slab or ()) if not k.startswith(TOMBSTONE_PREFIX)
               and self.slab.get(policy.slab.lookup(k)) != k]
        return out + [("ssd", k) for k in (policy.store or ())
                      if not k.startswith(TOMBSTONE_PREFIX) and self.disk.get(k) != k]
