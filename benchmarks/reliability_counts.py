"""Count the README's Reliability figures by running the suites that hold them up.

    python -m benchmarks.reliability_counts                       # CI sizes: fuzz, faults, numerics
    CCE_FUZZ_EXAMPLES=10000 python -m benchmarks.reliability_counts --suites fuzz   # long fuzzing

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

Writes ``benchmarks/results/reliability_counts[_<tag>].json`` and ``.md`` (tag: ``long<N>`` in long
mode) with the machine, versions and commit, and prints the markdown. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import pytest

from benchmarks.common import REPO, close_env, env_info, md_table, write_results

SUITES = {
    "fuzz": ["tests/test_fuzz.py", "tests/test_fuzz_distill.py"],
    "faults": ["tests/test_faults.py"],
    "numerics": ["tests/test_numerics.py"],
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
    counts["tests"] = {o: sum(v == o for v in rec.outcomes.values()) for o in ("passed", "failed", "skipped")}
    counts["hangs"] = sum("did not finish within" in f for f in rec.failures.values())
    counts["failures"] = rec.failures
    return counts


def _markdown(payload: dict) -> str:
    c, env = payload["counts"], payload["env"]
    rows = []
    if "fuzz_cases" in c:
        fam = ", ".join(f"{k} {v}" for k, v in c["fuzz_cases_by_family"].items())
        rows.append(("cases fuzzed against the oracle", f"{c['fuzz_cases']} ({fam})"))
    if "faults_injected" in c:
        kinds = ", ".join(f"{v} {k}" for k, v in c["faults_by_kind"].items())
        rows.append(("faults injected on a process group", f"{c['faults_injected']} ({kinds})"))
    if "nonfinite_single_process_cases" in c:
        nf = c["nonfinite_single_process_cases"]
        total = sum(nf.values())
        rows.append(("non-finite single-process input cases", f"{total} (torch {nf['torch']}, triton {nf['triton']})"))
    rows.append(
        ("tests passed / failed / skipped", " / ".join(str(c["tests"][k]) for k in ("passed", "failed", "skipped")))
    )
    rows.append(("hangs", c["hangs"]))
    rows.append(("wall time of the whole run", f"{env['run_wall_s']} s"))
    md = [f"# Reliability counts ({payload['command']})", "", md_table(["figure", "count"], rows), ""]
    slow = sorted(payload["durations_s"].items(), key=lambda kv: -kv[1])[:8]
    md += ["Slowest tests (s):", "", md_table(["test", "s"], slow), ""]
    for nodeid, text in c["failures"].items():
        md += [f"## FAILED {nodeid}", "", "```", text, "```", ""]
    md += [
        "Environment:",
        "",
        f"- fuzz examples per property: {c.get('fuzz_examples_per_property')}",
        f"- CCE_SLOW: {os.environ.get('CCE_SLOW', '')!r}",
    ]
    from benchmarks.common import env_markdown

    md.append(env_markdown(env))
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--suites", default="fuzz,faults,numerics", help=f"comma-separated, of {sorted(SUITES)} (default: all three)"
    )
    ap.add_argument("--tag", default=None, help="result file suffix (default: long<N> in long mode, else none)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --), e.g. -k torch")
    args = ap.parse_args(argv)
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    bad = sorted(set(suites) - set(SUITES))
    if bad:
        ap.error(f"unknown suite(s) {bad}; choose from {sorted(SUITES)}")
    long = os.environ.get("CCE_FUZZ_EXAMPLES", "")
    tag = args.tag if args.tag is not None else (f"long{long}" if long else "")
    command = " ".join(
        filter(
            None,
            [
                f"CCE_FUZZ_EXAMPLES={long}" if long else "",
                "python -m benchmarks.reliability_counts",
                f"--suites {','.join(suites)}",
                " ".join(args.pytest_args) and "-- " + " ".join(args.pytest_args),
            ],
        )
    )
    started = time.perf_counter()
    env = env_info()
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
    name = "reliability_counts" + (f"_{tag}" if tag else "")
    md = _markdown(payload)
    write_results(name, payload, md)
    print(md)
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
