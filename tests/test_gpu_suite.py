"""benchmarks/gpu_suite.sh in its dry run (CPU: tiny shapes, the Triton interpreter, no CUDA timing).

The suite has one try on a GPU machine with a hard time limit, so its plumbing is tested here: it
writes only under the output folder it is given, the JSONL holds a row for every case (ok, error,
timeout or skipped), an injected failure and a child that dies become error rows while the later cases
still run and the exit code is 1 with a summary of what ran, a hung case is killed at its timeout (at
most a quarter of its stage's budget), the kernels are compared with the model this run built, the
environment row imports what each peer's measurement imports (the carried wheels appended after the
environment's own packages, never shadowing them), the carried wheels are pinned for Python 3.12, and
the markdown is re-generated from the JSONL alone.
"""

from __future__ import annotations

import os
import re
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


def _peer_site(tmp_path: Path) -> Path:
    """A carried-wheels folder: a stand-in cut_cross_entropy, and a numpy that would break everything if the
    folder came before the environment's own packages."""
    site = tmp_path / "site"
    (site / "cut_cross_entropy").mkdir(parents=True)
    (site / "cut_cross_entropy" / "__init__.py").write_text(
        "def linear_cross_entropy(*a, **k):\n    raise NotImplementedError\n"
    )
    (site / "numpy").mkdir()
    (site / "numpy" / "__init__.py").write_text("raise ImportError('the carried folder shadowed numpy')\n")
    return site


def _fresh_import(peer: str) -> str:
    """ok / error of what gpu_suite imports for ``peer``, in a fresh interpreter of this environment."""
    code = "; ".join(f"from {m} import {a}" for m, a in gpu_suite.PEERS[peer][1])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=_env())
    return "ok" if proc.returncode == 0 else "error"


def test_dry_run_of_the_shell_script(tmp_path):
    out = tmp_path / "out"
    site = _peer_site(tmp_path)
    before = _snapshot()
    t0 = time.time()
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_suite.sh"), str(out), "--dry-run"],
        cwd=tmp_path,  # the script finds the repository itself
        env=_env(CCE_SUITE_FAIL="backward tiles", CCE_SUITE_CRASH="backward owner", CCE_SUITE_PEER_SITE=str(site)),
        capture_output=True,
        text=True,
        timeout=360,
    )
    took = time.time() - t0
    # A failed case makes the exit code 1 (the dry run's own cases all pass: test_a_clean_run_exits_0)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert took < 240, f"the dry run took {took:.0f} s"  # ~90 s on 2 idle cores, 126 s at load 11

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
            assert by[(stage, case)]["status"] in gpu_suite.STATUSES
    assert by[("pytest", "GPU tests")]["status"] == "ok", by[("pytest", "GPU tests")]
    # the interpreter compiles nothing: the spills stage is skipped by design (it reads a real run's cache)
    assert by[("spills", "compiled kernels")]["status"] == "skipped" and by[("spills", "compiled kernels")]["expected"]
    # the GPU tests never recompile what CI compiles on CPU
    for covered in gpu_suite.PYTEST_CPU_COVERED:
        assert covered not in by[("pytest", "GPU tests")]["command"]
        assert covered not in gpu_suite.pytest_files()
    assert set(gpu_suite.PYTEST_FILES) <= set(gpu_suite.pytest_files())

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

    # The summary ends the output: what ran, failed, errored, timed out, was skipped and why, the exit code.
    tail = proc.stdout[proc.stdout.rindex("== gpu_suite summary ==") :]
    assert re.search(r"\d+ ran \(\d+ ok, 0 failed, 2 errored, 0 timed out\)", tail), tail
    assert "error    correctness / backward tiles: RuntimeError: injected failure" in tail, tail
    assert "correctness / backward owner" in tail and "(by design): dry run" in tail
    assert "exit 1: a case failed" in tail and "gpu_suite.sh: done rc=1" in tail
    assert by[("suite", "summary")]["exit_code"] == 1

    # The static model is built by this run before the kernels stage, which compares with it (never with the
    # committed benchmarks/results/gpu_model.json).
    stages = [r["stage"] for r in rows]
    assert stages.index("gpu_model") < stages.index("kernels")
    assert by[("gpu_model", "static model")]["status"] == "ok"
    run = rows[-1]["run"]
    for case in gpu_suite.KERNEL_CASES:
        r = by[("kernels", case)]
        assert r["status"] == "ok", r
        assert r["model_source"].startswith(f"gpu_model.json of this run {run}"), r["model_source"]
        assert r["model_ms_low"] <= r["model_ms_high"], r  # every kernel case has its estimate in the model

    # The environment row imports what each peer's measurement imports, from the carried folder appended
    # after the environment's own packages (its numpy would break every stage if it came first).
    env = by[("env", "env")]
    assert env["peer_site"] == str(site) and env["peer_site_position"].split(" of ")[0] != "0"
    assert set(env["peers"]) == set(gpu_suite.PEERS)
    assert env["peers"]["apple_cce"]["status"] == "ok"
    assert env["peers"]["apple_cce"]["from"]["cut_cross_entropy"].startswith(str(site))
    assert env["peers"]["trl"]["imports"] == [
        "from trl.kernels import ChunkedLogProbFunction",
        "from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE",
    ]
    for peer in ("trl", "liger"):  # what the row says is what a fresh import says
        assert env["peers"][peer]["status"] == _fresh_import(peer), env["peers"][peer]

    # Rows carry the provenance; CUDA-only peers are skipped by design in the dry run, the rest measured.
    ok = by[("peers", "32x16x130 cce_dist")]
    assert ok["status"] == "ok" and ok["fwd_bwd_ms"] > 0 and "bwd_ms" in ok
    assert ok["env"]["commit"] and ok["env"]["torch"] and ok["env"]["dry_run"] is True
    liger = by[("peers", "32x16x130 liger")]
    assert liger["status"] == "skipped" and liger["expected"] is True
    assert by[("peers", "32x16x130 torch.compile")]["status"] == "ok"

    # The markdown is the JSONL's: re-rendering gives the same file.
    md = (out / "gpu_suite.md").read_text()
    assert "injected failure" in md and "| backward chunked | ok |" in md and "## Summary" in md
    assert "- apple_cce (cut-cross-entropy" in md
    (out / "gpu_suite.md").unlink()
    subprocess.run([sys.executable, str(SUITE), "--render", "--out", str(out)], check=True, env=_env(), timeout=60)
    assert (out / "gpu_suite.md").read_text() == md


