"""benchmarks/gpu_check.sh without a GPU (GPU_CHECK_DRY=1), as ``make test`` runs it: the
wheel is built offline and installed with ``--target`` (kvstrata then imports from there,
never from the checkout), everything the GPU tests import is imported, the non-GPU cases
of the GPU test files run from the installed wheel, and what comes back (summary.json,
the archive) is what a GPU run returns. The device's own steps need a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_imports import check, imported_modules  # noqa: E402


@pytest.mark.slow
@pytest.mark.long  # builds and installs the wheel in a fresh venv
def test_dry_run_installs_the_wheel_and_imports_what_the_gpu_tests_import(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, GPU_CHECK_DRY="1", OUT=str(out), GPU_CHECK_WORK=str(tmp_path / "work"),
               GPU_CHECK_WHEELS=str(tmp_path / "wheel"), GPU_PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(REPO))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "done" and summary["failed"] == 0
    assert [s["status"] for s in summary["steps"]] == ["ok"] * len(summary["steps"])
    assert sum(s["limit_s"] for s in summary["steps"]) <= summary["budget_s"] <= 480  # one call of 8 minutes
    assert f"kvstrata from {tmp_path / 'work' / 'site'}" in log  # the installed wheel, not the checkout
    assert "imports of 4 GPU test files resolved" in log
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"summary.json", "gpu_check.log", "gpu_tests.log", "bench_copies.json"} <= names


def test_import_check_finds_what_would_fail_on_the_gpu_machine(tmp_path: Path) -> None:
    good = tmp_path / "test_good_gpu.py"
    good.write_text("import numpy\nfrom kvstrata.connectors.kit.kv_layout import KVLayout, LayoutRows\n"
                    "def test():\n    from kvstrata.system.streams import CudaStreams\n")
    bad = tmp_path / "test_bad_gpu.py"
    bad.write_text("def test():\n    from kvstrata.no_such_module import thing\n    import cupy_only_there\n")
    assert "kvstrata.system.streams.CudaStreams" in imported_modules(good)
    imported, missing, errors = check([good], set())
    assert not errors and "kvstrata.connectors.kit.kv_layout.LayoutRows" in imported
    _, missing, errors = check([bad], {"cupy_only_there"})
    assert len(errors) == 1 and "kvstrata.no_such_module" in errors[0]
    assert missing == ["test_bad_gpu.py: cupy_only_there (needs cupy_only_there)"]
