"""The tier policy: one bytes-free object that decides placement for every mode.

See :mod:`tierkv.policy.manager` for the verbs and lifetime rules,
:mod:`tierkv.policy.plans` for what executors receive, and
:mod:`tierkv.policy.events` for what metrics and statistics consume.
"""

from tierkv.policy.events import EVENT_KINDS, LOWER_TIERS, PolicyEvent
from tierkv.policy.manager import TierPolicy
from tierkv.policy.plans import COMPUTED, EVICTED, PAGEOUT, SHUTDOWN, STORE_REASONS, FetchPlan, LoadPlan, StorePlan
from tierkv.policy.slot_index import PinnedError, SlotIndex
from tierkv.policy.spec import ADMISSIONS, ON_COMPUTE, ON_EVICT, PolicySpec

__all__ = ["TierPolicy", "PolicySpec", "LoadPlan", "StorePlan", "FetchPlan", "PolicyEvent", "SlotIndex", "PinnedError",
           "COMPUTED", "PAGEOUT", "EVICTED", "SHUTDOWN", "STORE_REASONS", "ADMISSIONS", "ON_COMPUTE",
           "ON_EVICT", "EVENT_KINDS", "LOWER_TIERS"]
