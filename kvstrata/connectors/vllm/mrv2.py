"""What model runner v2's step order asks of the scheduler half.

vLLM's model runner v2 (the only runner in vLLM 0.34; ``ActiveKVConnector`` drives the
connector) runs ``update_requests`` before ``handle_preemptions``: it zeroes the blocks in
``new_block_ids_to_zero`` and applies the copy-on-write copies ``kv_cache_block_copies``
there, before the workers copy out the blocks vLLM evicted in this step. These rules keep
such a store from reading what that overwrote. Pure functions over one scheduler output,
called from ``build_connector_meta`` on vLLM's scheduler thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["not_overwritten", "take_zeroing"]


def take_zeroing(scheduler_output: "SchedulerOutput") -> list[int]:
    """vLLM's blocks to zero this step, taken out of the scheduler output for the workers.

    Model runner v2 zeroes them in ``update_requests``, before it calls
    ``handle_preemptions``, where the workers copy out the blocks vLLM just evicted and
    handed out again: those copies would read zeros. The workers zero them instead, after
    those copies and after the fence that orders every pending store's copy out of a
    reused block before the compute stream touches it (the V1 runner calls
    ``handle_preemptions`` first; the same order holds there)."""
    ids = getattr(scheduler_output, "new_block_ids_to_zero", None)
    if not ids:
        return []
    scheduler_output.new_block_ids_to_zero = None
    return list(ids)


def not_overwritten(evicted: list[tuple[int, bytes]],
                    scheduler_output: "SchedulerOutput") -> list[tuple[int, bytes]]:
    """The evicted blocks model runner v2 does not overwrite before ``handle_preemptions``:
    a copy-on-write copy into a block (``kv_cache_block_copies``) runs in its
    ``update_requests``, so such a block is not stored (a dropped store: a future miss)."""
    copies = getattr(scheduler_output, "kv_cache_block_copies", None)
    if not copies or not evicted:
        return evicted
    targets = {int(dst) for _, dst in copies}
    return [(b, k) for b, k in evicted if b not in targets]
