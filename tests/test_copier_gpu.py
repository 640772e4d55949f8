"""The copier on a real GPU: CUDA streams and events, kvstrata's gather/scatter kernels,
the page-locked slab, a real SSD tier (needs a GPU and cupy; run by
benchmarks/gpu_check.sh). The same ordering rules are checked without a GPU by
tests/test_copier_state.py on a fake device."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU copier tests skipped", allow_module_level=True)
pytest.importorskip("cupy")

from kvstrata.connectors.kit.kv_layout import KVLayout, LayoutRows  # noqa: E402
from kvstrata.dataplane.copier import Copier  # noqa: E402
from kvstrata.dataplane.executor import Executor  # noqa: E402
from kvstrata.policy import COMPUTED, LoadPlan, StorePlan  # noqa: E402
from kvstrata.system.streams import CudaStreams  # noqa: E402
from kvstrata.tiers.host import HostSlab  # noqa: E402
from kvstrata.tiers.ssd import SSDTier  # noqa: E402

NUM_BLOCKS = 16
LAYERS = 4


def _engine(tmp_path):
    # vLLM's default CUDA layout (LBNHC): one buffer [L, B, N, H, C], per layer a logical
    # [B, H, N, C] view (C: K and V of one head, 2 x 64)
    buf = torch.randn(LAYERS, NUM_BLOCKS, 16, 4, 128, device="cuda", dtype=torch.float16)
    kv = {f"layer.{i}": buf[i].permute(0, 2, 1, 3) for i in range(LAYERS)}
    layout = KVLayout(kv, NUM_BLOCKS)
    rows = LayoutRows(layout)
    slab = HostSlab(6, layout.block_nbytes, pin_memory=True)
    assert slab.pinned
    ssd = SSDTier(tmp_path / "ssd", capacity_bytes=64 * 1024**2, block_nbytes=layout.block_nbytes)
    copier = Copier(Executor(rows, {"cpu": slab, "ssd": ssd}), rows, CudaStreams(torch.device("cuda")))
    return kv, layout, slab, ssd, copier


def _bytes_of(layout: KVLayout, block_ids: list[int]) -> np.ndarray:
    out = torch.empty((len(block_ids), layout.block_nbytes), dtype=torch.uint8, device="cuda")
    layout.gather(torch.tensor(block_ids, device="cuda"), out)
    return out.cpu().numpy()


def _until(pred, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def test_store_then_load_round_trips_bit_exact(tmp_path) -> None:
    kv, layout, slab, ssd, copier = _engine(tmp_path)
    keys = [bytes([9, i]) * 16 for i in range(6)]
    src = [1, 3, 4, 7, 9, 12]
    expected = _bytes_of(layout, src)
    # four into the slab (two of them also to SSD), two only to SSD (through staging)
    plan = StorePlan(1, COMPUTED, src, keys, [0, 1, 2, 3, -1, -1], {"ssd": [1, 3, 4, 5]}, slab="cpu")
    copier.store(plan, copier.streams.current().record())
    done = _until(lambda: copier.poll().stored, "the store")
    assert done == [1]
    for slot in range(4):
        assert np.array_equal(slab.array[slot], expected[slot])
    assert ssd.flush()
    for k in list(kv.values()):
        k.zero_()
    dst = [0, 2, 5, 6, 8, 10]
    load = LoadPlan(2, "r", dst, keys, [0, 1, 2, 3, -1, -1], ["cpu", "cpu", "cpu", "cpu", "ssd", "ssd"],
                    [-1, -1, -1, -1, 4, 5], slab="cpu")
    copier.load(load)
    result = _until(lambda: copier.poll().loads.get("r"), "the load")
    assert result.loaded == 6 and result.lost == []
    assert np.array_equal(_bytes_of(layout, dst), expected)
    assert np.array_equal(slab.array[4], expected[4]) and np.array_equal(slab.array[5], expected[5])
    copier.close()
    ssd.close()


def test_the_fence_keeps_a_reused_block_until_its_gather_ran(tmp_path) -> None:
    """A block handed out again and rewritten by the compute stream right after its store
    was queued: the slab gets the bytes it had when the store was queued."""
    kv, layout, slab, ssd, copier = _engine(tmp_path)
    expected = _bytes_of(layout, [5])
    plan = StorePlan(1, COMPUTED, [5], [b"k" * 32], [0], {}, slab="cpu")
    copier.store_stream.submit(lambda: torch.cuda._sleep(200_000_000))  # ~0.1 s: the gather waits behind it
    copier.store(plan, copier.streams.current().record())
    copier.fence([5])
    for k in kv.values():
        k[5].fill_(7.0)  # the next forward rewrites block 5 on the compute stream
    _until(lambda: 1 in copier.poll().stored, "the store")
    assert np.array_equal(slab.array[0], expected[0])
    copier.close()
    ssd.close()


def test_queueing_a_copy_behind_a_busy_forward_does_not_block_the_host(tmp_path) -> None:
    """The store's block ids reach the device through pinned memory: a copy from pageable
    memory would first synchronise the store stream, which waits for the compute stream,
    so the step thread would wait for the forward (here ~0.5 s of GPU sleep)."""
    kv, layout, slab, ssd, copier = _engine(tmp_path)
    torch.cuda._sleep(1_000_000_000)  # the "forward", on the compute stream
    after = copier.streams.current().record()
    t0 = time.perf_counter()
    copier.store(StorePlan(1, COMPUTED, [2, 3], [b"a" * 32, b"b" * 32], [0, 1], {}, slab="cpu"), after)
    queued_s = time.perf_counter() - t0
    assert not after.query(), "the forward was over before the store was queued: nothing measured"
    assert queued_s < 0.1, f"queueing the store took {queued_s:.3f} s: the host waited for the forward"
    _until(lambda: copier.poll().stored, "the store")
    copier.close()
    ssd.close()


def test_a_load_reports_the_device_time_of_its_copies_not_its_wait_in_the_queue(tmp_path) -> None:
    """The load stream is busy for ~0.2 s (a GPU sleep queued on it) when a load from the slab
    is queued: the load completes after that, but the seconds it reports are its copies' own,
    between two timed events on the load stream."""
    kv, layout, slab, ssd, copier = _engine(tmp_path)
    keys = [bytes([3, i]) * 16 for i in range(4)]
    plan = StorePlan(1, COMPUTED, [1, 2, 3, 4], keys, [0, 1, 2, 3], {}, slab="cpu")
    copier.store(plan, copier.streams.current().record())
    _until(lambda: copier.poll().stored, "the store")
    copier.load_stream.submit(lambda: torch.cuda._sleep(400_000_000))
    t0 = time.perf_counter()
    copier.load(LoadPlan(2, "r", [8, 9, 10, 11], keys, [0, 1, 2, 3], ["cpu"] * 4, [-1] * 4, slab="cpu"))
    result = _until(lambda: copier.poll().loads.get("r"), "the load")
    waited = time.perf_counter() - t0
    assert result.loaded == 4
    assert waited > 0.1, f"the load stream was not busy ({waited:.3f} s): nothing measured"
    assert 0 < result.seconds < waited / 4, (result.seconds, waited)
    copier.close()
    ssd.close()


def test_copy_streams_never_outrank_the_compute_stream() -> None:
    least, greatest = torch.cuda.Stream.priority_range()
    compute = torch.cuda.current_stream().priority
    streams = CudaStreams(torch.device("cuda"))
    store = streams.new_stream(low_priority=True).torch_stream.priority
    load = streams.new_stream(low_priority=False).torch_stream.priority
    assert store == least and load == compute, (least, greatest, compute, store, load)
    assert store >= compute and load >= compute  # CUDA: a larger number is a lower priority


def test_slab_close_unregisters_the_page_locked_memory() -> None:
    slab = HostSlab(4, 1 << 16, pin_memory=True)
    assert slab.pinned and slab.tensor.is_pinned()
    slab.array[1] = 5
    slab.close()
    assert not slab.pinned and not slab.tensor.is_pinned() and int(slab.array[1, 0]) == 5
    slab.close()  # idempotent


def test_transfer_write_rows_runs_after_the_compute_stream() -> None:
    """A promotion into a pool row that queued compute work still writes lands after it."""
    from kvstrata.dataplane.transfer import TransferEngine

    pool = torch.zeros((4, 1 << 20), dtype=torch.uint8, device="cuda")
    engine = TransferEngine(pool)
    torch.cuda._sleep(200_000_000)
    pool[1].fill_(7)  # the row's previous owner, still queued on the compute stream
    event = engine.write_rows([1], np.full((1, 1 << 20), 3, dtype=np.uint8))
    engine.wait_event(event)
    torch.cuda.synchronize()
    assert bool((pool[1] == 3).all())


def test_unregister_and_restore_on_cuda(tmp_path) -> None:
    """The sleep-mode hooks' device side: the kernel tables are dropped with the views, and
    after restore a store still gathers the right bytes."""
    from kvstrata.kernels import cuda_block_ops

    kv, layout, slab, ssd, copier = _engine(tmp_path)
    rows = LayoutRows(layout)
    staging = rows.staging(1)
    rows.gather([3], staging, [0])
    torch.cuda.synchronize()
    assert cuda_block_ops._table.cache_info().currsize > 0
    cuda_block_ops.drop_tables()
    assert cuda_block_ops._table.cache_info().currsize == 0
    again = rows.staging(1)
    rows.gather([3], again, [0])
    torch.cuda.synchronize()
    assert np.array_equal(staging, again)
    copier.close()
    ssd.close()
