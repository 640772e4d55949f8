"""Every kernel specialisation compiles with nvcc for sm_80 and sm_90.

The quick grid (a few specialisations covering every source, type and code
path) always runs. The full grid (186 specialisations, ~2 minutes on two
cores) is marked ``slow``: it runs under ``make test`` (CI) and is skipped by
``make test-quick`` and when KVSTRATA_QUICK=1. Without nvcc the tests skip with
a reason; the NVRTC variant needs cupy and skips without it.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from kvstrata.kernels import compile_check
from kvstrata.kernels.sources import cuda_dir, read_source
from kvstrata.kernels.specs import full_grid, quick_grid

NVCC = compile_check.find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA compile check cannot run")


def _assert_compiles(specs) -> None:
    results = compile_check.check(specs, jobs=2)
    assert sum(len(r.specs) for r in results) == len(specs)
    report = compile_check.failures_report(results)
    assert not report, report


@needs_nvcc
def test_quick_grid_compiles() -> None:
    _assert_compiles(quick_grid())


@pytest.mark.long
@needs_nvcc
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KVSTRATA_QUICK") == "1", reason="KVSTRATA_QUICK=1: full compile grid skipped")
def test_full_grid_compiles() -> None:
    _assert_compiles(full_grid())


@needs_nvcc
def test_checker_fails_on_a_type_error_inside_a_template(tmp_path: Path) -> None:
    # The error only exists once the template is instantiated, as in the kernels.
    broken = (
        '#include "kvstrata_types.cuh"\n'
        "template <typename T> __global__ void k(T* out) { tkv::f16 h = out[0]; out[0] = h; }\n"
        "void* tkv_instances[] = {(void*)&k<float>};\n"
    )
    ok, log = compile_check.compile_unit(broken, NVCC, tmp_path, "broken")
    assert not ok and "error" in log
    fixed = broken.replace("tkv::f16 h = out[0]", "T h = out[0]")
    ok, log = compile_check.compile_unit(fixed, NVCC, tmp_path, "fixed")
    assert ok, log


def test_grid_covers_the_issue_parameters() -> None:
    names = " ".join(s.name for s in full_grid())
    for token in ("tkv::fp8e4m3", "tkv::fp8e5m2", "tkv::bf16", "tkv::f16", "float, float", " 64,", " 256,", " 8, 128>", " 32, 128>"):
        assert token in names
    assert len(set(full_grid())) == len(full_grid()) == 186
    assert set(quick_grid()) <= set(full_grid())


def test_sources_are_found() -> None:
    assert (cuda_dir() / "kvstrata_types.cuh").is_file() and list(cuda_dir().glob("*.cu"))
    assert "paged_attention_body" in read_source("paged_attention.cuh")


@pytest.mark.slow
def test_nvrtc_compiles_quick_grid() -> None:
    # The runtime path (cupy.RawModule -> NVRTC, with runtime.kernel's options and the
    # ones cupy appends) without a GPU: compile only, through cupy's NVRTC program wrapper.
    pytest.importorskip("cupy")  # the skip reason carries the import error
    from cupy.cuda import compiler

    from kvstrata.kernels.runtime import CUPY_APPENDED_OPTIONS, NVRTC_OPTIONS

    for spec, arch in itertools.product(quick_grid(), ("sm_80", "sm_90")):
        program = compiler._NVRTCProgram(read_source(spec.source), spec.source, name_expressions=[spec.name], method="cubin")
        options = (*NVRTC_OPTIONS, f"--include-path={cuda_dir()}", f"-arch={arch}", *CUPY_APPENDED_OPTIONS)
        cubin, names = program.compile(options)
        assert cubin and names[spec.name].startswith("_Z")
