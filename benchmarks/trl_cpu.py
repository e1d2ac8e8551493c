"""TRL's fused LM head on CPU: is cce_dist faster than TRL 1.16's chunked head, with a fraction of its memory?

One device, float32, forward + backward (hidden and head gradients), side by side in one run, at N=4096, D=1024,
V=65536 (the shape of issue 23), on the per-token kernel TRL's fused head calls
(``trl.kernels.ChunkedLogProbFunction``: TRL's torch chunks off Triton devices) and on cce_dist's in its place
(``cce_dist.trl.CceLogProbs``, what ``cce_dist.trl.patch()`` installs), with the same arguments:

- ``*_logprobs_entropy``: ``log_probs`` and ``entropy`` (the loss is ``-(log_probs).mean() + 0.01 entropy.mean()``,
  so both gradients are formed: GRPO's entropy bonus)
- ``*_all_fields``: also ``log_sum_sq_probs``, ``mean_logits`` and ``is_top1`` (DPO's outputs)

and on the DistillationTrainer's two-head divergence kernel (``trl.kernels.ChunkedDivergenceFunction`` against
``cce_dist.trl.CceDivergence``, which ``patch()`` also installs) at N=2048, D_student=512, D_teacher=1024, V=65536:

- ``*_kl``: forward KL (TRL's ``beta=0``); ``*_jsd``: the generalized JSD at ``beta=0.5``; the loss is the mean
  divergence, whose gradient reaches the student's hidden states and head; both return the student's entropy.

Time: median of interleaved repeats after a warm-up, as a ratio to TRL's. Memory: peak RSS growth above the inputs
in a fresh process per variant (one warm-up + one measured step), minus the gradient bytes, as a ratio to TRL's.

Usage (from the repository root): ``python -m benchmarks.trl_cpu [--quick] [--shape N,D,V] [--distill-shape
N,D_s,D_t,V]`` (results: benchmarks/results/trl_cpu.{md,json}).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from benchmarks import common as C

THREADS = 2
N, D, V = 4096, 1024, 65536
TEMPERATURE = 0.9
FIELDS = {
    "logprobs_entropy": ("log_probs", "entropy"),
    "all_fields": ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
}
#: the DistillationTrainer's head: TRL's beta (0: forward KL, 0.5: the generalized JSD)
DIVERGENCES = {"kl": 0.0, "jsd": 0.5}
DISTILL_SHAPE = (2048, 512, 1024, 65536)
VARIANTS = {f"{impl}_{kind}": (impl, kind) for kind in (*FIELDS, *DIVERGENCES) for impl in ("trl", "cce")}
BASELINE = {f"cce_{kind}": f"trl_{kind}" for kind in (*FIELDS, *DIVERGENCES)}


def make_inputs(n, d, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.05).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    return h, w, t


def make_distill_inputs(n, ds, dt, v, seed=0):
    """Student ``h_s [n, ds]``, ``w_s [v, ds]`` (requiring grad); a frozen teacher ``h_t [n, dt]``, ``w_t [v, dt]``."""
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(n, ds, generator=g).requires_grad_()
    w_s = (torch.randn(v, ds, generator=g) * 0.05).requires_grad_()
    h_t = torch.randn(n, dt, generator=g)
    w_t = torch.randn(v, dt, generator=g) * 0.05
    return h_s, w_s, h_t, w_t


def kernel(impl, kind="logprobs_entropy"):
    if kind in DIVERGENCES:
        if impl == "trl":
            from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

            return ChunkedDivergenceFunction
        from cce_dist.trl import CceDivergence

        return CceDivergence
    if impl == "trl":
        from trl.kernels import ChunkedLogProbFunction

        return ChunkedLogProbFunction
    from cce_dist.trl import CceLogProbs

    return CceLogProbs


def make_step(name, *inputs):
    """One forward + backward of variant ``name`` on ``inputs`` (:func:`make_inputs` or :func:`make_distill_inputs`)."""
    impl, kind = VARIANTS[name]
    fn = kernel(impl, kind)
    if kind in DIVERGENCES:
        h_s, w_s, h_t, w_t = inputs

        def step():
            h_s.grad = None
            w_s.grad = None
            div, _ = fn.apply(h_s, w_s, None, h_t, w_t, None, DIVERGENCES[kind], TEMPERATURE, 1.0, None, 1.0, None)
            div.mean().backward()

        return step
    h, w, t = inputs

    def step():
        h.grad = None
        w.grad = None
        lp, ent, *_ = fn.apply(h, w, None, t, TEMPERATURE, 32768, None, 1.0, FIELDS[kind])
        (-lp.mean() + 0.01 * ent.mean()).backward()

    return step


def child_main(spec: dict) -> None:
    """Fresh process: allocate inputs, then the peak RSS growth of a warm-up + a measured step."""
    torch.set_num_threads(THREADS)
    r0 = C.rss_bytes()
    distill = VARIANTS[spec["variant"]][1] in DIVERGENCES
    small = make_distill_inputs(8, 16, 24, 64, seed=1) if distill else make_inputs(8, 16, 64, seed=1)
    make_step(spec["variant"], *small)()  # one-time costs (imports) excluded
    first_call = C.rss_bytes() - r0
    inputs = make_distill_inputs(*spec["shape"]) if distill else make_inputs(*spec["shape"])
    res = C.peak_growth(make_step(spec["variant"], *inputs), steps=2)
    res["first_call_bytes"] = first_call
    res["grad_bytes"] = sum(x.grad.numel() * x.grad.element_size() for x in inputs[:2])
    C.child_print(res)


def run_child(spec: dict, timeout: float = 1800) -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONWARNINGS", "ignore")
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.trl_cpu", "--child", json.dumps(spec)],
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
    """Both kernels give the same fields (a small shape; float32: agreement to ~1e-6 of each field's scale)."""
    h, w, t = make_inputs(64, 32, 1000, seed=3)
    fields = FIELDS["all_fields"]
    with torch.no_grad():
        a = kernel("cce").apply(h, w, None, t, TEMPERATURE, 32768, None, 1.0, fields)
        b = kernel("trl").apply(h, w, None, t, TEMPERATURE, 32768, None, 1.0, fields)
    out = {}
    for name, x, y in zip(fields, a, b):
        diff = float((x.double() - y.double()).abs().max())
        out[name] = {"max_abs_diff": diff}
        log(f"  same {name}: max |cce - trl| = {diff:.3g}")
    inputs = make_distill_inputs(64, 24, 40, 1000, seed=4)
    for kind, beta in DIVERGENCES.items():
        with torch.no_grad():
            args = (None, *inputs[2:], None, beta, TEMPERATURE, 1.0, None, 1.0, None)
            a = kernel("cce", kind).apply(*inputs[:2], *args)
            b = kernel("trl", kind).apply(*inputs[:2], *args)
        for name, x, y in zip((kind, f"{kind} entropy"), a, b):
            diff = float((x.double() - y.double()).abs().max())
            out[name] = {"max_abs_diff": diff}
            log(f"  same {name}: max |cce - trl| = {diff:.3g}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--shape", default=None, help="N,D,V (default 4096,1024,65536)")
    ap.add_argument("--distill-shape", default=None, help="N,D_s,D_t,V (default 2048,512,1024,65536)")
    ap.add_argument("--no-save", action="store_true", help="print only; do not write benchmarks/results")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--render", action="store_true", help="rewrite the .md from benchmarks/results/trl_cpu.json")
    args = ap.parse_args()
    if args.render:  # the ratios and table from the recorded run, without measuring again
        path = C.REPO / "benchmarks" / "results" / "trl_cpu.json"
        payload = json.loads(path.read_text())
        for name, base in BASELINE.items():
            r, b = payload["rows"][name], payload["rows"][base]
            r["cpu_time_ratio"] = r["median_cpu_s"] / b["median_cpu_s"]
        C.write_results("trl_cpu", payload, render_markdown(payload))
        return
    if args.child is not None:
        child_main(json.loads(args.child))
        return
    n, d, v = (int(x) for x in args.shape.split(",")) if args.shape else (N, D, V)
    dshape = tuple(int(x) for x in args.distill_shape.split(",")) if args.distill_shape else DISTILL_SHAPE
    torch.set_num_threads(THREADS)
    repeats = args.repeats or (1 if args.quick else 3)
    started = time.perf_counter()
    log = C.logger("trl_cpu")
    import trl

    env = C.env_info(mode="quick" if args.quick else "full", repeats=repeats, trl=trl.__version__)
    payload: dict = {"env": env, "shape": {"N": n, "D": d, "V": v, "dtype": "float32"}, "temperature": TEMPERATURE}
    payload["distill_shape"] = dict(zip(("N", "D_student", "D_teacher", "V"), dshape))
    payload["same_fields"] = check_numbers(log)
    timing = {}
    for group, inputs in (("logprobs", make_inputs(n, d, v)), ("distillation", make_distill_inputs(*dshape))):
        names = [k for k, (_, kind) in VARIANTS.items() if (kind in DIVERGENCES) == (group == "distillation")]
        fns = {name: make_step(name, *inputs) for name in names}
        log(f"timing {group} {[tuple(x.shape) for x in inputs]}: {names}")
        timing.update(C.time_interleaved(fns, repeats=repeats, warmup=1, log=log))
        del fns, inputs
    rows = {}
    for name in VARIANTS:
        distill = VARIANTS[name][1] in DIVERGENCES
        mem = run_child({"variant": name, "shape": list(dshape) if distill else [n, d, v]})
        log(f"  memory {name}: growth - grads {C.mib(mem['growth_bytes'] - mem['grad_bytes'])} MiB")
        rows[name] = {**timing[name], "memory": mem}
    for name, base in BASELINE.items():
        r, b = rows[name], rows[base]
        r["baseline"] = base
        r["time_ratio"] = r["median_s"] / b["median_s"]
        r["cpu_time_ratio"] = r["median_cpu_s"] / b["median_cpu_s"]
        m, bm = r["memory"], b["memory"]
        r["mem_ratio_minus_grads"] = (m["growth_bytes"] - m["grad_bytes"]) / max(
            bm["growth_bytes"] - bm["grad_bytes"], 1
        )
    payload["rows"] = rows
    C.close_env(env, started)
    md = render_markdown(payload)
    if not args.no_save:
        C.write_results("trl_cpu", payload, md)
    print(md)


def render_markdown(p: dict) -> str:
    sh = p["shape"]
    s = [
        "# trl_cpu — TRL's fused LM head kernel vs cce_dist's in its place, on CPU",
        "",
        C.env_markdown(p["env"]),
        "",
        f"N={sh['N']}, D={sh['D']}, V={sh['V']}, float32, temperature {p['temperature']}. Forward + backward (hidden "
        "and head gradients) of the per-token kernel TRL's fused head calls, median of interleaved repeats after a "
        "warm-up (wall and process CPU time: on a loaded machine the CPU time is the fairer ratio; the load average "
        "is in the environment above). Memory = peak RSS growth above the inputs in a fresh process per variant, "
        "minus the gradients."
        + (
            " The `*_kl` / `*_jsd` rows: the DistillationTrainer's divergence kernel at "
            + ", ".join(f"{k}={v}" for k, v in p["distill_shape"].items())
            + " (student gradients only)."
            if "distill_shape" in p
            else ""
        ),
        "",
    ]
    headers = ["variant", "median s", "time / TRL", "CPU s", "CPU time / TRL", "growth - grads MiB", "memory / TRL"]
    rows = []
    for name, r in p["rows"].items():
        m = r["memory"]
        rows.append(
            [
                name,
                r["median_s"],
                r.get("time_ratio"),
                r["median_cpu_s"],
                r.get("cpu_time_ratio"),
                C.mib(m["growth_bytes"] - m["grad_bytes"]),
                r.get("mem_ratio_minus_grads"),
            ]
        )
    s += [C.md_table(headers, rows), ""]
    s += ["Same fields (max |cce - trl| at N=64, D=32, V=1000; the divergences at N=64, D_s=24, D_t=40, V=1000):", ""]
    s += [f"- {k}: {v['max_abs_diff']:.3g}" for k, v in p["same_fields"].items()]
    return "\n".join(s) + "\n"


if __name__ == "__main__":
    main()
