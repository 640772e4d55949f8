#!/usr/bin/env bash
# Everything that needs a GPU, in one call of at most 8 minutes (GPU_CHECK_BUDGET_S,
# default 480 s; the step limits add up to it):
#   1. setup       kvstrata installed from its wheel (built here beside the script, carried in
#                  out/gpu_wheel; rebuilt offline when the sources changed), lmdb and
#                  zstandard from benchmarks/wheels, all with pip --target into a scratch
#                  site (never the checkout on PYTHONPATH: kvstrata.connectors exists only
#                  in the installed package); NVRTC located; a cupy RawKernel smoke test;
#                  every import of the GPU tests (benchmarks/gpu_imports.py)
#   2. warm        every kernel specialisation compiled in parallel into cupy's disk cache
#   3. gpu tests   pytest -m gpu: the kernels against their references, the copier
#                  (streams, kernels, pinned slab, fence, no host wait), the transfer engine,
#                  kvstrata.engine token for token against transformers (the kernels end to end)
#   4. copies      benchmarks/bench_copies_gpu.py: memcpy baseline, store/load through the
#                  pinned slab, thread-block caps, interference with a matmul loop
#   5. kernels     benchmarks/bench_kernels_gpu.py: paged attention and gather/scatter
#   5b. engine     benchmarks/bench_engine.py --device cuda: prefill and decode tokens/s, multi-turn
#                  TTFT with and without the tiers
#   5c. vllm       opt-in (VLLM_WHEELS or GPU_CHECK_VLLM=1; give GPU_CHECK_BUDGET_S=540): the
#                  connector's engine scenarios (tests/test_vllm_mrv2.py: model runner v2's
#                  connector driver; tests/test_vllm_connector.py) over vLLM 0.34 installed from
#                  VLLM_WHEELS, or over a vLLM already there; said when there is none
#   5d. sglang     opt-in (SGLANG_WHEELS or GPU_CHECK_SGLANG=1; give GPU_CHECK_BUDGET_S=600, 660
#                  with 5c): benchmarks/gpu_sglang.py, a tiny Llama served by SGLang with kvstrata as
#                  its HiCache storage backend (--hicache-storage-backend dynamic), twice over one
#                  SSD tier: greedy outputs identical with and without its hits; SGLang (the
#                  Makefile's SGLANG_PIN) from SGLANG_WHEELS, or one already there
#   6. sanitizer   compute-sanitizer memcheck, then racecheck, with what is left (last)
# A failed step is reported and the others still run; exit status 1 when any failed.
#
# What comes back ($OUT, default out/gpu_check; at most 8 files): summary.json (rewritten
# after every step, so a timeout still says what ran), gpu_check.log, gpu_check.tar.gz
# (every log, JUnit XML, JSON and markdown, re-packed after every step) and the two
# benchmarks' markdown tables.
#
#   bash benchmarks/gpu_check.sh --wheel           # here: build the wheel the GPU machine installs
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh      # on the GPU machine (python3 with torch, cupy)
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh   # anywhere (make test): every step that needs no
#                                                  # GPU, the install and the imports included
#
# Environment: GPU_PYTHON (default python3; .venv/bin/python in a dry run when present),
# GPU_CHECK_BUDGET_S, SANITIZE=0 (skip step 6), GPU_CHECK_WORK (scratch, default under
# $TMPDIR), GPU_CHECK_WHEELS (where kvstrata's wheel is, default out/gpu_wheel).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY=${GPU_CHECK_DRY:-0}
OUT=${OUT:-$REPO/out/gpu_check}
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/kvstrata-gpu-check}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/out/gpu_wheel}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
if [ -n "${GPU_PYTHON:-}" ]; then PY=$GPU_PYTHON
elif { [ "$DRY" = 1 ] || [ "${1:-}" = --wheel ]; } && [ -x .venv/bin/python ]; then PY=$REPO/.venv/bin/python
else PY=python3; fi
RESULTS=$WORK/results   # everything; archived into $OUT/gpu_check.tar.gz
SITE=$WORK/site
GPU_TESTS=(tests/test_kernels_gpu.py tests/test_copier_gpu.py tests/test_tiered.py tests/test_engine.py)

