"""Spills and shared memory of every enumerated kernel, per Triton version and GPU target, without a GPU.

Question: with which Triton versions (the supported range, ``cce_dist.kernels.TRITON_RANGE``) and on which targets
(``kernels.config.KNOWN_DEVICES``) does a launch the library can make spill registers, and which one?

For each Triton (the installed one, and each ``--triton VERSION=DIR`` installed beside it with ``pip install
--target DIR triton==VERSION``) and each target, a subprocess with ``DIR`` first on ``PYTHONPATH`` and
``TRITON_INTERPRET`` unset runs ``python -m cce_dist.kernels.aot --matrix all --level LEVEL``: the launches the
planners make for the flag sets of ``LEVEL`` (``kernels.aot.LEVELS``: ``full`` is every flag set, ``triples`` /
``pairs`` a covering set in which every triple / pair of flag values occurs; ``--matrix fwd`` etc. one family),
reduced to distinct specializations, compiled with that Triton's ptxas. Each cell's rows are kept in ``--work`` (one
JSON per Triton x target x level x matrix, beside it its provenance: the commit and the fingerprint of
``cce_dist/kernels``' code it was compiled from, comments and docstrings left out, and the digest of the launches it
compiled, their Triton cache keys). A work folder lives as long as a session; what lasts is the report's ledger,
committed beside it (``--out``'s ``.json``: per cell its summary and provenance), into which every cell compiled is
folded and from which the report is rendered, so cells compiled in different sessions make one report.

A cell is compiled unless the ledger holds it compiled from the tree's kernel code (``--force``: compiled anyway; a
recompile of unchanged launches reads their records from ``kernels.aot.cache_dir``, so it costs the planning only).
A cell compiled from other kernel code is marked stale in the report: it is not evidence for this commit. With
``--replan`` the ledger's cells of each ``--triton`` are first planned again (no compile) at the tree's code, and a
stale cell whose launches are the same (a change to config rules that does not touch that Triton and target) is
carried: named with both commits, no longer stale:

    python -m benchmarks.aot_matrix --level triples --replan \\
        --triton 3.6.0=~/.cache/cce_dist/triton-3.6.0 --triton 3.7.1=~/.cache/cce_dist/triton-3.7.1 \\
        --triton 3.8.0=~/.cache/cce_dist/triton-3.8.0 --triton installed \\
        --out benchmarks/results/aot_spills_triples.md
    python -m benchmarks.aot_matrix --render-only --level triples --out benchmarks/results/aot_spills_triples.md

At most ``--jobs`` (default 2) compiler processes run at a time. Writes ``--out`` (markdown) and its ledger, and
nothing else besides the work folder.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

from cce_dist.kernels.aot import LEVELS, MATRICES, SPILL_BOUND

REPO = pathlib.Path(__file__).resolve().parents[1]
TARGETS = ("sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
LIMITS = {"sm_80": 166_912, "sm_86": 101_376, "sm_90": 232_448, "sm_100": 232_448, "sm_120": 101_376}


def _env(path: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    env["PYTHONPATH"] = os.pathsep.join([p for p in (path, str(REPO), env.get("PYTHONPATH")) if p])
    return env


def _probe(path: str | None) -> dict[str, str]:
    """Version of the Triton in ``path`` (None: the installed one) and of its ptxas binaries."""
    code = "import triton, os; print(triton.__version__); print(os.path.dirname(triton.__file__))"
    out = subprocess.run([sys.executable, "-c", code], env=_env(path), capture_output=True, text=True, check=True)
    version, root = out.stdout.split()
    ptxas = {}
    for name in ("ptxas", "ptxas-blackwell"):
        exe = pathlib.Path(root, "backends", "nvidia", "bin", name)
        if exe.exists():
            text = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=False).stdout
            m = re.search(r"release ([\d.]+), (V[\d.]+)", text)
            ptxas[name] = m.group(2) if m else text.strip().splitlines()[-1]
    return {"version": version, "ptxas": ", ".join(f"{k} {v}" for k, v in ptxas.items())}


def _cell(work: pathlib.Path, version: str, target: str, level: str, matrix: str = "all") -> pathlib.Path:
    return work / f"{version}-{target}-{level}{'' if matrix == 'all' else '-' + matrix}.json"


def _code_of(source: bytes) -> bytes:
    """The code of a Python module without its comments, docstrings and layout: its syntax tree with every statement
    that is a bare string literal removed, dumped without positions (so a comment or docstring edit keeps it)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                kept = [
                    s
                    for s in stmts
                    if not (
                        isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)
                    )
                ]
                setattr(node, field, kept or [ast.Pass()])
    return ast.dump(tree).encode()


