#!/usr/bin/env bash
# Builds the libFuzzer target tests/fuzz/fuzz_attention.cpp (clang, AddressSanitizer + UBSan on the harness)
# against the built library and runs it.
#   bash scripts/fuzz.sh [SECONDS]     a search with a fresh random seed, growing build/fuzz/corpus (default 60 s)
#   FASTMHA_FUZZ_RUNS=N FASTMHA_FUZZ_SEED=S bash scripts/fuzz.sh
#                                      N inputs from seed S and an empty corpus, so a finding shows up run
#                                      after run (what the test command runs)
# Needs Debian's clang and libclang-rt-*-dev (scripts/setup.sh installs them) and a built fastmha.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-60}"
py=.venv/bin/python
torch_dir="$($py -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
fastmha_dir="$($py -c 'import fastmha; print(fastmha.cmake_prefix_path)')"
mkdir -p build/fuzz/corpus
libs=(-lfastmha -ltorch -ltorch_cpu -lc10)
for optional in torch_cuda c10_cuda; do
  [ -e "$torch_dir/lib/lib$optional.so" ] && libs+=("-l$optional")
done
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -D_GLIBCXX_USE_CXX11_ABI=1 \
  -I"$torch_dir/include" -I"$torch_dir/include/torch/csrc/api/include" -I"$fastmha_dir/include" -Itests/cpp \
  tests/fuzz/fuzz_attention.cpp tests/cpp/oracle.cpp -o build/fuzz/fuzz_attention \
  -L"$torch_dir/lib" -L"$fastmha_dir/lib" -Wl,--no-as-needed "${libs[@]}" \
  -Wl,-rpath,"$torch_dir/lib:$fastmha_dir/lib"
if [ -n "${FASTMHA_FUZZ_RUNS:-}" ]; then
  corpus="$(mktemp -d)"
  trap 'rm -rf "$corpus"' EXIT
  limits=(-runs="$FASTMHA_FUZZ_RUNS" -seed="${FASTMHA_FUZZ_SEED:-1}")
else
  corpus=build/fuzz/corpus
  limits=(-max_total_time="$seconds")
fi
# torch's own allocations are not ours to leak-check; one intra-op thread keeps runs comparable.
ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1 OMP_NUM_THREADS=1 \
  build/fuzz/fuzz_attention "${limits[@]}" -max_len=64 -timeout=20 "$corpus"