def test_a_clean_run_exits_0(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SUITE), "--dry-run", "--out", str(out), "--stages", "atomics,gpu_model,kernels"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("exit 0: every case ok"), proc.stdout[-2000:]
    rows = gpu_suite.read_rows(out)
    stages = [r["stage"] for r in rows if r["stage"] != "suite"]
    assert stages == ["gpu_model"] + ["kernels"] * len(gpu_suite.KERNEL_CASES) + ["atomics"] * 2, stages


def test_a_hung_case_is_killed_and_the_rest_runs(tmp_path):
    """A hung case is recorded as a timeout after at most a quarter of its stage's budget, whatever
    --case-timeout asks, and the next case runs in a fresh child; the run's exit code is 1."""
    out = tmp_path / "out"
    t0 = time.time()
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
            "100",
            "--stage-cap",
            "24",
        ],
        cwd=REPO,
        env=_env(CCE_SUITE_HANG="L2-resident"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.time() - t0 < 60
    by = {r["case"]: r for r in gpu_suite.read_rows(out) if r["stage"] == "atomics"}
    hung = by["L2-resident 16 MB"]
    assert hung["status"] == "timeout" and "ran past 6 s" in hung["error"], hung
    assert by["HBM 2.36 GB (dW at paper shape)"]["status"] == "ok"
    assert "0 errored, 1 timed out" in proc.stdout


def test_case_timeouts_leave_three_quarters_of_each_stage():
    for stage, (cap, case_timeout, least) in gpu_suite.STAGES.items():
        if stage in gpu_suite.CHILD_STAGES:
            assert case_timeout <= cap / 4, stage
        assert least <= cap, stage
    assert gpu_suite.ORDER.index("gpu_model") < gpu_suite.ORDER.index("kernels")


def test_exit_code_and_summary():
    rows = [
        {"stage": "suite", "case": "start", "status": "ok"},
        {"stage": "peers", "case": "a", "status": "ok"},
        {"stage": "peers", "case": "b", "status": "skipped", "expected": True, "error": "dry run: CUDA"},
    ]
    assert gpu_suite.exit_code(rows) == 0
    for bad in (
        {"status": "fail"},
        {"status": "error"},
        {"status": "timeout"},
        {"status": "skipped", "error": "not run: budget"},
    ):
        assert gpu_suite.exit_code(rows + [{"stage": "kernels", "case": "x", **bad}]) == 1, bad
    text = gpu_suite.summary(rows + [{"stage": "kernels", "case": "x", "status": "timeout", "error": "timeout: 6 s"}])
    assert "3 cases: 2 ran (1 ok, 0 failed, 0 errored, 1 timed out), 1 skipped (1 by design, 0 for want" in text
    assert "timeout  kernels / x: timeout: 6 s" in text and text.endswith("was not run")


# --- the carried wheels --------------------------------------------------------------------------------


def test_the_peer_wheels_are_pinned_for_python_3_12():
    pins = gpu_suite.peer_wheel_pins()
    # every peer's distribution, and what trl's import path needs that the GPU image lacks
    for dist, _ in gpu_suite.PEERS.values():
        assert dist in pins, dist
    assert pins["trl"].startswith("1.16.")
    assert {"datasets", "dill", "multiprocess"} <= set(pins)
    # never what the image already has: a second copy would only be found after it anyway, or break it
    assert not {"torch", "triton", "numpy", "transformers", "huggingface-hub", "accelerate"} & set(pins)
    fetch = (REPO / "benchmarks" / "fetch_peer_wheels.sh").read_text()
    for flag in ("--python-version 3.12", "--only-binary=:all:", "--no-deps", "-r benchmarks/peer_wheels.txt"):
        assert flag in fetch, flag
    assert "manylinux" in fetch and "x86_64" in fetch and "--check-wheels" in fetch
    sh = (REPO / "benchmarks" / "gpu_suite.sh").read_text()
    code = "\n".join(line for line in sh.splitlines() if not line.lstrip().startswith("#"))
    assert "--target /tmp/site" in code and "CCE_SUITE_PEER_SITE=/tmp/site" in code
    assert "PYTHONPATH=/tmp/site" not in code and 'PYTHONPATH="/tmp/site' not in code  # would shadow the image


def test_a_pin_that_is_not_one_version_is_refused(tmp_path):
    for bad in ("trl>=1.16", "trl", "trl==1.16.*", "trl==1.16.0\ntrl==1.16.0"):
        p = tmp_path / "pins.txt"
        p.write_text(bad + "\n")
        with pytest.raises(ValueError):
            gpu_suite.peer_wheel_pins(p)


def test_check_wheels_finds_what_would_break_the_install(tmp_path):
    pins = gpu_suite.peer_wheel_pins()
    good = tmp_path / "good"
    good.mkdir()
    for name, ver in pins.items():
        py = "py312" if name == "multiprocess" else "py3"
        (good / f"{name.replace('-', '_')}-{ver}-{py}-none-any.whl").write_bytes(b"")
    assert gpu_suite.check_wheels(good) == []
    (good / "multiprocess-0.70.19-py312-none-any.whl").rename(good / "multiprocess-0.70.19-py311-none-any.whl")
    (good / "trl-1.15.0-py3-none-any.whl").write_bytes(b"")
    (good / "rich-14.0.0-py3-none-any.whl").write_bytes(b"")
    (good / f"datasets-{pins['datasets']}-py3-none-any.whl").unlink()
    problems = "\n".join(gpu_suite.check_wheels(good))
    assert "py311-none-any.whl: not a wheel for CPython 3.12" in problems
    assert "trl-1.15.0-py3-none-any.whl: peer_wheels.txt pins trl==" in problems
    assert "rich-14.0.0-py3-none-any.whl: not in peer_wheels.txt" in problems
    assert f"datasets=={pins['datasets']}: no wheel" in problems
    proc = subprocess.run(
        [sys.executable, str(SUITE), "--check-wheels", str(good)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "no wheel" in proc.stdout


def test_the_carried_folder_goes_after_the_environments_packages(tmp_path):
    site = _peer_site(tmp_path)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from benchmarks import gpu_suite; "
        "print(gpu_suite.add_peer_site()); import numpy, cut_cross_entropy; "
        "print(sys.path.index(gpu_suite.os.environ['CCE_SUITE_PEER_SITE']) == len(sys.path) - 1, "
        "numpy.__file__, cut_cross_entropy.__file__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(REPO)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(CCE_SUITE_PEER_SITE=str(site)),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = proc.stdout.splitlines()
    assert first == str(site)
    last, np_file, cce_file = second.split()
    assert last == "True" and not np_file.startswith(str(site)) and cce_file.startswith(str(site))


def test_the_dry_run_with_the_oldest_triton(tmp_path):
    """The interpreter paths of the suite with Triton 3.6 first on the path (what the GPU machine has)."""
    import triton_oldest

    oldest = triton_oldest.require_oldest()
    out = tmp_path / "out"
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(oldest), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, str(SUITE), "--dry-run", "--out", str(out), "--stages", "correctness,gpu_model,kernels"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = [r for r in gpu_suite.read_rows(out) if r["stage"] in ("correctness", "kernels")]
    assert rows and all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    assert {r["env"]["triton"] for r in rows} == {triton_oldest.OLDEST}


def test_numpy_is_pinned_below_2_4_wherever_triton_3_6_is_used():
    """Triton 3.6's interpreter breaks with numpy 2.4: the `test` extra (whose Triton range starts at 3.6)
    pins it, and the script that installs Triton 3.6 beside the environment's own installs the same pin."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "numpy<2.4" in extras["test"] and any(r.startswith("triton>=3.6") for r in extras["test"])
    script = (REPO / "tests" / "install_oldest_triton.sh").read_text()
    assert '"numpy<2.4"' in script and '"triton==$version"' in script


# ------------------------------------------------------------------------------------------------
# the spills stage: registers and spills of every kernel a real run compiled, from its Triton cache
# ------------------------------------------------------------------------------------------------

#: Compiles one forward launch for sm_80 twice into the Triton cache ``argv[1]``: as planned (no spill) and held to
#: 32 registers (it needs about 190: ptxas spills), then reads the cache as the spills stage does.
_SPILL_PROBE = """
import json, sys
import torch
from cce_dist.kernels import aot, config, resources
from benchmarks import gpu_suite
kernel, _grid, args, kw = aot.forward_launches(config.KNOWN_DEVICES["sm_80"], torch.bfloat16, 256, 128, 512)[0]
fits = aot.compile_launch(kernel, args, kw, 80)
spills = aot.compile_launch(kernel, args, {**kw, "maxnreg": 32}, 80)
recs = resources.scan_cache(sys.argv[1])
print(json.dumps({"compiled": [fits.__dict__, spills.__dict__], "scanned": recs, "cuobjdump": resources.cuobjdump(),
                  "rows": gpu_suite.spill_rows(recs, sys.argv[1]), "triton": __import__("triton").__version__}))
"""


@pytest.mark.parametrize("triton", ["newest", "oldest"])
def test_the_spills_stage_reads_what_a_run_compiled(triton, tmp_path, capsys):
    """With the compiler and the cuobjdump of each end of the Triton range (the GPU machine has the oldest): the
    cache holds both compiles, the scan reads each one's registers and spills, and the stage's row fails on the
    spilling variant (naming it) and passes the planned one; ``python -m cce_dist.kernels.resources`` says the
    same of the cache."""
    import json

    import triton_oldest

    env = triton_oldest.env_with(triton_oldest.require_oldest() if triton == "oldest" else None)
    env.update(
        TRITON_CACHE_DIR=str(tmp_path / "triton"),
        CCE_DIST_AOT_CACHE=str(tmp_path / "aot"),  # compile, never reuse an earlier record
        TRITON_DEFAULT_FP_FUSION="0",
        PYTHONPATH=os.pathsep.join([p for p in [env.get("PYTHONPATH"), str(REPO)] if p]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _SPILL_PROBE, str(tmp_path / "triton")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    if triton == "oldest":
        assert got["triton"] == triton_oldest.OLDEST
        assert got["cuobjdump"].startswith(str(triton_oldest.oldest_dir())), got["cuobjdump"]
    fits, spills = got["compiled"]
    assert fits["stack"] + fits["local"] == 0 and fits["registers"] > 64, fits
    assert spills["stack"] + spills["local"] > 0 and spills["registers"] <= 32, spills

    scanned = {r["hash"]: r for r in got["scanned"]}
    assert set(scanned) == {fits["hash"], spills["hash"]}
    for c in (fits, spills):
        r = scanned[c["hash"]]
        assert r["name"] == "_row_stats_kernel" and r["ours"] and r["arch"] == 80 and "error" not in r, r
        assert (r["registers"], r["spill"], r["shared"]) == (c["registers"], c["stack"] + c["local"], c["shared"])
        assert (r["num_warps"], r["num_stages"], r["maxnreg"]) == (c["num_warps"], c["num_stages"], c["maxnreg"])
        assert r["triton_version"] == got["triton"]

    (row,) = got["rows"]
    assert row["case"] == "_row_stats_kernel" and row["status"] == "fail" and row["variants"] == 2, row
    assert row["max_spill_bytes"] == spills["stack"] + spills["local"] and row["archs"] == [80]
    assert row["error"] == "1 of 2 variants spill past 0 B"
    (bad,) = row["spilling"]
    assert bad.startswith(spills["hash"][:12]) and "maxnreg 32" in bad and bad.endswith(f"{row['max_spill_bytes']} B")
    assert gpu_suite.exit_code([row]) == 1

    # the same reading for a user's own cache after a GPU run: one line per variant, exit code 1 on a spill
    from cce_dist.kernels import resources

    assert resources.main([str(tmp_path / "triton")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"2 cce_dist kernel variants in {tmp_path / 'triton'}; 1 spill past 0 B", lines
    (flagged,) = [x for x in lines if "<- spills" in x]
    assert (
        "maxnreg 32" in flagged and f"{row['max_spill_bytes']} B spilled" in flagged and spills["hash"][:12] in flagged
    )


def _rec(name: str, spill: int = 0, ours: bool = True, **kw) -> dict:
    return {
        "name": name,
        "cubin": f"/c/{name}-{spill}.cubin",
        "hash": f"{name}{spill:04d}".ljust(16, "0"),
        "arch": 90,
        "num_warps": 4,
        "num_stages": 3,
        "maxnreg": None,
        "shared": 1024,
        "ours": ours,
        "registers": 128,
        "stack": spill,
        "local": 0,
        "spill": spill,
        **kw,
    }


def test_spill_rows_hold_each_kernel_to_the_bound_and_report_the_peers():
    rows = gpu_suite.spill_rows(
        [_rec("_row_stats_kernel"), _rec("_row_stats_kernel"), _rec("_cce_lse_kernel", 48, ours=False)], "/c"
    )
    assert [(r["case"], r["status"]) for r in rows] == [
        ("_row_stats_kernel", "ok"),
        ("peers' kernels (informative)", "ok"),
    ]
    assert rows[0]["variants"] == 2 and rows[0]["max_spill_bytes"] == 0 and rows[0]["spilling"] == []
    assert rows[1]["max_spill_by_kernel"] == {"_cce_lse_kernel": 48}
    assert gpu_suite.exit_code(rows) == 0  # a peer's spill is not ours to fail on

    spilled = gpu_suite.spill_rows(
        [_rec("_grads_dw_kernel"), _rec("_grads_dw_kernel", 8, maxnreg=255, hash="0123456789abcdef")], "/c"
    )
    assert spilled[0]["status"] == "fail" and spilled[0]["spilling"] == ["0123456789ab sm_90 w4s3 maxnreg 255: 8 B"]
    unreadable = {k: v for k, v in _rec("_dz_store_kernel").items() if k not in ("registers", "stack", "spill")}
    errs = gpu_suite.spill_rows([{**unreadable, "error": "CalledProcessError: cuobjdump"}], "/c")
    assert errs[0]["status"] == "error" and errs[0]["unreadable"] == [
        "/c/_dz_store_kernel-0.cubin: CalledProcessError: cuobjdump"
    ]
    (none,) = gpu_suite.spill_rows([_rec("_cce_lse_kernel", ours=False)], "/c")  # the cache missed our stages
    assert none["status"] == "error" and "no cce_dist kernel" in none["error"] and "_cce_lse_kernel" in none["error"]
    assert gpu_suite.spill_rows([], "/c")[0]["status"] == "error"


def test_the_cli_fails_on_a_cubin_of_ours_it_cannot_read(tmp_path, capsys):
    """``python -m cce_dist.kernels.resources`` after a GPU run: a cce_dist cubin cuobjdump cannot read is a failure
    (exit 1, counted in the summary), as in the suite's stage; a peer's unreadable cubin is listed, not counted."""
    from cce_dist.kernels import resources

    for name in ("_dz_store_kernel", "_cce_lse_kernel"):
        d = tmp_path / name
        d.mkdir()
        (d / f"{name}.cubin").write_bytes(b"not an ELF file")
    assert resources.main([str(tmp_path), "--all"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"1 cce_dist kernel variants in {tmp_path}; 0 spill past 0 B, 1 could not be read", lines
    (ours,) = [x for x in lines if x.startswith("_dz_store_kernel")]
    (peer,) = [x for x in lines if x.startswith("_cce_lse_kernel")]
    assert ours.endswith("<- unreadable") and not peer.endswith("<- unreadable"), lines

    (tmp_path / "_dz_store_kernel" / "_dz_store_kernel.cubin").unlink()
    assert resources.main([str(tmp_path), "--all"]) == 0  # only the peer's is left
    assert capsys.readouterr().out.splitlines()[-1] == f"0 cce_dist kernel variants in {tmp_path}; 0 spill past 0 B"


def test_a_real_run_compiles_into_its_own_cache_and_its_spills_stage_records_it(tmp_path, monkeypatch):
    """Not a dry run (no CUDA needed to build the Suite): every stage compiles into one fresh per-run Triton cache
    (the static model's AOT compiles excepted), and the spills stage records its scan of that cache, rendered into
    gpu_suite.md."""
    import argparse

    from cce_dist.kernels import resources

    for k in (
        "CCE_SUITE_RUN",
        "CCE_SUITE_COMMIT",
        "CCE_SUITE_TREE",
        "CCE_SUITE_OUT",
        "TRITON_CACHE_DIR",
        "PYTHONUNBUFFERED",
    ):
        monkeypatch.setenv(k, "")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # restored after the test
    out = tmp_path / "out"
    a = argparse.Namespace(out=str(out), dry_run=False, started=None, budget_s=480.0)
    suite = gpu_suite.Suite(a)
    cache = os.environ["TRITON_CACHE_DIR"]
    assert os.path.dirname(cache) == gpu_suite.tempfile.gettempdir()
    assert os.path.basename(cache) == gpu_suite.TRITON_CACHE_PREFIX + suite.run_id

    seen = []
    monkeypatch.setattr(resources, "scan_cache", lambda d, jobs: seen.append(d) or [_rec("_row_stats_kernel", 16)])
    suite.run_spills(budget=30)
    assert seen == [cache]
    (row,) = [r for r in gpu_suite.read_rows(out) if r["stage"] == "spills"]
    assert row["case"] == "_row_stats_kernel" and row["status"] == "fail" and row["max_spill_bytes"] == 16
    md = gpu_suite.render(out)
    assert "## Registers and spills of every kernel this run compiled" in md
    assert "| _row_stats_kernel | fail | 1 | [90] | 128 | 16 | 1024 |" in md


def test_the_scanned_kernel_names_are_the_kernels_cce_dist_launches():
    """resources.cce_dist_kernels (read from the source) names every kernel the planners launch, and only those:
    the spills stage tells our kernels from the peers' by it."""
    import triton

    from cce_dist.kernels import backward, distill, forward, resources

    # a @triton.jit function is an InterpretedFunction under TRITON_INTERPRET, else a JITFunction
    kinds = (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction)
    jitted = {
        name
        for mod in (forward, backward, distill)
        for name, obj in vars(mod).items()
        if isinstance(obj, kinds) and name.endswith("_kernel")
    }
    assert resources.cce_dist_kernels() == jitted
    assert {"_row_stats_kernel", "_grads_fused_kernel", "_distill_grads_kernel"} <= jitted
