#!/usr/bin/env bash
# Runs every test: sets up (scripts/setup.sh), then pytest (tests/python), ctest (Catch2, tests/cpp), the C++
# tests again under AddressSanitizer + UBSan, and a short libFuzzer run of the op boundary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/python -m pytest tests/python -q "$@"
if [ -f build/tests/cpp/CTestTestfile.cmake ]; then
  .venv/bin/ctest --test-dir build --output-on-failure
else
  echo "C++ tests were not built (Catch2 missing)" >&2
  exit 1
fi
bash scripts/sanitize.sh address,undefined
bash scripts/fuzz.sh "${FASTMHA_FUZZ_SECONDS:-20}" 2>&1 | tail -n 20
