"""The tier policy: the bytes-free object that decides placement, its plans, events and indexes.
May import: errors, system, identity, config.

One bytes-free object decides placement for every mode. See :mod:`kvstrata.policy.manager`
for the verbs and lifetime rules, :mod:`kvstrata.policy.plans` for what executors receive, and
:mod:`kvstrata.policy.events` for what metrics and statistics consume.
"""

from kvstrata.policy.events import EVENT_KINDS, LOWER_TIERS, PolicyEvent
from kvstrata.policy.manager import TierPolicy
from kvstrata.policy.plans import COMPUTED, EVICTED, PAGEOUT, SHUTDOWN, STORE_REASONS, FetchPlan, LoadPlan, StorePlan
from kvstrata.policy.slot_index import PinnedError, SlotIndex
from kvstrata.policy.spec import ADMISSIONS, ON_COMPUTE, ON_EVICT, PolicySpec

__all__ = ["TierPolicy", "PolicySpec", "LoadPlan", "StorePlan", "FetchPlan", "PolicyEvent", "SlotIndex", "PinnedError",
           "COMPUTED", "PAGEOUT", "EVICTED", "SHUTDOWN", "STORE_REASONS", "ADMISSIONS", "ON_COMPUTE",
           "ON_EVICT", "EVENT_KINDS", "LOWER_TIERS"]
