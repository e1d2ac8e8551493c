#!/usr/bin/env bash
# Installs the oldest Triton the kernels support (tests/triton_oldest.py: OLDEST) beside the
# environment's own, with `pip install --target`, so that tests/test_aot_compile.py and
# tests/test_triton_oldest.py compile and interpret the kernels with both ends of the range.
# numpy < 2.4 comes with it: Triton 3.6's interpreter converts 1-element arrays with int(), which
# numpy 2.4 refuses (the same pin as pyproject.toml's `test` extra, which holds it for the environment's
# own numpy). Idempotent: does nothing when the folder already holds it.
set -euo pipefail
cd "$(dirname "$0")/.."
version="$(python -c 'import sys; sys.path.insert(0, "tests"); import triton_oldest as t; print(t.OLDEST)')"
dir="$(python -c 'import sys; sys.path.insert(0, "tests"); import triton_oldest as t; print(t.oldest_dir())')"
if [ ! -f "$dir/triton/__init__.py" ]; then
  python -m pip install -q --disable-pip-version-check --no-deps --target "$dir" "triton==$version" "numpy<2.4"
fi
echo "Triton $version in $dir"
