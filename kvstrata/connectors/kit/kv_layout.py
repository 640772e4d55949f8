"""Opaque-page view of an engine's paged KV tensors.

A kvstrata block is every byte that one engine block id addresses in the KV
tensors (all layers), as raw bytes in a fixed order. What the bytes are is
taken from what the engine states, never from a size that happens to match:

* the block axis is dimension 0. vLLM (0.32 and 0.33) hands a connector one
  logical ``[B, H, N, C]`` view per layer (``create_kv_cache_views``), with
  ``B = num_blocks x ratio`` when the attention backend's kernel block is
  smaller than ``--block-size`` (engine block ``b`` is kernel blocks
  ``b*ratio .. b*ratio+ratio-1``);
* the physical arrangement (the resolved ``KVCacheLayout``: LBHNC, LBNHC,
  LHBNC, BLHNC, BLNHC, BHLNC) is read from the views' strides: one engine
  block's bytes in each view are decomposed into maximal contiguous runs
  (one per layer for LBHNC or LBNHC, one per layer and head for LHBNC, a few
  per block, or one, for the block-outermost layouts);
* the runs of all layers are united per storage (layers that alias the same
  bytes, such as KV cache groups overlaid by the hybrid allocator or layers
  sharing a KV cache, count once), merged where adjacent and ordered by their
  offset in the storage (never by address: the order is the same in every
  process), and checked not to overlap another engine block's bytes.

A block's bytes are therefore layout-specific: the fingerprint carries the
layout (see ``vllm_fingerprint``). When all runs are equally sized, equally
spaced views of one buffer (layer-compact layouts), the whole block is moved
with a single strided ``index_select`` / ``index_copy_`` on the CPU; otherwise
one such copy per run. kvstrata's CUDA gather/scatter kernels take every run in
one launch (a row table per run).

:class:`LayoutRows` adapts a layout to the executor and the copier: whole
blocks as host rows, through kvstrata's gather/scatter kernels on CUDA (one
launch per job over every run, straight into pinned slab slots or staging)
and through the copies above on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from kvstrata.dataplane.device_rows import host_rows
from kvstrata.tiers.buffers import copy_rows

if TYPE_CHECKING:
    import torch

__all__ = ["KVLayout", "LayoutRows", "Segment", "block_runs", "union_runs"]

# More separate runs per block than this is not a layout any engine uses (LHBNC with
# 128 layers of 16 KV heads is 2,048); refusing it keeps the kernels' row tables small.
MAX_RUNS = 16384


@dataclass(frozen=True)
class Segment:
    """One contiguous run of bytes per block inside one storage."""

    storage_ptr: int
    offset: int         # bytes from the storage start to block 0's run
    block_stride: int   # bytes between consecutive blocks' runs
    nbytes: int         # bytes of the run


def _u8_base(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def union_runs(runs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` byte ranges united: sorted, overlapping or adjacent ones merged."""
    out: list[list[int]] = []
    for off, n in sorted(runs):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], off + n - out[-1][0])
        else:
            out.append([off, n])
    return [(o, n) for o, n in out]