def kernels_fingerprint(repo: pathlib.Path = REPO) -> str:
    """Hash of the code that decides what a cell compiles and what it records: ``cce_dist/kernels/*.py`` (the
    kernels, their configs and planners, the enumeration of ``kernels.aot``, the cubin reader), comments and
    docstrings left out (:func:`_code_of`): documenting a rule does not make hours of compiled cells stale."""
    h = hashlib.sha256()
    for f in sorted((repo / "cce_dist" / "kernels").glob("*.py")):
        h.update(f.name.encode() + b"\0" + _code_of(f.read_bytes()) + b"\0")
    return h.hexdigest()[:16]


def _provenance(cell: pathlib.Path) -> pathlib.Path:
    return cell.with_name(cell.stem + ".provenance.json")


def read_provenance(cell: pathlib.Path) -> dict | None:
    """``{commit, dirty, kernels, compiled_utc}`` of a cell (``dirty``: uncommitted changes under cce_dist/kernels;
    ``kernels``: :func:`kernels_fingerprint`), or None for a cell compiled before provenance was recorded."""
    p = _provenance(cell)
    return json.loads(p.read_text()) if p.exists() else None


def is_fresh(prov: dict | None, fingerprint: str) -> bool:
    """A cell with provenance ``prov`` (None: none recorded) was compiled from, or carried to, the kernel code whose
    fingerprint is ``fingerprint``."""
    return prov is not None and prov.get("kernels") == fingerprint


def _head(repo: pathlib.Path = REPO) -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()


def _git_status(*pathspec: str, repo: pathlib.Path = REPO) -> str:
    """Uncommitted changes to tracked files under ``pathspec``."""
    cmd = ["git", "status", "--porcelain", "--untracked-files=no", "--", *pathspec]
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True).stdout.strip()


def _compiled_at(prov: dict, fingerprint: str) -> str:
    at = f"`{prov['commit'][:9]}`" + (" + uncommitted kernel changes" if prov.get("dirty") else "")
    if not is_fresh(prov, fingerprint):
        return f"{at} (stale: kernels changed since)"
    carried = prov.get("carried")  # its launches re-planned unchanged at a later commit (see replan)
    return f"{at}, same launches at `{carried['to_commit'][:9]}`" if carried and carried.get("to_commit") else at


def compile_cell(
    path: str | None, version: str, target: str, level: str, work: pathlib.Path, jobs: int, matrix: str = "all"
) -> None:
    """Compile the ``matrix`` (``kernels.aot.MATRICES``) of ``target`` with the Triton in ``path`` into ``work``'s
    cell file, and record its provenance (raises if the kernel sources changed during the compile)."""
    out = _cell(work, version, target, level, matrix)
    tmp = out.with_suffix(".tmp")
    before, commit = kernels_fingerprint(), _head()
    dirty = bool(_git_status("cce_dist/kernels"))
    cmd = [sys.executable, "-m", "cce_dist.kernels.aot", "--target", target, "--matrix", matrix, "--level", level]
    cmd += ["--jobs", str(jobs), "--json", str(tmp)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(path), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{version} {target}: {proc.stderr[-3000:]}")
    if kernels_fingerprint() != before:
        raise RuntimeError(f"{version} {target}: cce_dist/kernels changed during the compile; not recorded")
    os.replace(tmp, out)
    stamp = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
    rows = json.loads(out.read_text())
    prov = {"commit": commit, "dirty": dirty, "kernels": before, "compiled_utc": stamp, "launches": launch_digest(rows)}
    _provenance(out).write_text(json.dumps(prov))


def launch_digest(rows: list[dict]) -> str | None:
    """Digest of the set of launches a cell compiled: their Triton cache keys (``hash``, which is
    ``kernels.aot.launch_key``: source, constexprs, specialization, options, target). Two plans with one digest compile
    the same kernels. None when a launch failed (it has no key)."""
    if not all(r["ok"] for r in rows):
        return None
    return _digest(r["hash"] for r in rows)


def _digest(keys) -> str:
    return hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:16]


