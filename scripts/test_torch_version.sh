#!/usr/bin/env bash
# Builds the committed tree against another torch release and runs pytest and ctest there: the README names a range
# of torch releases (requirements.txt), and the test command checks only the one that pip picks, the newest.
#
#   bash scripts/test_torch_version.sh 2.11.0 [WORKDIR]     # WORKDIR default: $TMPDIR/fastmha-torch-VERSION
#
# It works in a clone of its own with a venv of its own (several GB, with torch's CUDA packages), so the work
# tree's .venv and build stay as they are; the clone takes HEAD, not uncommitted changes. The wheel test, which builds
# a wheel from scratch, is left out. Arguments after WORKDIR go to pytest.
set -euo pipefail
VERSION=${1:?usage: scripts/test_torch_version.sh TORCH_VERSION [WORKDIR] [PYTEST_ARGS...]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${2:-${TMPDIR:-/tmp}/fastmha-torch-$VERSION}
shift $(($# < 2 ? $# : 2))

rm -rf "$WORK"
git clone -q "$ROOT" "$WORK"
cd "$WORK"
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==$VERSION"
# The rest of requirements.txt, then the build; pip keeps the torch above, which is inside the required range.
bash scripts/setup.sh
found=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
if [ "$found" != "$VERSION" ]; then
  echo "[torch-version] the build took torch $found, not $VERSION (outside requirements.txt's range?)" >&2
  exit 1
fi

status=0
echo "[torch-version] ---- pytest against torch $VERSION"
.venv/bin/python -m pytest -q tests/python --deselect tests/python/test_wheel.py -p no:cacheprovider "$@" || status=1
echo "[torch-version] ---- ctest against torch $VERSION"
.venv/bin/ctest --test-dir build -j2 --output-on-failure || status=1
echo "[torch-version] torch $VERSION: $([ $status = 0 ] && echo all passed || echo FAILED), in $WORK"
exit $status
