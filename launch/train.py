"""torchrun entry point: train a small decoder LM whose output head is vocab-parallel, and compare
cce_dist's logits-free loss with the materialized Megatron-style loss step by step.

    torchrun --standalone --nproc-per-node 2 launch/train.py            # tp=2, CPU, gloo
    torchrun --standalone --nproc-per-node 4 launch/train.py --tp 2     # tp=2 x dp=2
    torchrun --standalone --nproc-per-node 8 launch/train.py --device cuda --dtype bf16

Layout: world = tp * dp. TP groups are consecutive ranks; each TP rank holds rows [start, stop)
of the head weight; the rest of the model is replicated. DP groups take one rank of every TP
group; every gradient is averaged over its DP group. Both losses return the full hidden-state
gradient on every TP rank, so the replicated trunk gets identical gradients on all TP ranks.

With ``--loss both`` (default) two identical seeded models train side by side on the same batches,
one through ``cce_dist.linear_cross_entropy`` and one through ``launch/baseline.py``. Rank 0
prints a table, writes ``summary.json`` and ``curves.png`` to ``--out-dir`` and ends with a
one-line ``VERDICT``. Exit status 2 when the curves disagree beyond the tolerance.

Memory is the peak of tensor bytes allocated by the loss's forward + backward (including the
dH and dW it returns) above what existed before; see ``launch/memory.py``. On CUDA the caching
allocator's ``max_memory_allocated`` delta over the same region is recorded too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline  # noqa: E402
import data  # noqa: E402
from memory import TensorMemory  # noqa: E402
from model import ModelConfig, VocabParallelLM  # noqa: E402

# Agreement tolerances. The two variants are independent trainings from the same weights on the
# same batches; they differ only in floating-point summation order (chunked vs one block, the
# order of the fp32 statistics across ranks), and those last-bit differences in the gradients
# grow slowly through the optimizer. First step (identical weights): relative difference of the
# loss and of the hidden/head gradients. Curve: max |loss_cce - loss_materialized| over all steps
# in nats. Measured with the defaults (200 steps, fp32): <= 6e-5 on all but one step, 5.6e-4 at the
# worst (a batch with an outlier token whose loss is very sensitive to the weights); on that
# weight state both losses agree with a float64 reference to 1e-6. A wrong gradient (e.g. a dH
# not reduced over the group) shows up at step 0 and moves the curves by >1e-2 within a few steps.
TOL_FIRST = {"fp32": 1e-5, "bf16": 1e-2}
TOL_GRAD = {"fp32": 1e-4, "bf16": 5e-2}
TOL_CURVE = {"fp32": 5e-3, "bf16": 5e-2}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tp", type=int, default=0, help="tensor-parallel size (0 = world size)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="compute dtype (bf16 = autocast; master weights stay fp32)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu uses gloo, cuda uses NCCL (one GPU per local rank)")
    ap.add_argument("--impl", choices=["auto", "torch", "triton"], default="auto",
                    help="cce_dist implementation")
    ap.add_argument("--loss", choices=["both", "cce", "materialized"], default="both")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per DP rank per step")
    ap.add_argument("--vocab-size", type=int, default=32768,
                    help="BPE vocabulary trained on the stdlib (the demo wants >= 32768)")
    ap.add_argument("--max-files", type=int, default=None,
                    help="train the tokenizer on the first N stdlib files only (fast tests)")
    ap.add_argument("--chunk-size", type=int, default=1 << 20,
                    help="cce_dist torch impl: logits elements held at once (0 = library default)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads per rank (0 = cores / local ranks)")
    ap.add_argument("--log-every", type=int, default=10, help="table row every N steps")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "out")
    ap.add_argument("--no-progress", action="store_true",
                    help="no progress bar (there is none anyway when stdout is not a terminal)")
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    if a.vocab_size < 512:
        ap.error("--vocab-size must be >= 512")
    return a


# --------------------------------------------------------------------------------------------
# process groups


def init_distributed(device: str):
    """Init from torchrun's env (or as a single process); return rank, world, local rank/world."""
    if "RANK" not in os.environ:  # plain `python launch/train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    # generous: local rank 0 may spend minutes building the tokenizer cache before a barrier
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return rank, world, local_rank, local_world


