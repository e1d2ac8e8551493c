"""Is cce_dist's CPU path (impl='torch') as fast as the materialized loss, with ~10x
less memory, and faster than PyTorch's own chunked ``F.linear_cross_entropy``?

One device, forward + backward (grads for hidden and weight), side by side in one run:

- ``materialized``  ``F.cross_entropy(F.linear(h, W), t)``
- ``cce``           ``cce_dist.linear_cross_entropy(h, W, t, impl='torch')`` (defaults: fused schedule)
- ``cce_2pass``     same with ``grad_in_forward=False`` (forward statistics, recompute in backward)
- ``torch_default`` ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``
- ``torch_best``    PyTorch's chunked path at the fastest ``batch_chunk_size`` of a short sweep

Time: median of >= 3 interleaved repeats after a warm-up (wall and process CPU time), and the
ratio to ``materialized``. Memory: peak RSS growth above the inputs, measured in a fresh
subprocess per variant (VmHWM reset after the inputs exist; one warm-up + one measured step),
also minus the gradient bytes (the unavoidable output).

Also: scaling in V (32768, 262144 fp32), bf16 (at a reduced shape: this CPU has no native bf16
GEMM, see the results), and a sweep of cce_dist's ``chunk_size`` around its default.

Usage, from the repository root: ``python -m benchmarks.cpu_single [--quick]``
(results: benchmarks/results/cpu_single.*)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import (
    RESULTS,
    child_print,
    close_env,
    env_info,
    env_markdown,
    logger,
    md_table,
    mib,
    peak_growth,
    rss_bytes,
    run_child,
    save_results,
    steady_growth,
    time_interleaved,
)

THREADS = 2
N, D, V = 2048, 512, 65536
TORCH_SWEEP = [128, 256, 512, 1024]  # batch_chunk_size of PyTorch's chunked path (64: > 10x slower)
CHUNK_SWEEP = [2**21, 2**22, 2**23, 2**24, 2**25]  # cce_dist chunk_size (logits per chunk)
SCALING_V = [32768, 262144]
BF16_SHAPE = (512, 512, 8192)  # N, D, V: bf16 GEMMs are emulated on this CPU (~100x slower)


# ----------------------------------------------------------------------------------------------
# variants
# ----------------------------------------------------------------------------------------------


def make_inputs(n: int, d: int, v: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(v, d, generator=g, dtype=torch.float32) * 0.02).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    return h, w, t


def make_step(variant: str, opts: dict, h, w, t):
    """A closure running forward + backward once (grads dropped first)."""
    import cce_dist

    if variant == "materialized":

        def loss():
            return F.cross_entropy(F.linear(h, w), t)
    elif variant == "cce":

        def loss():
            return cce_dist.linear_cross_entropy(h, w, t, impl="torch", **opts)
    elif variant == "torch_chunked":
        o = torch.nn.LinearCrossEntropyOptions(**opts)

        def loss():
            return F.linear_cross_entropy(h, w, t, options=o)
    else:
        raise ValueError(variant)

    def step():
        h.grad = None
        w.grad = None
        loss().backward()

    return step


def torch_opts(batch_chunk_size):
    return {} if batch_chunk_size is None else {"batch_chunk_size": batch_chunk_size, "chunking_method": None}


def child_main(spec: dict) -> None:
    """Fresh process: allocate inputs, then measure peak RSS growth of warm-up + measured step."""
    torch.set_num_threads(THREADS)
    dtype = getattr(torch, spec["dtype"])
    # One call at a tiny shape first: one-time costs (lazy imports -- cce_dist's first call imports
    # torch.distributed.tensor (+sympy), PyTorch's chunked path its own modules -- ~50-150 MiB of
    # RSS) are not per-step memory. They are reported separately as "first_call_bytes".
    r0 = rss_bytes()
    tiny = make_inputs(8, spec["D"], 64, dtype, seed=1)
    make_step(spec["variant"], {k: v for k, v in spec["opts"].items() if k != "batch_chunk_size"}, *tiny)()
    del tiny
    first_call = rss_bytes() - r0
    h, w, t = make_inputs(spec["N"], spec["D"], spec["V"], dtype)
    step = make_step(spec["variant"], spec["opts"], h, w, t)
    res = peak_growth(step, steps=2)
    res["first_call_bytes"] = first_call
    res.update(steady_growth(step))
    res["grad_bytes"] = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    res["input_bytes"] = sum(x.numel() * x.element_size() for x in (h, w, t))
    child_print(res)


def measure_memory(variant: str, opts: dict, n: int, d: int, v: int, dtype: str, log) -> dict:
    spec = {"variant": variant, "opts": opts, "N": n, "D": d, "V": v, "dtype": dtype}
    r = run_child("benchmarks.cpu_single", spec)
    log(
        f"  memory {variant} {opts}: growth {mib(r['growth_bytes'])} MiB "
        f"(minus grads {mib(r['growth_bytes'] - r['grad_bytes'])} MiB)"
    )
    return r


# ----------------------------------------------------------------------------------------------
# one comparison block
# ----------------------------------------------------------------------------------------------


def compare(variants: dict[str, tuple[str, dict]], n, d, v, dtype: str, repeats: int, log, memory: bool = True) -> dict:
    """Time ``variants`` (name -> (kind, opts)) interleaved in this process; memory in children."""
    dt = getattr(torch, dtype)
    h, w, t = make_inputs(n, d, v, dt)
    fns = {name: make_step(kind, opts, h, w, t) for name, (kind, opts) in variants.items()}
    log(f"timing N={n} D={d} V={v} {dtype}: {list(variants)}")
    timing = time_interleaved(fns, repeats=repeats, warmup=1, log=log)
    del h, w, t, fns
    rows = {}
    for name, (kind, opts) in variants.items():
        r = {"kind": kind, "opts": opts, **timing[name]}
        if memory:
            r["memory"] = measure_memory(kind, opts, n, d, v, dtype, log)
        rows[name] = r
    base = rows.get("materialized")
    for r in rows.values():
        if base is not None:
            r["time_ratio"] = r["median_s"] / base["median_s"]
            r["cpu_time_ratio"] = r["median_cpu_s"] / base["median_cpu_s"]
            if memory:
                m, bm = r["memory"], base["memory"]
                r["mem_ratio"] = m["growth_bytes"] / bm["growth_bytes"]
                r["mem_ratio_minus_grads"] = (m["growth_bytes"] - m["grad_bytes"]) / max(
                    bm["growth_bytes"] - bm["grad_bytes"], 1
                )
    return {"shape": {"N": n, "D": d, "V": v, "dtype": dtype}, "repeats": repeats, "rows": rows}


def block_table(block: dict) -> str:
    headers = [
        "variant",
        "options",
        "median s",
        "CPU s",
        "time / mat.",
        "growth MiB",
        "growth - grads MiB",
        "growth / mat.",
        "(growth - grads) / mat.",
        "steady growth excl. grads MiB",
    ]
    rows = []
    for name, r in block["rows"].items():
        m = r.get("memory")
        rows.append(
            [
                name,
                json.dumps(r["opts"]) if r["opts"] else "defaults",
                r["median_s"],
                r["median_cpu_s"],
                r.get("time_ratio"),
                mib(m["growth_bytes"]) if m else None,
                mib(m["growth_bytes"] - m["grad_bytes"]) if m else None,
                r.get("mem_ratio"),
                r.get("mem_ratio_minus_grads"),
                mib(m["steady_growth_bytes"]) if m and m.get("steady_growth_bytes") is not None else None,
            ]
        )
    return md_table(headers, rows)


# ----------------------------------------------------------------------------------------------
# plot
# ----------------------------------------------------------------------------------------------


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    main = payload["main"]["rows"]
    names = list(main)
    ax = axes[0]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [main[k]["time_ratio"] for k in names], 0.4, label="time / materialized")
    ax.bar([x + 0.2 for x in xs], [main[k].get("mem_ratio", 0) for k in names], 0.4, label="peak growth / materialized")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), names, rotation=20)
    ax.set_title(f"N={N} D={D} V={V} fp32, fwd+bwd")
    ax.legend()

    ax = axes[1]
    sc = payload.get("scaling_fp32")
    if sc:
        for name in ("materialized", "cce", "torch_best"):
            pts = sorted((b["shape"]["V"], b["rows"][name]["median_s"]) for b in sc if name in b["rows"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("V")
        ax.set_ylabel("median s (fwd+bwd)")
        ax.set_title("scaling in V (fp32)")
        ax.legend()

    ax = axes[2]
    cs = payload.get("chunk_sweep")
    if cs:
        rows = cs["rows"]
        ks = sorted(rows, key=lambda k: rows[k]["opts"]["chunk_size"])
        x = [rows[k]["opts"]["chunk_size"] for k in ks]
        ax.plot(x, [rows[k]["median_s"] for k in ks], "o-", color="C0", label="median s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cce_dist chunk_size (logits per chunk)")
        ax.set_ylabel("median s", color="C0")
        if all("memory" in rows[k] for k in ks):
            ax2 = ax.twinx()
            ax2.plot(x, [mib(rows[k]["memory"]["growth_bytes"]) for k in ks], "s--", color="C1")
            ax2.set_ylabel("peak growth MiB", color="C1")
        ax.set_title("cce_dist chunk_size sweep")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, fewer sweep points, no V=262144")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--skip", default="", help="comma list of sections to skip: scaling,bf16,chunk")
    ap.add_argument("--shape", default=None, help="N,D,V of the main block (default 2048,512,65536)")
    ap.add_argument("--render-only", action="store_true", help="re-render .md/.png from the saved JSON")
    ap.add_argument("--update", default="", help="re-measure only these sections (scaling) into the saved results")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global N, D, V, SCALING_V, BF16_SHAPE
    if args.shape:
        N, D, V = (int(x) for x in args.shape.split(","))
        SCALING_V = [V // 2, V * 2]
        BF16_SHAPE = (N // 4, D, V // 8)
    if args.child is not None:
        child_main(json.loads(args.child))
        return
    if args.render_only:
        finish(json.loads((RESULTS / "cpu_single.json").read_text()))
        return
    torch.set_num_threads(THREADS)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.update:
        update_main(args, repeats)
        return
    started = time.perf_counter()
    log = logger("cpu_single")
    skip = set(filter(None, args.skip.split(",")))
    env = env_info(mode="quick" if args.quick else "full", repeats=repeats)
    payload: dict = {"env": env, "question": "cce_dist CPU path vs materialized and torch's chunked LCE"}

    # 1. PyTorch's chunked path: find its best batch_chunk_size at the main shape.
    sweep = TORCH_SWEEP if not args.quick else [128, 512]
    tv = {f"torch_bcs{b}": ("torch_chunked", torch_opts(b)) for b in sweep}
    tsweep = compare(tv, N, D, V, "float32", repeats=1, log=log, memory=not args.quick)
    best_name = min(tsweep["rows"], key=lambda k: tsweep["rows"][k]["median_s"])
    best_bcs = tsweep["rows"][best_name]["opts"]["batch_chunk_size"]
    payload["torch_sweep"] = tsweep
    payload["torch_best_batch_chunk_size"] = best_bcs
    log(f"torch best batch_chunk_size = {best_bcs}")

    # 2. The main comparison.
    variants = {
        "materialized": ("materialized", {}),
        "cce": ("cce", {}),
        "cce_2pass": ("cce", {"grad_in_forward": False}),
        "torch_default": ("torch_chunked", {}),
        "torch_best": ("torch_chunked", torch_opts(best_bcs)),
    }
    import cce_dist.core.options

    payload["cce_default_chunk_size"] = cce_dist.core.options.DEFAULT_CHUNK_SIZE
    payload["main"] = compare(variants, N, D, V, "float32", repeats=repeats, log=log)
    save_partial(payload, env, started)

    # 3. cce_dist chunk_size sweep (fused schedule, the default).
    if "chunk" not in skip:
        cs = CHUNK_SWEEP if not args.quick else [2**22, 2**23, 2**24, 2**25]
        cv = {f"cce_chunk2^{c.bit_length() - 1}": ("cce", {"chunk_size": c}) for c in cs}
        payload["chunk_sweep"] = compare(cv, N, D, V, "float32", repeats=repeats, log=log)
        save_partial(payload, env, started)

    # 4. Scaling in V (fp32).
    if "scaling" not in skip:
        run_scaling(payload, args.quick, repeats, log)
        save_partial(payload, env, started)

    # 5. bf16 (reduced shape).
    if "bf16" not in skip:
        n, d, v = BF16_SHAPE
        bv = {
            "materialized": ("materialized", {}),
            "cce": ("cce", {}),
            "cce_2pass": ("cce", {"grad_in_forward": False}),
            "torch_default": ("torch_chunked", {}),
            "torch_bcs128": ("torch_chunked", torch_opts(128)),
        }
        payload["bf16"] = compare(bv, n, d, v, "bfloat16", repeats=repeats, log=log)
        # the same shape in fp32, for the bf16/fp32 cost ratio
        fv = {"materialized": ("materialized", {}), "cce": ("cce", {})}
        payload["bf16_fp32_reference"] = compare(fv, n, d, v, "float32", repeats=repeats, log=log, memory=False)

    payload["complete"] = True
    close_env(env, started)
    finish(payload)


def run_scaling(payload: dict, quick: bool, repeats: int, log) -> None:
    """Section 4: materialized / cce / torch's best at the other vocabulary sizes (fp32)."""
    best_bcs = payload["torch_best_batch_chunk_size"]
    blocks = []
    for v in [32768] if quick else SCALING_V:
        vv = {
            "materialized": ("materialized", {}),
            "cce": ("cce", {}),
            "torch_best": ("torch_chunked", torch_opts(best_bcs)),
        }
        blocks.append(compare(vv, N, D, v, "float32", repeats=repeats, log=log))
    main_block = {
        "shape": payload["main"]["shape"],
        "rows": {k: payload["main"]["rows"][k] for k in ("materialized", "cce", "torch_best")},
    }
    payload["scaling_fp32"] = sorted(blocks + [main_block], key=lambda b: b["shape"]["V"])