#: Run in a subprocess with a Triton first on the path: plans a cell (no compile) and prints the key
#: ``kernels.aot.plan`` computes for each launch, one a line.
_PLAN_KEYS = """
import sys
from cce_dist.kernels import aot, config
keys, key_of = set(), aot.launch_key
aot.launch_key = lambda *a: (k := key_of(*a), keys.add(k))[0]
target, matrix, level = sys.argv[1:4]
aot.plan(config.KNOWN_DEVICES[target], aot.MATRICES[matrix], level)
print("\\n".join(sorted(keys)))
"""


def planned_digest(path: str | None, target: str, level: str, matrix: str) -> str:
    """:func:`launch_digest` of what the tree plans for the cell today with the Triton in ``path`` (no compile)."""
    cmd = [sys.executable, "-c", _PLAN_KEYS, target, matrix, level]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(path), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"planning {target}: {proc.stderr[-3000:]}")
    return _digest(proc.stdout.split())


def summarize(rows: list[dict], target: str) -> dict:
    """Counts, maxima and offenders of one cell (offending launches described in words: what a report keeps)."""
    ok = [r for r in rows if r["ok"]]

    def worst(sel):
        return max((r["stack"] + r["local"] for r in sel), default=0)

    strict = [r for r in ok if not r["label"].startswith("fp32/")]
    ieee = [r for r in ok if r["label"].startswith("fp32/")]
    ragged = [r for r in ok if "/ragged/" in r["label"] and not r["label"].startswith("fp32/")]
    spilling = [r for r in ok if r["stack"] + r["local"] > 0]
    return {
        "kernels": len(rows),
        "failed": [f"{r['label']}: {r['error'][:200]}" for r in rows if not r["ok"]],
        "max_spill": worst(strict),
        "max_spill_ieee": worst(ieee),
        "max_spill_ragged": worst(ragged),
        "max_shared": max((r["shared"] for r in ok), default=0),
        "over_shared": [r["label"] for r in ok if r["shared"] > LIMITS[target]],
        "over_bound": [_describe(r) for r in spilling if r["stack"] + r["local"] > SPILL_BOUND],
        "within_bound": [_describe(r) for r in spilling if r["stack"] + r["local"] <= SPILL_BOUND],
    }


def _describe(r: dict) -> str:
    c = r["constexprs"]
    tile = f"{c.get('BLOCK_N')}x{c.get('BLOCK_V')}x{c.get('BLOCK_D')}"
    cap = f"r{r['maxnreg']}" if r.get("maxnreg") else ""
    return f"`{r['label']}` {tile} w{r['num_warps']}s{r['num_stages']}{cap}: {r['stack'] + r['local']} B"


def ledger_path(out: pathlib.Path) -> pathlib.Path:
    """The report's ledger, committed beside it (``aot_spills_full_fwd.md`` -> ``.json``): per Triton and target the
    cell's summary and provenance. The report is rendered from it, so cells compiled in earlier sessions (whose work
    folders are gone) stay in it, and a new cell is added to them."""
    return out.with_suffix(".json")


def load_ledger(path: pathlib.Path) -> dict:
    """``{"versions": {VERSION: {version, ptxas}}, "cells": {"VERSION/TARGET": {"summary", "provenance"}}}``."""
    return json.loads(path.read_text()) if path.exists() else {"versions": {}, "cells": {}}


def fold(ledger: dict, work: pathlib.Path, level: str, matrix: str = "all") -> list[str]:
    """Fold the cells in ``work`` into ``ledger`` (in place): a cell replaces the ledger's record of its Triton and
    target unless that record is as recent (the same compile, perhaps carried since) or newer. Returns the keys
    folded."""
    folded = []
    for v in sorted(ledger["versions"]):
        for t in TARGETS:
            f = _cell(work, v, t, level, matrix)
            prov = read_provenance(f) if f.exists() else None
            if prov is None:
                continue
            old = ledger["cells"].get(f"{v}/{t}")
            if old is not None and old["provenance"].get("compiled_utc", "") >= prov["compiled_utc"]:
                continue
            rows = json.loads(f.read_text())
            prov.setdefault("launches", launch_digest(rows))  # a cell compiled before digests were recorded
            ledger["cells"][f"{v}/{t}"] = {"summary": summarize(rows, t), "provenance": prov}
            folded.append(f"{v}/{t}")
    return folded


