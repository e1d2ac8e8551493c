"""Is cce_dist's vocab-parallel loss at least as fast as Megatron-core's, with <= 15%
of its peak memory, and how many collectives / bytes does each move per step?

TP=2 on gloo (two spawned processes, ``torch.set_num_threads(1)`` each), N=4096, D=512,
V=65536 (32768 rows per rank), fp32, forward + backward (grads for hidden and the weight shard):

- ``megatron``   ``copy_to_tensor_model_parallel_region(h)`` -> ``F.linear`` on the shard ->
                 ``vocab_parallel_cross_entropy`` -> mean (megatron-core's parallel_state set up on
                 gloo with ``initialize_model_parallel(tensor_model_parallel_size=2)``)
- ``cce``        ``cce_dist.linear_cross_entropy(h, w_shard, t, shard=VocabShard.even(V, group))``
                 (defaults: fused schedule, dH all-reduced by the library)
- ``cce_2pass``  the same with ``grad_in_forward=False``

Time: per step the slower rank's time, median of >= 3 interleaved repeats after a warm-up.
Memory: peak RSS growth per rank above the inputs, in a fresh pair of processes per variant.
Collectives: count and bytes per step per rank, from shims around torch.distributed's
collectives installed in the benchmark processes.

Usage, from the repository root: ``python -m benchmarks.tp_megatron [--quick]``
(results: benchmarks/results/tp_megatron.*)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.common import (
    RESULTS,
    close_env,
    env_info,
    env_markdown,
    free_port,
    logger,
    malloc_trim,
    md_table,
    mib,
    peak_growth,
    rss_bytes,
    save_results,
    steady_growth,
)
from cce_dist.testing import CollectiveLog

TP = 2
N, D, V = 4096, 512, 65536
VARIANTS = {
    "megatron": ("megatron", {}),
    "cce": ("cce", {}),
    "cce_2pass": ("cce", {"grad_in_forward": False}),
}


def make_inputs(rank: int, world: int, n: int, d: int, v: int, seed: int = 0):
    """Identical hidden/targets on every rank; this rank's rows of one global weight."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    per = v // world
    gw = torch.Generator().manual_seed(seed + 1)
    w = torch.empty(per, d)
    for r in range(world):  # generate the global weight shard by shard, keep ours (no V x D temp)
        blk = torch.randn(per, d, generator=gw) * 0.02
        if r == rank:
            w.copy_(blk)
        del blk
    return h, w.requires_grad_(), t


def make_step(kind: str, opts: dict, h, w, t, v: int, group):
    if kind == "megatron":
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, vocab_parallel_cross_entropy

        def loss():
            x = copy_to_tensor_model_parallel_region(h)
            return vocab_parallel_cross_entropy(F.linear(x, w), t).mean()
    elif kind == "cce":
        import cce_dist

        shard = cce_dist.VocabShard.even(v, group)

        def loss():
            return cce_dist.linear_cross_entropy(h, w, t, shard=shard, impl="torch", **opts)
    else:
        raise ValueError(kind)

    out = {}

    def step():
        h.grad = None
        w.grad = None
        lo = loss()
        lo.backward()
        out["loss"] = float(lo)

    step.out = out
    return step


def setup(rank: int, world: int, port: int, megatron: bool):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if megatron:
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        return ps.get_tensor_model_parallel_group()
    return dist.group.WORLD


def _max_over_ranks(x: float) -> float:
    buf = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return float(buf)


# ----------------------------------------------------------------------------------------------
# workers
# ----------------------------------------------------------------------------------------------