def update_main(args, repeats: int) -> None:
    """``--update scaling``: re-measure only that section into the saved results, recording the
    re-run's own date, commit and load next to the original run's."""
    payload = json.loads((RESULTS / "cpu_single.json").read_text())
    sections = set(filter(None, args.update.split(",")))
    if sections - {"scaling"}:
        raise SystemExit(f"--update supports: scaling (got {sorted(sections)})")
    started = time.perf_counter()
    env = env_info(mode="update", sections=sorted(sections), repeats=repeats)
    log = logger("cpu_single")
    run_scaling(payload, args.quick, repeats, log)
    close_env(env, started)
    payload.setdefault("updates", []).append(env)
    finish(payload)


def save_partial(payload: dict, env: dict, started: float) -> None:
    """Write what is measured so far (a long run can be interrupted; 'complete' stays False)."""
    payload.setdefault("complete", False)
    close_env(env, started)
    try:
        finish(payload)
    except Exception as e:  # noqa: BLE001 - a rendering problem must not lose the data
        print(f"rendering failed: {e!r}", file=sys.stderr)


def finish(payload: dict) -> None:
    save_results("cpu_single", payload, render_markdown, plot)
    print(f"done; wrote {RESULTS}/cpu_single.{{json,md,png}}")


def targets(payload: dict) -> list[str]:
    rows = payload["main"]["rows"]
    cce, tb = rows["cce"], rows["torch_best"]
    out = []

    def verdict(ok):
        return "**met**" if ok else "**missed**"

    tr = cce["time_ratio"]
    out.append(
        f"- time cce / materialized = {tr:.2f} (target <= 1.0): {verdict(tr <= 1.0)}"
        f" (process CPU-time ratio {cce['cpu_time_ratio']:.2f})"
    )
    mr, mg = cce["mem_ratio"], cce["mem_ratio_minus_grads"]
    out.append(
        f"- peak growth cce / materialized = {mr:.3f} incl. gradients, {mg:.3f} excl. gradients "
        f"(target <= 0.10): {verdict(mr <= 0.10)} incl. / {verdict(mg <= 0.10)} excl."
    )
    faster = cce["median_s"] < tb["median_s"]
    lessmem = cce["memory"]["growth_bytes"] <= tb["memory"]["growth_bytes"]
    out.append(
        f"- vs torch's best setting (batch_chunk_size={payload['torch_best_batch_chunk_size']}): "
        f"time {cce['median_s'] / tb['median_s']:.2f}x, growth "
        f"{cce['memory']['growth_bytes'] / tb['memory']['growth_bytes']:.2f}x: faster {verdict(faster)}, "
        f"no more memory {verdict(lessmem)}"
    )
    return out


