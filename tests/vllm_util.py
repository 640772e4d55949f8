"""Helpers for the real-vLLM tests and benchmark: a tiny local Llama, and an
engine runner that executes one scenario in a fresh process.

Nothing here downloads anything: the model is built with random weights and a
byte-level BPE tokenizer trained on generated text. ``initializer_range=0.1``:
with 1.0 attention is so peaked that, measured on a 700-token prompt, changing
any one prompt token left the last position's log-probabilities bit-identical;
with 0.1 changing any token moves them by ~0.02-0.1, so comparing sampled-token
log-probabilities (recorded by the runner) detects wrong KV anywhere in the prompt.

Usage as a script (what the tests do, one engine per process)::

    python tests/vllm_util.py '<json scenario>'

prints one JSON line ``RESULT {...}`` with each prompt's output token ids and
``num_cached_tokens``, and the engine's external prefix-cache hit counter.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega cache block tier token layer head page slab disk "
         "memory prefix hash chain engine vector matrix").split()


def build_tiny_llama(path: str | os.PathLike[str], *, layers: int = 2, hidden: int = 128, heads: int = 2,
                     kv_heads: int = 2, intermediate: int = 128, vocab: int = 512,
                     max_positions: int = 4096, seed: int = 0, init_range: float = 0.1) -> Path:
    """Write a random-weight Llama (float32) and a trained BPE tokenizer to ``path``.

    Idempotent: an existing complete model directory is reused.
    """
    out = Path(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(64)) for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=max(vocab, tok.get_vocab_size()), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, initializer_range=init_range,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def _tokenizer_into(out: Path, vocab: int) -> None:
    """The tiny Llama's tokenizer files, copied into the model directory ``out``."""
    import shutil

    tokenizer = build_tiny_llama(out.parent / f"{out.name}-tokenizer", vocab=vocab)
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)


def build_tiny_gemma3(path: str | os.PathLike[str], *, layers: int = 6, sliding: int = 5, window: int = 64,
                      hidden: int = 128, heads: int = 2, kv_heads: int = 2, head_dim: int = 64, vocab: int = 512,
                      seed: int = 0) -> Path:
    """A random-weight Gemma-3 text model (float32): ``sliding`` of its ``layers`` attend
    within ``window`` tokens, the others to everything (a hybrid model for vLLM's hybrid
    memory allocator), with the tiny Llama's tokenizer. Idempotent."""
    out = Path(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    _tokenizer_into(out, vocab)
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           head_dim=head_dim, sliding_window=window, max_position_embeddings=4096,
                           layer_types=["sliding_attention"] * sliding + ["full_attention"] * (layers - sliding),
                           bos_token_id=0, eos_token_id=1, pad_token_id=1, initializer_range=0.1)
    Gemma3ForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


def build_tiny_qwen3_next(path: str | os.PathLike[str], *, layers: int = 4, hidden: int = 128, vocab: int = 512,
                          seed: int = 0) -> Path:
    """A random-weight Qwen3-Next model (bfloat16): three Gated DeltaNet (linear attention)
    layers, then one full-attention layer, repeated, a tiny mixture of experts; with the
    tiny Llama's tokenizer. vLLM's CPU build runs it in bfloat16 only (its GDN kernel), with
    128-wide linear-attention heads. A state hybrid: with prefix caching vLLM keeps one state
    per block position of its linear-attention layers (``mamba_cache_mode`` align). Idempotent."""
    out = Path(path)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    _tokenizer_into(out, vocab)
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=max(2, hidden // 64), num_key_value_heads=2,
                          head_dim=64,
                          linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_num_key_heads=1, linear_num_value_heads=1, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=64, shared_expert_intermediate_size=64, max_position_embeddings=8192,
                          layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
                          bos_token_id=0,
                          eos_token_id=1, pad_token_id=1, initializer_range=0.1, tie_word_embeddings=False)
    Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def random_token_prompt(n: int, seed: int, vocab: int = 500) -> list[int]:
    """``n`` random token ids avoiding the special ids 0 and 1."""
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(n)]


# --------------------------------------------------------------------------- engine runner

