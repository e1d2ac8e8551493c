"""``benchmarks.aot_matrix``: each cell of the spill report says which commit and which kernel sources it was compiled
from, a cell whose sources differ from the tree's is marked stale (not evidence for this commit) and recompiled on
the next run unless re-planning shows its launches unchanged, the rows and offenders are rendered from the cells'
summaries, and those are kept in a committed ledger so cells compiled in other sessions stay in the report."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from benchmarks import aot_matrix

VERSIONS = {"3.9.0": {"version": "3.9.0", "ptxas": "ptxas V12.9.86"}}


def _row(label: str, spill: int = 0, shared: int = 1024) -> dict:
    return {
        "label": label,
        "ok": True,
        "error": "",
        "kernel": "_row_stats_kernel",
        "arch": 90,
        "hash": "h",
        "num_warps": 8,
        "num_stages": 3,
        "shared": shared,
        "registers": 200,
        "stack": spill,
        "local": 0,
        "mma": ["wgmma"],
        "atomics": 0,
        "constexprs": {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_D": 64},
        "dtype": "bf16",
        "maxnreg": None,
    }


def _write(work: pathlib.Path, target: str, rows: list[dict], prov: dict | None) -> pathlib.Path:
    cell = aot_matrix._cell(work, "3.9.0", target, "full", "fwd")
    cell.write_text(json.dumps(rows))
    if prov is not None:
        aot_matrix._provenance(cell).write_text(json.dumps(prov))
    return cell


def _ledger(work: pathlib.Path) -> dict:
    ledger = {"versions": dict(VERSIONS), "cells": {}}
    aot_matrix.fold(ledger, work, "full", "fwd")
    return ledger


def _table(md: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| 3.9.0 |")]
    return {r[1]: r for r in rows}


def test_each_cell_names_its_commit_and_stale_cells_are_marked(tmp_path):
    fp = aot_matrix.kernels_fingerprint()
    prov = {"commit": "0123456789abcdef", "dirty": False, "kernels": fp, "compiled_utc": "2026-12-06 19:00"}
    _write(tmp_path, "sm_90", [_row("bf16/paper/fwd:plain/_row_stats_kernel")], prov)
    _write(tmp_path, "sm_80", [_row("bf16/paper/fwd:bias/_row_stats_kernel", spill=24)], {**prov, "kernels": "old"})
    _write(tmp_path, "sm_100", [_row("bf16/paper/fwd:plain/_row_stats_kernel")], None)
    _write(tmp_path, "sm_120", [_row("fp16/paper/fwd:plain/_row_stats_kernel")], {**prov, "dirty": True})
    md = aot_matrix.render(_ledger(tmp_path), "full", "fwd")
    table = _table(md)
    assert table["sm_90"][-1] == "`012345678`" and table["sm_90"][2:5] == ["1", "0", "0 B"]
    assert table["sm_80"][-1] == "`012345678` (stale: kernels changed since)" and table["sm_80"][4] == "24 B"
    assert table["sm_100"][2] == "not compiled"  # no provenance: not folded into the ledger
    assert table["sm_120"][-1] == "`012345678` + uncommitted kernel changes"
    assert table["sm_86"][2] == "not compiled" and len(table["sm_86"]) == len(table["sm_90"])
    # a cell carried over a change to config rules only (its launches checked unchanged): named with both commits
    carried = {**prov, "carried": {"from_kernels": "old", "to_commit": "fedcba9876543210"}}
    (tmp_path / "c").mkdir()
    _write(tmp_path / "c", "sm_86", [_row("bf16/paper/fwd:plain/_row_stats_kernel")], carried)
    assert _table(aot_matrix.render(_ledger(tmp_path / "c"), "full", "fwd"))["sm_86"][-1] == (
        "`012345678`, same launches at `fedcba987`"
    )
    assert "- 3.9.0 sm_80: over its bound: `bf16/paper/fwd:bias/_row_stats_kernel` 64x128x64 w8s3: 24 B" in md
    assert "marked stale" in md


def test_is_fresh_follows_the_kernel_code_not_its_comments(tmp_path):
    repo = tmp_path / "repo"
    (repo / "cce_dist" / "kernels").mkdir(parents=True)
    src = repo / "cce_dist" / "kernels" / "forward.py"
    src.write_text("BLOCK = 64\n")
    (repo / "cce_dist" / "other.py").write_text("x = 1\n")
    fp = aot_matrix.kernels_fingerprint(repo)
    (repo / "cce_dist" / "other.py").write_text("x = 2\n")  # outside the kernels: same fingerprint
    assert aot_matrix.kernels_fingerprint(repo) == fp
    src.write_text('"""Tiles."""\n\nBLOCK = 64  # a comment\n\n\ndef f():\n    """Doc."""\n    return BLOCK\n')
    fp = aot_matrix.kernels_fingerprint(repo)
    # comments, docstrings and layout: the same fingerprint (documenting a rule leaves the compiled cells fresh)
    src.write_text('"""Tiles, reworded."""\nBLOCK = 64  # another\n# a new line\n\ndef f():\n    return BLOCK\n')
    assert aot_matrix.kernels_fingerprint(repo) == fp
    src.write_text('"""Tiles."""\n\nBLOCK = 128  # a comment\n\n\ndef f():\n    """Doc."""\n    return BLOCK\n')
    assert aot_matrix.kernels_fingerprint(repo) != fp  # the code changed
    src.write_text('"""Tiles."""\n\nBLOCK = 64  # a comment\n\n\ndef f():\n    """Doc."""\n    return BLOCK + 0\n')
    assert aot_matrix.kernels_fingerprint(repo) != fp
    src.write_text('"""Tiles."""\n\nBLOCK = 64  # a comment\n\n\ndef f():\n    """Doc."""\n    return "BLOCK"\n')
    assert aot_matrix.kernels_fingerprint(repo) != fp  # a string that is a value, not a docstring

    cell = _write(tmp_path, "sm_90", [], {"commit": "c", "dirty": False, "kernels": fp, "compiled_utc": ""})
    prov = aot_matrix.read_provenance(cell)
    assert aot_matrix.is_fresh(prov, fp) and not aot_matrix.is_fresh(prov, "other")
    aot_matrix._provenance(cell).unlink()
    assert aot_matrix.read_provenance(cell) is None and not aot_matrix.is_fresh(None, fp)  # none recorded


def test_compile_cell_records_its_provenance_and_refuses_sources_changed_midway(tmp_path, monkeypatch):
    real = subprocess.run
    seen = []

    def fake(cmd, *args, **kwargs):
        if "cce_dist.kernels.aot" in cmd:
            seen.append(cmd)
            pathlib.Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps([_row("x")]))
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(aot_matrix.subprocess, "run", fake)
    aot_matrix.compile_cell(None, "3.9.0", "sm_90", "full", tmp_path, 2, "fwd")
    cell = aot_matrix._cell(tmp_path, "3.9.0", "sm_90", "full", "fwd")
    prov = aot_matrix.read_provenance(cell)
    head = real(["git", "rev-parse", "HEAD"], cwd=aot_matrix.REPO, capture_output=True, text=True).stdout.strip()
    assert prov is not None and prov["commit"] == head and prov["kernels"] == aot_matrix.kernels_fingerprint()
    assert json.loads(cell.read_text())[0]["label"] == "x"
    assert seen[0][:3] == [sys.executable, "-m", "cce_dist.kernels.aot"] and "--level" in seen[0]

    prints = iter(["before", "after"])
    monkeypatch.setattr(aot_matrix, "kernels_fingerprint", lambda repo=None: next(prints))
    other = aot_matrix._cell(tmp_path, "3.9.0", "sm_80", "full", "fwd")
    with pytest.raises(RuntimeError, match="changed during the compile"):
        aot_matrix.compile_cell(None, "3.9.0", "sm_80", "full", tmp_path, 2, "fwd")
    assert not other.exists() and aot_matrix.read_provenance(other) is None


def _run_main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["aot_matrix", *argv])
    aot_matrix.main()


def test_the_ledger_keeps_cells_compiled_in_other_sessions(tmp_path, monkeypatch):
    """Each session compiles into its own work folder, which does not outlive it: the report is rendered from the
    committed ledger beside it, so a new cell joins the cells compiled before instead of replacing the report."""
    fp = aot_matrix.kernels_fingerprint()
    out = tmp_path / "results" / "spills.md"
    out.parent.mkdir()
    prov = {"commit": "0123456789abcdef", "dirty": False, "kernels": fp, "compiled_utc": "2026-12-06 19:00"}
    first, second = tmp_path / "session1", tmp_path / "session2"
    for work in (first, second):
        work.mkdir()
        (work / "versions.json").write_text(json.dumps(VERSIONS))
    _write(first, "sm_90", [_row("bf16/paper/fwd:plain/_row_stats_kernel", spill=8)], prov)
    argv = ("--render-only", "--level", "full", "--matrix", "fwd", "--out", str(out))
    _run_main(monkeypatch, *argv, "--work", str(first))
    ledger = json.loads(aot_matrix.ledger_path(out).read_text())
    assert ledger["cells"]["3.9.0/sm_90"]["summary"]["over_bound"] == [
        "`bf16/paper/fwd:plain/_row_stats_kernel` 64x128x64 w8s3: 8 B"
    ]
    shutil.rmtree(first)  # the first session's work folder is gone
    _write(second, "sm_80", [_row("bf16/paper/fwd:plain/_row_stats_kernel")], {**prov, "compiled_utc": "2026-12-07"})
    _run_main(monkeypatch, *argv, "--work", str(second))
    table = _table(out.read_text())
    assert table["sm_90"][2:5] == ["1", "0", "8 B"] and table["sm_80"][2:5] == ["1", "0", "0 B"]
    assert "- 3.9.0 sm_90: over its bound: `bf16/paper/fwd:plain/_row_stats_kernel` 64x128x64 w8s3: 8 B" in (
        out.read_text()
    )
    # a later compile of a cell replaces its record; the same compile (or an older one) does not
    _write(second, "sm_90", [_row("bf16/paper/fwd:plain/_row_stats_kernel")], {**prov, "compiled_utc": "2026-12-07"})
    _run_main(monkeypatch, *argv, "--work", str(second))
    assert _table(out.read_text())["sm_90"][4] == "0 B"
    ledger = json.loads(aot_matrix.ledger_path(out).read_text())
    ledger["cells"]["3.9.0/sm_80"]["provenance"]["carried"] = {"from_kernels": "old", "to_commit": "fedcba987654"}
    aot_matrix.ledger_path(out).write_text(json.dumps(ledger))
    _run_main(monkeypatch, *argv, "--work", str(second))
    assert _table(out.read_text())["sm_80"][-1] == "`012345678`, same launches at `fedcba987`"


def test_replan_carries_only_cells_whose_launches_are_unchanged(tmp_path, monkeypatch):
    fp = aot_matrix.kernels_fingerprint()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=aot_matrix.REPO, capture_output=True, text=True).stdout
    prov = {"commit": "0123456789abcdef", "dirty": False, "compiled_utc": "2026-12-06 19:00"}
    summary = aot_matrix.summarize([_row("x")], "sm_90")
    cells = {
        "sm_80": {**prov, "kernels": "old", "launches": "aaaa"},  # config-only change, same launches: carried
        "sm_86": {**prov, "kernels": "old", "launches": "bbbb"},  # launches changed: stays stale
        "sm_90": {**prov, "kernels": fp, "launches": None},  # migrated from a report: its digest is recorded
        "sm_100": {**prov, "kernels": fp, "launches": "dddd"},  # fresh, but plans other launches: said
        "sm_120": {**prov, "kernels": "old", "launches": None},  # nothing to compare with: stays stale
    }
    ledger = {
        "versions": dict(VERSIONS),
        "cells": {f"3.9.0/{t}": {"summary": summary, "provenance": p} for t, p in cells.items()},
    }
    planned = {"sm_80": "aaaa", "sm_86": "b000", "sm_90": "cccc", "sm_100": "d000", "sm_120": "eeee"}
    monkeypatch.setattr(aot_matrix, "planned_digest", lambda path, target, level, matrix: planned[target])
    said = aot_matrix.replan(ledger, None, "3.9.0", list(aot_matrix.TARGETS), "full", "fwd")
    assert said[0].endswith("carried") and said[2].endswith("digest recorded")
    assert "differ" in said[1] and "differ" in said[3] and "without a launch digest" in said[4]
    table = _table(aot_matrix.render(ledger, "full", "fwd"))
    assert table["sm_80"][-1] == f"`012345678`, same launches at `{head[:9]}`"
    assert table["sm_86"][-1].endswith("(stale: kernels changed since)")
    assert table["sm_120"][-1].endswith("(stale: kernels changed since)")
    assert table["sm_90"][-1] == "`012345678`" and ledger["cells"]["3.9.0/sm_90"]["provenance"]["launches"] == "cccc"
    assert ledger["cells"]["3.9.0/sm_100"]["provenance"]["launches"] == "dddd"  # not overwritten


_KEYS_OF_THE_PLAN = """
import hashlib, json
from cce_dist.kernels import aot, config
props = config.KNOWN_DEVICES["sm_90"]
jobs = aot.plan(props, ("fwd",), "each")
keys = [aot.launch_key(*aot._resolve(props, j)[1:], 90) for j in jobs]
rec = aot.compile_launch(*aot._resolve(props, jobs[0])[1:], 90)
print(json.dumps({"keys": keys, "compiled": rec.hash}))
"""


@pytest.mark.timeout(600)
def test_the_planned_digest_is_that_of_the_compiled_launches(tmp_path):
    """``replan`` compares a cell's compiled launches (their records' ``hash``) with what the tree plans today
    (``planned_digest``): the record's hash must be the launch's key, and the plan digest must cover every launch."""
    env = {**aot_matrix._env(None), "CCE_DIST_AOT_CACHE": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", _KEYS_OF_THE_PLAN], cwd=aot_matrix.REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert len(got["keys"]) >= 15 and len(set(got["keys"])) == len(got["keys"])  # distinct specializations
    assert got["compiled"] == got["keys"][0]
    rows = [{"ok": True, "hash": k} for k in got["keys"]]
    assert aot_matrix.planned_digest(None, "sm_90", "each", "fwd") == aot_matrix.launch_digest(rows)
    assert aot_matrix.launch_digest(rows[1:]) != aot_matrix.launch_digest(rows)
    assert aot_matrix.launch_digest([*rows, {"ok": False}]) is None  # a failed launch has no key