def build_groups(rank: int, world: int, tp: int):
    """TP groups of consecutive ranks, DP groups across them. Every rank creates every group."""
    if world % tp:
        raise SystemExit(f"world size {world} is not divisible by --tp {tp}")
    dp = world // tp
    tp_group = dp_group = None
    for i in range(dp):
        g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
        if rank // tp == i:
            tp_group = g
    for j in range(tp):
        g = dist.new_group(list(range(j, world, tp)))
        if rank % tp == j:
            dp_group = g
    return tp_group, dp_group, rank % tp, rank // tp, dp


# --------------------------------------------------------------------------------------------
# the two losses


def make_cce_loss(tp_group, start: int, stop: int, impl: str, chunk_size: int):
    """cce_dist's logits-free vocab-parallel loss, as ``f(hidden, weight_shard, targets)``."""
    import cce_dist

    shard = cce_dist.VocabShard(tp_group, start, stop)
    kw = {"chunk_size": chunk_size} if chunk_size > 0 else {}

    def loss_fn(hidden, weight_shard, targets):
        return cce_dist.linear_cross_entropy(hidden, weight_shard, targets, shard=shard,
                                             reduction="mean", impl=impl, **kw)

    return loss_fn


def make_materialized_loss(tp_group, start: int):
    def loss_fn(hidden, weight_shard, targets):
        return baseline.vocab_parallel_cross_entropy(hidden, weight_shard, targets, start, tp_group)

    return loss_fn


# --------------------------------------------------------------------------------------------
# one training step of one variant


