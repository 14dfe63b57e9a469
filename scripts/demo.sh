#!/usr/bin/env bash
# The main job: sets up (scripts/setup.sh), then runs the demo (examples/python/demo.py); flags pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/python examples/python/demo.py "$@"
