"""What does keeping an FSDP2 LM head vocab-sharded (cce_dist.fsdp) save against FSDP's own gather, per rank and step?

The head alone (``nn.Linear(D, V, bias=False)``, fp32) on P gloo ranks (P = 2 and 4 in one run), each rank with its
own, different number of tokens (hidden states ``[n_r, D]`` requiring grad, standing for the decoder's output), forward
+ backward of each rank's mean cross-entropy:

- ``fsdp``       ``fully_shard(head)``: FSDP all-gathers ``V x D`` before the forward, the materialized
                 ``F.cross_entropy(F.linear(h, W), t)``, FSDP reduce-scatters the ``V x D`` gradient
- ``fsdp_cce``   the same FSDP head, scored by a single-device ``cce_dist.linear_cross_entropy`` on the gathered
                 weight (what a fused head does under FSDP, e.g. TRL's after ``full_tensor()``): no logits, the same
                 ``V x D`` traffic
- ``cce_dp``     ``fully_shard(..., ignored_params=cce_dist.fsdp.shard_lm_head(...))`` and
                 ``cce_dist.fsdp.head_cross_entropy``: the tokens travel (``N x D``), the head does not

Time: per step the slower rank's, median of repeats after a warm-up (1 thread per rank; the ranks share the
machine's cores). Memory: peak RSS growth per rank above the inputs, max over ranks, in a fresh process group per
variant (a warm-up step first, so lazy initialisation is excluded). Bytes: what this rank's collectives send + receive
per step (``cce_dist.testing.CollectiveLog``), max over ranks. The communication model at 8-64 ranks is in
docs/fsdp.md (``comm_model`` below computes its table).

Usage, from the repository root: ``python -m benchmarks.fsdp_head [--quick]`` (results: benchmarks/results/fsdp_head.*)
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
from torch import nn

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
    save_results,
)
from cce_dist.testing import CollectiveLog

D, V = 256, 32768
#: tokens per rank (uneven), per group size
COUNTS = {2: (640, 384), 4: (640, 384, 512, 512)}
VARIANTS = ("fsdp", "fsdp_cce", "cce_dp")


class Head(nn.Module):
    def __init__(self, d: int, v: int):
        super().__init__()
        self.lm_head = nn.Linear(d, v, bias=False)

    def forward(self, h, t, variant: str):
        import cce_dist
        import cce_dist.fsdp

        if variant == "fsdp":
            return F.cross_entropy(self.lm_head(h), t)
        if variant == "fsdp_cce":  # inside the FSDP forward the weight is the gathered [V, D] tensor
            return cce_dist.linear_cross_entropy(h, self.lm_head.weight, t, impl="torch")
        return cce_dist.fsdp.head_cross_entropy(self.lm_head, h, t, impl="torch")


def _setup(rank: int, world: int, port: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _max_over_ranks(x: float) -> float:
    buf = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX)
    return float(buf)


def worker(rank: int, world: int, port: int, cfg: dict, outdir: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import init_device_mesh

    import cce_dist.fsdp

    _setup(rank, world, port)
    d, v, variant = cfg["D"], cfg["V"], cfg["variant"]
    n = cfg["counts"][rank]
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = Head(d, v)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)
    ignored = cce_dist.fsdp.shard_lm_head(model, mesh) if variant == "cce_dp" else None
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    g = torch.Generator().manual_seed(rank)
    h = torch.randn(n, d, generator=g).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    out: dict = {}

    def step():
        h.grad = None
        for p in model.parameters():
            p.grad = None
        loss = model(h, t, variant)
        loss.backward()
        out["loss"] = float(loss.detach())

    def synced():
        dist.barrier()
        step()

    synced()  # warm-up: lazy initialisation of FSDP and of the loss
    malloc_trim()
    mem = peak_growth(synced, steps=2)
    walls, rank_walls = [], []
    for _ in range(cfg["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        el = time.perf_counter() - t0
        rank_walls.append(round(el, 4))
        walls.append(round(_max_over_ranks(el), 4))
    log = CollectiveLog().install()
    with log.counting():
        step()
    log.uninstall()
    s = log.summary()
    biggest = max((max(c["in_bytes"], c["out_bytes"]) for c in s["calls"]), default=0)
    res = {
        "rank": rank,
        "n": n,
        "loss": out["loss"],
        "wall_s": walls,
        "rank_wall_s": rank_walls,
        "median_s": statistics.median(walls),
        "memory": mem,
        "collectives": {k: s[k] for k in ("count", "in_bytes", "out_bytes", "by_op")},
        "largest_collective_bytes": biggest,
    }
    (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def spawn(world: int, cfg: dict) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, free_port(), cfg, tmp), nprocs=world, join=True)
        return [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("*.json"))]


# ----------------------------------------------------------------------------------------------
# the communication model (docs/fsdp.md)
# ----------------------------------------------------------------------------------------------


def comm_model(p: int, n: int, d: int, v: int, *, w_bytes: int = 2, h_bytes: int = 2, dh_bytes: int = 4) -> dict:
    """Bytes one rank receives per step (ring collectives, the NCCL case), FSDP's head vs cce_dist's data-parallel
    mode, ``n`` tokens on every rank. FSDP: all-gather of the ``[V, D]`` weight in ``w_bytes`` and reduce-scatter of
    its gradient in the same dtype (FSDP2's reduce dtype defaults to the parameter dtype), ``(P-1)/P * V*D`` each.
    cce_dist: all-gather of the hidden states ``(P-1)*n*D*h_bytes``, of the int64 targets and of the float32 upstream
    gradients ``(P-1)*n*(8 + 4)``, the statistics by two all-reduces (MAX of ``N`` float32, SUM of ``N x 4``; ring
    all-reduce: ``2 (P-1)/P`` of the buffer), and the reduce-scatter of dH ``(P-1)/P * N*D*dh_bytes``, ``N = P n``."""
    big_n = p * n
    frac = (p - 1) / p
    fsdp = 2 * frac * v * d * w_bytes
    tokens = (p - 1) * n * d * h_bytes + (p - 1) * n * 12
    stats = 2 * frac * big_n * 4 * 5
    dh = frac * big_n * d * dh_bytes
    return {
        "P": p,
        "fsdp_head_bytes": fsdp,
        "cce_dp_bytes": tokens + stats + dh,
        "cce_dp_hidden_gather_bytes": (p - 1) * n * d * h_bytes,
        "cce_dp_dh_bytes": dh,
        "cce_dp_gathered_activation_bytes": big_n * d * h_bytes + big_n * d * dh_bytes,
        "fsdp_unsharded_head_bytes": v * d * w_bytes + v * d * w_bytes,
    }


MODEL_SHAPE = {"V": 262144, "D": 4096, "n": 8192}


def model_table() -> str:
    gib = 2.0**30
    rows = []
    for p in (8, 16, 32, 64):
        m = comm_model(p, MODEL_SHAPE["n"], MODEL_SHAPE["D"], MODEL_SHAPE["V"])
        rows.append(
            [
                p,
                f"{m['fsdp_head_bytes'] / gib:.2f}",
                f"{m['cce_dp_bytes'] / gib:.2f}",
                f"{m['cce_dp_bytes'] / m['fsdp_head_bytes']:.2f}",
                f"{m['cce_dp_gathered_activation_bytes'] / gib:.2f}",
                f"{m['fsdp_unsharded_head_bytes'] / gib:.2f}",
            ]
        )
    hdr = [
        "P",
        "FSDP head GiB / rank",
        "cce_dp GiB / rank",
        "cce_dp / FSDP",
        "cce_dp gathered h + dH GiB",
        "FSDP unsharded W + grad GiB",
    ]
    return md_table(hdr, rows)


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def render(p: dict) -> str:
    sh = p["shape"]
    s = [
        "# fsdp_head — an FSDP2 LM head kept vocab-sharded (cce_dist.fsdp) vs FSDP's own gather",
        "",
        env_markdown(p["env"]),
        "",
        f"D={sh['D']} V={sh['V']} fp32, the head alone (bias-free), forward + backward of each rank's mean "
        "cross-entropy over its own tokens; 1 thread per rank on gloo. Time: the slower rank per step, median of "
        f"{p['repeats']} repeats after a warm-up. Memory: peak RSS growth above the inputs, max over ranks, fresh "
        "process group per variant. Bytes: sent + received by one rank's collectives per step, max over ranks "
        "(gloo: dH is all-reduced, not reduce-scattered). Ratios against `fsdp` of the same group size.",
        "",
    ]
    hdr = [
        "P",
        "tokens per rank",
        "variant",
        "median s",
        "time / fsdp",
        "peak growth MiB",
        "memory / fsdp",
        "collectives",
        "MiB moved / rank",
        "bytes / fsdp",
        "largest collective MiB",
        "loss (rank 0)",
    ]
    tab = []
    for world, rows in p["worlds"].items():
        base = rows["fsdp"]
        for name, r in rows.items():
            tab.append(
                [
                    world,
                    "/".join(str(x) for x in p["counts"][world]),
                    name,
                    r["median_s"],
                    r["median_s"] / base["median_s"],
                    mib(r["growth_bytes"]),
                    r["growth_bytes"] / base["growth_bytes"],
                    r["count"],
                    mib(r["bytes"]),
                    r["bytes"] / base["bytes"],
                    mib(r["largest_bytes"]),
                    f"{r['loss']:.6f}",
                ]
            )
    s += [md_table(hdr, tab), ""]
    s += [
        f"The head is {mib(sh['V'] * sh['D'] * 4):.1f} MiB (fp32); `cce_dp`'s largest collective is the dH reduction "
        "(`N x D` float32).",
        "",
        "## Communication model at 8-64 ranks (docs/fsdp.md)",
        "",
        f"V={MODEL_SHAPE['V']}, D={MODEL_SHAPE['D']}, {MODEL_SHAPE['n']} tokens per rank, bf16 weight and hidden "
        "states, float32 dH; bytes one rank receives per step with ring collectives (`comm_model`):",
        "",
        model_table(),
        "",
    ]
    return "\n".join(s)


def plot(p: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, vals = [], {"time": [], "memory": [], "bytes": []}
    for world, rows in p["worlds"].items():
        base = rows["fsdp"]
        for name, r in rows.items():
            labels.append(f"P={world}\n{name}")
            vals["time"].append(r["median_s"] / base["median_s"])
            vals["memory"].append(r["growth_bytes"] / base["growth_bytes"])
            vals["bytes"].append(r["bytes"] / base["bytes"])
    xs = range(len(labels))
    for i, (k, ys) in enumerate(vals.items()):
        ax.bar([x + (i - 1) * 0.27 for x in xs], ys, 0.27, label=f"{k} / fsdp")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_title(f"FSDP2 head, D={p['shape']['D']} V={p['shape']['V']} fp32, gloo")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--render-only", action="store_true", help="re-render .md/.png from the saved JSON")
    args = ap.parse_args()
    if args.render_only:
        save_results("fsdp_head", json.loads((RESULTS / "fsdp_head.json").read_text()), render, plot)
        return
    started = time.perf_counter()
    repeats = args.repeats or (2 if args.quick else 5)
    log = logger("fsdp_head")
    env = env_info(mode="quick" if args.quick else "full", repeats=repeats, threads_per_rank=1)
    worlds: dict[str, dict] = {}
    for world in (int(w) for w in args.worlds.split(",")):
        rows = {}
        for variant in VARIANTS:
            log(f"P={world} {variant}")
            cfg = {"D": D, "V": V, "variant": variant, "counts": COUNTS[world], "repeats": repeats}
            per_rank = spawn(world, cfg)
            r0 = per_rank[0]
            rows[variant] = {
                "median_s": r0["median_s"],
                "wall_s": r0["wall_s"],
                "rank_wall_s": [r["rank_wall_s"] for r in per_rank],
                "growth_bytes": max(r["memory"]["growth_bytes"] for r in per_rank),
                "memory_by_rank": [r["memory"] for r in per_rank],
                "count": max(r["collectives"]["count"] for r in per_rank),
                "bytes": max(r["collectives"]["in_bytes"] + r["collectives"]["out_bytes"] for r in per_rank),
                "by_op": r0["collectives"]["by_op"],
                "largest_bytes": max(r["largest_collective_bytes"] for r in per_rank),
                "loss": r0["loss"],
                "loss_by_rank": [r["loss"] for r in per_rank],
            }
            log(f"  {rows[variant]['median_s']:.3f} s, {mib(rows[variant]['bytes']):.1f} MiB moved")
        worlds[str(world)] = rows
    payload = {
        "env": env,
        "question": "FSDP2 LM head: cce_dist's vocab-sharded data-parallel mode vs FSDP's gather",
        "shape": {"D": D, "V": V},
        "counts": {str(w): COUNTS[int(w)] for w in worlds},
        "repeats": repeats,
        "worlds": worlds,
        "model": [comm_model(p, MODEL_SHAPE["n"], MODEL_SHAPE["D"], MODEL_SHAPE["V"]) for p in (8, 16, 32, 64)],
    }
    close_env(env, started)
    save_results("fsdp_head", payload, render, plot)


if __name__ == "__main__":
    sys.exit(main())
