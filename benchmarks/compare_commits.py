"""Two runs of the same benchmarks side by side: did a change make cce_dist slower or hungrier than before?

``python -m benchmarks.compare_commits BEFORE_DIR AFTER_DIR --out FILE`` reads ``cpu_single.md``, ``tp_megatron.md``
and ``trl_cpu.md`` (as the benchmarks write them under ``benchmarks/results``) from a run at each commit and writes one
markdown table per benchmark: each variant's ratios to the peer of its own run (time / materialized, time / megatron,
time / TRL, CPU time / TRL, memory ratios) before and after. Ratios within one run are what a change can be judged by
on a shared machine: the variants of a run are timed interleaved, so load hits them alike; absolute seconds of two
runs are not comparable. Each run's header (date, commit, machine, load average) is copied above its table.
"""

from __future__ import annotations

import argparse
import pathlib

BENCHMARKS = ("cpu_single", "tp_megatron", "trl_cpu")


def _header(text: str) -> list[str]:
    return [line for line in text.splitlines()[:8] if line.startswith("- ")]


def _first_table(text: str) -> tuple[list[str], list[list[str]]]:
    lines = [ln for ln in text.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| variant"))
    cols = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return cols, rows


def compare(before: pathlib.Path, after: pathlib.Path, note: str = "") -> str:
    out = ["# cce_dist before and after a change: ratios to the peer of the same run", ""]
    if note:
        out += [note, ""]
    for name in BENCHMARKS:
        b, a = before / f"{name}.md", after / f"{name}.md"
        if not (b.exists() and a.exists()):
            out += [f"## {name}", "", f"not compared: {b if not b.exists() else a} is missing", ""]
            continue
        tb, ta = b.read_text(), a.read_text()
        cols, rows_b = _first_table(tb)
        cols_a, rows_a = _first_table(ta)
        ratio_cols = [c for c in cols if "/" in c and c in cols_a]
        by_variant = {r[0]: r for r in rows_a}
        out += [f"## {name}", "", "before:", *_header(tb), "", "after:", *_header(ta), ""]
        out.append("| variant | " + " | ".join(f"{c} before | after" for c in ratio_cols) + " |")
        out.append("|---|" + "---|---|" * len(ratio_cols))
        for r in rows_b:
            ra = by_variant.get(r[0])
            if ra is None:
                continue
            cells = [f"{r[cols.index(c)]} | {ra[cols_a.index(c)]}" for c in ratio_cols]
            out.append(f"| {r[0]} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=pathlib.Path)
    ap.add_argument("after", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--note", default="", help="a paragraph under the title: how the runs were made")
    args = ap.parse_args()
    args.out.write_text(compare(args.before, args.after, args.note))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
