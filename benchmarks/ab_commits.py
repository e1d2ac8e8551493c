"""Is one commit's CPU loss slower than another's? The two commits timed alternately, round by round, in one run.

``python -m benchmarks.ab_commits BEFORE_DIR AFTER_DIR [--rounds 12] [--shape N,D,V] [--out NAME]``: ``BEFORE_DIR`` and
``AFTER_DIR`` are checkouts of the two commits (e.g. ``git worktree add /tmp/before c8d595c``). Each round starts one
fresh process per checkout (``PYTHONPATH`` = that checkout; the order alternates between rounds), which times
``cce_dist.linear_cross_entropy`` (forward + backward, the scalar loss's default schedule) and the materialized
``F.cross_entropy(F.linear(...))`` on the same inputs, interleaved. Reported:

- the paired ratio after / before of cce_dist's time, per round (the two processes of a round run back to back, so
  load drifts hit both alike), and its median over the rounds;
- within each process, cce_dist / materialized (that process's own peer), before and after.

Writes ``results/<out>.json`` and ``results/<out>.md`` with the machine, versions and both commits. Nothing asserts a
timing: a reader judges the ratios and their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import close_env, env_info, env_markdown, fmt, md_table, write_results

CHILD = r"""
import json, sys, time, gc
import torch
import torch.nn.functional as F
from cce_dist import linear_cross_entropy
n, d, v, iters = (int(x) for x in sys.argv[1:5])
g = torch.Generator().manual_seed(0)
h = torch.randn(n, d, generator=g).requires_grad_(True)
w = (torch.randn(v, d, generator=g) * d ** -0.5).requires_grad_(True)
t = torch.randint(0, v, (n,), generator=g)
def cce():
    linear_cross_entropy(h, w, t, impl="torch").backward()
def materialized():
    F.cross_entropy(F.linear(h, w), t).backward()
fns = {"cce": cce, "materialized": materialized}
for fn in fns.values():
    fn()
out = {k: [] for k in fns}
for _ in range(iters):
    for k, fn in fns.items():
        h.grad = w.grad = None
        gc.collect()
        t0 = time.perf_counter()
        fn()
        out[k].append(time.perf_counter() - t0)
import cce_dist
print(json.dumps({"times": out, "cce_dist_file": cce_dist.__file__}))
"""


def _commit(path: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True, check=True
    ).stdout.strip()


def _run(path: Path, shape: tuple[int, int, int], iters: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(path))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, shape), str(iters)],
        env=env,
        cwd=path,
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if not result["cce_dist_file"].startswith(str(path)):
        raise RuntimeError(f"the child imported cce_dist from {result['cce_dist_file']}, not from {path}")
    return result["times"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--iters", type=int, default=2, help="timed calls of each variant per process")
    ap.add_argument("--shape", default="2048,512,65536")
    ap.add_argument("--out", default="ab_commits")
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    assert len(shape) == 3, "--shape N,D,V"
    dirs = {"before": args.before.resolve(), "after": args.after.resolve()}
    env = env_info(commits={k: _commit(p) for k, p in dirs.items()}, shape=dict(zip("NDV", shape)), rounds=args.rounds)
    started = time.perf_counter()
    rounds = []
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        got = {k: _run(dirs[k], shape, args.iters) for k in order}
        rounds.append({k: {v: statistics.median(ts) for v, ts in got[k].items()} for k in dirs})
        print(f"round {r}: " + ", ".join(f"{k} cce {rounds[-1][k]['cce']:.2f}s" for k in dirs), flush=True)
    paired = [x["after"]["cce"] / x["before"]["cce"] for x in rounds]
    own = {k: [x[k]["cce"] / x[k]["materialized"] for x in rounds] for k in dirs}
    payload = {"env": close_env(env, started), "rounds": rounds, "paired_after_over_before": paired, "own_ratio": own}
    commits = env["commits"]
    md = [
        f"# cce_dist CPU loss: commit {commits['after']} against {commits['before']}, alternated",
        "",
        env_markdown(env).rstrip("\n"),
        f"- shape N, D, V = {shape}, float32, impl='torch', forward + backward of the mean loss; {args.rounds} rounds, "
        f"each one fresh process per commit (order alternating), {args.iters} timed calls per variant per process",
        f"- command: `python -m benchmarks.ab_commits BEFORE AFTER --rounds {args.rounds} --iters {args.iters} "
        f"--shape {args.shape}`",
        "",
        md_table(
            ["measure", "median", "min", "max"],
            [
                [
                    "cce_dist after / before (paired per round)",
                    fmt(statistics.median(paired), 3),
                    fmt(min(paired), 3),
                    fmt(max(paired), 3),
                ],
                *[
                    [
                        f"cce_dist / materialized, {k} ({commits[k]})",
                        fmt(statistics.median(v), 3),
                        fmt(min(v), 3),
                        fmt(max(v), 3),
                    ]
                    for k, v in own.items()
                ],
            ],
        ),
        "",
        "Per round (seconds, median of the process's timed calls):",
        "",
        md_table(
            ["round", "before cce", "before materialized", "after cce", "after materialized", "after / before"],
            [
                [
                    i,
                    fmt(x["before"]["cce"]),
                    fmt(x["before"]["materialized"]),
                    fmt(x["after"]["cce"]),
                    fmt(x["after"]["materialized"]),
                    fmt(p, 3),
                ]
                for i, (x, p) in enumerate(zip(rounds, paired))
            ],
        ),
        "",
    ]
    write_results(args.out, payload, "\n".join(md))


if __name__ == "__main__":
    main()
