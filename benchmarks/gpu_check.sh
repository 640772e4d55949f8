#!/usr/bin/env bash
# Everything that needs a GPU, in one call of at most 8 minutes:
#   1. setup       lmdb + zstandard from the wheels beside this script (the GPU machine
#                  has no package index), the checkout on PYTHONPATH (no pip install -e),
#                  NVRTC located, a cupy RawKernel smoke test
#   2. warm        every kernel specialisation compiled in parallel into cupy's disk cache
#                  (the tests then load them instead of compiling one at a time)
#   3. gpu tests   pytest -m gpu: every kernel against its reference, the copier (streams,
#                  kernels, pinned slab, fence), the transfer engine
#   4. copies      benchmarks/bench_copies_gpu.py: memcpy baseline, store/load through the
#                  pinned slab, thread-block caps, interference with a matmul loop, bit-exact
#   5. kernels     benchmarks/bench_kernels_gpu.py: paged attention and gather/scatter figures
#   6. sanitizer   compute-sanitizer memcheck (copy, cache and two attention tests) and
#                  racecheck (attention), when the machine has it
# Each step runs under its own time limit, cut to what is left of the overall budget
# (GPU_CHECK_BUDGET_S, default 450 s); a failed step is reported and the others still
# run; the exit status is 1 when any step failed. Logs, JUnit XML and the benchmarks'
# JSON and markdown go to $OUT (default out/gpu_check); per step one line, plus tails.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh      # on the GPU machine (python3 with torch, cupy)
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh   # anywhere: every step that needs no GPU
#
# Environment: GPU_PYTHON (default python3; .venv/bin/python in a dry run when present),
# GPU_CHECK_BUDGET_S, SANITIZE=0 (skip step 6), GPU_CHECK_WORK (scratch, default under $TMPDIR).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY=${GPU_CHECK_DRY:-0}
RESULTS=${OUT:-$REPO/out/gpu_check}
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/tierkv-gpu-check}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
if [ -n "${GPU_PYTHON:-}" ]; then PY=$GPU_PYTHON
elif [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PY=$REPO/.venv/bin/python
else PY=python3; fi
mkdir -p "$RESULTS" "$WORK"
SITE=$WORK/site
DEADLINE=$((SECONDS + BUDGET))
FAILED=() SKIPPED=()
log() { echo "[gpu_check $(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$RESULTS/gpu_check.log" >&2; }

export REPO RESULTS WORK SITE PY DRY
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1 PYTHONDONTWRITEBYTECODE=1
export CUPY_CACHE_DIR=$WORK/cupy-cache

# step NAME LIMIT_S COMMAND [soft]: run COMMAND (exported functions) under min(LIMIT_S, what is
# left of the budget); with "soft", running out of time is reported as incomplete, not failed.
step() {
  local name=$1 limit=$2 fn=$3 soft=${4:-} left rc=0 start=$SECONDS
  left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    log "$name: SKIPPED (${left}s of the budget left)"; SKIPPED+=("$name"); return 0
  fi
  log "$name (limit ${limit}s)"
  timeout -k 10 "$limit" bash -c "$fn" || rc=$?
  if [ "$rc" -eq 0 ]; then
    log "$name: ok ($((SECONDS - start))s)"
  elif { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [ "$soft" = soft ]; then
    log "$name: INCOMPLETE (time limit of ${limit}s; not a failure)"; SKIPPED+=("$name")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    log "$name: FAILED (time limit of ${limit}s)"; FAILED+=("$name")
  else
    log "$name: FAILED (exit $rc, $((SECONDS - start))s)"; FAILED+=("$name")
  fi
}

# ---------------------------------------------------------------------- 1. setup
setup() {
  set -e
  "$PY" -c 'import sys; print("python", sys.version.split()[0], sys.executable)'
  rm -rf "$SITE"; mkdir -p "$SITE"
  local wheels=("$REPO"/benchmarks/wheels/*.whl)
  if [ "$DRY" = 1 ]; then  # this machine's python may differ: check the wheels against CPython 3.12
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux2014_x86_64 --target "$SITE" "${wheels[@]}"
    ls "$SITE"/lmdb/*cpython-312*.so "$SITE"/zstandard/*cpython-312*.so > /dev/null
    rm -rf "$SITE"; mkdir -p "$SITE"
    for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$SITE"; done  # the fallback without pip
    ls "$SITE"/lmdb/*cpython-312*.so "$SITE"/zstandard/*cpython-312*.so > /dev/null
    echo "wheels: ${wheels[*]##*/} install offline for CPython 3.12 (pip --no-index, and unzipped)"
    rm -rf "$SITE"; mkdir -p "$SITE"
    "$PY" -c 'import lmdb, zstandard, tierkv.kernels, tierkv.tiers.ssd; print("tierkv imports from the checkout")'
    return 0
  fi
  if ! "$PY" -c 'import lmdb, zstandard' 2>/dev/null; then
    if "$PY" -m pip --version >/dev/null 2>&1; then
      "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$SITE" "${wheels[@]}"
    else
      for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$SITE"; done
    fi
  fi
  "$PY" - <<'PY'
import cupy, lmdb, torch, zstandard
import tierkv
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(),
      "| cupy", cupy.__version__, "| lmdb", lmdb.__version__, "| zstandard", zstandard.__version__,
      "| tierkv from", tierkv.__file__)
k = cupy.RawKernel('extern "C" __global__ void f(int* x) { x[threadIdx.x] = threadIdx.x; }', "f")
x = cupy.zeros(32, dtype=cupy.int32)
k((1,), (32,), (x,))
assert int(x.sum()) == 496, "RawKernel smoke test"
print("NVRTC and a kernel launch: ok")
PY
}
export -f setup

# NVRTC from the nvidia wheels that came with torch (cupy looks for libnvrtc.so.<major>).
if [ "$DRY" != 1 ]; then
  NVRTC_DIR=$("$PY" - 2>/dev/null <<'PY'
import glob, os, site, sys
roots = [*getattr(site, "getsitepackages", lambda: [])(), *sys.path]
for root in roots:
    for lib in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*"))):
        print(os.path.dirname(lib))
        raise SystemExit
PY
  )
  [ -n "$NVRTC_DIR" ] && export LD_LIBRARY_PATH="$NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if [ "$DRY" != 1 ] && command -v nvidia-smi >/dev/null; then nvidia-smi > "$RESULTS/nvidia-smi.txt" 2>&1 || true; fi

# ---------------------------------------------------------------------- 2. warm the kernel cache
warm() {
  set -e
  if [ "$DRY" = 1 ]; then echo "dry run: nothing to compile for a device"; return 0; fi
  "$PY" - <<'PY'
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

from tierkv.kernels.specs import full_grid


def build(spec):
    from tierkv.kernels.runtime import kernel

    kernel(spec, 0)  # NVRTC, then cupy's disk cache ($CUPY_CACHE_DIR)


if __name__ == "__main__":
    specs = full_grid()
    jobs = max(1, min(len(specs), (os.cpu_count() or 2) - 2))
    start, failed = time.perf_counter(), []
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:  # CUDA not initialised here
        futures = {pool.submit(build, s): s for s in specs}
        for f in as_completed(futures):
            try:
                f.result()
            except Exception as exc:
                failed.append(f"{futures[f].name}: {exc}")
    print(f"{len(specs) - len(failed)} of {len(specs)} specialisations compiled in "
          f"{time.perf_counter() - start:.0f} s by {jobs} processes")
    for line in failed[:3]:
        print("FAILED", line[:3000])
    sys.exit(1 if failed else 0)
PY
}
export -f warm

# ---------------------------------------------------------------------- 3. gpu tests
gpu_tests() {
  local rc=0 files=(tests/test_kernels_gpu.py tests/test_copier_gpu.py tests/test_tiered.py)
  if [ "$DRY" = 1 ]; then
    "$PY" -m pytest -q -p no:cacheprovider --collect-only -m gpu "${files[@]}" > "$RESULTS/gpu_tests.log" 2>&1 || rc=$?
    tail -n 3 "$RESULTS/gpu_tests.log"
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]  # 5: nothing collected without CUDA (the GPU tests skip)
    return
  fi
  "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --durations=8 "${files[@]}" \
    --junitxml="$RESULTS/gpu_tests.xml" > "$RESULTS/gpu_tests.log" 2>&1 || rc=$?
  grep -E "^(FAILED|ERROR)" "$RESULTS/gpu_tests.log" | head -n 20
  tail -n 12 "$RESULTS/gpu_tests.log"
  [ "$rc" -eq 0 ] || { echo "pytest exit $rc"; return 1; }
  grep -qE "[0-9]+ passed" "$RESULTS/gpu_tests.log" || { echo "no gpu test ran"; return 1; }
  ! grep -qE "[0-9]+ skipped" "$RESULTS/gpu_tests.log" || { echo "gpu tests were skipped"; return 1; }
}
export -f gpu_tests