def timing_worker(rank, world, port, cfg, outdir):
    group = setup(rank, world, port, megatron=True)
    n, d, v = cfg["N"], cfg["D"], cfg["V"]
    h, w, t = make_inputs(rank, world, n, d, v)
    steps = {name: make_step(kind, opts, h, w, t, v, group) for name, (kind, opts) in cfg["variants"].items()}
    res = {name: {"wall_s": [], "rank_wall_s": [], "loss": None} for name in steps}

    def timed(name):
        dist.barrier()
        t0 = time.perf_counter()
        steps[name]()
        el = time.perf_counter() - t0
        res[name]["rank_wall_s"].append(round(el, 4))
        return _max_over_ranks(el)

    for name in steps:  # warm-up
        timed(name)
        res[name]["rank_wall_s"].clear()
    for _ in range(cfg["repeats"]):
        for name in steps:
            res[name]["wall_s"].append(round(timed(name), 4))
            if rank == 0:
                print(f"[tp_megatron] {name}: {res[name]['wall_s'][-1]:.2f}s", file=sys.stderr, flush=True)
    # one more step of each with the collective shims installed (not timed)
    counter = CollectiveLog().install()
    for name in steps:
        with counter.counting():
            steps[name]()
        s = counter.summary()
        res[name]["collectives"] = s
        res[name]["loss"] = steps[name].out["loss"]
    counter.uninstall()
    for r in res.values():
        r["median_s"] = statistics.median(r["wall_s"])
    (Path(outdir) / f"timing_rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def memory_worker(rank, world, port, cfg, outdir):
    kind, opts = cfg["kind"], cfg["opts"]
    group = setup(rank, world, port, megatron=(kind == "megatron"))
    n, d, v = cfg["N"], cfg["D"], cfg["V"]
    # one tiny call first so one-time lazy imports/initialisation are not counted as step memory
    r0 = rss_bytes()
    tiny = make_inputs(rank, world, 16, d, 64 * world, seed=3)
    make_step(kind, opts, *tiny, 64 * world, group)()
    del tiny
    first_call = rss_bytes() - r0
    h, w, t = make_inputs(rank, world, n, d, v)
    malloc_trim()
    step = make_step(kind, opts, h, w, t, v, group)

    def synced():
        dist.barrier()
        step()

    res = peak_growth(synced, steps=2)
    res["first_call_bytes"] = first_call
    res["grad_bytes"] = (h.grad.numel() + w.grad.numel()) * 4
    res.update(steady_growth(synced))
    (Path(outdir) / f"mem_{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn, world, cfg) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(world, free_port(), cfg, tmp), nprocs=world, join=True)
        files = sorted(Path(tmp).glob("*.json"))
        return [json.loads(f.read_text()) for f in files]


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def render(p: dict) -> str:
    sh = p["shape"]
    rows = p["rows"]
    meg = rows["megatron"]
    s = [
        f"# tp_megatron — cce_dist vs Megatron-core, TP={sh['TP']} on gloo",
        "",
        env_markdown(p["env"]),
        "",
        f"N={sh['N']} D={sh['D']} V={sh['V']} (V/rank={sh['V'] // sh['TP']}) fp32, forward + backward, "
        "1 thread per rank. Time: the slower rank per step, median of interleaved repeats after a "
        "warm-up. Memory: peak RSS growth per rank (max over ranks) above the inputs in fresh "
        "processes per variant (a tiny call first, so lazy imports are excluded). Collectives: per "
        "step per rank; bytes = this rank's input / output buffers.",
        "",
    ]
    hdr = [
        "variant",
        "median s",
        "time / megatron",
        "growth MiB (max rank)",
        "growth - grads MiB",
        "growth / megatron",
        "(growth - grads) / megatron",
        "steady growth excl. grads MiB",
        "collectives / step",
        "bytes in / step",
        "bytes out / step",
        "loss",
    ]
    tab = []
    for name, r in rows.items():
        m = r["memory"]
        c = r["collectives"]
        tab.append(
            [
                name,
                r["median_s"],
                r["median_s"] / meg["median_s"],
                mib(m["growth_bytes"]),
                mib(m["growth_bytes"] - m["grad_bytes"]),
                m["growth_bytes"] / meg["memory"]["growth_bytes"],
                (m["growth_bytes"] - m["grad_bytes"]) / (meg["memory"]["growth_bytes"] - meg["memory"]["grad_bytes"]),
                mib(m["steady_growth_bytes"]) if m.get("steady_growth_bytes") is not None else None,
                c["count"],
                c["in_bytes"],
                c["out_bytes"],
                f"{r['loss']:.6f}",
            ]
        )
    s += [md_table(hdr, tab), ""]
    s += ["Collectives per step, by op (count: in bytes -> out bytes):", ""]
    for name, r in rows.items():
        ops = "; ".join(
            f"{op} x{d['count']}: {d['in_bytes']} -> {d['out_bytes']}" for op, d in r["collectives"]["by_op"].items()
        )
        s.append(f"- {name}: {ops}")
    cce = rows["cce"]
    tr = cce["median_s"] / meg["median_s"]
    mr = cce["memory"]["growth_bytes"] / meg["memory"]["growth_bytes"]
    mg = (cce["memory"]["growth_bytes"] - cce["memory"]["grad_bytes"]) / (
        meg["memory"]["growth_bytes"] - meg["memory"]["grad_bytes"]
    )
    s += [
        "",
        "### Targets",
        "",
        f"- time cce / megatron = {tr:.2f} (target <= 1.0): {'**met**' if tr <= 1.0 else '**missed**'}",
        f"- peak growth cce / megatron = {mr:.3f} incl. gradients, {mg:.3f} excl. (target <= 0.15): "
        f"{'**met**' if mr <= 0.15 else '**missed**'} incl. / {'**met**' if mg <= 0.15 else '**missed**'} excl.",
        "- per-rank step time spread (rank 0 / rank 1 medians) in the JSON (rank_wall_s).",
        "",
    ]
    return "\n".join(s)


def plot(p: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = p["rows"]
    names = list(rows)
    meg = rows["megatron"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [rows[k]["median_s"] / meg["median_s"] for k in names], 0.4, label="time / megatron")
    ax.bar(
        [x + 0.2 for x in xs],
        [rows[k]["memory"]["growth_bytes"] / meg["memory"]["growth_bytes"] for k in names],
        0.4,
        label="peak growth / megatron",
    )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.15, color="r", lw=0.8, ls="--", label="memory target 0.15")
    ax.set_xticks(list(xs), names)
    sh = p["shape"]
    ax.set_title(f"TP={sh['TP']} gloo, N={sh['N']} D={sh['D']} V={sh['V']} fp32, fwd+bwd")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--shape", default=None, help="N,D,V (default 4096,512,65536)")
    ap.add_argument("--render-only", action="store_true", help="re-render .md/.png from the saved JSON")
    args = ap.parse_args()
    if args.render_only:
        finish(json.loads((RESULTS / "tp_megatron.json").read_text()))
        return
    started = time.perf_counter()
    n, d, v = (N, D, V) if not args.shape else (int(x) for x in args.shape.split(","))
    repeats = args.repeats or (1 if args.quick else 3)
    log = logger("tp_megatron")
    env = env_info(mode="quick" if args.quick else "full", repeats=repeats, threads_per_rank=1)
    cfg = {"N": n, "D": d, "V": v, "repeats": repeats, "variants": VARIANTS}
    log(f"timing TP={TP} N={n} D={d} V={v}")
    per_rank = spawn(timing_worker, TP, cfg)
    rows = {}
    for name in VARIANTS:
        r0 = per_rank[0][name]
        rows[name] = {
            "kind": VARIANTS[name][0],
            "opts": VARIANTS[name][1],
            "wall_s": r0["wall_s"],
            "median_s": r0["median_s"],
            "rank_wall_s": [pr[name]["rank_wall_s"] for pr in per_rank],
            "loss": r0["loss"],
            "loss_by_rank": [pr[name]["loss"] for pr in per_rank],
            "collectives": {k: v_ for k, v_ in r0["collectives"].items()},
            "collectives_by_rank": [pr[name]["collectives"]["count"] for pr in per_rank],
        }
    # Memory: a fresh process group per variant. RSS is per process, so the three groups run at
    # once (saves the slow start-up of three spawns; timing above ran alone).
    from concurrent.futures import ThreadPoolExecutor

    log("memory (fresh process groups, concurrently)")
    with ThreadPoolExecutor(len(VARIANTS)) as ex:
        futs = {
            name: ex.submit(spawn, memory_worker, TP, {"N": n, "D": d, "V": v, "kind": kind, "opts": opts})
            for name, (kind, opts) in VARIANTS.items()
        }
        mems = {name: f.result() for name, f in futs.items()}
    for name in VARIANTS:
        mem = mems[name]
        worst = max(mem, key=lambda m: m["growth_bytes"])
        rows[name]["memory"] = dict(worst)
        rows[name]["memory_by_rank"] = mem
        log(f"  growth {mib(worst['growth_bytes'])} MiB")
    payload = {
        "env": env,
        "question": "cce_dist vs megatron-core vocab-parallel CE at TP=2",
        "shape": {"TP": TP, "N": n, "D": d, "V": v},
        "rows": rows,
    }
    close_env(env, started)
    finish(payload)


def finish(payload: dict) -> None:
    save_results("tp_megatron", payload, render, plot)


if __name__ == "__main__":
    main()
