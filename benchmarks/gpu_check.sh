#!/usr/bin/env bash
# One GPU: install what the kernels need, run the `gpu` tests, then the kernel
# microbenchmarks (under 8 minutes), then the tests under compute-sanitizer.
# Results (logs, JUnit XML, bench JSON) go to $OUT when set. Fails loudly on
# any step.
#
#   bash benchmarks/gpu_check.sh            # GPU_VENV=.venv-gpu by default
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${GPU_VENV:-.venv-gpu}
RESULTS=${OUT:-$REPO/out/gpu_check}
mkdir -p "$RESULTS"
# Keep the working directory off sys.path: only the installed tierkv is imported.
export PYTHONSAFEPATH=1
log() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$RESULTS/gpu_check.log" >&2; }
die() { log "FAILED: $*"; exit 1; }

if command -v nvidia-smi >/dev/null; then nvidia-smi > "$RESULTS/nvidia-smi.txt" 2>&1 || true; fi

# 1. A venv that sees a preinstalled CUDA torch if the machine has one.
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV" || die "cannot create $VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --upgrade pip || log "pip upgrade failed (continuing)"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  log "installing a CUDA build of torch"
  "$PY" -m pip install --quiet torch || die "pip install torch"
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || die "torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)') sees no CUDA device"
fi
CUDA_MAJOR=$("$PY" -c 'import torch; print((torch.version.cuda or "12").split(".")[0])')
if ! "$PY" -c 'import cupy' 2>/dev/null; then
  log "installing cupy for CUDA $CUDA_MAJOR"
  "$PY" -m pip install --quiet "cupy-cuda${CUDA_MAJOR}x" "nvidia-cuda-nvrtc-cu${CUDA_MAJOR}" \
    || "$PY" -m pip install --quiet cupy-cuda12x nvidia-cuda-nvrtc-cu12 || die "pip install cupy"
fi
"$PY" -m pip install --quiet --no-deps -e . || die "pip install -e ."
"$PY" -m pip install --quiet numpy pytest hypothesis pyyaml || die "pip install test deps"
# NVRTC from the nvidia-*-cu* wheels, when the system has no CUDA toolkit libraries.
NVRTC_LIB=$("$PY" -c 'import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$NVRTC_LIB" ] && export LD_LIBRARY_PATH="$NVRTC_LIB:${LD_LIBRARY_PATH:-}"
"$PY" - <<'PY' >> "$RESULTS/gpu_check.log" 2>&1 || die "cupy smoke test (see $RESULTS/gpu_check.log)"
import cupy, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())
k = cupy.RawKernel('extern "C" __global__ void f(int* x) { x[threadIdx.x] = threadIdx.x; }', "f")
x = cupy.zeros(32, dtype=cupy.int32); k((1,), (32,), (x,))
assert int(x.sum()) == 496, "RawKernel smoke test"
PY

# 2. GPU tests (every kernel against its reference).
log "gpu tests"
rc=0
"$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_kernels_gpu.py tests/test_tiered.py \
  --junitxml="$RESULTS/gpu_tests.xml" > "$RESULTS/gpu_tests.log" 2>&1 || rc=$?
tail -n 40 "$RESULTS/gpu_tests.log"
[ "$rc" -eq 0 ] || die "gpu tests (exit $rc, see $RESULTS/gpu_tests.log)"
grep -qE "[0-9]+ passed" "$RESULTS/gpu_tests.log" || die "no gpu test ran"
! grep -qE "[0-9]+ skipped" "$RESULTS/gpu_tests.log" || die "gpu tests were skipped"

# 3. Microbenchmarks.
log "benchmarks"
rc=0
OUT="$RESULTS" "$PY" benchmarks/bench_kernels_gpu.py > "$RESULTS/bench.log" 2>&1 || rc=$?
cat "$RESULTS/bench.log"
[ "$rc" -eq 0 ] || die "benchmarks (exit $rc)"

# 4. The kernel tests under compute-sanitizer (memcheck, racecheck), when the machine has it
#    (last: slow; SANITIZE=0 skips it).
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1 || true)
if [ "${SANITIZE:-1}" = 0 ]; then
  log "SANITIZE=0: compute-sanitizer not run"
elif [ -n "$SANITIZER" ]; then
  for tool in memcheck racecheck; do
    log "compute-sanitizer --tool $tool"
    rc=0
    timeout 600 "$SANITIZER" --tool "$tool" --error-exitcode 99 \
      "$PY" -m pytest -q -p no:cacheprovider -m gpu -x tests/test_kernels_gpu.py \
      > "$RESULTS/sanitizer_$tool.log" 2>&1 || rc=$?
    tail -n 15 "$RESULTS/sanitizer_$tool.log"
    [ "$rc" -eq 124 ] && { log "compute-sanitizer $tool: did not finish in 600 s (incomplete, not a failure)"; continue; }
    [ "$rc" -eq 0 ] || die "compute-sanitizer $tool (exit $rc, see $RESULTS/sanitizer_$tool.log)"
  done
else
  log "compute-sanitizer not found: memcheck and racecheck not run"
fi

log "done: results in $RESULTS"
