"""GPU benchmark: cce_dist's Triton path against the materialized loss and the peers.

Question: on one GPU, at LLM head shapes in bf16, how do forward, backward and forward+backward
time and peak memory compare between the materialized ``F.linear`` + ``F.cross_entropy``, its
``torch.compile``, Apple's Cut Cross-Entropy, Liger-Kernel's fused linear cross-entropy and
cce_dist (triton)? Peers are measured only when they import (carry their wheels; see
benchmarks/gpu_suite.sh).

Timing: CUDA events around each phase, ``--warmup`` untimed runs, median of ``--repeats``.
Memory: peak allocated during forward+backward minus what was allocated before (inputs), next to
the bytes of the gradients themselves (dH + dW), which every method must produce.
FLOPs: the materialized count, 2*N*D*V for the forward and 4*N*D*V for the backward (dH, dW);
TFLOP/s = that count / time (recomputation done by a method is not credited).

    python benchmarks/gpu_suite.py --out benchmarks/results            # full (about 4-6 min on an H200)
    python benchmarks/gpu_suite.py --quick                             # one small shape
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = [(8192, 2304, 256000), (16384, 4096, 128256), (8192, 3584, 152064)]
QUICK_SHAPES = [(4096, 2048, 65536)]


def materialized(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def _variants() -> dict[str, Callable]:
    import cce_dist

    out: dict[str, Callable] = {
        "materialized": materialized,
        "torch.compile": torch.compile(materialized),
        "cce_dist": lambda h, w, t: cce_dist.linear_cross_entropy(h, w, t, impl="triton"),
        "cce_dist(filter)": lambda h, w, t: cce_dist.linear_cross_entropy(h, w, t, impl="triton", filter_eps="auto"),
    }
    try:
        from cut_cross_entropy import linear_cross_entropy as apple_cce

        out["apple_cce"] = lambda h, w, t: apple_cce(h, w, t)
    except ImportError as e:
        print(f"[skip] apple cut-cross-entropy not importable: {e}", file=sys.stderr)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda h, w, t: liger(w, h, t)
    except ImportError as e:
        print(f"[skip] liger-kernel not importable: {e}", file=sys.stderr)
    return out


def _median_ms(fn: Callable[[], None], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench_one(name: str, fn: Callable, n: int, d: int, v: int, warmup: int, repeats: int) -> dict:
    torch.manual_seed(0)
    dev = "cuda"
    h = (torch.randn(n, d, device=dev, dtype=torch.bfloat16) * 0.5).requires_grad_()
    w = (torch.randn(v, d, device=dev, dtype=torch.bfloat16) * d**-0.5).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)

    def fwd():
        with torch.no_grad():
            fn(h, w, t)

    def fwd_bwd():
        h.grad = w.grad = None
        fn(h, w, t).backward()

    row = {"method": name, "N": n, "D": d, "V": v}
    try:
        row["fwd_ms"] = _median_ms(fwd, warmup, repeats)
        row["fwd_bwd_ms"] = _median_ms(fwd_bwd, warmup, repeats)
        row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn(h, w, t)
        loss.backward()
        torch.cuda.synchronize()
        row["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["grad_mb"] = (h.numel() + w.numel()) * 2 / 2**20
        row["overhead_mb"] = row["peak_mb"] - row["grad_mb"]
        row["loss"] = float(loss)
        flops = 6.0 * n * d * v
        row["tflops_fwd_bwd"] = flops / (row["fwd_bwd_ms"] * 1e-3) / 1e12
        row["tflops_fwd"] = flops / 3 / (row["fwd_ms"] * 1e-3) / 1e12
    except torch.cuda.OutOfMemoryError as e:  # a peer may not fit; record it
        row["error"] = f"OOM: {e}"[:200]
    finally:
        h.grad = w.grad = None
        h = w = t = None  # free the inputs (the timing closures hold them) before emptying the cache
        torch.cuda.empty_cache()
    return row


def atomic_throughput(warmup: int, repeats: int) -> list[dict]:
    """fp32 atomic-add payload throughput (GB/s): ``index_add_`` (one atomicAdd per element, rows
    each hit once) into an L2-resident 16 MB buffer and into a 2.36 GB one (the fused backward's
    dW at the paper shape). Replaces the atomic-throughput assumption of benchmarks/gpu_model.py."""

    def one(label: str, nrows: int, d: int) -> dict:
        out = torch.zeros(nrows, d, device="cuda")
        src = torch.randn(nrows, d, device="cuda")
        idx = torch.randperm(nrows, device="cuda")
        ms = _median_ms(lambda: out.index_add_(0, idx, src), warmup, repeats)
        return {"buffer": label, "bytes": src.numel() * 4, "ms": ms, "gb_per_s": src.numel() * 4 / ms / 1e6}

    rows = []
    for label, nrows, d in (("L2-resident 16 MB", 1736, 2304), ("HBM 2.36 GB (dW at paper shape)", 256000, 2304)):
        rows.append(one(label, nrows, d))
        torch.cuda.empty_cache()
    return rows


def kernel_times(warmup: int, repeats: int) -> list[dict]:
    """Each cce_dist kernel timed alone at the paper shape, next to benchmarks/gpu_model.py's
    estimate for it (results/gpu_model.json of this commit)."""
    import cce_dist.kernels as K
    from cce_dist.backend import ALPHA, BETA, NUM_COEFS

    n, d, v = SHAPES[0]
    torch.manual_seed(0)
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16) * 0.5
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    t = torch.randint(0, v, (n,), device="cuda")
    stats = K.row_stats(h, w, None, t, vocab_start=0, softcap=None, temperature=None)
    lse = stats[:, 0] + torch.log(stats[:, 1])
    coef = torch.zeros(n, NUM_COEFS, device="cuda")  # mean cross-entropy: ALPHA = 1/N, BETA (excess over ALPHA) = 0
    coef[:, ALPHA] = 1.0 / n
    coef[:, BETA] = 0.0
    common = dict(vocab_start=0, softcap=None, temperature=None, need_hidden=True, need_weight=True, need_bias=False)
    runs = {
        "forward": lambda: K.row_stats(h, w, None, t, vocab_start=0, softcap=None, temperature=None),
        "forward cross-entropy (no SUM / ENTROPY)": lambda: K.row_stats(
            h, w, None, t, vocab_start=0, softcap=None, temperature=None, need_sum=False, need_entropy=False
        ),
        "backward chunked (default)": lambda: K.grads(h, w, None, t, lse, coef, _schedule="chunked", **common),
        "backward fused": lambda: K.grads(h, w, None, t, lse, coef, _schedule="tiles", **common),
        "backward super-tile (opt-in)": lambda: K.grads(h, w, None, t, lse, coef, _schedule="super", **common),
        "backward fused filter": lambda: K.grads(
            h, w, None, t, lse, coef, filter_eps=2.0**-12, _schedule="tiles", **common
        ),
        "backward deterministic (owner-computes)": lambda: K.grads(
            h, w, None, t, lse, coef, deterministic=True, _schedule="owner", **common
        ),
    }
    model = {}
    path = os.path.join(os.path.dirname(__file__), "results", "gpu_model.json")
    if os.path.exists(path):
        with open(path) as f:
            for r in json.load(f)["kernels"]:
                est = r["H200 SXM"]["est_ms"] if "H200" in torch.cuda.get_device_name() else r["H100 SXM"]["est_ms"]
                key = r["label"]
                if key.startswith("forward"):
                    model[key] = min(model.get(key, float("inf")), est)  # the autotuner keeps the fastest
                else:
                    model[key] = model.get(key, 0.0) + est  # kernels of one call run in sequence
    rows = []
    for name, fn in runs.items():
        ms = _median_ms(fn, warmup, repeats)
        rows.append(
            {
                "kernel": name,
                "measured_ms": ms,
                "model_ms": model.get(name),
                "measured_over_model": ms / model[name] if name in model else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def env() -> dict:
    def git(*a):
        try:
            return subprocess.check_output(["git", *a], text=True, stderr=subprocess.DEVNULL).strip()
        except Exception:
            return "unknown"

    import triton

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": git("rev-parse", "--short", "HEAD") + ("-dirty" if git("status", "--porcelain") else ""),
    }


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# GPU suite — {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}",
        "",
        f"{meta['date']}. bf16; FLOPs counted as 6*N*D*V for forward+backward.",
        "",
        "| N | D | V | method | fwd ms | bwd ms | fwd+bwd ms | vs apple_cce | TFLOP/s | peak MB | grads MB "
        "| overhead MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['N']} | {r['D']} | {r['V']} | {r['method']} | {r['error']} |||||||")
            continue
        ref = next(
            (
                x
                for x in rows
                if x["method"] == "apple_cce" and x["N"] == r["N"] and x["V"] == r["V"] and "error" not in x
            ),
            None,
        )
        ratio = f"{r['fwd_bwd_ms'] / ref['fwd_bwd_ms']:.2f}x" if ref else "n/a"
        lines.append(
            f"| {r['N']} | {r['D']} | {r['V']} | {r['method']} | {r['fwd_ms']:.2f} | {r['bwd_ms']:.2f} | "
            f"{r['fwd_bwd_ms']:.2f} | {ratio} | {r['tflops_fwd_bwd']:.0f} | {r['peak_mb']:.0f} | "
            f"{r['grad_mb']:.0f} | {r['overhead_mb']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--methods", default="", help="comma-separated subset")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_suite.py needs a CUDA device")
    variants = _variants()
    if a.methods:
        keep = set(a.methods.split(","))
        variants = {k: v for k, v in variants.items() if k in keep}
    atomics = atomic_throughput(a.warmup, a.repeats)
    kernels = [] if a.quick else kernel_times(1, 3)
    rows = []
    for n, d, v in QUICK_SHAPES if a.quick else SHAPES:
        for name, fn in variants.items():
            row = bench_one(name, fn, n, d, v, a.warmup, a.repeats)
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = env()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "gpu_suite.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "atomics": atomics, "kernels": kernels}, f, indent=1)
    md = markdown(rows, meta)
    md += "\n## fp32 atomic throughput (the model assumes 1.5 TB/s)\n\n| buffer | ms | GB/s |\n|---|---|---|\n"
    md += "".join(f"| {r['buffer']} | {r['ms']:.2f} | {r['gb_per_s']:.0f} |\n" for r in atomics)
    if kernels:
        md += (
            "\n## Kernels at the paper shape: measured vs benchmarks/gpu_model.py\n\n"
            "| kernel | measured ms | model ms | measured / model |\n|---|---|---|---|\n"
        )
        md += "".join(
            f"| {r['kernel']} | {r['measured_ms']:.2f} | {r['model_ms'] or float('nan'):.2f} | "
            f"{r['measured_over_model'] or float('nan'):.2f} |\n"
            for r in kernels
        )
    with open(os.path.join(a.out, "gpu_suite.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
