#!/usr/bin/env bash
# Builds the committed tree against another torch release and runs pytest and ctest there: the README names a range
# of torch releases (requirements.txt), and the test command's environment holds one of them.
#
#   bash scripts/test_torch_version.sh 2.11.0 [WORKDIR]     # WORKDIR default: ${TMPDIR:-/tmp}/fastmha-torch-VERSION
#
# It works in a clone of its own with a venv of its own (several GB, with torch's CUDA packages), so the work
# tree's .venv and build stay as they are; the clone takes HEAD, not uncommitted changes. The wheel test, which builds
# a wheel from scratch, is left out. Arguments after WORKDIR go to pytest.
set -euo pipefail
VERSION=${1:?usage: scripts/test_torch_version.sh TORCH_VERSION [WORKDIR] [PYTEST_ARGS...]}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${2:-${TMPDIR:-/tmp}/fastmha-torch-$VERSION}
shift $(($# < 2 ? $# : 2))
MARK=.fastmha-torch-version  # marks a folder this script made, so that a rerun may delete it

# Only a folder this script made is deleted: a WORKDIR given by mistake (the checkout, a home folder) is refused.
if [ -e "$WORK" ]; then
  if [ ! -f "$WORK/$MARK" ]; then
    echo "[torch-version] $WORK exists and was not made by this script; give another WORKDIR" >&2
    exit 2
  fi
  rm -rf "$WORK"
fi
git clone -q "$ROOT" "$WORK"
cd "$WORK"
touch "$MARK"
unset FASTMHA_BUILD_DIR  # the build goes into this clone's build/, whatever the caller's environment says
export PATH="$PWD/.venv/bin:$PATH"  # cmake and ninja for the tests that build C++ projects

python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==$VERSION"
# pip takes a release such as 2.11 as 2.11.0: compare as versions, before the long build.
found=$(.venv/bin/python -W ignore -c "import torch; print(torch.__version__.split('+')[0])")  # (no NumPy yet)
same_release='import sys; a, b = (s.split(".") for s in sys.argv[1:]); n = max(len(a), len(b))
sys.exit(a + ["0"] * (n - len(a)) != b + ["0"] * (n - len(b)))'
if ! python3 -c "$same_release" "$found" "$VERSION"; then
  echo "[torch-version] pip installed torch $found for $VERSION" >&2
  exit 1
fi
# The rest of requirements.txt, then the build, with torch held at this release.
echo "torch==$found" >constraints-torch.txt
PIP_CONSTRAINT=$PWD/constraints-torch.txt bash scripts/setup.sh

status=0
echo "[torch-version] ---- pytest against torch $found"
.venv/bin/python -m pytest -q tests/python --deselect tests/python/test_wheel.py -p no:cacheprovider "$@" || status=1
echo "[torch-version] ---- ctest against torch $found"
.venv/bin/ctest --test-dir build --no-tests=error --output-on-failure || status=1
echo "[torch-version] torch $found: $([ $status = 0 ] && echo all passed || echo FAILED), in $WORK"
exit $status
