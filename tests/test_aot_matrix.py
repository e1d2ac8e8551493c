"""``benchmarks.aot_matrix``: each cell of the spill report says which commit and which kernel sources it was compiled
from, a cell whose sources differ from the tree's is marked stale (not evidence for this commit) and recompiled on
the next run, and the rows and offenders are rendered from the cells' records."""

from __future__ import annotations

import json
import pathlib
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
    md = aot_matrix.render(tmp_path, "full", VERSIONS, "fwd")
    table = _table(md)
    assert table["sm_90"][-1] == "`012345678`" and table["sm_90"][2:5] == ["1", "0", "0 B"]
    assert table["sm_80"][-1] == "`012345678` (stale: kernels changed since)" and table["sm_80"][4] == "24 B"
    assert table["sm_100"][-1] == "unrecorded (stale)"
    assert table["sm_120"][-1] == "`012345678` + uncommitted kernel changes"
    assert table["sm_86"][2] == "not compiled" and len(table["sm_86"]) == len(table["sm_90"])
    # a cell carried over a change to config rules only (its launches checked unchanged): named with both commits
    carried = {**prov, "carried": {"from_kernels": "old", "to_commit": "fedcba9876543210"}}
    (tmp_path / "c").mkdir()
    _write(tmp_path / "c", "sm_86", [_row("bf16/paper/fwd:plain/_row_stats_kernel")], carried)
    assert _table(aot_matrix.render(tmp_path / "c", "full", VERSIONS, "fwd"))["sm_86"][-1] == (
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
    assert aot_matrix.is_fresh(cell, fp) and not aot_matrix.is_fresh(cell, "other")
    aot_matrix._provenance(cell).unlink()
    assert not aot_matrix.is_fresh(cell, fp)  # compiled before provenance was recorded
    assert not aot_matrix.is_fresh(tmp_path / "missing.json", fp)


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