def render_markdown(p: dict) -> str:
    s = ["# cpu_single — single-device CPU loss + grads", "", env_markdown(p["env"]), ""]
    for u in p.get("updates", []):
        s += [
            f"Re-measured later with `--update {','.join(u['sections'])}` (that section only):",
            "",
            env_markdown(u),
            "",
        ]
    if not p.get("complete", True):
        s += ["**Partial run**: the sections below are those measured before the run stopped.", ""]
    s += [
        "Forward + backward (grads for hidden and weight), median of interleaved repeats after a "
        "warm-up; memory = peak RSS growth above the inputs in a fresh process per variant "
        "(VmHWM reset after the inputs, one warm-up + one measured step; a tiny call of the same variant "
        "ran before the inputs so one-time lazy imports are excluded). 'steady growth excl. grads' = peak of one "
        "more step above the RSS after those (malloc_trim; the previous step's grads are held until the step "
        "drops them, so this excludes the gradient bytes). 'grads' = bytes of "
        "hidden.grad + weight.grad, the unavoidable output.",
        "",
    ]
    sh = p["main"]["shape"]
    s += [f"## Main: N={sh['N']} D={sh['D']} V={sh['V']} {sh['dtype']}", "", block_table(p["main"]), ""]
    s += ["### Targets", ""] + targets(p) + [""]
    s += ["## PyTorch chunked path: batch_chunk_size sweep (1 timed run each)", "", block_table(p["torch_sweep"]), ""]
    if "chunk_sweep" in p:
        default = p.get("cce_default_chunk_size", "unrecorded")
        s += [f"## cce_dist chunk_size sweep (default {default})", "", block_table(p["chunk_sweep"]), ""]
    for b in p.get("scaling_fp32", []):
        sh = b["shape"]
        if sh["V"] == V:
            continue
        s += [f"## Scaling: V={sh['V']} fp32 (N={sh['N']} D={sh['D']})", "", block_table(b), ""]
    if "bf16" in p:
        sh = p["bf16"]["shape"]
        s += [
            f"## bf16 at N={sh['N']} D={sh['D']} V={sh['V']} (reduced: this CPU has no native bf16 GEMM)",
            "",
            block_table(p["bf16"]),
            "",
            "Same shape in fp32 (time only):",
            "",
            block_table(p["bf16_fp32_reference"]),
            "",
        ]
    return "\n".join(s)


if __name__ == "__main__":
    main()
