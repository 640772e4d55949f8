"""Where a page store's executor reads and writes pages: the rows of the call being served.

An engine hands a storage backend its pages in two ways: as positions in its host pool
(registered once; SGLang's zero-copy ``batch_get_v1`` / ``batch_set_v1``) or as buffers of
their own, one per page (SGLang's generic ``get`` / ``set``). Both are
:class:`~kvstrata.dataplane.executor.DeviceRows` of one page size:

* :class:`BufferRows`: one call's buffers (CPU tensors, numpy arrays, bytearrays), block
  ``i`` being the ``i``-th buffer;
* a host pool's pages through :class:`~kvstrata.connectors.kit.kv_layout.LayoutRows`
  (block ``p``: page ``p``);
* :class:`RoutedRows`: the one device the executor is built over; each call routes it to
  its own rows (:meth:`RoutedRows.using`) while it holds the page store's lock.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

from kvstrata.dataplane.device_rows import DeviceRows
from kvstrata.tiers.buffers import as_numpy

__all__ = ["BufferRows", "RoutedRows", "page_buffer"]


def page_buffer(buf: Any, block_nbytes: int, what: str = "buffer") -> np.ndarray:
    """``buf`` (a contiguous CPU tensor, numpy array or bytes-like) as ``block_nbytes`` uint8
    bytes sharing its memory; ``ValueError`` naming ``what`` for anything else."""
    arr = as_numpy(buf, what)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: must be contiguous")
    flat = arr.reshape(-1).view(np.uint8)
    if flat.size != block_nbytes:
        raise ValueError(f"{what}: expected {block_nbytes} bytes (one page), got {flat.size}")
    return flat


class BufferRows:
    """One page per buffer: block ``i`` is ``buffers[i]`` (each exactly ``block_nbytes``)."""

    def __init__(self, buffers: Sequence[Any], block_nbytes: int, *, writable: bool) -> None:
        self.block_nbytes = block_nbytes
        self._views = [page_buffer(b, block_nbytes, f"buffers[{i}]") for i, b in enumerate(buffers)]
        if writable and any(not v.flags.writeable for v in self._views):
            raise ValueError("buffers: a page to read into must be writable")

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        rows = np.empty((len(block_ids), self.block_nbytes), dtype=np.uint8)
        for row, b in zip(rows, block_ids):
            row[:] = self._views[b]
        return rows

    def write(self, block_ids: Sequence[int], rows: np.ndarray) -> None:
        for row, b in zip(rows, block_ids):
            self._views[b][:] = row

    def staging(self, n: int) -> np.ndarray:
        return np.empty((n, self.block_nbytes), dtype=np.uint8)


class RoutedRows:
    """The device of a page store's executor: the rows of the call being served (None between
    calls: a plan run then has no device, which the store never does)."""

    def __init__(self, block_nbytes: int) -> None:
        self.block_nbytes = block_nbytes
        self._rows: DeviceRows | None = None

    @contextlib.contextmanager
    def using(self, rows: DeviceRows) -> Iterator[None]:
        """Route reads and writes to ``rows`` until the block exits (the caller holds the lock)."""
        if rows.block_nbytes != self.block_nbytes:
            raise ValueError(f"rows: pages of {rows.block_nbytes} bytes, the store's are {self.block_nbytes}")
        self._rows = rows
        try:
            yield
        finally:
            self._rows = None

    def _current(self) -> DeviceRows:
        if self._rows is None:
            raise RuntimeError("no rows are routed: a page store runs plans only inside a call")
        return self._rows

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        return self._current().read(block_ids)

    def write(self, block_ids: Sequence[int], rows: np.ndarray) -> Any:
        return self._current().write(block_ids, rows)

    def staging(self, n: int) -> np.ndarray:
        return self._current().staging(n)
