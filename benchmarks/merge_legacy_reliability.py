"""One-off: fold the per-run ``benchmarks/results/reliability_counts*.json`` files into the per-suite
``reliability_<suite>.json`` files of ``benchmarks.reliability_counts`` (run once, then removed).

Each legacy run gets the tag its command gives today (``default_tag``: ``ci`` / ``long<N>`` plus the
``-k`` selection); the latest run per tag is kept; a failed run is dropped when every test it ran
passed in a later run with as many examples. NOTES says, on the entries that followed them, what
the superseded failures docs/reliability.md refers to were.
"""

import json
import shlex

from benchmarks.common import RESULTS
from benchmarks.reliability_counts import default_tag, record, suite_entries

NOTES = {
    "long10000_cross_entropy_torch": "Earlier runs of this property stopped on findings A (aee4996, after 103 cases, "
    'in a run of `-k "not triton_interpreter"`), C (b1f6552, after 3,020), D (8cfd8be, after 1,115) and H (29a55bf, '
    "after 339), each fixed or resolved before this run (docs/reliability.md, Findings).",
    "long10000_logprobs_torch": "Earlier runs of this property: 2,872 cases right at aee4996 when the time budget "
    'ended it (in a run of `-k "not triton_interpreter"`); finding F stopped one at 88c6735 after 5,399 cases, '
    "fixed before this run.",
    "long10000_sharded": 'At aee4996 (in a run of `-k "not triton_interpreter"`) 5 of the 2,500 torch cases failed: '
    "finding B, fixed. The same selection passed 2,500 + 200 at afd19b6 too, before the sharded cases offset logits.",
    "long10000_cross_entropy_triton": "Finding E stopped a run of this property at 126c6c8 after 200 cases; fixed "
    "before this run. At aee4996 (in a run of `-k triton_interpreter`) 844 cases were right when the budget ended it.",
    "long10000_logprobs_triton": "Finding E stopped a run of this property at 126c6c8 after 1,416 cases, and I at "
    "64bc23f after 3,921; E fixed, I (the judge) resolved in afd19b6, before this run.",
    "long10000_distill_and_torch": "kl stopped here at case 9,232 on a judge too strict under cancellation (T = 20: "
    "fp32 dH error 0.3 ulp of p, 2.2x the float32 materialized program's), resolved in f777633: see "
    "`long10000_distill_torch_and_kl_and_not_reverse`. jsd and reverse_kl passed.",
    "long10000_distill_torch_and_kl_and_not_reverse": "Follows two stops of kl on the fuzz's judge (c6a10f8 at case "
    "9,232, 75aa767 at 9,319), resolved in f777633 (gradients also judged against the contract's float64 program).",
    "long10000_test_fuzz_distill_triton_interpreter_and_jsd": "The distillation fuzz had found the Triton JSD NaN "
    "where one head's logits sat about 88 / T below the other's; fixed before this run "
    "(`test_triton_one_head_far_below_the_other`).",
    "long10000_test_fuzz_distill_triton_interpreter_and_reverse_kl": "A first run stopped on a judgement, not a "
    "defect: at T = 0.05 with a teacher offset of -60 cce_dist's loss equals the float32 materialized program's to "
    "the bit; the fuzz's forward tolerance, which left logits of magnitude 1000 and more out of its scale, was "
    "fixed in 8d3b1cf.",
    "long10000_cross_entropy_torch_or_sharded": "A run of this command at 847f08d found the weighted smoothing "
    "gradient's db up to 5x less accurate than the float32 materialized program (eps = 1, V = 2); fixed before "
    "this run (`test_weighted_smoothing_gradient_is_as_accurate_as_the_materialized_program`).",
}


def _legacy_tag_and_command(command: str) -> tuple[str, str]:
    # legacy commands joined the pytest arguments unquoted: the -k expression runs to the next option
    head, _, tail = command.partition(" -- ")
    n = head.split()[0].split("=", 1)[1] if head.startswith("CCE_FUZZ_EXAMPLES=") else ""
    args, words = [], tail.split()
    while words:
        w = words.pop(0)
        if w == "-k":
            expr = []
            while words and not words[0].startswith("-"):
                expr.append(words.pop(0))
            args += ["-k", " ".join(expr)]
        else:
            args.append(w)
    return default_tag(n, args), head + (" -- " + shlex.join(args) if args else "")


def main() -> None:
    legacy = sorted(RESULTS.glob("reliability_counts*.json"))
    entries: dict[tuple[str, str], dict] = {}
    for path in legacy:
        payload = json.loads(path.read_text())
        tag, payload["command"] = _legacy_tag_and_command(payload["command"])
        for suite, e in suite_entries(payload, tag, NOTES.get(tag, "")).items():
            if (suite, tag) not in entries or entries[suite, tag]["date"] < e["date"]:
                entries[suite, tag] = e
    for (suite, tag), e in sorted(entries.items(), key=lambda kv: kv[1]["date"]):
        n = e["counts"].get("fuzz_examples_per_property")
        later = [
            x
            for (s, _), x in entries.items()
            if s == suite and x["date"] > e["date"] and x["counts"].get("fuzz_examples_per_property") == n
        ]
        if e["tests"]["failed"] and all(any(x["outcomes"].get(t) == "passed" for x in later) for t in e["outcomes"]):
            print(f"dropped {suite} {tag} ({e['commit']}, {e['date']}): superseded")
            continue
        record(suite, e)
        print(f"kept {suite} {tag} ({e['commit']}, {e['date']}, failed {e['tests']['failed']})")
    print("legacy files:", " ".join(str(p.relative_to(RESULTS)) for p in legacy))


if __name__ == "__main__":
    main()
