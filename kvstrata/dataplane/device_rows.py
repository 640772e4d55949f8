"""Device rows: whole blocks of the device KV storage as host rows, what the executor copies.

:class:`DeviceRows` is the protocol; :class:`PoolRows` adapts kvstrata's own pool (through a
:class:`~kvstrata.dataplane.transfer.TransferEngine`); :func:`host_rows` makes host rows
(page-locked on a GPU). Imports the system layer only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from kvstrata.dataplane.transfer import TransferEngine

__all__ = ["DeviceRows", "PoolRows", "host_rows"]


class DeviceRows(Protocol):
    """Whole blocks of the device KV storage, as host rows of ``block_nbytes`` bytes."""

    block_nbytes: int

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """A host copy ``[len(block_ids), block_nbytes]`` uint8, complete on return."""

    def write(self, block_ids: Sequence[int], rows: np.ndarray) -> Any:
        """Copy host ``rows`` into the blocks; returns an event to wait on before the
        blocks are read, or None when the copy is complete."""

    def staging(self, n: int) -> np.ndarray:
        """Host rows ``[n, block_nbytes]`` uint8 to gather a load into before :meth:`write`
        (pinned when the device is a GPU, so the copy up needs no second host copy)."""


class PoolRows:
    """:class:`DeviceRows` over kvstrata's own pool through a :class:`TransferEngine`."""

    def __init__(self, engine: "TransferEngine") -> None:
        self.engine = engine
        self.block_nbytes = engine.block_nbytes

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        return self.engine.read_rows(block_ids).numpy()

    def write(self, block_ids: Sequence[int], rows: np.ndarray) -> Any:
        return self.engine.write_rows(block_ids, rows)

    def staging(self, n: int) -> np.ndarray:
        return host_rows(n, self.block_nbytes, pinned=self.engine.cuda)


def host_rows(n: int, block_nbytes: int, *, pinned: bool) -> np.ndarray:
    """``[n, block_nbytes]`` uint8 host rows, in page-locked memory when ``pinned``."""
    if not pinned:
        return np.empty((n, block_nbytes), dtype=np.uint8)
    import torch

    return torch.empty((n, block_nbytes), dtype=torch.uint8, pin_memory=True).numpy()
