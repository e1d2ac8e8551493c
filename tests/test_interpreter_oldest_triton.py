"""A representative set of the interpreter kernel tests, run again with the oldest supported Triton.

The interpreter runs the kernels' Python with Triton's language patched in; its semantics (and its
bugs) move between releases, so the same kernel code is checked with both ends of
``cce_dist.kernels.TRITON_RANGE``: every kernel (forward statistics, each backward schedule, the
distillation statistics / rows / gradient kernels) against its oracle. The full files run with the
installed (newest) Triton in the main suite; tests/test_aot_compile.py compiles every launch with both.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
from triton_oldest import OLDEST, env_with, require_oldest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The chunked schedule in row blocks: four of test_kernels' 32 cases, which take bias, softcap, temperature, a
#: vocab offset, the deterministic dW and filtering each with both values.
CHUNKED_ROW_BLOCKS = " or ".join(
    f"chunked_row_blocks_match_oracle[{case}]" for case in ("0-0.0", "7-None", "10-0.0", "15-None")
)
#: The distillation's statistics (with a cross sum: reverse KL), rows (JSD) and gradient kernels, each reduction.
DISTILL = " or ".join(f"matches_oracle_and_torch_fp32[{case}]" for case in ("reverse_kl", "jsd0.5"))

#: (test file, -k expression, how many tests it selects): each kernel and schedule at least once, fp32 and half
#: precision, each flag on and off.
SELECTION = [
    ("tests/test_kernels.py", "row_stats_fp32_all_combinations or row_stats_half or optional_columns", 30),
    ("tests/test_kernels.py", f"grads_schedules_match_oracle or {CHUNKED_ROW_BLOCKS} or zero_coef_rows", 17),
    ("tests/test_kernels.py", "deterministic_is_bitwise_repeatable or filter_keeps_target", 9),
    ("tests/test_distill_triton.py", f"{DISTILL} or deterministic_kernels_match_oracle", 5),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "path,expr,count", SELECTION, ids=[f"{p.split('/')[-1]}:{i}" for i, (p, _e, _n) in enumerate(SELECTION)]
)
def test_kernels_in_the_oldest_interpreter(path, expr, count):
    env = env_with(require_oldest())
    env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", path, "-k", expr]
    probe = [sys.executable, "-c", "import triton; print(triton.__version__)"]
    version = subprocess.run(probe, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert version == OLDEST, f"the subprocess imports Triton {version}, not {OLDEST}"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=880, check=False)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert re.search(rf"\b{count} passed", tail) and " failed" not in tail, tail  # the selection, all of it
