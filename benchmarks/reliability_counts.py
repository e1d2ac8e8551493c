"""Count the Reliability figures of docs/reliability.md by running the suites that hold them up.

    python -m benchmarks.reliability_counts                       # CI sizes: fuzz, faults, numerics
    CCE_FUZZ_EXAMPLES=10000 python -m benchmarks.reliability_counts --suites fuzz -- -k sharded   # long fuzzing

Runs ``pytest`` in this process on ``tests/test_fuzz.py`` and ``tests/test_fuzz_distill.py`` (the
``fuzz`` suite), ``tests/test_faults.py`` and
``tests/test_numerics.py`` (or the ``--suites`` given; extra arguments after ``--`` go to pytest)
and counts from what actually ran, never from constants alone:

- fuzzed cases: ``tests/test_fuzz.py`` counts every case it checked against the oracle and found
  right (``fuzz_common.CHECKED``, tests/fuzz_common.py, by property family: torch /
  triton-interpreter cross-entropy and logprobs, sharded torch / triton on 3 gloo ranks;
  ``tests/test_fuzz_distill.py`` adds torch / triton-interpreter distillation per divergence);
- faults injected on a process group: the case lists of ``tests/test_faults.py``
  (``ERROR_CASES``, ``NONFINITE_CASES``, ``DEATHS``, ``STALLS``, the head-dtype case), each counted
  only when the test that injects it passed;
- non-finite single-process cases: the passed items of
  ``test_numerics.py::test_nonfinite_inputs_propagate_like_the_materialized_loss``;
- every test's outcome and wall time (in long mode pytest-timeout's per-test limit is lifted unless
  ``--timeout=`` is passed), the failures (a hang is a failure: the spawn deadline of
  ``tests/dist_utils.py`` turns it into a ``TimeoutError``), and the whole run's wall time.

Each suite has one result file, ``benchmarks/results/reliability_<suite>.json`` and its ``.md``
(regenerated from the JSON): one entry per run tag, with the command, commit, date, counts, test
outcomes, wall times, machine and versions. A run replaces the entry of its tag. The tag names what
was run: ``ci`` or ``long<N>`` (``CCE_FUZZ_EXAMPLES=N``), plus the ``-k`` selection; ``--tag``
overrides it. Prints the markdown of each suite written. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common import REPO, RESULTS, close_env, env_info, env_markdown, md_table

SUITES = {
    "fuzz": ["tests/test_fuzz.py", "tests/test_fuzz_distill.py"],
    "faults": ["tests/test_faults.py"],
    "numerics": ["tests/test_numerics.py"],
}
# the keys of _count's result that belong to each suite's entry
_SUITE_COUNTS = {
    "fuzz": ("fuzz_cases_by_family", "fuzz_cases", "fuzz_examples_per_property"),
    "faults": ("faults_by_kind", "faults_injected"),
    "numerics": ("nonfinite_single_process_cases",),
}


class _Recorder:
    """pytest plugin: each test's outcome and duration, and the test modules that ran."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.failures: dict[str, str] = {}
        self.modules: dict[str, Any] = {}

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            self.modules[item.module.__name__] = item.module

    def pytest_runtest_logreport(self, report) -> None:
        nodeid = report.nodeid
        self.durations[nodeid] = self.durations.get(nodeid, 0.0) + report.duration
        if report.when == "call" or report.outcome != "passed":
            # a setup/teardown error or skip also decides the outcome
            if self.outcomes.get(nodeid) in (None, "passed"):
                self.outcomes[nodeid] = report.outcome
            if report.failed:
                text = str(report.longrepr)
                self.failures[nodeid] = "\n".join(text.splitlines()[-60:])

    def passed(self, prefix: str) -> list[str]:
        return [n for n, o in self.outcomes.items() if o == "passed" and n.split("::", 1)[-1].startswith(prefix)]