# The wheel of this checkout, with a digest of the sources it was built from.
sources_digest() {
  "$PY" - "$REPO" <<'PY'
import hashlib, pathlib, sys
root = pathlib.Path(sys.argv[1])
h = hashlib.sha256()
files = [root / "pyproject.toml", *sorted(p for d in ("kvstrata",) for p in (root / d).rglob("*")
                                          if p.is_file() and "__pycache__" not in p.parts)]
for p in files:
    h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
print(h.hexdigest())
PY
}
build_wheel() {  # offline: no build isolation, no index (setuptools and wheel must be there)
  set -e
  rm -rf "$WHEELS"; mkdir -p "$WHEELS"
  "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation --no-index \
    -w "$WHEELS" "$REPO" > "$WHEELS/build.log" 2>&1 || { tail -n 20 "$WHEELS/build.log"; return 1; }
  sources_digest > "$WHEELS/SOURCES.sha256"
  echo "built $(ls "$WHEELS"/kvstrata-*.whl) from sources $(cut -c1-12 "$WHEELS/SOURCES.sha256")"
}
if [ "${1:-}" = --wheel ]; then build_wheel; exit; fi

mkdir -p "$OUT" "$WORK"
rm -rf "$RESULTS"; mkdir -p "$RESULTS"
rm -f "$OUT/summary.json" "$OUT/gpu_check.log" "$OUT/gpu_check.tar.gz"
DEADLINE=$((SECONDS + BUDGET))
FAILED=() SKIPPED=() STEPS=()
log() { echo "[gpu_check $(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$OUT/gpu_check.log" >&2; }

export REPO RESULTS WORK SITE PY DRY WHEELS
export -f sources_digest build_wheel
export PYTHONPATH="$SITE"          # kvstrata, lmdb and zstandard as installed; not the checkout
export PYTHONSAFEPATH=1 PYTHONDONTWRITEBYTECODE=1   # nor the working directory
export CUPY_CACHE_DIR=$WORK/cupy-cache

# summary.json and the archive, after every step: a run cut short still returns both.
report() {
  local state=$1
  { printf '{"dry_run": %s, "state": "%s", "budget_s": %d, "elapsed_s": %d, "steps": [' \
      "$([ "$DRY" = 1 ] && echo true || echo false)" "$state" "$BUDGET" "$SECONDS"
    local first=1 entry
    for entry in "${STEPS[@]}"; do [ $first = 1 ] || printf ', '; first=0; printf '%s' "$entry"; done
    printf '], "failed": %d}\n' "${#FAILED[@]}"; } > "$OUT/summary.json.tmp" && mv "$OUT/summary.json.tmp" "$OUT/summary.json"
  cp "$OUT/gpu_check.log" "$OUT/summary.json" "$RESULTS/" 2>/dev/null
  for md in bench_copies.md bench_kernels.md bench_engine.md; do [ -f "$RESULTS/$md" ] && cp "$RESULTS/$md" "$OUT/"; done
  tar -czf "$OUT/gpu_check.tar.gz.tmp" -C "$RESULTS" . && mv "$OUT/gpu_check.tar.gz.tmp" "$OUT/gpu_check.tar.gz"
}

