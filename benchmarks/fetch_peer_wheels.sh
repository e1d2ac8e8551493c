#!/usr/bin/env bash
# Downloads the peers' wheels (benchmarks/peer_wheels.txt, every version pinned) for the offline GPU machine:
# CPython 3.12 on manylinux x86_64, binary only, no dependencies resolved (the list names each one the image
# lacks). Run where PyPI is reachable, from any directory:
#
#   bash benchmarks/fetch_peer_wheels.sh [DEST]      # DEST defaults to .whl/ (git-ignored) in the repository
#
# then carry DEST to the machine (device tool: carry [".whl"]). benchmarks/gpu_suite.sh installs them into
# /tmp/site with `pip install --no-index --no-deps --target` and gpu_suite.py appends /tmp/site after the
# image's site-packages. The folder is checked afterwards (gpu_suite.py --check-wheels): one wheel per pin, of
# the pinned version, nothing else (two versions of one package stop the whole install there).
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$dest"
"$PY" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$dest" -r benchmarks/peer_wheels.txt
"$PY" benchmarks/gpu_suite.py --check-wheels "$dest"