# ---------------------------------------------------------------------- 4. copy benchmark
copies() {
  local dry=()
  [ "$DRY" = 1 ] && dry=(--dry-run)
  "$PY" benchmarks/bench_copies_gpu.py "${dry[@]}" --out "$RESULTS" > "$RESULTS/bench_copies.log" 2>&1
  local rc=$?
  if [ -f "$RESULTS/bench_copies.md" ] && [ "$rc" -eq 0 ]; then cat "$RESULTS/bench_copies.md"; else tail -n 30 "$RESULTS/bench_copies.log"; fi
  return $rc
}
export -f copies

# ---------------------------------------------------------------------- 5. kernel benchmarks
kernels() {
  if [ "$DRY" = 1 ]; then "$PY" -m py_compile benchmarks/bench_kernels_gpu.py && echo "dry run: compiled only"; return; fi
  local rc=0
  OUT="$RESULTS" "$PY" benchmarks/bench_kernels_gpu.py > "$RESULTS/bench_kernels.log" 2>&1 || rc=$?
  tail -n 12 "$RESULTS/bench_kernels.log"
  return $rc
}
export -f kernels

# ---------------------------------------------------------------------- 6. compute-sanitizer
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1 || true)
export SANITIZER
sanitize() {  # TOOL PYTEST_K
  local tool=$1 select=$2 rc=0
  if [ "$DRY" = 1 ]; then echo "dry run: compute-sanitizer ${SANITIZER:-not found}"; return 0; fi
  "$SANITIZER" --tool "$tool" --error-exitcode 99 "$PY" -m pytest -q -p no:cacheprovider -m gpu -x \
    tests/test_kernels_gpu.py -k "$select" > "$RESULTS/sanitizer_$tool.log" 2>&1 || rc=$?
  grep -E "ERROR SUMMARY|[0-9]+ (passed|failed)" "$RESULTS/sanitizer_$tool.log" | tail -n 4
  return $rc
}
export -f sanitize
MEMCHECK_K="gather or scatter or copy or slab or rows or reshape or fp8_code or length_zero"
RACECHECK_K="fp8_code or length_zero"

[ "$DRY" = 1 ] && log "dry run: GPU steps reduced to what runs without a GPU"
step "setup" 60 setup
if [[ " ${FAILED[*]} " == *" setup "* ]]; then
  log "setup failed: nothing else can run"; exit 1
fi
step "warm kernel cache" 120 warm
step "gpu tests" 180 gpu_tests
step "copy benchmark" 150 copies
step "kernel benchmark" 90 kernels
if [ "${SANITIZE:-1}" = 0 ]; then
  log "SANITIZE=0: compute-sanitizer not run"
elif [ -z "$SANITIZER" ] && [ "$DRY" != 1 ]; then
  log "compute-sanitizer not found: memcheck and racecheck not run"
else
  step "compute-sanitizer memcheck" 90 "sanitize memcheck '$MEMCHECK_K'" soft
  step "compute-sanitizer racecheck" 60 "sanitize racecheck '$RACECHECK_K'" soft
fi

log "done in ${SECONDS}s: ${#FAILED[@]} failed${FAILED[*]:+ (${FAILED[*]})}, ${#SKIPPED[@]} skipped${SKIPPED[*]:+ (${SKIPPED[*]})}; results in $RESULTS"
[ "${#FAILED[@]}" -eq 0 ]