def _count(rec: _Recorder) -> dict:
    counts: dict[str, Any] = {}
    # both fuzz modules count into the CHECKED of the module they import it from
    fuzz = sys.modules.get("fuzz_common") if {"test_fuzz", "test_fuzz_distill"} & set(rec.modules) else None
    if fuzz is not None:
        checked = dict(sorted(fuzz.CHECKED.items()))
        counts["fuzz_cases_by_family"] = checked
        counts["fuzz_cases"] = sum(checked.values())
        counts["fuzz_examples_per_property"] = fuzz.LONG or "CI (fixed, derandomized)"
    faults = rec.modules.get("test_faults")
    if faults is not None:
        by_kind = {}
        if rec.passed("test_rank_local_faults"):
            by_kind["rank-local input errors"] = len(faults.ERROR_CASES)
            by_kind["one-rank NaN/Inf"] = len(faults.NONFINITE_CASES)
        if rec.passed("test_rank_dies_mid_step"):
            by_kind["rank deaths"] = len(faults.DEATHS)
        if rec.passed("test_rank_stalls"):
            by_kind["stalls"] = len(faults.STALLS)
        if rec.passed("test_head_dtype_differs"):
            by_kind["head-dtype mismatch"] = 1
        counts["faults_by_kind"] = by_kind
        counts["faults_injected"] = sum(by_kind.values())
    numerics = rec.modules.get("test_numerics")
    if numerics is not None:
        items = rec.passed("test_nonfinite_inputs_propagate_like_the_materialized_loss")
        counts["nonfinite_single_process_cases"] = {
            impl: sum(f"-{impl}]" in n for n in items) for impl in ("torch", "triton")
        }
    counts["failures"] = rec.failures
    return counts


def default_tag(examples: str, pytest_args: list[str]) -> str:
    """``ci`` or ``long<N>``, plus the ``-k`` expression as a slug: what was run, not when."""
    tag = f"long{examples}" if examples else "ci"
    for i, arg in enumerate(pytest_args):
        if arg == "-k" and i + 1 < len(pytest_args):
            expr = pytest_args[i + 1]
        elif arg.startswith("-k") and len(arg) > 2:
            expr = arg[2:]
        else:
            continue
        tag += "_" + re.sub(r"[^a-z0-9]+", "_", expr.lower()).strip("_")
    return tag


def _suite_of(nodeid: str) -> str | None:
    path = nodeid.split("::", 1)[0]
    return next((s for s, paths in SUITES.items() if path in paths), None)


def suite_entries(payload: dict, tag: str, note: str = "") -> dict[str, dict]:
    """One entry per suite that ran, from a run's payload (command, exit_status, counts, outcomes,
    durations_s, env)."""
    entries = {}
    counts, env = payload["counts"], payload["env"]
    for suite in SUITES:
        outcomes = {n: o for n, o in payload["outcomes"].items() if _suite_of(n) == suite}
        if not outcomes:
            continue
        failures = {n: t for n, t in counts["failures"].items() if n in outcomes}
        durations = {n: s for n, s in payload["durations_s"].items() if n in outcomes}
        entries[suite] = {
            "tag": tag,
            "command": payload["command"],
            "commit": env["git_commit"],
            "date": env["date"],
            "counts": {k: counts[k] for k in _SUITE_COUNTS[suite] if k in counts},
            "tests": {o: sum(v == o for v in outcomes.values()) for o in ("passed", "failed", "skipped")},
            "hangs": sum("did not finish within" in t for t in failures.values()),
            "suite_wall_s": round(sum(durations.values()), 1),
            "run_wall_s": env.get("run_wall_s"),
            "exit_status": payload["exit_status"],
            "note": note,
            "outcomes": outcomes,
            "durations_s": durations,
            "failures": failures,
            "env": env,
        }
    return entries


def record(suite: str, entry: dict, results: Path = RESULTS) -> dict:
    """Write ``entry`` into ``results/reliability_<suite>.json`` (replacing the entry of its tag) and
    regenerate ``.md`` from the JSON; returns the suite's document."""
    path = results / f"reliability_{suite}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"suite": suite, "tests": SUITES[suite], "runs": []}
    runs = [r for r in doc["runs"] if r["tag"] != entry["tag"]] + [entry]
    doc["runs"] = sorted(runs, key=lambda r: (r["date"], r["tag"]))
    results.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    path.with_suffix(".md").write_text(markdown(doc))
    return doc


def _counted(suite: str, c: dict) -> str:
    if suite == "fuzz" and "fuzz_cases" in c:
        return f"{c['fuzz_cases']} ({', '.join(f'{k} {v}' for k, v in c['fuzz_cases_by_family'].items())})"
    if suite == "faults" and "faults_injected" in c:
        return f"{c['faults_injected']} ({', '.join(f'{v} {k}' for k, v in c['faults_by_kind'].items())})"
    if suite == "numerics" and "nonfinite_single_process_cases" in c:
        nf = c["nonfinite_single_process_cases"]
        return f"{sum(nf.values())} (torch {nf['torch']}, triton {nf['triton']})"
    return "-"