def replan(ledger: dict, path: str | None, version: str, targets: list[str], level: str, matrix: str) -> list[str]:
    """Re-plan (no compile) the ledger's cells of Triton ``version`` (installed in ``path``) on ``targets`` at the
    tree's code, and compare the launches with those the cell compiled (:func:`launch_digest`):

    - a cell compiled from other kernel code whose launches are the same (a change to config rules or planners that
      plans nothing new for that Triton and target) is carried: fresh, named with both commits;
    - a fresh cell without a digest (migrated from a report) gets one;
    - otherwise the difference is reported: the cell must be compiled again. Returns one line per cell."""
    fingerprint, head = kernels_fingerprint(), _head()
    said = []
    for t in targets:
        rec = ledger["cells"].get(f"{version}/{t}")
        if rec is None:
            continue
        prov, digest = rec["provenance"], planned_digest(path, t, level, matrix)
        if is_fresh(prov, fingerprint) and prov.get("launches") in (None, digest):
            said.append(f"{version} {t}: fresh" + ("" if prov.get("launches") else ", digest recorded"))
            prov["launches"] = digest
        elif not is_fresh(prov, fingerprint) and prov.get("launches") == digest:
            prov["carried"] = {"from_kernels": prov["kernels"], "to_commit": head}
            prov["kernels"] = fingerprint
            said.append(f"{version} {t}: same launches at {head[:9]}: carried")
        elif prov.get("launches") is None:
            said.append(f"{version} {t}: stale, and compiled without a launch digest to compare: compile it again")
        else:
            said.append(f"{version} {t}: launches differ from those compiled ({prov.get('launches')} -> {digest})")
    return said


