"""The scheduler half's request recorder (``trace.path``): what each request looked like.

Hands each finished request to :class:`~kvstrata.trace.recorder.TraceRecorder`
(its prompt's full blocks, those its output completed, its preemptions), and
every few seconds the counters the plugin measured, so that ``kvstrata bench``
can replay the recording and compare.

Threads: vLLM's scheduler thread (the recorder writes on its own).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from kvstrata.config.schema import KVStrataConfig
from kvstrata.trace.recorder import RecordedRequest
from kvstrata.policy.tiers import GPU

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from kvstrata.identity.fingerprint import Fingerprint
    from kvstrata.policy.spec import PolicySpec

__all__ = ["SchedulerRecording", "MEASURE_S"]

MEASURE_S = 5.0  # how often the recorder's copy of the measured counters is refreshed
_MEASURED = ("queries", "hits", "preempted", "spills", "promotions", "evictions", "dropped_spills", "corrupt_blocks",
             "capacity_blocks", "load")


class SchedulerRecording:
    """One recorder, fed by the scheduler half (see the module docstring)."""

    def __init__(self, cfg: KVStrataConfig, vllm_config: "VllmConfig", gpu_blocks: int, spec: "PolicySpec",
                 fingerprint: "Fingerprint", block_size: int, block_nbytes: int) -> None:
        import vllm

        from kvstrata.bench.deployment import recorded_deployment
        from kvstrata.connectors.vllm.common import retention_of
        from kvstrata.trace.recorder import TraceRecorder

        deployment = recorded_deployment(
            cfg, block_size=block_size, block_nbytes=block_nbytes, gpu_blocks=gpu_blocks,
            capacity_blocks={GPU: gpu_blocks, **spec.capacity()},
            max_num_batched_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
            engine={"name": "vllm", "version": vllm.__version__, "model": fingerprint.model,
                    "tp_size": fingerprint.tp_size, "kv_layout": fingerprint.kv_layout,
                    **({"groups": fingerprint.groups, "retention_interval": retention_of(vllm_config)}
                       if fingerprint.groups else {})})
        self.recorder = TraceRecorder(cfg.trace, block_size=block_size, deployment=deployment)
        self.block_size, self.block_nbytes = block_size, block_nbytes
        self._measured_at = 0.0

    def admitted(self, req_id: str) -> None:
        self.recorder.admitted(req_id)

    @staticmethod
    def preempted(st: Any) -> None:
        """The request was preempted now (resumed: :meth:`resumed`)."""
        st.preemptions.append([time.time(), None, 0])

    @staticmethod
    def resumed(st: Any, num_tokens: int) -> None:
        """A preempted request is looked up again, ``num_tokens`` tokens of it."""
        if st.preemptions and st.preemptions[-1][1] is None:
            st.preemptions[-1][1:] = [time.time(), num_tokens]

    def finished(self, st: Any, hashes: Callable[[Any, int], list[bytes]], cacheable: bool) -> None:
        """Hand a finished request to the recorder: its prompt's full blocks and those its
        output completed (whose KV was computed: all tokens but the last)."""
        req: Request = st.request
        if req.num_computed_tokens == 0 and req.num_output_tokens == 0:  # aborted before it ran
            self.recorder.finished(req.request_id, None)
            return
        prompt = req.num_prompt_tokens
        computed = max(prompt, req.num_tokens - 1) // self.block_size if cacheable else 0
        keys = hashes(st, computed) if computed else []
        full = min(prompt // self.block_size, len(keys))
        self.recorder.finished(req.request_id, RecordedRequest(
            arrival=float(req.arrival_time), finish=time.time(), input_length=prompt,
            output_length=req.num_output_tokens, keys=keys[:full], output_keys=keys[full:computed],
            preemptions=[(p, r, n) for p, r, n in st.preemptions if r is not None]))

    def measure(self, stats: Callable[[], dict[str, Any]], final: bool = False) -> None:
        """The recorder's view of what the plugin measured, every few seconds and at the end."""
        now = time.monotonic()
        if not final and now - self._measured_at < MEASURE_S:
            return
        self._measured_at = now
        snapshot = stats()
        self.recorder.measured({k: snapshot[k] for k in _MEASURED}
                               | {"block_size": self.block_size, "block_nbytes": self.block_nbytes})

    def close(self, stats: Callable[[], dict[str, Any]]) -> None:
        """Record the final counters and close the recording."""
        self.measure(stats, final=True)
        self.recorder.close()