_COUNTED = {
    "fuzz": "cases fuzzed against the oracle and right, by family",
    "faults": "faults injected on a process group, by kind",
    "numerics": "non-finite single-process input cases",
}


def markdown(doc: dict) -> str:
    suite = doc["suite"]
    md = [
        f"# Reliability runs: {suite} ({', '.join(f'`{t}`' for t in doc['tests'])})",
        "",
        f"Generated from `reliability_{suite}.json` by `python -m benchmarks.reliability_counts`: one entry",
        "per run tag (what was run), a newer run of a tag replacing the older. Wall time: the suite's",
        "tests / the whole run.",
        "",
    ]
    rows = [
        (
            f"`{r['tag']}`",
            f"`{r['command']}`",
            r["commit"],
            r["date"][:10],
            _counted(suite, r["counts"]),
            " / ".join(str(r["tests"][k]) for k in ("passed", "failed", "skipped")),
            f"{r['suite_wall_s']} / {r['run_wall_s']} s",
        )
        for r in doc["runs"]
    ]
    md += [md_table(["tag", "command", "commit", "date", _COUNTED[suite], "passed / failed / skipped", "wall"], rows)]
    for r in doc["runs"]:
        md += ["", f"## {r['tag']}", ""]
        if r.get("note"):
            md += [r["note"], ""]
        if "fuzz_examples_per_property" in r["counts"]:
            md.append(f"- fuzz examples per property: {r['counts']['fuzz_examples_per_property']}")
        md.append(f"- hangs: {r['hangs']}; exit status {r['exit_status']}; CCE_SLOW: {r['env'].get('cce_slow', '')!r}")
        md.append(env_markdown(r["env"]).rstrip("\n"))
        slow = sorted(r["durations_s"].items(), key=lambda kv: -kv[1])[:5]
        md += ["", "Slowest tests (s):", "", md_table(["test", "s"], slow)]
        for nodeid, text in r["failures"].items():
            md += ["", f"FAILED `{nodeid}`:", "", "```", "\n".join(text.splitlines()[-25:]), "```"]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--suites", default="fuzz,faults,numerics", help=f"comma-separated, of {sorted(SUITES)} (default: all three)"
    )
    ap.add_argument("--tag", default=None, help="the entry's tag (default: ci or long<N>, plus the -k selection)")
    ap.add_argument("--note", default="", help="a line recorded with the entry (e.g. what a rerun follows)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --), e.g. -k torch")
    args = ap.parse_args(argv)
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    bad = sorted(set(suites) - set(SUITES))
    if bad:
        ap.error(f"unknown suite(s) {bad}; choose from {sorted(SUITES)}")
    long = os.environ.get("CCE_FUZZ_EXAMPLES", "")
    tag = args.tag if args.tag is not None else default_tag(long, args.pytest_args)
    command = " ".join(
        filter(
            None,
            [
                f"CCE_FUZZ_EXAMPLES={long}" if long else "",
                "python -m benchmarks.reliability_counts",
                f"--suites {','.join(suites)}",
                f"--tag {args.tag}" if args.tag is not None else "",
                "-- " + shlex.join(args.pytest_args) if args.pytest_args else "",
            ],
        )
    )
    started = time.perf_counter()
    env = env_info(cce_slow=os.environ.get("CCE_SLOW", ""))
    rec = _Recorder()
    os.chdir(REPO)
    extra = list(args.pytest_args)
    if long and not any(a.startswith("--timeout") for a in extra):
        extra.append("--timeout=0")  # pyproject's 600 s per test would cut a long property short
    rc = pytest.main(
        ["-q", "-p", "no:cacheprovider", *[path for s in suites for path in SUITES[s]], *extra], plugins=[rec]
    )
    payload = {
        "command": command,
        "exit_status": int(rc),
        "counts": _count(rec),
        "outcomes": rec.outcomes,
        "durations_s": {k: round(v, 2) for k, v in rec.durations.items()},
        "env": close_env(env, started),
    }
    for suite, entry in suite_entries(payload, tag, args.note).items():
        print(markdown(record(suite, entry)))
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
