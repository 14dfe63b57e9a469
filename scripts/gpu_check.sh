#!/usr/bin/env bash
# The GPU machine's one prepared call: build fastmha against the torch it finds, run every CUDA test, the
# compute-sanitizer checks and the GPU benchmark, writing logs and results into OUTDIR (summary.txt first).
#
#   bash scripts/gpu_check.sh OUTDIR                       # all phases: build, test, sanitize, bench
#   PHASES=build,test bash scripts/gpu_check.sh OUTDIR     # a subset
#   ARCHIVE=/path/results.tar.gz bash scripts/gpu_check.sh OUTDIR   # also OUTDIR packed in one file, after each phase
#
# The phases' limits add up to more than 10 minutes; where one call may last 10 minutes at most, run it as
# two calls on the same machine: PHASES=build,test,sanitize, then PHASES=bench (the build stays), or shorten
# the phases: LIMIT_test_cuda_kernels=120 (the phase's name, dashes as underscores) sets that phase's limit.
#
# Each phase has its own time limit (so a hang costs one phase, not the whole check) and the next one runs even
# when one fails; the exit status is non-zero if any failed. Without a GPU everything still runs (CUDA
# tests skip, the sanitizer and the benchmark say so): that is the dry run on a CPU machine.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PHASES=${PHASES:-build,test,sanitize,bench}
PY=${PYTHON:-python3}
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=$PWD/.venv/bin/python
# cmake, ninja and pybind11 come with that Python's packages.
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
status=0

phase() {  # phase NAME LIMIT_SECONDS COMMAND...; LIMIT_<NAME> (dashes as underscores) overrides the limit
  local name=$1 limit=$2 override="LIMIT_${1//-/_}"
  limit=${!override:-$limit}
  shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$name.log"
  [ "$rc" = 0 ] || status=1
  pack
}
# Refreshed after every phase, so that a check cut short still leaves what it found in the archive.
pack() { [ -z "${ARCHIVE:-}" ] || tar czf "$ARCHIVE" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
wants() { [[ ",$PHASES," == *",$1,"* ]]; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "no nvidia-smi"
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
  "$PY" -c "import setuptools; print('setuptools', setuptools.__version__)" 2>&1 | tail -n 1
} >"$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"
pack

if wants build; then
  # Only the local GPU's arch by default: the shortest build (the default of a normal build is 8.0;9.0+PTX).
  local_arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo 9.0)
  # pyproject.toml's SPDX license string needs setuptools >= 77, and the build takes the environment's own.
  if ! "$PY" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null; then
    echo "build: setuptools >= 77 is needed; install it first (pip install 'setuptools>=77')" | tee -a "$OUT/summary.txt"
  fi
  # 300 s is meant for a GPU machine's many cores; a dry run on 2 cores took about 10 minutes (BUILD_LIMIT_S=1200).
  phase build "${BUILD_LIMIT_S:-300}" env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$local_arch}" \
    MAX_JOBS="${MAX_JOBS:-$(nproc)}" FASTMHA_BUILD_DIR="${FASTMHA_BUILD_DIR:-build-gpu}" \
    "$PY" -m pip install --no-build-isolation --no-deps -e .
  "$PY" -c "import fastmha; print(fastmha.build_info)" | tee -a "$OUT/summary.txt"
fi
if wants test; then
  # Where the plugins are there: a time limit per test (a hang costs one test, not the phase) and, on a machine
  # with many cores, a few test processes sharing the GPU.
  pytest_args=(-q -p no:cacheprovider -rfE)
  "$PY" -c "import pytest_timeout" 2>/dev/null && pytest_args+=(--timeout="${TEST_TIMEOUT_S:-90}")
  if "$PY" -c "import xdist" 2>/dev/null && [ "$(nproc)" -ge 8 ]; then pytest_args+=(-n "${TEST_WORKERS:-4}"); fi
  # The launch code against the stand-in runtime: the same rules the real launches below must pass. Built with
  # the C++ tests, which need Catch2.
  if [ -d "${FASTMHA_BUILD_DIR:-build-gpu}/tests/cuda_launch" ]; then
    phase test-cuda-launch 60 ctest --test-dir "${FASTMHA_BUILD_DIR:-build-gpu}" -R "cuda launch:" \
      --output-on-failure --no-tests=error
  else
    echo "test-cuda-launch: skipped, the build has no C++ tests (Catch2 not found)" | tee -a "$OUT/summary.txt"
  fi
  phase test-cuda-kernels 240 "$PY" -m pytest "${pytest_args[@]}" tests/python/test_cuda_kernels.py \
    --junitxml="$OUT/test-cuda-kernels.xml"
  # Every other test parameterized by device, on its CUDA cases (opcheck, gradients, module, causal, ...).
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    phase test-device-cuda 180 "$PY" -m pytest "${pytest_args[@]}" tests/python -k cuda \
      --ignore tests/python/test_cuda_kernels.py --junitxml="$OUT/test-device-cuda.xml"
  else
    echo "test-device-cuda: no CUDA device, skipped" | tee -a "$OUT/summary.txt"
  fi
fi
if wants sanitize; then
  if command -v compute-sanitizer >/dev/null; then
    # Only fastmha's kernels are checked (their names hold the namespace): torch's and cuBLAS's run unchecked,
    # which is faster and keeps their reports out. A sanitizer that does not take the filter checks every kernel.
    only_fastmha=(--kernel-name kns=fastmha)
    if ! compute-sanitizer "${only_fastmha[@]}" true >/dev/null 2>&1; then
      echo "sanitize: this compute-sanitizer takes no --kernel-name filter; every kernel is checked" |
        tee -a "$OUT/summary.txt"
      only_fastmha=()
    fi
    for tool in memcheck racecheck synccheck; do
      phase "sanitize-$tool" 100 compute-sanitizer --tool "$tool" "${only_fastmha[@]}" --error-exitcode 7 \
        "$PY" scripts/cuda_smoke.py
    done
  else
    echo "sanitize: compute-sanitizer not found" | tee -a "$OUT/summary.txt"
  fi
fi
if wants bench; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    phase bench-core 240 "$PY" benchmarks/bench_cuda.py --out "$OUT/bench" --repeats "${BENCH_REPEATS:-5}"
    # The whole block against the oracle block and nn.MultiheadAttention (the CPU benchmark's harness).
    phase bench-block 120 "$PY" benchmarks/bench.py --device cuda --dtypes bfloat16 --lengths 1024,4096 \
      --repeats "${BENCH_REPEATS:-5}" --tag bf16 --out "$OUT/bench"
  else
    phase bench-core-smoke 120 "$PY" benchmarks/bench_cuda.py --smoke --device cpu --dtype float32 --out "$OUT/bench"
  fi
fi
echo "gpu_check: $( [ $status = 0 ] && echo all phases passed || echo some phase FAILED ), results in $OUT"
exit $status
