"""benchmarks/bench_vllm.py without vLLM: every engine process it starts, with kvstrata and
without, gets the same environment (the same compute threads), and the run fails when
the engines report different threads. The engine runner is replaced by a stand-in that
records what it was given (a real run is the benchmark itself, minutes long)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_vllm  # noqa: E402


class FakeEngines:
    """Stands in for ``run_in_subprocess``: answers every scenario with plausible steps
    and the compute threads ``threads(spec, env)`` says the engine runs with."""

    def __init__(self, threads: Any) -> None:
        self.calls: list[dict[str, Any]] = []
        self.threads = threads

    def __call__(self, spec: dict[str, Any], *, multiprocessing: bool = False,
                 env: dict[str, str] | None = None, **_: Any) -> dict[str, Any]:
        self.calls.append({"spec": spec, "multiprocessing": multiprocessing, "env": dict(env or {})})
        n = spec.get("max_tokens", 1)
        steps = [{"reset": True} if s.get("reset") else
                 {"tokens": [[7] * n for _ in s["prompts"]], "seconds": 0.01 if spec.get("kvstrata") else 1.0,
                  "external_hits": 3040 if spec.get("kvstrata") else 0, "hook_seconds": [1e-4] * 4}
                 for s in spec["steps"]]
        return {"steps": steps, "executor": "mp" if multiprocessing else "uni",
                "threads": [self.threads(spec, env or {})],
                "omp_binding_log": ["OpenMP thread binding info:", "local_world_size=1, reserve_cpu_num=1"]}


def equal_threads(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    return {"pid": 1, "torch_threads": int(env["OMP_NUM_THREADS"]), "affinity": [0, 1],
            "OMP_NUM_THREADS": env["OMP_NUM_THREADS"], "OMP_PLACES": None, "GOMP_CPU_AFFINITY": None}


def vllm_default(spec: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """What vLLM's MP executor does on 2 cores without VLLM_CPU_NUM_OF_RESERVED_CPU: one
    core reserved, none with a KV connector."""
    n = 2 if spec.get("kvstrata") is not None else 1
    return {"pid": 1, "torch_threads": n, "affinity": [0], "OMP_NUM_THREADS": str(n), "OMP_PLACES": None,
            "GOMP_CPU_AFFINITY": " ".join(str(i) for i in range(n))}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    def install(threads: Any) -> FakeEngines:
        engines = FakeEngines(threads)
        monkeypatch.setattr(bench_vllm, "run_in_subprocess", engines)
        monkeypatch.setattr(bench_vllm, "build_tiny_llama", lambda path, **_: Path(path))
        monkeypatch.setattr(bench_vllm, "drop_page_cache", lambda path: None)
        return engines
    return install


@pytest.mark.parametrize("extra", [[], ["--multiprocessing"]])
def test_every_engine_gets_the_same_environment_and_threads(fake, tmp_path, extra):
    engines = fake(equal_threads)
    out = tmp_path / "out.json"
    assert bench_vllm.main(["--repeats", "1", "--workdir", str(tmp_path), "--json", str(out), *extra]) == 0
    with_kvstrata = [c for c in engines.calls if c["spec"].get("kvstrata") is not None]
    without = [c for c in engines.calls if c["spec"].get("kvstrata") is None]
    assert with_kvstrata and without
    envs = [c["env"] for c in engines.calls]
    assert all(e == envs[0] for e in envs), envs
    assert envs[0]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1" and envs[0]["OMP_NUM_THREADS"] == "2"
    assert {c["multiprocessing"] for c in engines.calls} == {bool(extra)}
    report = json.loads(out.read_text())
    assert report["same_threads"] is True and report["env"] == envs[0]
    assert [r["engine"] for r in report["engines"]][:3] == ["recompute", "CPU tier", "SSD tier"]
    remote = [c["spec"]["kvstrata"] for c in with_kvstrata if "remote.url" in c["spec"]["kvstrata"]]
    assert len(remote) == 2 and remote[0]["remote.url"] == remote[1]["remote.url"]  # one server
    assert remote[0]["ssd.path"] != remote[1]["ssd.path"]  # the reader holds nothing locally
    assert set(report["ratio_to_recompute"]) == {"cpu", "ssd", "remote"}
    assert all(r["threads"][0]["torch_threads"] == 2 and r["omp_binding_log"] for r in report["engines"])
    assert (report["hook_us"] is None) == bool(extra)  # timed in-process only


def test_engines_on_different_threads_fail_the_run(fake, tmp_path):
    """vLLM's own reservation (left unset: ``--reserved-cpus vllm``) gives the engines with
    kvstrata another thread count on 2 cores: the run reports it and exits 1."""
    engines = fake(vllm_default)
    out = tmp_path / "out.json"
    rc = bench_vllm.main(["--repeats", "1", "--workdir", str(tmp_path), "--json", str(out),
                          "--multiprocessing", "--reserved-cpus", "vllm"])
    assert rc == 1
    envs = [c["env"] for c in engines.calls]
    assert all(e == envs[0] for e in envs) and "VLLM_CPU_NUM_OF_RESERVED_CPU" not in envs[0]
    report = json.loads(out.read_text())
    assert report["same_threads"] is False
    assert {r["kvstrata"]: r["threads"][0]["torch_threads"] for r in report["engines"]} == {False: 1, True: 2}
