#!/usr/bin/env bash
# The GPU suite in one command, for a machine nobody watches (one H200, offline, a hard time limit):
# correctness of every Triton path against float64, cce_dist against Apple's Cut Cross-Entropy,
# Liger-Kernel, torch.compile and the materialized program, each kernel alone against
# benchmarks/gpu_model.py, fp32 atomics, then the GPU tests with the static model beside them.
# Everything is written under OUT_DIR (nothing else in the repository is touched), the log from
# its first line:
#   suite.log          this script's whole output
#   gpu_suite.jsonl    one row per case, appended as it is measured (ok / fail / error / skipped)
#   gpu_suite.md       rendered from the JSONL at the end (re-render: gpu_suite.py --render --out DIR)
#   pytest_gpu.xml     the GPU tests (JUnit)
#   gpu_model.json/md  the static model of this commit's kernels
#
# Usage: [CCE_COMMIT=<hash>] [CCE_SUITE_BUDGET_S=480] bash benchmarks/gpu_suite.sh [OUT_DIR] [gpu_suite.py args]
#   OUT_DIR defaults to $OUT if set, else benchmarks/results/gpu. CCE_COMMIT records the commit where
#   the machine has no .git. --dry-run (or CCE_SUITE_DRY_RUN=1) runs the CPU plumbing check (tests/test_gpu_suite.py).
# Peers: pure-Python wheels carried in .whl/ (pip download --no-deps --only-binary=:all: -d .whl
#   cut-cross-entropy liger-kernel trl, plus transformers accelerate datasets where the machine lacks them)
#   are installed into /tmp/site (offline, no index).
set -uo pipefail
started=$(date +%s)
cd "$(dirname "$0")/.."
out="${1:-${OUT:-benchmarks/results/gpu}}"
shift || true
mkdir -p "$out"
out="$(cd "$out" && pwd)"
PY="${PYTHON:-python3}"
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
[ -n "${CCE_SUITE_DRY_RUN:-}" ] && [ "${CCE_SUITE_DRY_RUN}" != "0" ] && dry=1

main() {
  echo "gpu_suite.sh: $(date -u +%FT%TZ) out=$out dry_run=$dry host=$(hostname) python=$PY"
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  if [ "$dry" = 0 ]; then
    if ls .whl/*.whl >/dev/null 2>&1; then
      ls .whl/*.whl
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || echo "gpu_suite.sh: installing .whl/ failed; peers will be skipped"
    else
      echo "gpu_suite.sh: no .whl/ folder: the peers are measured only if already installed"
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 || true
  fi
  # cce_dist from this checkout: the repository root first on PYTHONPATH (a plain package, kernels
  # included); an installed copy elsewhere never takes its place.
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -c "import cce_dist.kernels as k, triton, torch; print('cce_dist.kernels from', k.__file__, '| torch', torch.__version__, '| triton', triton.__version__)" \
    || echo "gpu_suite.sh: cce_dist.kernels does not import: every stage will record the error"
  "$PY" benchmarks/gpu_suite.py --out "$out" --started "$started" "$@"
  rc=$?
  echo "gpu_suite.sh: done rc=$rc after $(( $(date +%s) - started )) s"
  return $rc
}

main "$@" 2>&1 | tee -a "$out/suite.log"
exit "${PIPESTATUS[0]}"
