#!/usr/bin/env bash
# The GPU suite in one command, for a machine nobody watches (one H200, offline, a hard time limit):
# correctness of every Triton path against float64, cce_dist against Apple's Cut Cross-Entropy,
# Liger-Kernel, torch.compile and the materialized program, each kernel alone against
# this run's benchmarks/gpu_model.py (built in the background from the start, waited for before the kernels
# stage), fp32 atomics, the GPU tests (not the ahead-of-time compiles CI covers), then the registers and spills
# of every kernel the run compiled (read from its own Triton cache).
# Everything is written under OUT_DIR (nothing else in the repository is touched), the log from
# its first line:
#   suite.log          this script's whole output
#   gpu_suite.jsonl    one row per case, appended as it is measured (ok / fail / error / timeout / skipped)
#   gpu_suite.md       rendered from the JSONL at the end (re-render: gpu_suite.py --render --out DIR)
#   pytest_gpu.xml     the GPU tests (JUnit)
#   gpu_model.json/md  the static model of this commit's kernels, built by this run
#
# Usage: [CCE_COMMIT=<hash>] [CCE_SUITE_BUDGET_S=480] bash benchmarks/gpu_suite.sh [OUT_DIR] [gpu_suite.py args]
#   OUT_DIR defaults to $OUT if set, else benchmarks/results/gpu. CCE_COMMIT records the commit where
#   the machine has no .git. --dry-run (or CCE_SUITE_DRY_RUN=1) runs the CPU plumbing check (tests/test_gpu_suite.py).
# Peers: the pinned wheels of benchmarks/peer_wheels.txt, downloaded for Python 3.12 by
#   benchmarks/fetch_peer_wheels.sh into the ignored folder .whl/ and carried to the machine, are checked against
#   the pins and installed into /tmp/site (offline: --no-index --no-deps). gpu_suite.py appends that folder to
#   sys.path AFTER the image's site-packages ($CCE_SUITE_PEER_SITE, site.addsitedir): a carried wheel never
#   shadows the image's packages (PYTHONPATH would put it first). The environment row records what each peer
#   imports and from where; a peer that does not import is an error, and the script's exit code is not 0.
# Exit code: gpu_suite.py's: 0 when every case is ok (or skipped by design in the dry run), 1 when any failed,
#   errored, timed out or was not run, 2 without CUDA (not a dry run); a summary of what ran ends the output.
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
      "$PY" benchmarks/gpu_suite.py --check-wheels .whl || echo "gpu_suite.sh: .whl/ does not match benchmarks/peer_wheels.txt (above)"
      if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
        export CCE_SUITE_PEER_SITE=/tmp/site
      else
        echo "gpu_suite.sh: installing .whl/ failed; the peers that need it will be errors"
      fi
    else
      echo "gpu_suite.sh: no .whl/ folder (bash benchmarks/fetch_peer_wheels.sh): peers not in the image will be errors"
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