def loading_every_hit(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` with ``load.policy: always`` unless it sets a ``load.*`` key: the tests of
    the tiers assert that hits are loaded, and a tiny model computes a block faster than any
    tier loads it, so ``measured`` (the default) would rightly compute them. The decision
    is tested on its own (``test_vllm_load_costs.py``, ``test_vllm_load_throttled.py``)."""
    if any(str(k).startswith("load.") for k in extra):
        return dict(extra)
    return {**extra, "load.policy": "always"}


def kv_transfer_config(extra: dict[str, Any], *, module_path: bool = True) -> dict[str, Any]:
    cfg: dict[str, Any] = {"kv_connector": "KVStrataConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": loading_every_hit(extra),
                           "kv_load_failure_policy": "recompute"}
    if module_path:
        cfg["kv_connector_module_path"] = "kvstrata.connectors.vllm"
    return cfg


def _make_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(model=spec["model"], dtype="float32", block_size=32,
                                  enable_prefix_caching=True, enforce_eager=True, seed=0,
                                  kv_cache_memory_bytes=spec.get("kv_bytes", 8 * 1024**2),
                                  max_model_len=spec.get("max_model_len", 2048),
                                  disable_log_stats=False)
    if spec.get("tp", 1) > 1:  # one worker process per rank (run with multiprocessing=True)
        kwargs.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    kwargs.update(spec.get("engine", {}))  # other LLM() arguments
    if spec.get("kvstrata") is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(spec["kvstrata"],
                                                          module_path=spec.get("module_path", True))
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=spec["kv_events"], topic="kv",
                                                    replay_endpoint=spec["kv_events"] + "-replay")
    return LLM(**kwargs)


class EventSubscriber:
    """A router's view of the engine's KV-cache events: a ZMQ SUB socket on ``endpoint``,
    batches decoded with vLLM's own decoder, kept as plain dicts (``type`` and the fields).

    As a router must, it orders batches by their sequence number and fetches the ones it
    missed from the publisher's replay socket (``replay_endpoint``): a SUB socket receives
    nothing published before its subscription reached the publisher, which binds only
    once the engine starts, so the first batches of a fast engine can go past it."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        import threading

        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._batches: dict[int, list[dict[str, Any]]] = {}  # by sequence number
        self._next = 0  # the first sequence number not handed out yet
        self.replayed = 0  # batches fetched from the replay socket
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _decode(self, seq: bytes, payload: bytes) -> tuple[int, list[dict[str, Any]]]:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
        events = [{"type": type(e).__name__, **{f: getattr(e, f) for f in e.__struct_fields__}}
                  for e in batch.events]
        return int.from_bytes(seq, "big"), events

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            _topic, seq, payload = self._sock.recv_multipart()
            n, events = self._decode(seq, payload)
            with self._lock:
                self._batches[n] = events

    def _replay(self, start: int) -> None:
        """Every batch from ``start`` on that the publisher still buffers."""
        import zmq

        from vllm.distributed.kv_events import ZmqEventPublisher

        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self._replay_endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                if not sock.poll(30_000):
                    raise AssertionError(f"no answer from the replay socket {self._replay_endpoint}")
                _empty, _topic, seq, payload = sock.recv_multipart()
                if seq == ZmqEventPublisher.END_SEQ:
                    return
                n, events = self._decode(seq, payload)
                with self._lock:
                    if n not in self._batches:
                        self._batches[n] = events
                        self.replayed += 1
        finally:
            sock.close(0)

    def take(self, quiet_s: float = 0.5) -> list[dict[str, Any]]:
        """The events of every batch received so far, in publishing order, once none arrived
        for ``quiet_s``; batches missed before the last one received, or all of them when none
        was received, are replayed first."""
        import time

        n = -1
        while n != len(self._batches):
            n = len(self._batches)
            time.sleep(quiet_s)
        with self._lock:
            missing = [s for s in range(self._next, max(self._batches, default=self._next))
                       if s not in self._batches]
            start = missing[0] if missing else (None if self._batches else self._next)
        if start is not None:  # a gap, or nothing at all (everything may have gone past)
            self._replay(start)
        with self._lock:
            top = max(self._batches, default=self._next - 1)
            lost = [s for s in range(self._next, top + 1) if s not in self._batches]
            assert not lost, f"event batches {lost} neither received nor replayed"
            out = [e for s in range(self._next, top + 1) for e in self._batches.pop(s)]
        self._next = top + 1
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
        self._ctx.term()


def _external_hits(llm: Any) -> int:
    total = 0
    for m in llm.get_metrics():
        if m.name == "vllm:external_prefix_cache_hits":
            total += int(getattr(m, "value", 0))
    return total


def _hits_by_source(llm: Any) -> dict[str, int]:
    """Prompt tokens served per cache tier (device, host, disk, ...) so far."""
    out: dict[str, int] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_cached_by_source":
            source = m.labels.get("source", "?")
            out[source] = out.get(source, 0) + int(getattr(m, "value", 0))
    return out


# The worker-side hooks vLLM calls once per engine step, in this order (the last closes a step).
_WORKER_HOOKS = ("handle_preemptions", "start_load_kv", "wait_for_save", "get_finished",
                 "get_block_ids_with_load_errors", "get_kv_connector_stats", "build_connector_worker_meta")


def _time_worker_hooks() -> list[float]:
    """Time kvstrata's worker-side hooks (in-process engines); returns the list each engine
    step appends its total seconds spent inside them to."""
    import time

    from kvstrata.connectors.vllm.connector import KVStrataConnector

    steps: list[float] = []
    acc = [0.0]
    for name in _WORKER_HOOKS:
        orig = getattr(KVStrataConnector, name)

        def timed(self: Any, *args: Any, _orig: Any = orig, _last: bool = name == _WORKER_HOOKS[-1],
                  **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _orig(self, *args, **kwargs)
            finally:
                if getattr(self, "_worker", None) is not None:
                    acc[0] += time.perf_counter() - t0
                    if _last:
                        steps.append(acc[0])
                        acc[0] = 0.0

        setattr(KVStrataConnector, name, timed)
    return steps


def _record_pages() -> dict[str, dict[str, str]]:
    """Digests of the KV pages kvstrata's worker stores (read when the store is queued, before
    any copy) and loads (read once the load finished whole), by block key (hex): what a
    test compares byte for byte. In-process engines only."""
    import hashlib

    from kvstrata.connectors.vllm.worker import KVStrataWorker

    pages: dict[str, dict[str, str]] = {"stored": {}, "loaded": {}}

    def digests(worker: Any, block_ids: list[int], keys: list[bytes], into: dict[str, str]) -> None:
        rows = worker.executor.device.read(block_ids)
        for key, row in zip(keys, rows):
            into[key.hex()] = hashlib.sha256(row.tobytes()).hexdigest()

    queue_stores, collect = KVStrataWorker._queue_stores, KVStrataWorker._collect

    def _queue_stores(self: Any, plans: list[Any]) -> None:
        for plan in plans:
            digests(self, plan.block_ids, plan.keys, pages["stored"])
        queue_stores(self, plans)

    def _collect(self: Any, done: Any) -> None:
        for req_id, result in done.loads.items():
            plan = self._inflight[req_id]
            if result.loaded == len(plan):
                digests(self, plan.block_ids, plan.keys, pages["loaded"])
        collect(self, done)

    KVStrataWorker._queue_stores, KVStrataWorker._collect = _queue_stores, _collect
    return pages


def run_scenario(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec["steps"]`` on one engine. Each step is ``{"prompts": [[ids...]], "salt": str|None}``
    or ``{"reset": true}`` (reset vLLM's prefix cache; with ``"connector": true`` kvstrata's
    tiers too) or ``{"idle": seconds}`` (the engine does nothing that long). ``spec["hook_timing"]``: each step also reports ``hook_seconds``, the time
    every engine step of it spent inside kvstrata's worker-side hooks. ``spec["kv_events"]``
    (an ``ipc://`` endpoint): KV-cache events on, each step reports the ``events`` a router
    subscribed from before the engine started received, or, with ``events_from_step: i``,
    one that connected before step ``i`` (the batches before it come from the replay socket).
    ``spec["stdin_steps"]``: after ``spec["steps"]``, the engine says ``READY`` and runs
    each step it then reads from stdin (one JSON line), answering each with ``STEP {...}``
    (its result), until stdin closes (:class:`EngineProcess`)."""
    import time

    from vllm import SamplingParams

    hook_steps = _time_worker_hooks() if spec.get("hook_timing") else []
    pages = _record_pages() if spec.get("pages") else None
    def subscribe(at: int) -> EventSubscriber | None:  # a router connecting before step ``at``
        if spec.get("kv_events") and at == spec.get("events_from_step", -1):
            return EventSubscriber(spec["kv_events"], spec["kv_events"] + "-replay")
        return None

    events = subscribe(-1)
    llm = _make_llm(spec)
    sp = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, logprobs=0)
    results: list[Any] = []
    for i, step in enumerate(_steps(spec, results)):
        events = events or subscribe(i)
        if step.get("reset"):
            ok = llm.reset_prefix_cache(reset_connector=bool(step.get("connector")))
            results.append({"reset": bool(ok)})
            continue
        if step.get("sleep"):
            results.append(_sleep_cycle(llm))
            continue
        if step.get("idle"):
            time.sleep(float(step["idle"]))
            results.append({"idle": float(step["idle"])})
            continue
        prompts = [{"prompt_token_ids": p} for p in step["prompts"]]
        if step.get("salt") is not None:
            for p in prompts:
                p["cache_salt"] = step["salt"]
        del hook_steps[:]
        hits_before = _external_hits(llm)
        by_source_before = _hits_by_source(llm)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        by_source = {k: v - by_source_before.get(k, 0) for k, v in _hits_by_source(llm).items()}
        results.append({
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [_sampled_logprobs(o.outputs[0]) for o in outs],
            "cached": [int(o.num_cached_tokens or 0) for o in outs],
            "external_hits": _external_hits(llm) - hits_before,
            "by_source": {k: v for k, v in by_source.items() if v},
            "seconds": elapsed,
            "hook_seconds": list(hook_steps),
            **({"load": _load_stats(llm)} if spec.get("load_stats") else {}),
            **({"events": _jsonable(events.take())} if events is not None else {}),
        })
    replayed = events.replayed if events is not None else 0
    if events is not None:
        events.close()
    return {"steps": results, "events_replayed": replayed, "pid": os.getpid(), "engine_pids": _worker_pids(llm),
            **({"pages": pages} if pages is not None else {}),
            **({"load": _load_stats(llm)} if spec.get("load_stats") else {}),
            "num_gpu_blocks": _num_gpu_blocks(llm),
            "block_size": llm.collective_rpc(_block_size)[0],
            "executor": llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend,
            "threads": [dict(t) for t in llm.collective_rpc(_thread_binding)]}


def _steps(spec: dict[str, Any], results: list[Any]) -> Any:
    """The steps of a scenario: ``spec["steps"]``, then (``stdin_steps``) those read from
    stdin, each answered with its result once it has run."""
    yield from spec["steps"]
    if not spec.get("stdin_steps"):
        return
    print("READY", flush=True)
    for line in sys.stdin:
        yield json.loads(line)
        print("STEP " + json.dumps(results[-1]), flush=True)


class EngineProcess:
    """One engine in a child process (``python tests/vllm_util.py``, or ``cmd``) that stays
    up between steps, so that several engines can take turns: :meth:`step` sends one step
    and returns its result. The child inherits this process's cgroups as they are when it
    starts. Its stderr goes to ``log``."""

    def __init__(self, spec: dict[str, Any], log: Path, *, env: dict[str, str] | None = None,
                 cmd: list[str] | None = None, ready: str = "READY") -> None:
        self.log = Path(log)
        argv = cmd or [sys.executable, __file__, json.dumps({**spec, "stdin_steps": True})]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log.open("w"), text=True, env=engine_env(env=env), cwd=str(REPO))
        self.ready = self.answer(ready)

    def step(self, step: Any, tag: str = "STEP") -> Any:
        """Send one step (a JSON value, on one line) and wait for the answer tagged ``tag``."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(step) + "\n")
        self.proc.stdin.flush()
        return self.answer(tag)

    def answer(self, tag: str) -> Any:
        """The JSON after the next stdout line starting with ``tag`` (None for a bare tag)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.rstrip("\n") == tag:
                return None
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        self.proc.wait(timeout=60)
        raise RuntimeError(f"the engine stopped (rc={self.proc.returncode}); its log, {self.log}:\n"
                           f"{self.log.read_text()[-4000:]}")

    def close(self) -> Any:
        """Close its stdin; the engine's final ``RESULT`` (None from another command)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            return self.answer("RESULT")
        except RuntimeError:
            return None
        finally:
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def take_turns(engines: dict[str, EngineProcess], steps: list[Any], *, tag: str = "STEP", pause_s: float = 0.5,
               first: int = 0, each: Any = None) -> dict[str, list[Any]]:
    """Each step to every engine in turn, one engine running at a time, each after a pause
    that lets the one before it go idle (its compute threads, its background copies), in an
    order that rotates from step to step (``first``: the rotation of the first step).
    This machine's drift over minutes then falls on every engine alike. ``each(label, step)``:
    what engine ``label`` is sent for ``step`` (default: the step itself)."""
    import time

    labels = list(engines)
    out: dict[str, list[Any]] = {label: [] for label in labels}
    for n, step in enumerate(steps):
        k = (first + n) % len(labels)
        for label in labels[k:] + labels[:k]:
            time.sleep(pause_s)
            out[label].append(engines[label].step(step if each is None else each(label, step), tag))
    return out


def _jsonable(value: Any) -> Any:
    """Events as JSON can carry them (bytes as hex)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _sleep_cycle(llm: Any) -> dict[str, Any]:
    """What vLLM 0.33's ``sleep(level=1)`` / ``wake_up()`` do to a connector, in an
    in-process engine (vLLM 0.32's CPU build has no sleep mode: its CuMem allocator is
    CUDA's): the GPU prefix cache is cleared (``pause_scheduler(clear_cache=True)``),
    ``unregister_kv_caches``, the KV memory is released (here: every byte overwritten, so
    a copy that still used it would move garbage), then ``restore_kv_caches``."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm.reset_prefix_cache()
    connector = get_kv_transfer_group()
    connector.unregister_kv_caches()
    connector.unregister_kv_caches()  # idempotent
    worker = connector._worker
    dropped = worker.copier is None and worker.executor.device is None
    for t in worker._kv_caches.values():
        torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).fill_(0x7F)
    connector.restore_kv_caches()
    connector.restore_kv_caches()
    return {"sleep": dropped and worker.copier is not None}


def _load_stats(llm: Any) -> dict[str, Any] | None:
    """The connector's load-or-recompute estimates and decisions (in-process engines only)."""
    try:
        return llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler.stats()["load"]
    except AttributeError:
        return None


def _num_gpu_blocks(llm: Any) -> int | None:
    """Blocks of the engine's KV cache (vLLM's null block included)."""
    try:
        return int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    except Exception:  # multiprocess engines keep it in the engine-core process
        return None


def _sampled_logprobs(completion: Any) -> list[float]:
    """Log-probability of each sampled token: sensitive to every bit of the KV it attended to."""
    return [float(lp[tok].logprob) for tok, lp in zip(completion.token_ids, completion.logprobs or [])]


def _block_size(worker: Any) -> int:
    """The block size the engine runs with: vLLM resolves it in the workers (a hybrid's
    attention block grows to the state page, whose size can depend on the CPU)."""
    return int(worker.vllm_config.cache_config.block_size)


def _getpid(*_: Any) -> int:
    return os.getpid()


def _thread_binding(*_: Any) -> dict[str, Any]:
    """The compute threads of the calling worker: torch's intra-op thread count, the CPUs
    the process may run on, and the OpenMP settings it started with."""
    import torch

    return {"pid": os.getpid(), "torch_threads": torch.get_num_threads(),
            "affinity": sorted(os.sched_getaffinity(0)),
            **{k: os.environ.get(k) for k in _BINDING_ENV}}


# What decides a CPU worker's compute threads: vLLM's OpenMP binding (MP executor only:
# it reserves one core, one more with a KV connector, unless told how many) and OpenMP.
_BINDING_ENV = ("OMP_NUM_THREADS", "OMP_PLACES", "GOMP_CPU_AFFINITY", "VLLM_CPU_NUM_OF_RESERVED_CPU",
                "VLLM_CPU_OMP_THREADS_BIND")


def _worker_pids(llm: Any) -> list[int]:
    """Process ids of the engine's workers (where the connector's worker half runs)."""
    return [int(p) for p in llm.collective_rpc(_getpid)]


def run_in_subprocess(spec: dict[str, Any], *, multiprocessing: bool = False, timeout: float = 600,
                      env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one scenario in a fresh Python process; returns its result or raises with its log tail."""
    full_env = engine_env(multiprocessing=multiprocessing, env=env)
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=str(REPO))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["omp_binding_log"] = omp_binding_log(proc.stdout + proc.stderr)
            result["log"] = proc.stdout + proc.stderr
            return result
    raise RuntimeError(f"engine process failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")


def engine_env(*, multiprocessing: bool = False, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every engine process of the tests and benchmarks starts with
    (offline, quiet, the same compute threads), ``env`` on top."""
    full_env = dict(os.environ)
    full_env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                     "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocessing else "0",
                     "OMP_NUM_THREADS": full_env.get("OMP_NUM_THREADS", "2"),
                     "TOKENIZERS_PARALLELISM": "false",
                     "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # collective_rpc(_getpid) in tests only
    full_env.update(env or {})
    return full_env


def omp_binding_log(log: str) -> list[str]:
    """The "OpenMP thread binding info" block vLLM's MP executor logs at INFO level when it
    starts CPU workers (the reserved core count, each rank's core ids), as its lines;
    empty when the engine logged none (an in-process executor binds nothing)."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        at = line.find("OpenMP thread binding info")
        if at >= 0:  # vLLM repeats the record's prefix on each line of a multi-line message
            prefix = line[:at]
            block = [line[at:].strip()]
            for nxt in lines[i + 1:]:
                if not nxt.startswith(prefix + "\t"):
                    break
                block.append(nxt[len(prefix):].strip())
            return block
    return []


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    result = run_scenario(spec)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
