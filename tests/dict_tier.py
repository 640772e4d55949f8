"""A test-only tier kind's backend: a key-addressed tier over a dict, with every method of the
store role's executor half (:data:`kvstrata.tiers.kinds.HALVES`)."""

from __future__ import annotations

from typing import Any

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