def block_runs(shape: Sequence[int], strides: Sequence[int], itemsize: int, base: int,
               num_blocks: int, what: str = "tensor") -> tuple[int, list[tuple[int, int]]]:
    """``(block stride, [(offset, nbytes)])``: the bytes of engine block 0 of a tensor of
    ``shape`` (block axis 0: ``num_blocks``, or a multiple of it in kernel blocks) and
    byte ``strides`` whose element 0 is ``base`` bytes into its storage, as contiguous
    runs. The one rule for "which bytes are a block", for tensors (:class:`KVLayout`)
    and for vLLM's stated placement (``block_nbytes_of``) alike."""
    if not shape or shape[0] == 0 or shape[0] % num_blocks:
        got = "no dimensions" if not shape else f"{shape[0]} entries"
        raise ValueError(f"{what}: dimension 0 (the blocks) has {got}, not num_blocks="
                         f"{num_blocks} or a multiple of it (kernel blocks); shape {tuple(shape)}")
    ratio = shape[0] // num_blocks
    dims = sorted(((size, stride) for size, stride in zip((ratio, *shape[1:]), strides) if size > 1),
                  key=lambda d: d[1])
    run, outer = itemsize, []
    for size, stride in dims:  # innermost first: merge while each dim continues the run
        if not outer and stride == run:
            run *= size
        else:
            outer.append((size, stride))
    starts = np.zeros(1, dtype=np.int64)
    for size, stride in outer:
        starts = (starts[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
        if starts.size > MAX_RUNS:
            raise ValueError(f"{what}: one block's bytes are more than {MAX_RUNS} separate runs "
                             f"(shape {tuple(shape)}, byte strides {tuple(strides)}): not a layout kvstrata moves")
    return strides[0] * ratio, union_runs((base + int(s), run) for s in starts)


def _block_runs(name: str, t: "torch.Tensor", num_blocks: int) -> tuple[int, list[tuple[int, int]]]:
    item = t.element_size()
    return block_runs(tuple(t.shape), [s * item for s in t.stride()], item, t.storage_offset() * item,
                      num_blocks, f"kv_caches[{name!r}]")


def _check_disjoint(name: str, segs: Sequence[Segment], num_blocks: int) -> None:
    """No run of one block overlaps a run of another block (in the same storage): a load
    of one block must never write bytes of another."""
    by_ptr: dict[int, list[Segment]] = {}
    for s in segs:
        by_ptr.setdefault(s.storage_ptr, []).append(s)
    last = num_blocks - 1
    for group in by_ptr.values():
        off = np.array([s.offset for s in group], dtype=np.int64)
        size = np.array([s.nbytes for s in group], dtype=np.int64)
        stride = np.array([s.block_stride for s in group], dtype=np.int64)
        for i, s in enumerate(group):
            if num_blocks > 1 and s.nbytes > s.block_stride:
                raise ValueError(f"{name}: a block's run of {s.nbytes} bytes is longer than the block "
                                 f"stride ({s.block_stride}): blocks overlap")
            same = stride == s.block_stride
            d = off - s.offset  # run j of block b+k starts at d + k*stride from run i of block b
            # the smallest k with d + k*stride > -size_j, then whether it still starts before run i ends
            k = np.clip(-((d + size - 1) // s.block_stride), -last, last) if s.block_stride else 0
            x = d + k * s.block_stride
            hit = same & (x < s.nbytes) & (x + size > 0) & ((k != 0) | (np.arange(len(group)) != i))
            span_i = (s.offset, s.offset + last * s.block_stride + s.nbytes)
            other = ~same & (off < span_i[1]) & (off + last * stride + size > span_i[0])
            if hit.any() or other.any():
                raise ValueError(f"{name}: the bytes of different blocks overlap (strides "
                                 f"{s.block_stride} and {int(stride[np.argmax(hit | other)])}): "
                                 "dimension 0 is not the block axis")


class KVLayout:
    """Gather/scatter whole kvstrata blocks (all layers) between an engine's KV
    tensors and ``[n, block_nbytes]`` uint8 row tensors."""

    def __init__(self, kv_caches: Mapping[str, "torch.Tensor"], num_blocks: int) -> None:
        import torch

        if not kv_caches:
            raise ValueError("kv_caches: empty")
        storages: dict[int, torch.Tensor] = {}  # storage -> a tensor on it, in layer order
        runs: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (storage, block stride) -> runs
        for name, t in kv_caches.items():
            ptr = t.untyped_storage().data_ptr()
            storages.setdefault(ptr, t)
            stride, block = _block_runs(name, t, num_blocks)
            runs.setdefault((ptr, stride), []).extend(block)
        order = {ptr: i for i, ptr in enumerate(storages)}
        segs = [Segment(ptr, off, stride, n) for (ptr, stride), rs in runs.items() for off, n in union_runs(rs)]
        # Page order inside a kvstrata block: storages in the order of their first layer,
        # then the offset in the storage; never addresses, which differ between processes.
        segs.sort(key=lambda s: (order[s.storage_ptr], s.offset, s.block_stride))
        _check_disjoint("kv_caches", segs, num_blocks)
        self.num_blocks = num_blocks
        self.segments = segs
        self.block_nbytes = sum(s.nbytes for s in segs)
        self.device = next(iter(kv_caches.values())).device
        base = {ptr: _u8_base(t) for ptr, t in storages.items()}
        self._fused = self._fused_view(base)
        self._views = [torch.as_strided(base[s.storage_ptr], (num_blocks, s.nbytes),
                                        (s.block_stride, 1), s.offset) for s in self.segments]
        self._offsets = [0]
        for s in self.segments[:-1]:
            self._offsets.append(self._offsets[-1] + s.nbytes)

    def _fused_view(self, base: Mapping[int, "torch.Tensor"]) -> "torch.Tensor | None":
        import torch

        s0 = self.segments[0]
        same = all(s.storage_ptr == s0.storage_ptr and s.nbytes == s0.nbytes
                   and s.block_stride == s0.block_stride for s in self.segments)
        if not same:
            return None
        n = len(self.segments)
        step = self.segments[1].offset - s0.offset if n > 1 else s0.nbytes
        if any(s.offset != s0.offset + i * step for i, s in enumerate(self.segments)):
            return None
        return torch.as_strided(base[s0.storage_ptr], (self.num_blocks, n, s0.nbytes),
                                (s0.block_stride, step, 1), s0.offset)

    @property
    def pages(self) -> list["torch.Tensor"]:
        """Per segment, a ``[num_blocks, page bytes]`` uint8 view (rows strided): the
        caches kvstrata's gather/scatter kernels take, in kvstrata block order."""
        return list(self._views)

    @property
    def page_offsets(self) -> list[int]:
        """Where each segment's page starts in a kvstrata block (the order of :attr:`pages`)."""
        return list(self._offsets)

    @property
    def fused(self) -> bool:
        return self._fused is not None

    def gather(self, block_ids: "torch.Tensor", out: "torch.Tensor") -> None:
        """``out[i] = bytes of engine block block_ids[i]``; ``out`` is ``[n, block_nbytes]`` uint8."""
        import torch

        if self._fused is not None:
            torch.index_select(self._fused, 0, block_ids, out=out.view(len(block_ids), *self._fused.shape[1:]))
            return
        for view, off in zip(self._views, self._offsets):
            out[:, off:off + view.shape[1]].copy_(torch.index_select(view, 0, block_ids))

    def scatter(self, block_ids: "torch.Tensor", rows: "torch.Tensor") -> None:
        """Write ``rows[i]`` (``[n, block_nbytes]`` uint8) into engine block ``block_ids[i]``."""
        if self._fused is not None:
            self._fused.index_copy_(0, block_ids, rows.view(len(block_ids), *self._fused.shape[1:]))
            return
        for view, off in zip(self._views, self._offsets):
            view.index_copy_(0, block_ids, rows[:, off:off + view.shape[1]])


    def zero(self, block_ids: "torch.Tensor") -> None:
        """Zero engine blocks ``block_ids`` in every layer (on the current stream, as vLLM's
        own zeroing of newly allocated blocks runs)."""
        for view in self._views:
            view.index_fill_(0, block_ids, 0)


class LayoutRows:
    """vLLM's KV tensors as whole kvstrata blocks: :class:`~kvstrata.dataplane.executor.DeviceRows`
    (synchronous, for the shutdown store) and :class:`~kvstrata.dataplane.copier.CopyRows` (work the
    copier submits on its streams: kvstrata's kernels on CUDA, one launch per job across
    every layer; row memcpys on the CPU backend)."""

    def __init__(self, layout: KVLayout) -> None:
        import torch

        self.layout = layout
        self.block_nbytes = layout.block_nbytes
        self.cuda = torch.device(layout.device).type == "cuda"
        # the CPU backend: each segment's pages as numpy rows, copied with memcpys straight
        # between the engine's blocks and host rows (no temporaries, no intra-op threads:
        # torch's would compete with the forward's, and each store's temporary tensors made
        # the allocator fault pages back in for the next forward)
        self._host = None if self.cuda else [(page.numpy(), off) for page, off in zip(layout.pages,
                                                                                       layout.page_offsets)]

    def _index(self, block_ids: Sequence[int]) -> "torch.Tensor":
        from kvstrata.system.streams import to_device

        return to_device(list(block_ids), self.layout.device)

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        rows = self.staging(len(block_ids))
        self.gather(block_ids, rows, range(len(block_ids)))
        if self.cuda:
            import torch

            torch.cuda.current_stream(self.layout.device).synchronize()  # a synchronous store (shutdown)
        return rows

    def write(self, block_ids: Sequence[int], rows: np.ndarray) -> Any:
        self.scatter(rows, range(len(block_ids)), block_ids)
        return None

    def gather(self, block_ids: Sequence[int], dst: np.ndarray, dst_rows: Sequence[int]) -> None:
        import torch

        host = torch.from_numpy(dst)
        if self.cuda and host.is_pinned():
            from kvstrata.kernels import gather_blocks

            gather_blocks(self.layout.pages, list(block_ids), host, out_rows=list(dst_rows), check_indices=False)
            return
        if self._host is not None:
            for page, off in self._host:
                copy_rows(page, block_ids, dst[:, off:off + page.shape[1]], dst_rows)
            return
        n = len(block_ids)  # pageable host memory (HostSlab warned: ~10x slower)
        rows = torch.empty((n, self.block_nbytes), dtype=torch.uint8, device=self.layout.device)
        self.layout.gather(self._index(block_ids), rows)
        copy_rows(rows.cpu().numpy(), range(n), dst, dst_rows)

    def scatter(self, src: np.ndarray, src_rows: Sequence[int], block_ids: Sequence[int]) -> None:
        import torch

        host = torch.from_numpy(src)
        if self.cuda and host.is_pinned():
            from kvstrata.kernels import scatter_blocks

            scatter_blocks(host, self.layout.pages, list(block_ids), staging_rows=list(src_rows),
                           check_indices=False)
            return
        if self._host is not None:
            for page, off in self._host:
                copy_rows(src[:, off:off + page.shape[1]], src_rows, page, block_ids)
            return
        n = len(block_ids)
        rows = np.empty((n, self.block_nbytes), dtype=np.uint8)
        copy_rows(src, src_rows, rows, range(n))
        self.layout.scatter(self._index(block_ids), torch.from_numpy(rows).to(self.layout.device))

    def zero(self, block_ids: Sequence[int]) -> None:
        """Zero these engine blocks in every layer, on the current (compute) stream."""
        if block_ids:
            self.layout.zero(self._index(block_ids))

    def staging(self, n: int) -> np.ndarray:
        return host_rows(n, self.block_nbytes, pinned=self.cuda)