def render(ledger: dict, level: str, matrix: str = "all") -> str:
    """The markdown report of the cells in ``ledger`` (of ``level`` and ``matrix``)."""
    versions = ledger["versions"]
    commit, fingerprint = _head(), kernels_fingerprint()
    # a change to the results files (another render) does not change what was compiled
    dirty = _git_status(".", ":!benchmarks/results")
    lines = [
        "# Register spills of the cce_dist kernels per Triton version and target (generated)",
        "",
        f"Generated by `python -m benchmarks.aot_matrix --level {level}"
        + ("" if matrix == "all" else f" --matrix {matrix}")
        + "` on "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC at commit `{commit}`"
        + (" (with uncommitted changes)" if dirty else "")
        + ". No GPU: each launch is compiled with the Triton's own ptxas for the target "
        "(`cce_dist.kernels.aot`). Flag sets: "
        + {
            "full": "every flag set the planners take (the product of their axes).",
            "triples": "a covering set (`kernels.aot.LEVELS`): every triple of flag values (mode, shape, bias, "
            "softcap, temperature, statistics / row outputs, filtering, class weights, gradients wanted, "
            "deterministic, schedule, divergence, hard label) occurs in some compiled flag set, plus the plain and "
            "heavy flag sets of each mode at each shape per schedule / divergence and every config the planners "
            "select.",
            "pairs": "a covering set (`kernels.aot.LEVELS`): every pair of flag values (mode, shape, bias, softcap, "
            "temperature, statistics / row outputs, filtering, class weights, gradients wanted, deterministic, "
            "schedule, divergence, hard label) occurs in some compiled flag set, plus the plain and heavy flag sets "
            "of each mode per schedule / divergence and every config the planners select.",
            "each": "the covering subset CI compiles (`kernels.aot.LEVELS`): every value of every axis (mode, shape, "
            "bias, softcap, temperature, statistics / row outputs, filtering, class weights, gradients wanted, "
            "deterministic, schedule, divergence, hard label), every kernel, every constexpr value (in every "
            "cross-entropy kernel), every config the planners select, and every feature on at once (bf16).",
        }[level]
        + ("" if matrix == "all" else f" Kernels: {', '.join(MATRICES[matrix])} only.")
        + " The launches are reduced to distinct specializations (Triton's cache key). Each cell names the commit it "
        "was compiled at; one compiled from other kernel code (`cce_dist/kernels/*.py`, comments aside) than this "
        "commit's is marked stale: it is not evidence for this commit. A cell named with a later commit too ('same "
        "launches at') was compiled before a change to config rules or planners only, and shown to plan the same "
        "launches at the later commit: planned again (`--replan`: the same Triton cache keys), or, where only config "
        "functions changed, their every output for the cell's target and Triton compared equal.",
        "",
        f"Spill bound (`cce_dist.kernels.aot.SPILL_BOUND`, asserted by tests/test_aot_compile.py): {SPILL_BOUND} B "
        "for every launch: bf16 / fp16 / TF32 (and the TF32 teacher) on tensor cores and fp32 IEEE (FMA dot), at "
        "every shape, the ragged ones (D = 2303 / 2047: rows not 16-byte aligned) included. `r255`: a launch with "
        "`maxnreg=255` (ptxas's register cap; otherwise its own occupancy heuristic).",
        "",
        "| Triton | ptxas |",
        "|---|---|",
    ]
    for v, info in sorted(versions.items()):
        lines.append(f"| {v} | {info.get('ptxas', '?')} |")
    lines += [
        "",
        "| Triton | target | kernels | failed | max spill (bf16/fp16/TF32) | max spill fp32 IEEE | "
        "max spill ragged | max shared (limit) | over a bound | compiled at |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    details = []
    for v in sorted(versions):
        for t in TARGETS:
            rec = ledger["cells"].get(f"{v}/{t}")
            if rec is None:
                lines.append(f"| {v} | {t} | not compiled | | | | | | | |")
                continue
            s = rec["summary"]
            lines.append(
                f"| {v} | {t} | {s['kernels']} | {len(s['failed'])} | {s['max_spill']} B | {s['max_spill_ieee']} B | "
                f"{s['max_spill_ragged']} B | {s['max_shared']} ({LIMITS[t]}) | "
                f"{len(s['over_bound']) + len(s['over_shared'])} | {_compiled_at(rec['provenance'], fingerprint)} |"
            )
            for r in s["over_bound"]:
                details.append(f"- {v} {t}: over its bound: {r}")
            for label in s["over_shared"]:
                details.append(f"- {v} {t}: shared memory over the limit: `{label}`")
            for e in s["failed"]:
                details.append(f"- {v} {t}: failed: {e}")
            for r in s["within_bound"]:
                details.append(f"- {v} {t}: within its bound: {r}")
    lines += ["", "## Spilling, failing or oversized kernels", ""] + (details or ["None."])
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--triton", action="append", default=[], help="VERSION=DIR, or 'installed'")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--level", default="pairs", choices=LEVELS)
    ap.add_argument("--matrix", default="all", choices=tuple(MATRICES), help="which kernel families")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--work", default=str(pathlib.Path.home() / ".cache" / "cce_dist" / "aot_matrix"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "aot_spills.md"))
    ap.add_argument("--force", action="store_true", help="recompile cells, fresh ones too")
    ap.add_argument("--render-only", action="store_true", help="compile nothing; render the ledger (and --work)")
    ap.add_argument(
        "--replan",
        action="store_true",
        help="re-plan the ledger's cells first; carry those whose launches are unchanged",
    )
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    ledger = load_ledger(ledger_path(out))
    work = pathlib.Path(a.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    meta_file = work / "versions.json"
    if meta_file.exists():
        ledger["versions"].update(json.loads(meta_file.read_text()))
    targets, fingerprint = a.targets.split(","), kernels_fingerprint()

    def save() -> None:
        fold(ledger, work, a.level, a.matrix)
        ledger_path(out).write_text(json.dumps(ledger, indent=1, sort_keys=True) + "\n")
        out.write_text(render(ledger, a.level, a.matrix))

    save()
    for spec in (a.triton or ["installed"]) if a.replan or not a.render_only else []:
        path = None if spec == "installed" else os.path.expanduser(spec.split("=", 1)[1])
        info = _probe(path)
        ledger["versions"][info["version"]] = info
        meta_file.write_text(json.dumps(ledger["versions"], indent=1))
        if a.replan:
            for line in replan(ledger, path, info["version"], targets, a.level, a.matrix):
                print(line, flush=True)
            save()
        if a.render_only:
            continue
        for t in targets:
            rec = ledger["cells"].get(f"{info['version']}/{t}")
            if rec is not None and is_fresh(rec["provenance"], fingerprint) and not a.force:
                continue
            print(f"compiling Triton {info['version']} {t} ({a.level}, {a.matrix})", flush=True)
            compile_cell(path, info["version"], t, a.level, work, a.jobs, a.matrix)
            save()
    print(f"wrote {out} and {ledger_path(out)}")


if __name__ == "__main__":
    main()
