#!/usr/bin/env bash
# Sets fastmha up from a fresh machine: Debian packages, .venv with torch & co, the build (CMake via
# setup.py, editable install). Safe to re-run: each step is skipped or incremental when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# 1. Debian packages: Catch2 (C++ tests), ccache (fast rebuilds), clang with its runtime (the libFuzzer
#    target). Where apt is unavailable the build still runs; the test command's C++ steps then fail.
missing=()
for package in catch2 ccache clang libclang-rt-14-dev; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] apt-get install ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "[setup] warning: missing Debian packages ${missing[*]}: without catch2 and clang the C++ test," \
      "sanitizer and fuzz steps of scripts/test.sh fail; without ccache rebuilds are slower"
  fi
fi

# 2. The virtual environment; dependencies are reinstalled only when requirements.txt changes.
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=".venv/.requirements-$(sha256sum requirements.txt | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  # torch and its CUDA libraries take about 6 GB once installed, more while pip unpacks them: say so up front
  # rather than fail midway with "No space left on device".
  free_gib=$(($(df -Pk . | awk 'NR == 2 {print $4}') / 1048576))
  if ((free_gib < 10)); then
    echo "[setup] error: $free_gib GiB free on the disk of $ROOT; installing requirements.txt needs about 10 GiB" >&2
    exit 1
  fi
  echo "[setup] pip install -r requirements.txt"
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -r requirements.txt
  touch "$stamp"
fi

# 3. The build: CMake (driven by setup.py) builds libfastmha, fastmha._C and the C++ tests into build/ and
#    installs them into python/fastmha. Ninja and ccache keep re-runs incremental.
export PATH="$ROOT/.venv/bin:$PATH"
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi
export MAX_JOBS="${MAX_JOBS:-2}"
echo "[setup] building fastmha (MAX_JOBS=$MAX_JOBS, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX})"
# (The filter only drops blank lines; a failed build still fails this script.)
.venv/bin/pip install -q --no-build-isolation --no-deps -e . 2>&1 | { grep -v "^\s*$" || true; }
.venv/bin/python -c "import fastmha; print('[setup] fastmha', fastmha.__version__, fastmha.build_info)"
