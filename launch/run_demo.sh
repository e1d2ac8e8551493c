#!/usr/bin/env bash
# The README's first command: install cce_dist (+ the launch extras) and run the demo:
# a small decoder LM with a vocab-parallel head (tp=2, gloo on CPU) trained with cce_dist and with
# the materialized Megatron-style loss side by side. Extra arguments go to launch.train, e.g.
#   bash launch/run_demo.sh --steps 50 --dtype bf16
# Environment: NPROC (default 2) processes; SKIP_INSTALL=1 to skip the pip install.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    python -m pip install -q -e ".[launch]"
fi
exec python -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
    -m launch.train "$@"
