#!/usr/bin/env bash
# One command for a GPU machine (< 8 min on one H200): the static model, the GPU tests, then the
# benchmark suite, all written to OUT_DIR with the commit.
# Peers (Apple's cut-cross-entropy, liger-kernel) are used when importable; on a machine without
# network, carry their wheels in .whl/ (pure-Python wheels: pip download --no-deps -d .whl
# cut-cross-entropy liger-kernel) and they are installed from there.
# Usage: bash benchmarks/gpu_suite.sh [OUT_DIR]      (default benchmarks/results)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu_env.txt"
# The static model of this commit's kernels (compiles for sm_90 on the CPU; cached): gpu_suite.md
# puts its estimates next to the measured kernel times.
timeout 100 python3 -m benchmarks.gpu_model > "$out/gpu_model.log" 2>&1 || echo "gpu_model failed (see $out/gpu_model.log)"
# GPU tests: kernels compiled for real (conftest only sets TRITON_INTERPRET without CUDA).
timeout 130 python3 -m pytest -q -x tests/test_kernels.py tests/test_core.py -m "not slow" 2>&1 | tail -n 30 | tee "$out/gpu_tests.txt"
# Timings: atomic throughput, each kernel at the paper shape vs the model, then the methods side by side.
timeout 240 python3 benchmarks/gpu_suite.py --out "$out"
git rev-parse --short HEAD > "$out/gpu_commit.txt" 2>/dev/null || true
