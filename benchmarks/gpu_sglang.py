"""SGLang serving a small model with kvstrata as its HiCache storage backend, on a GPU.

Step 5d of benchmarks/gpu_check.sh. A tiny random Llama (tests/vllm_util.py; or
``--model``) is served twice by ``python -m sglang.launch_server`` with
``--hicache-storage-backend dynamic`` pointing at ``kvstrata.connectors.sglang`` (the
README's flags) over one ``ssd.path``. The first server answers the prompts cold and
writes their pages through to the SSD tier; it is stopped (SIGTERM), and a second server,
whose GPU and host caches are empty, answers the same prompts from what it prefetches from
the SSD tier. Greedy outputs must be identical, and the second server must report cached
tokens (its hits came from below its host pool). Writes ``gpu_sglang.json`` under ``--out``.

    python benchmarks/gpu_sglang.py --out DIR [--model PATH] [--dry]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = 16
START_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(model: str, ssd: Path, port: int) -> list[str]:
    extra = {"backend_name": "kvstrata", "module_path": "kvstrata.connectors.sglang",
             "class_name": "KVStrataStorage", "interface_v1": 1, "ssd.path": str(ssd), "ssd.capacity": "2GiB",
             "model.id": "gpu-check-tiny-llama"}
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
            "--page-size", str(PAGE), "--enable-hierarchical-cache", "--hicache-ratio", "2",
            "--hicache-write-policy", "write_through", "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra),
            "--mem-fraction-static", "0.3", "--cuda-graph-backend-decode", "disabled",
            "--cuda-graph-backend-prefill", "disabled", "--log-level", "warning"]


def call(port: int, path: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw


def serve(model: str, ssd: Path, prompts: list[list[int]], log: Path) -> list[dict[str, Any]]:
    """One server's answers to ``prompts``, one at a time, then SIGTERM."""
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen(server_args(model, ssd, port), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
            try:
                call(port, "/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not answer /health in {START_S} s; see {log}") from None
                time.sleep(1)
        answers = []
        for ids in prompts:
            got = call(port, "/generate", {"input_ids": ids,
                                           "sampling_params": {"temperature": 0, "max_new_tokens": 16}})
            answers.append({"text": got.get("text"), "output_ids": got.get("output_ids"),
                            "cached_tokens": got.get("meta_info", {}).get("cached_tokens", 0)})
        time.sleep(2)  # the write-through backups of the last prompts reach the backend
        return answers
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def prompts_of(n: int, shared: int, own: int, seed: int = 7) -> list[list[int]]:
    """``n`` prompts of token ids: a ``shared``-token prefix, then ``own`` tokens each."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 500) for _ in range(own)] for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None, help="a local checkpoint (default: a tiny random Llama)")
    ap.add_argument("--dry", action="store_true", help="build the prompts and the command lines only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-sglang-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from vllm_util import build_tiny_llama

        model = str(build_tiny_llama(work / "tiny-llama"))
    prompts = prompts_of(4, shared=20 * PAGE, own=3 * PAGE)
    if args.dry:
        print(" ".join(server_args(model, work / "ssd", 0)[1:6]), "...", f"{len(prompts)} prompts")
        shutil.rmtree(work, ignore_errors=True)
        return
    log = out / "gpu_sglang_server.log"
    cold = serve(model, work / "ssd", prompts, log)
    warm = serve(model, work / "ssd", prompts, log)  # a new server: only the SSD tier holds the pages
    same = [a["text"] == b["text"] and a["output_ids"] == b["output_ids"] for a, b in zip(cold, warm)]
    report = {"identical": all(same), "per_prompt": same, "cold_cached_tokens": [a["cached_tokens"] for a in cold],
              "restart_cached_tokens": [b["cached_tokens"] for b in warm],
              "ssd_files": sorted(p.name for p in (work / "ssd").rglob("*") if p.is_file())}
    (out / "gpu_sglang.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    ok = report["identical"] and sum(report["restart_cached_tokens"]) >= len(prompts) * 16 * PAGE
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
