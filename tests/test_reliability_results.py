"""benchmarks.reliability_counts keeps one entry per run tag in each suite's result file."""

import json

from benchmarks.reliability_counts import default_tag, record, suite_entries


def _payload(date: str, commit: str, cases: int, failed: bool = False) -> dict:
    outcome = "failed" if failed else "passed"
    return {
        "command": "CCE_FUZZ_EXAMPLES=10 python -m benchmarks.reliability_counts --suites fuzz,faults",
        "exit_status": int(failed),
        "counts": {
            "fuzz_cases_by_family": {"torch cross-entropy": cases},
            "fuzz_cases": cases,
            "fuzz_examples_per_property": 10,
            "faults_by_kind": {"rank deaths": 4},
            "faults_injected": 4,
            "failures": {"tests/test_fuzz.py::test_fuzz_cross_entropy_torch": "boom"} if failed else {},
        },
        "outcomes": {
            "tests/test_fuzz.py::test_fuzz_cross_entropy_torch": outcome,
            "tests/test_faults.py::test_rank_dies_mid_step": "passed",
        },
        "durations_s": {
            "tests/test_fuzz.py::test_fuzz_cross_entropy_torch": 2.0,
            "tests/test_faults.py::test_rank_dies_mid_step": 3.0,
        },
        "env": {
            "date": date,
            "git_commit": commit,
            "machine": {"cpu_model": "cpu", "cores": 2, "ram_gib": 1.0},
            "python": "3.11",
            "torch": "2.13",
            "cce_dist": "0.1.0",
            "torch_num_threads": 2,
            "run_wall_s": 6.0,
        },
    }


def _write(tmp_path, payload: dict, tag: str) -> None:
    for suite, entry in suite_entries(payload, tag).items():
        record(suite, entry, results=tmp_path)


def _runs(tmp_path, suite: str) -> list[dict]:
    return json.loads((tmp_path / f"reliability_{suite}.json").read_text())["runs"]


def test_a_rerun_of_a_tag_replaces_its_entry(tmp_path):
    _write(tmp_path, _payload("2026-12-01T00:00:00+00:00", "aaaaaaa", 7, failed=True), "long10_torch")
    _write(tmp_path, _payload("2026-12-02T00:00:00+00:00", "bbbbbbb", 10), "long10_torch")
    (run,) = _runs(tmp_path, "fuzz")
    assert (run["tag"], run["commit"], run["date"]) == ("long10_torch", "bbbbbbb", "2026-12-02T00:00:00+00:00")
    assert run["counts"] == {
        "fuzz_cases_by_family": {"torch cross-entropy": 10},
        "fuzz_cases": 10,
        "fuzz_examples_per_property": 10,
    }
    assert run["tests"] == {"passed": 1, "failed": 0, "skipped": 0} and run["failures"] == {}
    assert run["suite_wall_s"] == 2.0 and run["run_wall_s"] == 6.0
    assert run["env"]["torch"] == "2.13" and run["env"]["machine"]["cores"] == 2
    # the same run's faults went to the faults file only, with that suite's counts and tests
    (faults,) = _runs(tmp_path, "faults")
    assert faults["counts"] == {"faults_by_kind": {"rank deaths": 4}, "faults_injected": 4}
    assert list(faults["outcomes"]) == ["tests/test_faults.py::test_rank_dies_mid_step"]
    assert not (tmp_path / "reliability_numerics.json").exists()
    assert "bbbbbbb" in (tmp_path / "reliability_fuzz.md").read_text()
    assert "aaaaaaa" not in (tmp_path / "reliability_fuzz.md").read_text()


def test_different_tags_keep_one_entry_each(tmp_path):
    _write(tmp_path, _payload("2026-12-02T00:00:00+00:00", "bbbbbbb", 10), "long10_b")
    _write(tmp_path, _payload("2026-12-01T00:00:00+00:00", "aaaaaaa", 7, failed=True), "long10_a")
    runs = _runs(tmp_path, "fuzz")
    assert [(r["tag"], r["commit"]) for r in runs] == [("long10_a", "aaaaaaa"), ("long10_b", "bbbbbbb")]  # by date
    assert runs[0]["tests"]["failed"] == 1
    assert runs[0]["failures"] == {"tests/test_fuzz.py::test_fuzz_cross_entropy_torch": "boom"}


def test_default_tag_names_the_selection():
    assert default_tag("", []) == "ci"
    assert default_tag("10000", ["-k", "distill and torch", "--timeout=5"]) == "long10000_distill_and_torch"
    assert default_tag("10000", ["-ksharded"]) == "long10000_sharded"
