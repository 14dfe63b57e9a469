#!/usr/bin/env bash
# The GPU machine's one prepared call: build fastmha against the torch it finds, run every CUDA test, the
# compute-sanitizer checks and the GPU benchmark, writing logs and results into OUTDIR (summary.txt first).
#
#   bash scripts/gpu_check.sh OUTDIR                       # all phases: build, test, sanitize, bench
#   PHASES=build,test bash scripts/gpu_check.sh OUTDIR     # a subset
#   ARCHIVE=/path/results.tar.gz bash scripts/gpu_check.sh OUTDIR   # also OUTDIR packed in one file, after each phase
#
# The whole check keeps within BUDGET_S seconds (default 480): each phase runs under its own limit or what is
# left of the budget, whichever is less, and a phase with under 15 s left is skipped (and counts as failed). The
# phases run most telling first: build, tests, memcheck, the core benchmark, the layer's profile, racecheck,
# synccheck, the block benchmark. LIMIT_test_cuda_kernels=120 (a phase's name, dashes as underscores) sets one
# phase's limit.
#
# A hang costs one phase, not the whole check, and the next phase runs even when one fails; the exit status is
# non-zero if any failed. Without a GPU everything still runs (CUDA tests skip, the sanitizer and the
# benchmark say so): that is the dry run on a CPU machine.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PHASES=${PHASES:-build,test,sanitize,bench}
DEADLINE=$((SECONDS + ${BUDGET_S:-480}))
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=$PWD/.venv/bin/python
# cmake, ninja and pybind11 come with that Python's packages.
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
BUILD_DIR=${FASTMHA_BUILD_DIR:-build-gpu}
status=0

note() { echo "$*" | tee -a "$OUT/summary.txt"; }
phase() {  # phase NAME LIMIT_SECONDS COMMAND...; LIMIT_<NAME> (dashes as underscores) overrides the limit
  local name=$1 limit=$2 override="LIMIT_${1//-/_}"
  limit=${!override:-$limit}
  shift 2
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 15 ]; then
    note "$name: skipped, ${left} s of the check's budget left"
    status=1
    return
  fi
  # A limit must be a whole number of seconds above 0 (timeout takes 0 as none); anything else gets what is left.
  [[ $limit =~ ^[0-9]+$ ]] && [ "$limit" -gt 0 ] && [ "$limit" -le "$left" ] || limit=$left
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  note "$name: rc=$rc, $((SECONDS - start)) s"
  tail -n 4 "$OUT/$name.log"
  [ "$rc" = 0 ] || status=1
  pack
}
# Refreshed after every phase, so that a check cut short still leaves what it found in the archive.
pack() {
  [ -z "${ARCHIVE:-}" ] || tar czf "$ARCHIVE" -C "$(dirname "$OUT")" "$(basename "$OUT")" || echo "pack: tar failed"
}
wants() { [[ ",$PHASES," == *",$1,"* ]]; }
has_gpu() { "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
  "$PY" -c "import setuptools; print('setuptools', setuptools.__version__)" 2>&1 | tail -n 1
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
pack

build() {
  # Only the local GPU's arch by default: the shortest build (the default of a normal build is 8.0;9.0+PTX).
  local local_arch
  local_arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo 9.0)
  # pyproject.toml's SPDX license string needs setuptools >= 77, and the build takes the environment's own.
  if ! "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
    note "build: setuptools >= 77 is needed; install it first (pip install 'setuptools>=77')"
  fi
  # 300 s is meant for a GPU machine's many cores; a dry run on 2 cores took about 10 minutes
  # (BUDGET_S=1500 LIMIT_build=1200).
  phase build 300 env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$local_arch}" \
    MAX_JOBS="${MAX_JOBS:-$(nproc)}" FASTMHA_BUILD_DIR="$BUILD_DIR" \
    "$PY" -m pip install --no-build-isolation --no-deps -e .
  "$PY" -c "import fastmha; print(fastmha.build_info)" 2>&1 | tail -n 1 | tee -a "$OUT/summary.txt"
}

