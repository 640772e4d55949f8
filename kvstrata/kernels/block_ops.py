"""Public whole-page copy ops over paged pools of any dtype: copy_blocks,
gather_blocks, scatter_blocks. Validate, then dispatch by device.

A *cache* is one layer's pool: a tensor whose dim 0 is the block index and
whose other dims are contiguous (rows may be strided, e.g. the K half of a
[num_blocks, 2, ...] tensor). Its page is ``cache[b]``, ``page_bytes =
cache[0].numel() * element_size`` bytes, copied as opaque bytes. A staging row
holds the pages of all layers back to back, in the order of ``caches``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvstrata.kernels import checks
from kvstrata.kernels.reference_blocks import copy_blocks_ref, gather_blocks_ref, page_nbytes, scatter_blocks_ref

MAX_PAGE_BYTES = 65535 * 16384  # grid y * bytes per chunk
MAX_JOBS = 2**31 - 1  # blocks * layers of one launch
MAX_THREAD_BLOCKS = 2**31 - 1  # grid x


def copy_blocks(caches: Sequence[Any], block_mapping: Any, *, check_indices: bool = True) -> None:
    """For every (src, dst) row of ``block_mapping`` ([n, 2] int64, or a list of
    pairs) copy page src onto page dst in every cache, in one launch on CUDA.
    dst ids must be distinct and must not appear as src (copy-on-write: fresh
    destinations), so the result does not depend on ordering.
    ``check_indices`` (one device sync for device ids) verifies ids < the
    smallest ``num_blocks`` and the distinctness rules."""
    cs = _caches(caches)
    mapping = checks.index_tensor("block_mapping", block_mapping)
    if mapping.numel() == 0:
        mapping = mapping.reshape(0, 2)
    checks.ndim("block_mapping", mapping, 2)
    if mapping.shape[1] != 2:
        raise ValueError(f"block_mapping: expected shape [n, 2], got {tuple(mapping.shape)}")
    _check_jobs(cs, mapping.shape[0])
    if check_indices:
        _check_ids("block_mapping", mapping, cs)
        src, dst = mapping[:, 0], mapping[:, 1]
        checks.distinct("block_mapping", dst)
        if bool(torch.isin(dst, src).any()):
            raise ValueError("block_mapping: a dst block is also a src block")
    if cs[0].device.type == "cpu":
        copy_blocks_ref(cs, mapping.to(cs[0].device))
        return
    _device_ids("block_mapping", mapping, cs[0].device)
    from kvstrata.kernels.cuda_block_ops import copy_blocks_cuda

    copy_blocks_cuda(cs, mapping)


def gather_blocks(caches: Sequence[Any], block_ids: Any, out: Any, *, out_rows: Any = None,
                  max_thread_blocks: int | None = None, check_indices: bool = True) -> torch.Tensor:
    """Copy page ``block_ids[i]`` of every cache into staging row ``out[out_rows[i]]``
    (``out[i]`` when ``out_rows`` is None).

      caches     per-layer pools (see module doc), all on one device
      block_ids  [n] int64 (tensor on CPU or the caches' device, or a list)
      out        [m, sum of page_bytes] uint8, contiguous; on the caches'
                 device, or pinned host memory when the caches are on CUDA
                 (e.g. the CPU tier's slab, filled in place). m == n when
                 ``out_rows`` is None.
      out_rows   None, or [n] int64 (placed like block_ids): distinct rows of
                 ``out``, each < m
      max_thread_blocks  cap on the thread blocks of the CUDA launch (each
                 walks its share of the work; ignored on CPU). None: 32
                 (``cuda_block_ops.HOST_STAGING_THREAD_BLOCKS``) when ``out``
                 is host memory: such a copy is bound by the host link, and
                 the cap keeps it off most SMs so that the forward pass keeps
                 them; no cap for device staging (an HBM copy, over quickly).
    Returns ``out``. CUDA: one launch, 16-byte accesses when every address,
    row stride and page size is a multiple of 16 (else byte accesses), on
    torch's current stream (synchronise before reading pinned ``out`` on the
    host). CPU: ``index_select`` per layer. Duplicate block ids are allowed.
    """
    cs = _caches(caches)
    ids = checks.index_tensor("block_ids", block_ids)
    staging = checks.as_tensor("out", out)
    rows = _rows("out_rows", out_rows)
    _thread_cap(max_thread_blocks)
    _check_staging("out", staging, cs, ids, "out_rows", rows, check_indices)
    if check_indices and rows is not None:
        checks.distinct("out_rows", rows)
    if cs[0].device.type == "cpu":
        return gather_blocks_ref(cs, ids, staging, rows)
    from kvstrata.kernels.cuda_block_ops import gather_scatter_cuda

    gather_scatter_cuda(cs, ids, staging, True, rows, max_thread_blocks)
    return staging


def scatter_blocks(staging: Any, caches: Sequence[Any], block_ids: Any, *, staging_rows: Any = None,
                   max_thread_blocks: int | None = None, check_indices: bool = True) -> None:
    """Inverse of ``gather_blocks``: copy staging row ``staging[staging_rows[i]]``
    (``staging[i]`` when ``staging_rows`` is None) onto page ``block_ids[i]`` of
    every cache. Same shapes, placement rules and thread-block cap; the block
    ids must be distinct (checked with ``check_indices``), staging rows may
    repeat (each < ``staging.shape[0]``)."""
    cs = _caches(caches)
    ids = checks.index_tensor("block_ids", block_ids)
    st = checks.as_tensor("staging", staging)
    rows = _rows("staging_rows", staging_rows)
    _thread_cap(max_thread_blocks)
    _check_staging("staging", st, cs, ids, "staging_rows", rows, check_indices)
    if check_indices:
        checks.distinct("block_ids", ids)
    if cs[0].device.type == "cpu":
        scatter_blocks_ref(st, cs, ids, rows)
        return
    from kvstrata.kernels.cuda_block_ops import gather_scatter_cuda

    gather_scatter_cuda(cs, ids, st, False, rows, max_thread_blocks)


def _caches(caches: Sequence[Any]) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence) or len(caches) == 0:
        raise ValueError("caches: expected a non-empty sequence of per-layer tensors")
    cs = [checks.as_tensor(f"caches[{i}]", c) for i, c in enumerate(caches)]
    for i, c in enumerate(cs):
        checks.inner_contiguous(f"caches[{i}]", c)
        if c.shape[0] == 0 or c[0].numel() == 0:
            raise ValueError(f"caches[{i}]: empty pool or page (shape {tuple(c.shape)})")
        if page_nbytes(c) > MAX_PAGE_BYTES:
            raise ValueError(f"caches[{i}]: page of {page_nbytes(c)} bytes exceeds {MAX_PAGE_BYTES}")
    checks.same_device([f"caches[{i}]" for i in range(len(cs))], cs)
    if cs[0].device.type not in ("cpu", "cuda"):
        raise ValueError(f"caches: unsupported device {cs[0].device}")
    return cs


def _check_jobs(cs: list[torch.Tensor], n: int) -> None:
    if n * len(cs) > MAX_JOBS:
        raise ValueError(f"block_ids: {n} blocks x {len(cs)} layers exceed {MAX_JOBS} copies per launch")


def _check_ids(name: str, ids: torch.Tensor, cs: list[torch.Tensor]) -> None:
    checks.in_range(name, ids, 0, min(c.shape[0] for c in cs))


def _device_ids(name: str, ids: torch.Tensor, device: torch.device) -> None:
    if ids.device.type != "cpu" and ids.device != device:
        raise ValueError(f"{name}: on {ids.device}, expected the CPU or {device}")


def _rows(name: str, rows: Any) -> torch.Tensor | None:
    return None if rows is None else checks.index_tensor(name, rows)


def _thread_cap(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREAD_BLOCKS:
        raise ValueError(f"max_thread_blocks: expected None or an integer in [1, {MAX_THREAD_BLOCKS}], got {value!r}")


def _check_staging(name: str, st: torch.Tensor, cs: list[torch.Tensor], ids: torch.Tensor, rows_name: str,
                   rows: torch.Tensor | None, check_indices: bool) -> None:
    checks.ndim("block_ids", ids, 1)
    checks.dtype_is(name, st, torch.uint8)
    total = sum(page_nbytes(c) for c in cs)
    if rows is None:
        checks.shape(name, st, (ids.shape[0], total))
    else:
        checks.ndim(name, st, 2)
        if st.shape[1] != total:
            raise ValueError(f"{name}: expected shape [rows, {total}], got {tuple(st.shape)}")
        checks.shape(rows_name, rows, (ids.shape[0],))
    checks.contiguous(name, st)
    _check_jobs(cs, ids.shape[0])
    device = cs[0].device
    index_names = ("block_ids",) if rows is None else ("block_ids", rows_name)
    if device.type == "cpu":
        if st.device.type != "cpu" or ids.device.type != "cpu" or (rows is not None and rows.device.type != "cpu"):
            raise ValueError(f"{name}: CPU caches need CPU staging, {' and '.join(index_names)}")
    else:
        _device_ids("block_ids", ids, device)
        if rows is not None:
            _device_ids(rows_name, rows, device)
        if st.device.type == "cpu" and not st.is_pinned():
            raise ValueError(f"{name}: host staging for CUDA caches must be pinned memory")
        if st.device.type == "cuda" and st.device != device:
            raise ValueError(f"{name}: on {st.device}, expected {device} or pinned host memory")
    if check_indices:
        _check_ids("block_ids", ids, cs)
        if rows is not None:
            checks.in_range(rows_name, rows, 0, st.shape[0])
