"""A test-only tier kind, defined in this one file: a key-addressed tier over a dict, with every
method of the store role's executor half (:data:`kvstrata.tiers.kinds.HALVES`), registered
between DRAM and SSD by :func:`dict_tier`."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np


class DictStore:
    """A key-addressed tier over a dict (every method of the store half); ``broken``: every
    read and write fails by raising, as a tier that breaks its promise would."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.broken = False

    def put(self, key: bytes, row: Any, tag: bytes | None = None) -> bool:
        if self.broken:
            raise OSError("dict tier down")
        self.data[key] = bytes(np.asarray(row, dtype=np.uint8))
        return True

    def get_into(self, keys: list[bytes], rows: list[Any]) -> list[bool]:
        if self.broken:
            raise OSError("dict tier down")
        out = []
        for key, row in zip(keys, rows):
            got = self.data.get(key)
            if got is not None:
                row[:] = np.frombuffer(got, dtype=np.uint8)
            out.append(got is not None)
        return out

    def discard_many(self, keys: list[bytes]) -> None:
        for k in keys:
            self.data.pop(k, None)

    def touch_many(self, keys: list[bytes]) -> None: ...
    def take_lost(self) -> list[bytes]: return []
    def flush(self) -> bool: return True
    def recovering(self) -> bool: return False
    def wait_ready(self, timeout: float | None = None) -> bool: return True
    def keys(self) -> list[bytes]: return list(self.data)
    def close(self) -> None: ...


#: the blocks the dict tier holds while registered (its capacity rule reads it)
BLOCKS = {"n": 0}
#: the backends it opened (a test inspects what they hold)
OPENED: list[DictStore] = []


def capacity(config: Any, block_nbytes: int) -> int:
    """The capacity rule: ``tiers.dict.capacity`` (bytes) when the config sets it, else
    :data:`BLOCKS`; its section's keys are checked here, named in the error."""
    from kvstrata.system.values import check_keys, parse_size

    section = config.tiers.get("dict")
    check_keys(section, ("capacity",), "tiers.dict")
    if "capacity" not in section:
        return BLOCKS["n"]
    return parse_size(section["capacity"], "tiers.dict.capacity") // block_nbytes


@contextlib.contextmanager
def dict_tier(blocks: int) -> Iterator[None]:
    """Register the ``dict`` tier kind between DRAM (100) and SSD (300), holding ``blocks``
    blocks in every deployment while the block runs (unless ``tiers.dict.capacity`` says
    otherwise); unregister it after."""
    from kvstrata.policy.tiers import Tier
    from kvstrata.tiers.kinds import TierKind, register, unregister

    BLOCKS["n"] = blocks
    OPENED.clear()

    def opened(opening: Any) -> DictStore:
        OPENED.append(DictStore())
        return OPENED[-1]

    register(TierKind(Tier("dict", medium="CPU", key="dict", label="dict", hint="raise the dict tier's blocks"),
                      section="dict", capacity=capacity, open=opened,
                      backend=DictStore, position=200))
    try:
        yield
    finally:
        unregister("dict")
