"""Which statistics collective should cce_dist's vocab-parallel forward use at a
given group size -- ``VocabShard(stats_collective="allreduce")`` (all-reduce MAX of the row max,
then one all-reduce SUM of the rescaled statistics: two round trips, 4 + 16 bytes per row) or
``"allgather"`` (one all-gather of the raw 20-byte rows, combined locally: one round trip, P x
the bytes)? This decides ``cce_dist.parallel.AUTO_ALLGATHER_MAX_ROWS_X_RANKS``.

For tp = 2, 4, 8 on gloo (spawned processes, 1 thread each; 8 processes on a 2-core machine is
oversubscribed, so absolute times are pessimistic, but both methods suffer alike):

1. the collective alone: ``Comm.reduce_stats`` on a ``[N, 5]`` float32 statistics tensor, for a
   few N, many calls interleaved; per call the slowest rank's time, median;
2. the whole forward: ``linear_cross_entropy(..., shard=VocabShard.even(V, group,
   stats_collective=...))`` under ``torch.no_grad()`` at a small shape; median per call.

Bytes per call and rank are counted by shims around torch.distributed's collectives.

Usage, from the repository root: ``python -m benchmarks.tp_collectives [--quick]``
(results: benchmarks/results/tp_collectives.*)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import (
    RESULTS,
    close_env,
    env_info,
    env_markdown,
    free_port,
    logger,
    md_table,
    save_results,
)
from cce_dist.testing import CollectiveLog

METHODS = ("allreduce", "allgather")
TPS = (2, 4, 8)
STATS_N = (1024, 4096, 16384)  # rows of the isolated collective
FWD_SHAPE = (2048, 256, 32768)  # N, D, V of the whole-forward measurement (V split over the group)


def worker(rank, world, port, cfg, outdir):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import cce_dist
    from cce_dist.core import stats as S
    from cce_dist.tp.collectives import Comm

    group = dist.group.WORLD
    counter = CollectiveLog().install()

    def slowest(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(el, op=dist.ReduceOp.MAX)
        return float(el)

    out = {"collective": {}, "forward": {}}
    # 1. the collective alone
    for n in cfg["stats_n"]:
        g = torch.Generator().manual_seed(rank)
        local = torch.randn(n, S.NUM_STATS, generator=g)
        local[:, S.SUMEXP] = local[:, S.SUMEXP].abs() + 1
        comms = {m: Comm(cce_dist.VocabShard.even(world * 8, group, stats_collective=m), None) for m in METHODS}
        times = {m: [] for m in METHODS}
        for it in range(cfg["warmup"] + cfg["iters"]):
            for m in METHODS:
                t = slowest(lambda: comms[m].reduce_stats(local))  # noqa: B023 (called at once)
                if it >= cfg["warmup"]:
                    times[m].append(t)
        res = {}
        for m in METHODS:
            with counter.counting():
                comms[m].reduce_stats(local)
            s = counter.summary()
            res[m] = {
                "median_s": statistics.median(times[m]),
                "min_s": min(times[m]),
                "calls": s["count"],
                "in_bytes": s["in_bytes"],
                "out_bytes": s["out_bytes"],
                "by_op": s["by_op"],
            }
        out["collective"][str(n)] = res
    # 2. the whole forward (no grad: statistics pass only)
    n, d, v = cfg["fwd_shape"]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    per = v // world
    w = torch.randn(per, d, generator=torch.Generator().manual_seed(1 + rank)) * 0.02
    shards = {m: cce_dist.VocabShard.even(v, group, stats_collective=m) for m in METHODS}
    times = {m: [] for m in METHODS}
    with torch.no_grad():
        for it in range(cfg["fwd_warmup"] + cfg["fwd_iters"]):
            for m in METHODS:
                tt = slowest(lambda: cce_dist.linear_cross_entropy(h, w, t, shard=shards[m], impl="torch"))  # noqa: B023
                if it >= cfg["fwd_warmup"]:
                    times[m].append(tt)
        for m in METHODS:
            with counter.counting():
                cce_dist.linear_cross_entropy(h, w, t, shard=shards[m], impl="torch")
            s = counter.summary()
            out["forward"][m] = {
                "median_s": statistics.median(times[m]),
                "min_s": min(times[m]),
                "calls": s["count"],
                "in_bytes": s["in_bytes"],
                "out_bytes": s["out_bytes"],
                "by_op": s["by_op"],
            }
    counter.uninstall()
    if rank == 0:
        (Path(outdir) / "out.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, cfg: dict) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, free_port(), cfg, tmp), nprocs=world, join=True)
        return json.loads((Path(tmp) / "out.json").read_text())


def render(p: dict) -> str:
    s = [
        "# tp_collectives — allreduce vs allgather statistics collective (cce_dist.VocabShard)",
        "",
        env_markdown(p["env"]),
        "",
        "gloo, one process per rank, 1 thread each (2 cores: tp=4/8 are oversubscribed). "
        "Per call: the slowest rank's wall time, median. Bytes: per rank per call "
        "(input buffers -> output buffers).",
        "",
        "## The statistics collective alone (`Comm.reduce_stats` on float32 [N, 5])",
        "",
    ]
    hdr = [
        "tp",
        "N rows",
        "allreduce ms",
        "allgather ms",
        "allgather / allreduce",
        "allreduce calls, bytes in->out",
        "allgather calls, bytes in->out",
    ]
    rows = []
    for tp, r in p["by_tp"].items():
        for n, c in r["collective"].items():
            ar, ag = c["allreduce"], c["allgather"]
            rows.append(
                [
                    tp,
                    n,
                    ar["median_s"] * 1e3,
                    ag["median_s"] * 1e3,
                    ag["median_s"] / ar["median_s"],
                    f"{ar['calls']}, {ar['in_bytes']}->{ar['out_bytes']}",
                    f"{ag['calls']}, {ag['in_bytes']}->{ag['out_bytes']}",
                ]
            )
    s += [md_table(hdr, rows), ""]
    n, d, v = p["fwd_shape"]
    s += [f"## Whole forward (no grad), N={n} D={d} V={v} split over the group", ""]
    hdr = [
        "tp",
        "allreduce ms",
        "allgather ms",
        "allgather / allreduce",
        "allreduce collectives (incl. handshake)",
        "allgather collectives (incl. handshake)",
    ]
    rows = []
    for tp, r in p["by_tp"].items():
        ar, ag = r["forward"]["allreduce"], r["forward"]["allgather"]
        rows.append(
            [
                tp,
                ar["median_s"] * 1e3,
                ag["median_s"] * 1e3,
                ag["median_s"] / ar["median_s"],
                f"{ar['calls']}, {ar['in_bytes']}->{ar['out_bytes']}",
                f"{ag['calls']}, {ag['in_bytes']}->{ag['out_bytes']}",
            ]
        )
    s += [md_table(hdr, rows), "", "## What the data says", ""] + p["verdict"] + [""]
    return "\n".join(s)


def verdict(p: dict) -> list[str]:
    out = []
    largest_ok = 1
    for tp, r in p["by_tp"].items():
        ratios = [c["allgather"]["median_s"] / c["allreduce"]["median_s"] for c in r["collective"].values()]
        fr = r["forward"]["allgather"]["median_s"] / r["forward"]["allreduce"]["median_s"]
        wins = sum(x < 1 for x in ratios)
        out.append(
            f"- tp={tp}: allgather/allreduce time ratio of the collective alone "
            f"{', '.join(f'{x:.2f}' for x in ratios)} (N = {', '.join(r['collective'])}); "
            f"whole forward {fr:.2f}"
        )
        if wins * 2 > len(ratios):
            largest_ok = max(largest_ok, int(tp))
    out.append(f"- largest measured group size where allgather wins on most N: {largest_ok} ({auto_rule(p)})")
    # The crossover in terms of the bytes each rank receives from the all-gather (P * N * 20).
    pts = sorted(
        (c["allgather"]["out_bytes"], c["allgather"]["median_s"] / c["allreduce"]["median_s"], tp, n)
        for tp, r in p["by_tp"].items()
        for n, c in r["collective"].items()
    )
    win = [b for b, x, _, _ in pts if x < 1]
    lose = [b for b, x, _, _ in pts if x >= 1]
    out.append(
        "- by bytes each rank receives from the all-gather (P x N x 20 B): allgather faster at "
        + ", ".join(f"{b // 1024} KiB" for b in win)
        + "; not faster at "
        + (", ".join(f"{b // 1024} KiB (tp={tp}, N={n})" for b, x, tp, n in pts if x >= 1) or "none")
    )
    if win and lose:
        out.append(
            f"- so the choice depends on N as well as P: a rule on the gathered bytes (allgather when "
            f"P*N*20 B <= ~{max(b for b in win if b < min(lose)) // 1024} KiB, measured on gloo/CPU) fits "
            "this data better than a rank-count threshold alone; N is agreed by every rank in the "
            "handshake, so such a rule stays rank-consistent"
        )
    return out


def auto_rule(p: dict) -> str:
    """The ``"auto"`` rule in force when ``p`` was recorded (results older than the rows x ranks
    rule carry the rank-count threshold that preceded it)."""
    if "auto_allgather_max_rows_x_ranks" in p:
        return f"cce_dist.parallel.AUTO_ALLGATHER_MAX_ROWS_X_RANKS is {p['auto_allgather_max_rows_x_ranks']}"
    return f"cce_dist.parallel.AUTO_ALLGATHER_MAX_RANKS was {p['auto_allgather_max_ranks']} when this was recorded"


def plot(p: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for tp, r in p["by_tp"].items():
        ns = [int(n) for n in r["collective"]]
        ax.plot(
            ns,
            [c["allgather"]["median_s"] / c["allreduce"]["median_s"] for c in r["collective"].values()],
            "o-",
            label=f"tp={tp}",
        )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows N of the [N, 5] statistics")
    ax.set_ylabel("allgather time / allreduce time")
    ax.set_title("cce_dist stats collective on gloo (< 1: allgather faster)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tps", default=None, help="comma list of group sizes (default 2,4,8)")
    ap.add_argument("--render-only", action="store_true", help="re-render .md/.png from the saved JSON")
    args = ap.parse_args()
    if args.render_only:
        payload = json.loads((RESULTS / "tp_collectives.json").read_text())
        payload["verdict"] = verdict(payload)
        save_results("tp_collectives", payload, render, plot)
        return
    started = time.perf_counter()
    log = logger("tp_collectives")
    tps = [int(x) for x in args.tps.split(",")] if args.tps else list(TPS)
    cfg = {
        "stats_n": list(STATS_N) if not args.quick else [4096],
        "warmup": 3,
        "iters": 10 if args.quick else 30,
        "fwd_shape": list(FWD_SHAPE) if not args.quick else [512, 64, 4096],
        "fwd_warmup": 1,
        "fwd_iters": 3 if args.quick else 7,
    }
    torch.set_num_threads(1)  # what every rank uses (recorded in env)
    env = env_info(mode="quick" if args.quick else "full", threads_per_rank=1, cfg=cfg)
    by_tp = {}
    for tp in tps:
        log(f"tp={tp}")
        by_tp[str(tp)] = run(tp, cfg)
    from cce_dist.tp.collectives import AUTO_ALLGATHER_MAX_ROWS_X_RANKS

    payload = {
        "env": env,
        "question": "allreduce vs allgather statistics collective by group size",
        "fwd_shape": cfg["fwd_shape"],
        "by_tp": by_tp,
        "auto_allgather_max_rows_x_ranks": AUTO_ALLGATHER_MAX_ROWS_X_RANKS,
    }
    payload["verdict"] = verdict(payload)
    close_env(env, started)
    save_results("tp_collectives", payload, render, plot)


if __name__ == "__main__":
    main()
