"""benchmarks/gpu_suite.sh in its dry run (CPU: tiny shapes, the Triton interpreter, no CUDA timing).

The suite has one try on a GPU machine with a hard time limit, so its plumbing is tested here: it
writes only under the output folder it is given, the JSONL holds a row for every case (ok, error or
skipped), an injected failure and a child that dies become error rows while the later cases still
run, a hung case is killed at its timeout, and the markdown is re-generated from the JSONL alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "benchmarks" / "gpu_suite.py"

sys.path.insert(0, str(REPO))
from benchmarks import gpu_suite  # noqa: E402

pytest.importorskip("triton")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_SUITE_") and k != "OUT"}
    env.update(PYTHON=sys.executable, TRITON_INTERPRET="1", **extra)
    return env


def _snapshot() -> tuple[dict, str]:
    """Files under benchmarks/results (with size and mtime) and git's view of the worktree."""
    res = {
        str(p.relative_to(REPO)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in (REPO / "benchmarks" / "results").rglob("*")
    }
    try:
        st = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        st = ""
    return res, st


def test_dry_run_of_the_shell_script(tmp_path):
    out = tmp_path / "out"
    before = _snapshot()
    t0 = time.time()
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), str(out), "--dry-run"],
        cwd=tmp_path,  # the script finds the repository itself
        env=_env(CCE_SUITE_FAIL="backward tiles", CCE_SUITE_CRASH="backward owner"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    took = time.time() - t0
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert took < 150, f"the dry run took {took:.0f} s"

    # Everything under the output folder, nothing else in the repository.
    assert _snapshot() == before
    for name in ("suite.log", "gpu_suite.jsonl", "gpu_suite.md", "pytest_gpu.xml", "gpu_model.json", "gpu_model.md"):
        assert (out / name).is_file(), name
    assert len(list(out.rglob("*"))) <= 8  # what the device machine sends back
    log = (out / "suite.log").read_text()
    assert log.startswith("gpu_suite.sh:"), log[:200]  # tee'd from the first line

    rows = gpu_suite.read_rows(out)
    by = {(r["stage"], r["case"]): r for r in rows}

    class Flags:
        dry, quick = True, False

    for stage in ("env", "correctness", "peers", "kernels", "atomics"):
        for case in gpu_suite.CHILD_STAGES[stage][0](Flags):  # type: ignore[arg-type]
            assert (stage, case) in by, (stage, case)
            assert by[(stage, case)]["status"] in ("ok", "error", "skipped", "fail")
    assert by[("pytest", "GPU tests")]["status"] == "ok", by[("pytest", "GPU tests")]
    assert by[("gpu_model", "static model")]["status"] == "ok"

    # The injected failure and the dead child are error rows; the cases after them ran.
    fail = by[("correctness", "backward tiles")]
    assert fail["status"] == "error" and "injected failure" in fail["error"]
    crash = by[("correctness", "backward owner")]
    assert crash["status"] == "error" and "rc=86" in crash["error"]
    for case in ("backward chunked", "linear_cross_entropy(impl='triton') loss + grads"):
        r = by[("correctness", case)]
        assert r["status"] == "ok", r
        assert r["within_tolerance"] and r["dH"]["rel_fro"] < 1e-2 and r["dW"]["rel_fro"] < 1e-2
    assert by[("correctness", "forward")]["lse"]["max_abs"] < 1e-3

    # Rows carry the provenance; CUDA-only peers are skipped in the dry run, the rest measured.
    ok = by[("peers", "32x16x130 cce_dist")]
    assert ok["status"] == "ok" and ok["fwd_bwd_ms"] > 0 and "bwd_ms" in ok
    assert ok["env"]["commit"] and ok["env"]["torch"] and ok["env"]["dry_run"] is True
    assert by[("peers", "32x16x130 liger")]["status"] == "skipped"
    assert by[("peers", "32x16x130 torch.compile")]["status"] == "ok"

    # The markdown is the JSONL's: re-rendering gives the same file.
    md = (out / "gpu_suite.md").read_text()
    assert "injected failure" in md and "| backward chunked | ok |" in md
    (out / "gpu_suite.md").unlink()
    subprocess.run([sys.executable, str(SUITE), "--render", "--out", str(out)], check=True, env=_env(), timeout=60)
    assert (out / "gpu_suite.md").read_text() == md


def test_a_hung_case_is_killed_and_the_rest_runs(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(SUITE),
            "--dry-run",
            "--out",
            str(out),
            "--stages",
            "atomics",
            "--case-timeout",
            "4",
            "--stage-cap",
            "60",
        ],
        cwd=REPO,
        env=_env(CCE_SUITE_HANG="L2-resident"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by = {r["case"]: r for r in gpu_suite.read_rows(out) if r["stage"] == "atomics"}
    assert by["L2-resident 16 MB"]["status"] == "error" and "timeout" in by["L2-resident 16 MB"]["error"]
    assert by["HBM 2.36 GB (dW at paper shape)"]["status"] == "ok"
