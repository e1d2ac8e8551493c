"""Knowledge distillation on CPU: is ``cce_dist.linear_distillation`` as fast as the materialized
two-head loss, with a small fraction of its memory?

One device, float32, forward + backward (gradients for the student's hidden and weight; the
teacher frozen), side by side in one run, at N=2048, D_student=512, D_teacher=1024, V=65536:

- ``materialized_kl``  both heads' ``[N, V]`` logits with ``F.linear`` (the teacher's under
  no_grad), ``T**2 * F.kl_div(log_softmax(z_s/T), log_softmax(z_t/T), log_target=True,
  reduction="batchmean")`` (Hinton et al.'s soft loss)
- ``cce_kl``           ``cce_dist.linear_distillation(..., divergence="kl")`` (same numbers)
- ``liger_jsd_materialized``  Liger's generalized JSD written materialized:
  ``M = beta p_t + (1-beta) p_s``, ``beta KL(p_t || M) + (1-beta) KL(p_s || M)``, mean over tokens
- ``cce_jsd``          ``cce_dist.linear_distillation(..., divergence="jsd", scale_by_temperature_squared=False)``

Time: median of interleaved repeats after a warm-up, as a ratio to the materialized program of
the same divergence. Memory: peak RSS growth above the inputs in a fresh process per variant
(VmHWM reset after the inputs exist; one warm-up + one measured step), also minus the gradient
bytes (the unavoidable output), as a ratio to the materialized program's.

Usage (from the repository root): ``python -m benchmarks.distill_cpu [--quick] [--shape N,DS,DT,V]``
(results: benchmarks/results/distill_cpu.{md,json}).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks import common as C

THREADS = 2
N, DS, DT, V = 2048, 512, 1024, 65536
TEMPERATURE = 2.0
BETA = 0.5

VARIANTS = {  # name -> (divergence, implementation)
    "materialized_kl": ("kl", "materialized"),
    "cce_kl": ("kl", "cce"),
    "liger_jsd_materialized": ("jsd", "materialized"),
    "cce_jsd": ("jsd", "cce"),
}
BASELINE = {"cce_kl": "materialized_kl", "cce_jsd": "liger_jsd_materialized"}


def make_inputs(n, ds, dt, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, ds, generator=g).requires_grad_()
    ws = (torch.randn(v, ds, generator=g) * 0.05).requires_grad_()
    ht = torch.randn(n, dt, generator=g)
    wt = torch.randn(v, dt, generator=g) * 0.05
    return hs, ws, ht, wt


def materialized_loss(divergence, hs, ws, ht, wt):
    zs = F.linear(hs, ws) / TEMPERATURE
    with torch.no_grad():
        lt = F.log_softmax(F.linear(ht, wt) / TEMPERATURE, -1)
    ls = F.log_softmax(zs, -1)
    if divergence == "kl":
        return F.kl_div(ls, lt, log_target=True, reduction="batchmean") * TEMPERATURE**2
    # Liger's generalized JSD, written materialized (teacher weight beta in the mixture)
    lm = torch.log(BETA * lt.exp() + (1 - BETA) * ls.exp())
    kl_t = F.kl_div(lm, lt, log_target=True, reduction="sum")
    kl_s = F.kl_div(lm, ls, log_target=True, reduction="sum")
    return (BETA * kl_t + (1 - BETA) * kl_s) / zs.shape[0]


def make_step(name, hs, ws, ht, wt):
    import cce_dist

    divergence, kind = VARIANTS[name]
    if kind == "materialized":

        def loss():
            return materialized_loss(divergence, hs, ws, ht, wt)
    else:
        kw = dict(temperature=TEMPERATURE, impl="torch")
        if divergence == "jsd":
            kw.update(beta=BETA, scale_by_temperature_squared=False)

        def loss():
            return cce_dist.linear_distillation(hs, ws, ht, wt, divergence=divergence, **kw)

    def step():
        hs.grad = None
        ws.grad = None
        loss().backward()

    return step


def child_main(spec: dict) -> None:
    """Fresh process: allocate inputs, then the peak RSS growth of a warm-up + a measured step."""
    torch.set_num_threads(THREADS)
    r0 = C.rss_bytes()
    tiny = make_inputs(8, spec["DS"], spec["DT"], 64, seed=1)
    make_step(spec["variant"], *tiny)()  # one-time costs (lazy imports) are not per-step memory
    del tiny
    first_call = C.rss_bytes() - r0
    hs, ws, ht, wt = make_inputs(spec["N"], spec["DS"], spec["DT"], spec["V"])
    step = make_step(spec["variant"], hs, ws, ht, wt)
    res = C.peak_growth(step, steps=2)
    res["first_call_bytes"] = first_call
    res["grad_bytes"] = sum(x.grad.numel() * x.grad.element_size() for x in (hs, ws))
    res["input_bytes"] = sum(x.numel() * x.element_size() for x in (hs, ws, ht, wt))
    C.child_print(res)


def run_child(spec: dict, timeout: float = 1800) -> dict:
    """``python -m benchmarks.distill_cpu --child '<spec>'`` in a fresh process; its last JSON line."""
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.distill_cpu", "--child", json.dumps(spec)],
        cwd=C.REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if p.returncode != 0:
        raise RuntimeError(f"child {spec} failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    for line in reversed(p.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"child {spec} printed no JSON:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def check_numbers(log) -> dict:
    """The compared programs compute the same loss (a tiny shape; float32 programs, so agreement to ~1e-6)."""
    import cce_dist

    hs, ws, ht, wt = make_inputs(64, 32, 48, 1000, seed=3)
    out = {}
    for name, ref in BASELINE.items():
        divergence = VARIANTS[name][0]
        kw = dict(beta=BETA, scale_by_temperature_squared=False) if divergence == "jsd" else {}
        with torch.no_grad():
            a = float(
                cce_dist.linear_distillation(hs, ws, ht, wt, divergence=divergence, temperature=TEMPERATURE, **kw)
            )
            b = float(materialized_loss(divergence, hs, ws, ht, wt))
        out[name] = {"cce": a, "materialized": b, "rel_diff": abs(a - b) / abs(b)}
        log(f"  same loss {name}: {a:.7f} vs {ref} {b:.7f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--shape", default=None, help="N,DS,DT,V (default 2048,512,1024,65536)")
    ap.add_argument("--no-save", action="store_true", help="print only; do not write benchmarks/results")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child_main(json.loads(args.child))
        return
    n, ds, dt, v = (int(x) for x in args.shape.split(",")) if args.shape else (N, DS, DT, V)
    torch.set_num_threads(THREADS)
    repeats = args.repeats or (1 if args.quick else 3)
    started = time.perf_counter()
    log = C.logger("distill_cpu")
    env = C.env_info(mode="quick" if args.quick else "full", repeats=repeats)
    payload: dict = {
        "env": env,
        "shape": {"N": n, "D_student": ds, "D_teacher": dt, "V": v, "dtype": "float32"},
        "temperature": TEMPERATURE,
        "beta": BETA,
    }
    payload["same_loss"] = check_numbers(log)
    hs, ws, ht, wt = make_inputs(n, ds, dt, v)
    fns = {name: make_step(name, hs, ws, ht, wt) for name in VARIANTS}
    log(f"timing N={n} DS={ds} DT={dt} V={v}: {list(VARIANTS)}")
    timing = C.time_interleaved(fns, repeats=repeats, warmup=1, log=log)
    del hs, ws, ht, wt, fns
    rows = {}
    for name in VARIANTS:
        spec = {"variant": name, "N": n, "DS": ds, "DT": dt, "V": v}
        mem = run_child(spec)
        log(
            f"  memory {name}: growth {C.mib(mem['growth_bytes'])} MiB "
            f"(minus grads {C.mib(mem['growth_bytes'] - mem['grad_bytes'])} MiB)"
        )
        rows[name] = {**timing[name], "memory": mem}
    for name, base in BASELINE.items():
        r, b = rows[name], rows[base]
        r["baseline"] = base
        r["time_ratio"] = r["median_s"] / b["median_s"]
        r["cpu_time_ratio"] = r["median_cpu_s"] / b["median_cpu_s"]
        m, bm = r["memory"], b["memory"]
        r["mem_ratio"] = m["growth_bytes"] / bm["growth_bytes"]
        r["mem_ratio_minus_grads"] = (m["growth_bytes"] - m["grad_bytes"]) / max(
            bm["growth_bytes"] - bm["grad_bytes"], 1
        )
    payload["rows"] = rows
    C.close_env(env, started)
    md = render_markdown(payload)
    if args.no_save:
        print(md)
    else:
        C.write_results("distill_cpu", payload, md)
        print(md)


def render_markdown(p: dict) -> str:
    sh = p["shape"]
    s = [
        "# distill_cpu — knowledge distillation from two heads on CPU",
        "",
        C.env_markdown(p["env"]),
        "",
        f"N={sh['N']}, D_student={sh['D_student']}, D_teacher={sh['D_teacher']}, V={sh['V']}, float32, "
        f"temperature {p['temperature']}, JSD beta {p['beta']}. Forward + backward (student hidden and weight "
        "gradients; teacher frozen), median of interleaved repeats after a warm-up. Memory = peak RSS growth above "
        "the inputs in a fresh process per variant (VmHWM reset after the inputs; one warm-up + one measured step); "
        "'grads' = bytes of the student's hidden.grad + weight.grad, the unavoidable output.",
        "",
    ]
    headers = [
        "variant",
        "median s",
        "CPU s",
        "time / baseline",
        "growth MiB",
        "growth - grads MiB",
        "(growth - grads) / baseline",
    ]
    rows = []
    for name, r in p["rows"].items():
        m = r["memory"]
        rows.append(
            [
                name,
                r["median_s"],
                r["median_cpu_s"],
                r.get("time_ratio"),
                C.mib(m["growth_bytes"]),
                C.mib(m["growth_bytes"] - m["grad_bytes"]),
                r.get("mem_ratio_minus_grads"),
            ]
        )
    s += [C.md_table(headers, rows), "", "## Targets", ""]
    for name, base in BASELINE.items():
        r = p["rows"][name]
        tr, mg = r["time_ratio"], r["mem_ratio_minus_grads"]
        s.append(
            f"- {name} vs {base}: time {tr:.2f}x (target <= 1.0: {'**met**' if tr <= 1.0 else '**missed**'}), "
            f"memory beyond gradients {mg:.3f} of the baseline's (target <= 0.10: "
            f"{'**met**' if mg <= 0.10 else '**missed**'})"
        )
    s += [
        "",
        "Same loss (tiny shape, both programs): "
        + ", ".join(f"{k} rel. diff {v['rel_diff']:.1e}" for k, v in p["same_loss"].items()),
        "",
    ]
    return "\n".join(s)


if __name__ == "__main__":
    main()