tests() {
  # Where the plugins are there: a time limit per test, so that a hang costs one test rather than the phase, and
  # on a machine with many cores a few test processes sharing the GPU.
  local pytest_args=(-q -p no:cacheprovider -rfE)
  local timeout_method=signal
  if "$PY" -c "import xdist" 2>/dev/null && [ "$(nproc)" -ge 8 ]; then
    pytest_args+=(-n "${TEST_WORKERS:-4}")
    # A test stuck in a CUDA call never returns to Python for the signal; the thread method ends its process,
    # which xdist replaces.
    timeout_method=thread
  fi
  "$PY" -c "import pytest_timeout" 2>/dev/null &&
    pytest_args+=(--timeout="${TEST_TIMEOUT_S:-90}" --timeout-method="$timeout_method")
  # The launch code against the stand-in runtime: the same rules the real launches below must pass. Built with
  # the C++ tests, which need Catch2.
  if [ -d "$BUILD_DIR/tests/cuda_launch" ]; then
    phase test-cuda-launch 60 ctest --test-dir "$BUILD_DIR" -R "cuda launch:" --output-on-failure --no-tests=error
  else
    note "test-cuda-launch: skipped, no $BUILD_DIR/tests/cuda_launch (no Catch2, no CUDA, or no build)"
  fi
  phase test-cuda-kernels 200 "$PY" -m pytest "${pytest_args[@]}" tests/python/test_cuda_kernels.py \
    --junitxml="$OUT/test-cuda-kernels.xml"
  # Every other test parameterized by device, on its CUDA cases (opcheck, gradients, module, causal, ...).
  if has_gpu; then
    phase test-device-cuda 120 "$PY" -m pytest "${pytest_args[@]}" tests/python -k cuda \
      --ignore tests/python/test_cuda_kernels.py --junitxml="$OUT/test-device-cuda.xml"
  else
    note "test-device-cuda: no CUDA device, skipped"
  fi
}

# Only fastmha's kernels are checked (their names hold the namespace): torch's and cuBLAS's run unchecked, which
# is faster and keeps their reports out. A sanitizer that does not take the filter checks every kernel.
sanitizer_filter=()
sanitizer_probed=0
sanitize() {  # sanitize TOOL LIMIT_SECONDS
  if ! command -v compute-sanitizer >/dev/null; then
    note "sanitize-$1: compute-sanitizer not found"
    return
  fi
  if [ "$sanitizer_probed" = 0 ]; then
    sanitizer_probed=1
    sanitizer_filter=(--kernel-name kns=fastmha)
    if ! timeout 30 compute-sanitizer "${sanitizer_filter[@]}" true >"$OUT/sanitize-probe.log" 2>&1; then
      note "sanitize: compute-sanitizer refused --kernel-name (sanitize-probe.log); every kernel is checked"
      sanitizer_filter=()
    fi
  fi
  phase "sanitize-$1" "$2" compute-sanitizer --tool "$1" "${sanitizer_filter[@]}" --error-exitcode 7 \
    "$PY" scripts/cuda_smoke.py
}

bench_core() {
  if has_gpu; then
    # Three lengths of the benchmark's six by default: the whole grid outlasts the phase's limit.
    phase bench-core 150 "$PY" benchmarks/bench_cuda.py --out "$OUT/bench" --repeats "${BENCH_REPEATS:-5}" \
      --lengths "${BENCH_LENGTHS:-1024,4096,16384}"
  else
    phase bench-core-smoke 120 "$PY" benchmarks/bench_cuda.py --smoke --device cpu --dtype float32 --out "$OUT/bench"
  fi
}

profile_layer() {
  # Where the default's forward + backward loses time against SDPA's: the host's issue against the GPU's kernels.
  has_gpu && phase profile-layer 60 "$PY" benchmarks/profile_cuda_layer.py --out "$OUT/bench"
}

bench_block() {
  # The whole block against the oracle block and nn.MultiheadAttention (the CPU benchmark's harness).
  has_gpu && phase bench-block 90 "$PY" benchmarks/bench.py --device cuda --dtypes bfloat16 --lengths 1024,4096 \
    --repeats "${BENCH_REPEATS:-5}" --tag bf16 --out "$OUT/bench"
}

wants build && build
wants test && tests
wants sanitize && sanitize memcheck 90
wants bench && bench_core
wants bench && profile_layer
wants sanitize && sanitize racecheck 150
wants sanitize && sanitize synccheck 45
wants bench && bench_block
echo "gpu_check: $([ $status = 0 ] && echo all phases passed || echo some phase FAILED), results in $OUT"
exit $status
