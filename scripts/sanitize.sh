#!/usr/bin/env bash
# Builds the library and the Catch2 tests with a sanitizer in build-<name>/ and runs them.
#   bash scripts/sanitize.sh thread               # ThreadSanitizer: the concurrency tests
#   bash scripts/sanitize.sh address,undefined    # AddressSanitizer + UndefinedBehaviorSanitizer: every test
# torch is not instrumented: reports from inside libtorch/libgomp (OpenMP's runtime, which TSan cannot see)
# are suppressed, ours are not. Needs scripts/setup.sh to have run (the .venv with torch).
set -euo pipefail
cd "$(dirname "$0")/.."
sanitizer="${1:-thread}"
build="build-${sanitizer//,/-}"
export PATH="$PWD/.venv/bin:$PATH"
torch_prefix="$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)')"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$torch_prefix" \
  -DFASTMHA_WITH_CUDA=OFF -DFASTMHA_SANITIZE="$sanitizer" -DPython_EXECUTABLE="$PWD/.venv/bin/python" >/dev/null
cmake --build "$build" -j "${MAX_JOBS:-2}" --target fastmha_tests
if [ "$sanitizer" = thread ]; then
  export TSAN_OPTIONS="suppressions=$PWD/scripts/tsan.supp halt_on_error=1 second_deadlock_stack=1"
  # One intra-op thread: at::parallel_for then runs in the calling thread, so TSan sees every access of the
  # tests' own threads. OpenMP's workers synchronize in libgomp, which TSan cannot see: with them it reports
  # their reads of a caller's stack against the caller's later reuse of that stack.
  export OMP_NUM_THREADS=1
  "$build/tests/cpp/fastmha_tests" "[concurrency]"
else
  # libtorch is not built with ASan: preload the runtime, and leaks inside torch's own allocations are not ours.
  export ASAN_OPTIONS="detect_leaks=0 halt_on_error=1"
  export UBSAN_OPTIONS="print_stacktrace=1 halt_on_error=1"
  LD_PRELOAD="$(gcc -print-file-name=libasan.so)" "$build/tests/cpp/fastmha_tests"
fi
