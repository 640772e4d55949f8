"""kvstrata driven by SGLang 0.5.23's own cache controller, on this CPU machine.

``HiCacheController`` (sglang/srt/managers/cache_controller.py) is built as SGLang's
hierarchical radix cache builds it at start-up with ``--hicache-storage-backend dynamic``:
it attaches kvstrata through the real ``StorageBackendFactory`` and starts its prefetch,
prefetch I/O, prefetch sync and backup threads. The storage paths then run as they run
under a server: ``write_storage`` queues a backup that the backup thread writes in batches
of ``STORAGE_BATCH_SIZE`` (128) pages (``_page_set_zero_copy`` -> ``batch_set_v1`` with
``interface_v1``, else ``_generic_page_set`` -> ``batch_set`` of flat pages); ``prefetch``
queues a query that the prefetch thread answers with ``batch_exists`` per 128 pages
(``_storage_hit_query``), and once host slots are given (what the radix cache does on the
scheduler thread: ``host_indices``, then ``prefetch_buffer``) the I/O thread reads the pages
in batches of 128 (``_page_transfer`` -> ``batch_get_v1`` or ``batch_get`` of flat pages)
and the sync thread acks each batch.

Nothing of this needs CUDA. What does (the device half, not run here): moving pages between
the device pool and the host pool, ``HiCacheController.write`` / ``load`` and
``start_writing`` / ``start_loading`` (device streams and events, the transfer kernels of
``sgl_kernel``). Two things SGLang's launcher sets up are stated instead (tests/sglang_env.py,
``controller``): the parallel widths, with ``get_parallel().override`` (SGLang's test-only
injection) while the backend attaches, and the process group: none (``tp_group=None``, one
rank: the controller then skips its hit and ack all-reduces).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from sglang_env import DYNAMIC, backup, controller, fill, host_pool, page_bytes, prefetch  # noqa: E402

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


def extra(tmp: Path, v1: int = 1, **more) -> dict:
    return {**DYNAMIC, "interface_v1": v1, "ssd.path": str(tmp / "ssd"), "ssd.capacity": "64MiB",
            "model.id": "test-model", **more}


def tokens_of(pages: int, page_size: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 32000 for i in range(pages * page_size)]


@pytest.mark.parametrize("layout, v1", [("page_first", 1), ("layer_first", 1), ("page_first_direct", 1),
                                        ("page_first", 0)])
def test_the_controller_backs_up_and_prefetches_byte_exact_in_batches_of_128(tmp_path, layout, v1) -> None:
    host = host_pool(layout, device_tokens=600, ratio=2.0)  # 300 pages of 4 tokens
    ctl = controller(extra(tmp_path, v1), host)
    try:
        zero_copy = "zero_copy" in ctl.page_set_func.__name__
        assert zero_copy == bool(v1) and type(ctl.storage_backend).__name__ == "KVStrataStorage"
        n, ps = 140, host.page_size
        src = host.alloc(n * ps)
        fill(host, src, seed=11)
        tokens = tokens_of(n, ps)
        assert backup(ctl, src, tokens) == n * ps
        assert ctl.storage_backend.get_stats().backup_pgs == [BATCH, n - BATCH]  # the controller's batches
        got, dst, acks = prefetch(ctl, host, tokens)
        assert got == n * ps and acks == [BATCH * ps, n * ps]
        assert set(dst.tolist()).isdisjoint(src.tolist())  # other host slots than the written ones
        assert page_bytes(host, dst) == page_bytes(host, src)
        assert ctl.storage_backend.get_stats().prefetch_pgs == [BATCH, n - BATCH]
    finally:
        ctl.detach_storage_backend()


def test_a_prefetch_brings_the_stored_prefix_and_stops_at_the_first_missing_page(tmp_path) -> None:
    host = host_pool("page_first", device_tokens=600, ratio=2.0)
    ctl = controller(extra(tmp_path), host)
    try:
        ps = host.page_size
        src = host.alloc(140 * ps)
        fill(host, src, seed=12)
        tokens = tokens_of(140, ps)
        assert backup(ctl, src[:100 * ps], tokens[:100 * ps]) == 100 * ps  # the first 100 pages only
        got, dst, acks = prefetch(ctl, host, tokens)
        assert got == 100 * ps and acks == [100 * ps]  # the query stopped at page 100: one batch
        assert page_bytes(host, dst) == page_bytes(host, src[:100 * ps])
        assert prefetch(ctl, host, tokens_of(8, ps, seed=5))[0] == 0  # nothing stored: no transfer
    finally:
        ctl.detach_storage_backend()


def test_a_new_controller_on_the_same_ssd_path_serves_the_pages_after_a_restart(tmp_path) -> None:
    host = host_pool("layer_first", device_tokens=600, ratio=2.0)
    ctl = controller(extra(tmp_path), host)
    ps, n = host.page_size, 130
    src = host.alloc(n * ps)
    fill(host, src, seed=13)
    written = page_bytes(host, src)
    tokens = tokens_of(n, ps)
    try:
        assert backup(ctl, src, tokens) == n * ps
    finally:
        ctl.detach_storage_backend()  # closes the backend: the SSD tier is flushed and closed
    host = host_pool("layer_first", device_tokens=600, ratio=2.0)  # a new server: a fresh host pool
    ctl = controller(extra(tmp_path), host)
    try:
        got, dst, _ = prefetch(ctl, host, tokens)
        assert got == n * ps and page_bytes(host, dst) == written
        assert ctl.storage_backend.get_stats().kvstrata["hits"]["ssd"]["blocks"] == n
    finally:
        ctl.detach_storage_backend()


def test_a_failed_attach_leaves_the_controller_without_storage(tmp_path) -> None:
    host = host_pool("page_first")
    with pytest.raises(Exception, match="ssd.capacty: unknown key"):
        controller({**extra(tmp_path), "ssd.capacty": "1GiB"}, host)
    assert not (tmp_path / "ssd").exists()