class Variant:
    def __init__(self, name, model, loss_fn, args, dp_group, dp):
        self.name, self.model, self.loss_fn = name, model, loss_fn
        self.dp_group, self.dp = dp_group, dp
        self.opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                     weight_decay=0.0)
        warm, total = max(1, args.warmup), args.steps

        def lr_lambda(s):  # linear warmup, cosine decay to 10%
            if s < warm:
                return (s + 1) / warm
            p = (s - warm) / max(1, total - warm)
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, p)))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)
        self.hidden_grad = None  # step-0 gradients, for the cross-check

    def step(self, x, y, autocast, device, keep_grads=False):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with autocast():
            h = self.model(x)
        h_in = h.detach().requires_grad_()
        # The loss region: forward + backward of the head alone, memory-tracked.
        cuda_base = 0
        if device.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats()
            cuda_base = torch.cuda.memory_allocated()
        t1 = time.perf_counter()
        with TensorMemory() as mem:
            with autocast():
                loss = self.loss_fn(h_in, self.model.head_weight, y)
            loss.backward()
        sync()
        t2 = time.perf_counter()
        cuda_peak = torch.cuda.max_memory_allocated() - cuda_base if device.type == "cuda" else 0
        if keep_grads:
            self.hidden_grad = h_in.grad.detach().clone()
            self.head_grad = self.model.head_weight.grad.detach().clone()
        h.backward(h_in.grad)
        if self.dp > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad.div_(self.dp)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        loss = loss.detach().float()
        if self.dp > 1:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.dp
        sync()
        t3 = time.perf_counter()
        return {"loss": loss.item(), "step_s": t3 - t0, "loss_s": t2 - t1,
                "mem": mem.peak, "cuda_mem": cuda_peak}


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    rank, world, local_rank, local_world = init_distributed(args.device)
    tp = args.tp or world
    tp_group, dp_group, tp_rank, dp_rank, dp = build_groups(rank, world, tp)
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cpu":
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        torch.set_num_threads(args.threads or max(1, cores // local_world))
    main_rank = rank == 0
    log = print if main_rank else (lambda *a, **k: None)

    # ---- data: local rank 0 of each node builds the cache, the others wait and load
    if local_rank == 0:
        folder = data.prepare(args.vocab_size, args.max_files, progress=main_rank)
    dist.barrier()
    if local_rank != 0:
        folder = data.prepare(args.vocab_size, args.max_files, progress=False)
    tokens, meta = data.load(folder)
    vocab = meta["vocab_size"]
    v_pad = -(-vocab // tp) * tp  # pad the head so the vocab splits evenly (as Megatron does)
    per = v_pad // tp
    start, stop = tp_rank * per, (tp_rank + 1) * per
    batches = data.Batches(tokens, args.batch_size, args.seq_len, args.seed, dp_rank)

    cfg = ModelConfig(vocab_size=v_pad, d_model=args.d_model, n_layers=args.layers,
                      n_heads=args.heads, seq_len=args.seq_len)
    torch.manual_seed(args.seed)
    compute_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    def autocast():
        if compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device.type, dtype=compute_dtype)

    variants: list[Variant] = []
    if args.loss in ("both", "cce"):
        m = VocabParallelLM(cfg, start, stop, seed=args.seed).to(device)
        variants.append(Variant("cce", m, make_cce_loss(tp_group, start, stop, args.impl,
                                                        args.chunk_size), args, dp_group, dp))
    if args.loss in ("both", "materialized"):
        m = VocabParallelLM(cfg, start, stop, seed=args.seed).to(device)
        variants.append(Variant("materialized", m, make_materialized_loss(tp_group, start),
                                args, dp_group, dp))
    names = [v.name for v in variants]
    n_params = sum(p.numel() for p in variants[0].model.parameters())
    n_head_full = v_pad * args.d_model
    tokens_local = args.batch_size * args.seq_len
    tokens_global = tokens_local * dp
    logits_mb = baseline.logits_bytes(tokens_local, per, compute_dtype) / 2**20
    grads_mb = (per + tokens_local) * args.d_model * 4 / 2**20  # dW shard + dH, fp32, both hold

    log(f"[setup] world {world} = tp {tp} x dp {dp} | backend {dist.get_backend()} | device "
        f"{args.device} | dtype {args.dtype} | torch threads/rank {torch.get_num_threads()}")
    log(f"[setup] data: {meta['tokens']:,} stdlib tokens, vocab {vocab} (head padded to {v_pad}, "
        f"{per} rows per TP rank) | model: d {args.d_model}, layers {args.layers}, heads "
        f"{args.heads}, params {n_params - per * args.d_model + n_head_full:,} "
        f"(head {n_head_full:,}) | {tokens_global:,} tokens/step")
    log(f"[setup] losses: {', '.join(names)} | cce impl {args.impl}, chunk_size "
        f"{args.chunk_size or 'default'} | per rank: materialized logits {logits_mb:.1f} MiB, "
        f"dW+dH (both variants) {grads_mb:.1f} MiB")

    # ---- training
    hist = {n: {"loss": [], "step_s": [], "loss_s": [], "mem": [], "cuda_mem": []} for n in names}
    mem_rank = {n: 0 for n in names}  # this rank's peak over steps
    stat_dev = device if args.device == "cuda" else torch.device("cpu")
    grad_check = {}
    steps = range(args.steps)
    bar = None
    if main_rank and not args.no_progress and sys.stdout.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True,
                       file=sys.stdout)
        except ImportError:
            pass
    out = bar.write if bar is not None else log
    short = {"cce": "cce", "materialized": "mat"}
    header = f"{'step':>5} | " + " | ".join(f"{'loss ' + short[n]:>10}" for n in names)
    if len(names) == 2:
        header += f" | {'|Δloss|':>9}"
    header += " | " + " | ".join(f"{'tok/s ' + short[n]:>10}" for n in names)
    header += " | " + " | ".join(f"{'MiB ' + short[n]:>9}" for n in names)
    out("[table] loss: global mean over the step's tokens; tok/s: global tokens / step time; "
        "MiB: peak tensor memory of the loss fwd+bwd, max over ranks")
    out(header)
    out("-" * len(header))
    for step in steps:
        x, y = batches.get(step)
        x, y = x.to(device), y.to(device)
        res = {}
        for v in variants:
            res[v.name] = v.step(x, y, autocast, device, keep_grads=(step == 0 and len(names) == 2))
        if step == 0 and len(names) == 2:
            a, b = variants
            grad_check = {"hidden_grad_max_rel_diff": max_rel_diff(a.hidden_grad, b.hidden_grad),
                          "head_grad_max_rel_diff": max_rel_diff(a.head_grad, b.head_grad)}
            t = torch.tensor(list(grad_check.values()), dtype=torch.float64, device=stat_dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            grad_check = dict(zip(grad_check, t.tolist()))
            for v in variants:
                v.hidden_grad = v.head_grad = None
        # max over ranks of time and memory (losses are already identical across ranks)
        t = torch.tensor([[res[n]["step_s"], res[n]["loss_s"], res[n]["mem"], res[n]["cuda_mem"]]
                          for n in names], dtype=torch.float64, device=stat_dev)
        for n in names:
            mem_rank[n] = max(mem_rank[n], res[n]["mem"])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for i, n in enumerate(names):
            hist[n]["loss"].append(res[n]["loss"])
            for j, k in enumerate(("step_s", "loss_s", "mem", "cuda_mem")):
                hist[n][k].append(t[i, j].item())
        if main_rank and (step % args.log_every == 0 or step == args.steps - 1):
            row = f"{step:>5} | " + " | ".join(f"{res[n]['loss']:>10.5f}" for n in names)
            if len(names) == 2:
                row += f" | {abs(res[names[0]]['loss'] - res[names[1]]['loss']):>9.2e}"
            row += " | " + " | ".join(f"{tokens_global / hist[n]['step_s'][-1]:>10.0f}"
                                      for n in names)
            row += " | " + " | ".join(f"{hist[n]['mem'][-1] / 2**20:>9.2f}" for n in names)
            out(row)
        if bar is not None:
            bar.set_postfix({short[n]: f"{res[n]['loss']:.3f}" for n in names})
            bar.update(1)
    if bar is not None:
        bar.close()

    # ---- per-rank peaks and a replica-consistency check of the trunk across the TP group
    peaks = torch.tensor([mem_rank[n] for n in names], dtype=torch.float64, device=stat_dev)
    all_peaks = [torch.zeros_like(peaks) for _ in range(world)]
    dist.all_gather(all_peaks, peaks)
    in_sync = True
    for v in variants:
        s = torch.stack([p.detach().double().sum() for n_, p in v.model.named_parameters()
                         if n_ != "head_weight"]).to(stat_dev)
        lo, hi = s.clone(), s.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=tp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=tp_group)
        ok = torch.tensor([float(torch.equal(lo, hi))], device=stat_dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        in_sync &= bool(ok.item())
    wall = time.perf_counter() - t_start

    status = 0
    if main_rank:
        status = report(args, names, hist, all_peaks, grad_check, in_sync, meta, cfg, world, tp,
                        dp, per, tokens_global, logits_mb, grads_mb, n_params, wall)
    st = torch.tensor([float(status)], device=stat_dev)
    dist.broadcast(st, 0)
    dist.destroy_process_group()
    return int(st.item())


def _median(xs):
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def report(args, names, hist, all_peaks, grad_check, in_sync, meta, cfg, world, tp, dp, per,
           tokens_global, logits_mb, grads_mb, n_params, wall) -> int:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    warm = hist[names[0]]["step_s"][1:] or hist[names[0]]["step_s"]
    skip = 1 if len(warm) < len(hist[names[0]]["step_s"]) else 0
    summary = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "world": world, "tp": tp, "dp": dp, "vocab": meta["vocab_size"], "vocab_padded":
        cfg.vocab_size, "vocab_per_rank": per, "params": n_params, "tokens_per_step":
        tokens_global, "data": meta, "torch": torch.__version__,
        "materialized_logits_mib_per_rank": logits_mb,
        "grads_mib_per_rank": grads_mb,
        "memory_method": "peak bytes of tensors allocated by the loss forward+backward (incl. the "
                         "dH/dW it returns) above what existed before, per rank (launch/memory.py)",
        "steps": list(range(args.steps)),
        "wall_s": wall,
    }
    for n in names:
        h = hist[n]
        summary[n] = {
            "loss": h["loss"],
            "step_s": h["step_s"],
            "loss_s": h["loss_s"],
            "loss_mem_mib": [m / 2**20 for m in h["mem"]],
            "cuda_loss_mem_mib": [m / 2**20 for m in h["cuda_mem"]] if args.device == "cuda"
            else None,
            "peak_loss_mem_mib_per_rank": [p[names.index(n)].item() / 2**20 for p in all_peaks],
            "median_tokens_per_s": tokens_global / _median(h["step_s"][skip:]),
            "median_loss_ms": 1e3 * _median(h["loss_s"][skip:]),
            "first_loss": h["loss"][0],
            "last_loss": h["loss"][-1],
            "finite": all(math.isfinite(x) for x in h["loss"]),
        }
    summary["trunk_replicas_in_sync"] = in_sync
    status = 0
    if len(names) == 2:
        a, b = (summary[n]["loss"] for n in names)
        diffs = [abs(x - y) for x, y in zip(a, b)]
        tol, tol0 = TOL_CURVE[args.dtype], TOL_FIRST[args.dtype]
        first_ok = diffs[0] <= tol0 * max(1.0, abs(b[0]))
        curve_ok = max(diffs) <= tol
        grad_ok = all(g <= TOL_GRAD[args.dtype] for g in grad_check.values())
        finite = summary["cce"]["finite"] and summary["materialized"]["finite"]
        agree = first_ok and curve_ok and grad_ok and finite and in_sync
        mc = max(summary["cce"]["peak_loss_mem_mib_per_rank"])
        mm = max(summary["materialized"]["peak_loss_mem_mib_per_rank"])
        summary["agreement"] = {
            "max_abs_diff": max(diffs), "first_step_abs_diff": diffs[0],
            "median_abs_diff": _median(diffs), "last_step_abs_diff": diffs[-1],
            "tol_curve": tol, "tol_first_step_rel": tol0, "tol_grad_rel": TOL_GRAD[args.dtype],
            **grad_check, "agree": agree,
        }
        summary["memory"] = {"cce_peak_mib": mc, "materialized_peak_mib": mm,
                             "ratio": mm / mc if mc > 0 else float("inf")}
        verdict = (f"VERDICT: curves {'agree' if agree else 'DISAGREE'} (max |Δloss| = "
                   f"{max(diffs):.1e} over {args.steps} steps, {args.dtype} tol {tol:g}; first step "
                   f"{diffs[0]:.1e}); loss memory {mc:.1f} MiB vs {mm:.1f} MiB per rank "
                   f"({summary['memory']['ratio']:.1f}x less; the materialized logits alone are "
                   f"{logits_mb:.1f} MiB)")
        if not in_sync:
            verdict += "; TRUNK REPLICAS DIVERGED across the TP group"
        status = 0 if agree else 2
    else:
        n = names[0]
        s = summary[n]
        verdict = (f"VERDICT: {n} only: loss {s['first_loss']:.3f} -> {s['last_loss']:.3f} over "
                   f"{args.steps} steps, peak loss memory {max(s['peak_loss_mem_mib_per_rank']):.1f}"
                   f" MiB per rank")
        status = 0 if s["finite"] and in_sync else 2
    summary["verdict"] = verdict
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        plot(summary, names, args.out_dir / "curves.png")
    except ImportError as e:  # matplotlib missing: keep the JSON, say so
        print(f"[plot] skipped ({e})")
    print()
    for n in names:
        s = summary[n]
        print(f"[{n}] loss {s['first_loss']:.4f} -> {s['last_loss']:.4f} | median "
              f"{s['median_tokens_per_s']:.0f} tok/s, loss fwd+bwd {s['median_loss_ms']:.1f} ms | "
              f"peak loss memory per rank (MiB): "
              + ", ".join(f"{m:.1f}" for m in s["peak_loss_mem_mib_per_rank"]))
    if grad_check:
        print(f"[check] step-0 gradients, max relative difference: hidden "
              f"{grad_check['hidden_grad_max_rel_diff']:.1e}, head shard "
              f"{grad_check['head_grad_max_rel_diff']:.1e}")
    print(f"[out] {args.out_dir / 'summary.json'}, {args.out_dir / 'curves.png'} "
          f"({wall:.0f} s total)")
    print(verdict, flush=True)
    return status


def plot(summary, names, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"cce": "tab:blue", "materialized": "tab:orange"}
    fig = plt.figure(figsize=(12, 5.5))
    gs = fig.add_gridspec(2, 2, width_ratios=[2, 1], height_ratios=[3, 1.3])
    ax1 = fig.add_subplot(gs[0, 0])
    ax2 = fig.add_subplot(gs[:, 1])
    steps = summary["steps"]
    for n in names:
        ls = "-" if n == "cce" else "--"
        ax1.plot(steps, summary[n]["loss"], ls, color=colors[n], label=n, lw=1.5)
    ax1.set_ylabel("training loss (nats)")
    ax1.set_title(f"tp={summary['tp']} dp={summary['dp']}, vocab {summary['vocab']}, "
                  f"{summary['config']['dtype']}, {summary['tokens_per_step']} tokens/step")
    ax1.legend(loc="upper right")
    if len(names) == 2:
        ax1.tick_params(labelbottom=False)
        ax3 = fig.add_subplot(gs[1, 0], sharex=ax1)
        floor = 1e-8
        d = [max(abs(x - y), floor) for x, y in zip(summary["cce"]["loss"],
                                                   summary["materialized"]["loss"])]
        ax3.semilogy(steps, d, color="gray", lw=0.8)
        ax3.axhline(summary["agreement"]["tol_curve"], color="red", ls=":", lw=1,
                    label=f"tolerance {summary['agreement']['tol_curve']:g}")
        ax3.set_ylim(floor / 2, max(summary["agreement"]["tol_curve"], max(d)) * 5)
        ax3.set_ylabel("|Δloss|")
        ax3.set_xlabel(f"step (|Δloss| = 0 drawn at {floor:g})")
        ax3.legend(loc="lower right", fontsize=8)
    else:
        ax1.set_xlabel("step")
    world = len(summary[names[0]]["peak_loss_mem_mib_per_rank"])
    width = 0.8 / len(names)
    top = summary["materialized_logits_mib_per_rank"]
    for i, n in enumerate(names):
        xs = [r + (i - (len(names) - 1) / 2) * width for r in range(world)]
        ys = summary[n]["peak_loss_mem_mib_per_rank"]
        top = max(top, *ys)
        bars = ax2.bar(xs, ys, width, color=colors[n], label=n)
        ax2.bar_label(bars, fmt="%.1f", fontsize=8)
    ax2.axhline(summary["materialized_logits_mib_per_rank"], color="k", ls=":", lw=1,
                label="fp32 logits block (analytic)")
    ax2.set_ylim(0, top * 1.35)
    ax2.set_xticks(range(world))
    ax2.set_xlabel("rank")
    ax2.set_ylabel("MiB")
    ax2.set_title("peak memory of loss forward+backward")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