# step NAME LIMIT_S COMMAND [soft]: run COMMAND (exported functions) under min(LIMIT_S, what is
# left of the budget); with "soft", running out of time is reported as incomplete, not failed.
step() {
  local name=$1 limit=$2 fn=$3 soft=${4:-} left rc=0 start=$SECONDS status
  left=$((DEADLINE - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 10 ]; then
    log "$name: SKIPPED (${left}s of the budget left)"; SKIPPED+=("$name")
    STEPS+=("{\"step\": \"$name\", \"status\": \"skipped\", \"seconds\": 0, \"limit_s\": $limit}")
    report running; return 0
  fi
  log "$name (limit ${limit}s)"
  STEPS+=("{\"step\": \"$name\", \"status\": \"running\", \"seconds\": 0, \"limit_s\": $limit}")
  report running
  timeout -k 5 "$limit" bash -c "$fn" 2>&1 | tee -a "$OUT/gpu_check.log" || rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    status=ok; log "$name: ok ($((SECONDS - start))s)"
  elif { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && [ "$soft" = soft ]; then
    status=incomplete; log "$name: INCOMPLETE (time limit of ${limit}s; not a failure)"; SKIPPED+=("$name")
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status=timeout; log "$name: FAILED (time limit of ${limit}s)"; FAILED+=("$name")
  else
    status=failed; log "$name: FAILED (exit $rc, $((SECONDS - start))s)"; FAILED+=("$name")
  fi
  STEPS[-1]="{\"step\": \"$name\", \"status\": \"$status\", \"seconds\": $((SECONDS - start)), \"limit_s\": $limit, \"exit\": $rc}"
  report running
}

# ---------------------------------------------------------------------- 1. setup
setup() {
  set -e
  "$PY" -c 'import sys; print("python", sys.version.split()[0], sys.executable)'
  if [ ! -f "$WHEELS/SOURCES.sha256" ] || [ "$(sources_digest)" != "$(cat "$WHEELS/SOURCES.sha256")" ]; then
    echo "kvstrata's wheel is missing or older than the sources: building it (offline)"
    build_wheel
  fi
  local deps=("$REPO"/benchmarks/wheels/*.whl) ours=("$WHEELS"/kvstrata-*.whl)
  rm -rf "$SITE"; mkdir -p "$SITE"
  if [ "$DRY" = 1 ]; then  # this machine's python may differ: the binary wheels must suit CPython 3.12
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --target "$WORK/site312" "${deps[@]}"
    ls "$WORK"/site312/lmdb/*cpython-312*.so "$WORK"/site312/zstandard/*cpython-312*.so > /dev/null
    rm -rf "$WORK/site312"
    echo "wheels: ${deps[*]##*/} install offline for CPython 3.12"
    deps=()  # here lmdb and zstandard come from the environment
  fi
  if "$PY" -m pip --version >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$SITE" "${ours[@]}" "${deps[@]}"
  else  # no pip: a wheel is a zip archive
    for w in "${ours[@]}" "${deps[@]}"; do "$PY" -m zipfile -e "$w" "$SITE"; done
  fi
  "$PY" - <<'PY'
import os, sys
import lmdb, torch, zstandard
import kvstrata, kvstrata.connectors.kit.kv_layout
site = os.environ["SITE"]
assert kvstrata.__file__.startswith(site), f"kvstrata imported from {kvstrata.__file__}, not the installed wheel in {site}"
print("torch", torch.__version__, "| lmdb", lmdb.__version__, "| zstandard", zstandard.__version__,
      "| kvstrata from", kvstrata.__file__)
if os.environ["DRY"] != "1":
    import cupy
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    print("cuda", torch.version.cuda, torch.cuda.get_device_name(), "| cupy", cupy.__version__)
    k = cupy.RawKernel('extern "C" __global__ void f(int* x) { x[threadIdx.x] = threadIdx.x; }', "f")
    x = cupy.zeros(32, dtype=cupy.int32)
    k((1,), (32,), (x,))
    assert int(x.sum()) == 496, "RawKernel smoke test"
    print("NVRTC and a kernel launch: ok")
PY
  local allow=()
  "$PY" -c 'import cupy' 2>/dev/null || allow=(--allow cupy)
  local tests; read -r -a tests <<< "$GPU_TESTS_LIST"
  "$PY" "$REPO/benchmarks/gpu_imports.py" "${tests[@]/#/$REPO/}" "${allow[@]}"
}
export -f setup
export GPU_TESTS_LIST="${GPU_TESTS[*]}"

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
cd "$REPO"

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

from kvstrata.kernels.specs import full_grid


def build(spec):
    from kvstrata.kernels.runtime import kernel

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
  local rc=0 files; read -r -a files <<< "$GPU_TESTS_LIST"
  if [ "$DRY" = 1 ]; then
    # collection alone proves little here (the GPU tests skip at import; setup imported
    # what they import): it runs the non-GPU cases of the same files from the installed wheel
    "$PY" -m pytest -q -p no:cacheprovider -m "not gpu" "${files[@]}" > "$RESULTS/gpu_tests.log" 2>&1 || rc=$?
    tail -n 3 "$RESULTS/gpu_tests.log"
    [ "$rc" -eq 0 ]
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

# ---------------------------------------------------------------------- 5b. engine benchmark
engine_bench() {
  if [ "$DRY" = 1 ]; then "$PY" -m py_compile benchmarks/bench_engine.py && echo "dry run: compiled only"; return; fi
  local rc=0
  "$PY" benchmarks/bench_engine.py --device cuda --skip-fp8 --json "$RESULTS/bench_engine.json" \
    > "$RESULTS/bench_engine.md" 2> "$RESULTS/bench_engine.log" || rc=$?
  cat "$RESULTS/bench_engine.md"; [ "$rc" -eq 0 ] || tail -n 20 "$RESULTS/bench_engine.log"
  return $rc
}
export -f engine_bench

# ---------------------------------------------------------------------- 5c. vLLM engine scenarios
# The connector's engine scenarios on the GPU, vLLM 0.34 (model runner v2, its only runner)
# included. The GPU machine reaches no index and vLLM's CUDA wheel is larger than what travels
# with the checkout: vLLM 0.34 is installed from VLLM_WHEELS (a directory of vLLM 0.34's wheel
# and its dependencies, e.g. a mounted cache) when given, else the step runs only over a vLLM
# already importable there, and says so when there is none.
vllm_engine() {
  local rc=0
  if [ -n "${VLLM_WHEELS:-}" ] && [ "$DRY" != 1 ]; then
    "$PY" -m pip install --quiet --no-index --find-links "$VLLM_WHEELS" --target "$SITE" 'vllm==0.34.*'       > "$RESULTS/vllm_install.log" 2>&1 || { tail -n 5 "$RESULTS/vllm_install.log"; return 1; }
  fi
  if ! "$PY" -c "import vllm" > /dev/null 2>&1; then
    echo "no vLLM importable here (VLLM_WHEELS unset or without vLLM 0.34): engine scenarios not run"
    return 0
  fi
  "$PY" -c "import vllm; print('vLLM', vllm.__version__)"
  [ "$DRY" = 1 ] && { echo "dry run: the scenarios need a GPU"; return 0; }
  "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_vllm_mrv2.py tests/test_vllm_connector.py -m "not long" \
    --junitxml="$RESULTS/vllm_engine.xml" > "$RESULTS/vllm_engine.log" 2>&1 || rc=$?
  grep -E "^(FAILED|ERROR)" "$RESULTS/vllm_engine.log" | head -n 20
  tail -n 3 "$RESULTS/vllm_engine.log"
  return $rc
}
export -f vllm_engine

# ---------------------------------------------------------------------- 5d. SGLang serving
# kvstrata as SGLang's HiCache storage backend on the GPU (benchmarks/gpu_sglang.py). SGLang's
# CUDA wheel does not travel with the checkout: the Makefile's pin is installed from
# SGLANG_WHEELS (a directory of its wheel and its dependencies) when given, else the step runs
# only over an SGLang already importable there, and says so when there is none.
sglang_engine() {
  local rc=0 pin
  pin=$(sed -n 's/^SGLANG_PIN := //p' Makefile)
  if [ -n "${SGLANG_WHEELS:-}" ] && [ "$DRY" != 1 ]; then
    "$PY" -m pip install --quiet --no-index --find-links "$SGLANG_WHEELS" --target "$SITE" "$pin" \
      > "$RESULTS/sglang_install.log" 2>&1 || { tail -n 5 "$RESULTS/sglang_install.log"; return 1; }
  fi
  if [ "$DRY" = 1 ]; then
    "$PY" -m py_compile benchmarks/gpu_sglang.py && echo "dry run: compiled only ($pin serving needs a GPU)"
    return 0
  fi
  if ! "$PY" -c "import sglang" > /dev/null 2>&1; then
    echo "no SGLang importable here (SGLANG_WHEELS unset or without $pin): SGLang serving not run"
    return 0
  fi
  "$PY" benchmarks/gpu_sglang.py --out "$RESULTS" > "$RESULTS/gpu_sglang.log" 2>&1 || rc=$?
  tail -n 5 "$RESULTS/gpu_sglang.log"
  return $rc
}
export -f sglang_engine

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
# Limits (seconds) add up to the default budget of 480: the tests and the copy figures
# first, compute-sanitizer last with what is left.
step "setup" 45 setup
if [[ " ${FAILED[*]} " == *" setup "* ]]; then
  log "setup failed: nothing else can run"; report done; exit 1
fi
step "warm kernel cache" 90 warm
step "gpu tests" 150 gpu_tests
step "copy benchmark" 75 copies
step "kernel benchmark" 45 kernels
step "engine benchmark" 30 engine_bench
if [ -n "${VLLM_WHEELS:-}" ] || [ "${GPU_CHECK_VLLM:-0}" = 1 ]; then  # opt-in: 60 s more than the default budget
  step "vllm engine scenarios" 60 vllm_engine soft
else
  log "vLLM engine scenarios not run (VLLM_WHEELS=DIR with vLLM 0.34's wheels, or GPU_CHECK_VLLM=1 over an installed vLLM)"
fi
if [ -n "${SGLANG_WHEELS:-}" ] || [ "${GPU_CHECK_SGLANG:-0}" = 1 ]; then  # opt-in: 120 s more than the default budget
  step "sglang serving" 120 sglang_engine soft
else
  log "SGLang serving not run (SGLANG_WHEELS=DIR with SGLang's wheels, or GPU_CHECK_SGLANG=1 over an installed SGLang)"
fi
if [ "${SANITIZE:-1}" = 0 ]; then
  log "SANITIZE=0: compute-sanitizer not run"
elif [ -z "$SANITIZER" ] && [ "$DRY" != 1 ]; then
  log "compute-sanitizer not found: memcheck and racecheck not run"
else
  step "compute-sanitizer memcheck" 30 "sanitize memcheck '$MEMCHECK_K'" soft
  step "compute-sanitizer racecheck" 15 "sanitize racecheck '$RACECHECK_K'" soft
fi

log "done in ${SECONDS}s: ${#FAILED[@]} failed${FAILED[*]:+ (${FAILED[*]})}, ${#SKIPPED[@]} skipped${SKIPPED[*]:+ (${SKIPPED[*]})}; archive $OUT/gpu_check.tar.gz"
report done
[ "${#FAILED[@]}" -eq 0 ]
