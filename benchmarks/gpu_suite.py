"""GPU suite: correctness, the peers side by side, each kernel alone, atomics, the GPU tests.

Question: on one GPU, at LLM head shapes in bf16, is every Triton path of cce_dist right (forward
and each backward schedule against a float64 reference), and how do forward, backward,
forward+backward time and peak memory compare between cce_dist, Apple's Cut Cross-Entropy (exact,
``filter_eps=None``, and its default ``filter_eps="high"``), Liger-Kernel's fused linear
cross-entropy, TRL 1.16's fused LM head kernel (``trl.kernels.ChunkedLogProbFunction``), ``torch.compile`` of the
materialized program and the materialized program itself?

Built to return results from its first run on a machine nobody has watched it on:

- everything goes under one output folder (``--out``; default ``$OUT`` if set, else
  ``benchmarks/results/gpu``): ``gpu_suite.jsonl`` (one row per case, APPENDED and flushed as it is
  measured), ``gpu_suite.md`` (rendered from the JSONL at the end; ``--render`` re-renders it),
  ``pytest_gpu.xml`` (the GPU tests), ``gpu_model.{json,md}``; benchmarks/gpu_suite.sh tees the log
  to ``suite.log``;
- each stage runs in a child process with a time budget, each case with a timeout; a case that
  raises (any Exception: a Triton CompilationError, a CUDA error, OOM) is recorded as an error
  row and the next case runs; a child that dies or hangs (a poisoned CUDA context, a hung kernel)
  is killed, its case recorded as an error, and a fresh child continues with the rest;
- a total budget (``--budget-s``, counted from ``--started``) bounds the whole run; stages are
  ordered by value (environment, correctness, peers, kernels, atomics, then the GPU tests with the
  static model beside them) and what a stage could not run is recorded as ``skipped``.

Rows carry the machine, the versions (torch, triton, cce_dist, the peers) and the commit
(``$CCE_COMMIT`` if set, else git; plus a hash of the source tree, for machines without .git).

Timing: CUDA events, warm-up, median of ``--repeats``. fwd+bwd is the headline; fwd (with autograd
recording, as in training) and bwd = fwd+bwd - fwd only for methods whose forward does not already
compute the gradients (Liger forms them inside its forward: fwd+bwd only). Memory: peak allocated
during one fwd+bwd minus what was allocated before (inputs), next to the bytes of the returned
gradients. FLOPs: 6*N*D*V (materialized count; recomputation is not credited). Gradient errors of
every method: against the float32 materialized program (TF32 off) on the same bf16 inputs.

    python benchmarks/gpu_suite.py --out DIR            # what gpu_suite.sh runs
    python benchmarks/gpu_suite.py --dry-run --out DIR  # CPU: tiny shapes, interpreter, no CUDA timing
    python benchmarks/gpu_suite.py --render --out DIR   # re-render gpu_suite.md from gpu_suite.jsonl

``CCE_SUITE_FAIL=substr[,substr]`` makes every case whose id contains one of them raise, and
``CCE_SUITE_CRASH=substr`` makes the child die (os._exit) and ``CCE_SUITE_HANG=substr`` hang at such a
case: tests of the error paths (``--case-timeout`` shortens the wait for the latter).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JSONL, MD, JUNIT = "gpu_suite.jsonl", "gpu_suite.md", "pytest_gpu.xml"

#: The CCE paper's shape first (every stage measures there), then Llama-3 8B and Qwen2 7B heads.
SHAPES = [(8192, 2304, 256000), (16384, 4096, 128256), (8192, 3584, 152064)]
QUICK_SHAPES = [(8192, 2304, 256000)]
DRY_SHAPES = [(32, 16, 130)]
CORRECTNESS_SHAPE, DRY_CORRECTNESS_SHAPE = (8192, 2304, 256000), (40, 24, 200)
METHODS = [
    "cce_dist",
    "apple_cce(exact)",
    "apple_cce(high)",
    "liger",
    "trl",
    "materialized",
    "torch.compile",
    "cce_dist(filter)",
]
#: Methods whose forward computes the gradients: report fwd+bwd only.
GRAD_IN_FORWARD = {"liger"}
SCHEDULES = ["chunked", "tiles", "owner"]

#: Per stage: (budget cap s, timeout of one case s, least budget to start it). Dry run: a fraction.
STAGES: dict[str, tuple[float, float, float]] = {
    "env": (40, 30, 5),
    "correctness": (80, 60, 10),
    "peers": (200, 100, 20),
    "kernels": (50, 40, 10),
    "atomics": (15, 10, 5),
    "pytest": (240, 240, 30),
}
ORDER = ["env", "correctness", "peers", "kernels", "atomics", "pytest"]
#: Seconds kept back at the end for rendering and the shell script's last lines.
RESERVE_S = 15.0


# ------------------------------------------------------------------------------------------------
# provenance
# ------------------------------------------------------------------------------------------------


def commit() -> str:
    if os.environ.get("CCE_COMMIT"):
        return os.environ["CCE_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git / no .git on the device machine
        return "unknown"


def tree_hash() -> str:
    """sha256 (12 hex) of the library and benchmark sources: identifies the code without .git."""
    h = hashlib.sha256()
    for sub in ("cce_dist", "benchmarks"):
        for p in sorted((REPO / sub).rglob("*.py")):
            h.update(str(p.relative_to(REPO)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


def row_env(dry: bool) -> dict:
    """The compact environment every row carries."""
    import torch

    try:
        import cce_dist

        cce = getattr(cce_dist, "__version__", "?")
    except Exception:  # noqa: BLE001
        cce = None
    gpu = None
    if not dry and torch.cuda.is_available():
        with contextlib.suppress(Exception):
            gpu = torch.cuda.get_device_name()
    return {
        "commit": os.environ.get("CCE_SUITE_COMMIT") or commit(),
        "tree": os.environ.get("CCE_SUITE_TREE") or tree_hash(),
        "gpu": gpu or ("cpu (dry run)" if dry else None),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cce_dist": cce,
        "cut_cross_entropy": _version("cut-cross-entropy"),
        "liger_kernel": _version("liger-kernel"),
        "trl": _version("trl"),
        "python": platform.python_version(),
        "host": platform.node(),
        "dry_run": dry,
    }


# ------------------------------------------------------------------------------------------------
# rows
# ------------------------------------------------------------------------------------------------


def append_row(out: Path, row: dict) -> None:
    """Append one row to the JSONL and flush it to disk (a killed run keeps every row written)."""
    out.mkdir(parents=True, exist_ok=True)
    row.setdefault("run", os.environ.get("CCE_SUITE_RUN", "?"))
    row.setdefault("time", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    with open(out / JSONL, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_rows(out: Path, run: str | None = None) -> list[dict]:
    """Rows of ``run`` (default: the last run in the file); a torn last line is ignored."""
    p = out / JSONL
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    if run is None and rows:
        run = rows[-1].get("run")
    return [r for r in rows if r.get("run") == run]


# ------------------------------------------------------------------------------------------------
# child side: the stages
# ------------------------------------------------------------------------------------------------


class Ctx:
    def __init__(self, dry: bool, quick: bool, warmup: int, repeats: int):
        import torch

        self.dry, self.quick, self.warmup, self.repeats = dry, quick, warmup, repeats
        self.cuda = (not dry) and torch.cuda.is_available()
        self.dev = "cuda" if self.cuda else "cpu"
        self.cache: dict[Any, Any] = {}

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def median_ms(self, fn: Callable[[], Any], warmup: int | None = None, repeats: int | None = None) -> float:
        """Median of ``repeats`` timed calls after ``warmup`` untimed ones: CUDA events on a GPU, the
        wall clock around a synchronized call otherwise (dry run)."""
        import torch

        for _ in range(self.warmup if warmup is None else warmup):
            fn()
        times = []
        for _ in range(self.repeats if repeats is None else repeats):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


def _errs(got, ref) -> dict:
    """Relative Frobenius error, max abs error and max abs error over max |ref| (float64)."""
    import torch

    g, r = got.detach().double(), ref.detach().double()
    d = (g - r).abs()
    nr = float(r.norm())
    return {
        "rel_fro": float((g - r).norm()) / nr if nr else float((g - r).norm()),
        "max_abs": float(d.max()) if d.numel() else 0.0,
        "max_rel": float(d.max()) / float(r.abs().max()) if d.numel() and float(r.abs().max()) else 0.0,
        "nonfinite": int((~torch.isfinite(g)).sum()),
    }


def _inputs(ctx: Ctx, n: int, d: int, v: int, seed: int = 0, ignore_every: int = 0):
    import torch

    g = torch.Generator(device=ctx.dev).manual_seed(seed)
    h = (torch.randn(n, d, device=ctx.dev, generator=g) * 0.5).bfloat16()
    w = (torch.randn(v, d, device=ctx.dev, generator=g) * d**-0.5).bfloat16()
    t = torch.randint(0, v, (n,), device=ctx.dev, generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t


# --- env --------------------------------------------------------------------------------------


def env_cases(ctx: Ctx) -> list[str]:
    return ["env"]


def env_run(ctx: Ctx, case: str) -> dict:
    import torch

    row: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        row.update(
            device=p.name,
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            cuda=torch.version.cuda,
        )
        with contextlib.suppress(Exception):
            row["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit,temperature.gpu",
                    "--format=csv",
                ],
                capture_output=True,
                text=True,
                timeout=15,
            ).stdout.strip()
    for mod in ("cut_cross_entropy", "liger_kernel", "trl"):
        try:
            __import__(mod)
            row[f"import_{mod}"] = "ok"
        except Exception as e:  # noqa: BLE001
            row[f"import_{mod}"] = f"{type(e).__name__}: {e}"[:300]
    row["versions"] = {k: _version(k) for k in ("torch", "triton", "numpy", "pytest", "pytest-xdist", "pytest-timeout")}
    return row


# --- correctness --------------------------------------------------------------------------------


def correctness_cases(ctx: Ctx) -> list[str]:
    return (
        ["forward", "forward cross-entropy (no SUM / ENTROPY)"]
        + [f"backward {s}" for s in SCHEDULES]
        + ["linear_cross_entropy(impl='triton') loss + grads"]
    )


def _reference(ctx: Ctx):
    """Float64 reference of the precision contract at the correctness shape: logits of the bf16
    inputs rounded once to bf16, then every statistic / gradient in float64. Computed in row
    blocks (memory) and cached for the stage."""
    if "ref" in ctx.cache:
        return ctx.cache["ref"]
    import torch

    n, d, v = DRY_CORRECTNESS_SHAPE if ctx.dry else CORRECTNESS_SHAPE
    h, w, t = _inputs(ctx, n, d, v, seed=1, ignore_every=10)
    valid = t >= 0
    nv = int(valid.sum())
    w64 = w.double()
    lse, tgt, mean, ent = (torch.empty(n, dtype=torch.float64, device=ctx.dev) for _ in range(4))
    dh = torch.empty(n, d, dtype=torch.float64, device=ctx.dev)
    dw = torch.zeros(v, d, dtype=torch.float64, device=ctx.dev)
    rows = max(1, min(n, 2**32 // (v * 8)))  # ~4 GiB of float64 logits at a time
    for s in range(0, n, rows):
        sl = slice(s, min(n, s + rows))
        z = (h[sl].double() @ w64.T).to(torch.bfloat16).double()
        m = z.max(1).values
        e = torch.exp(z - m[:, None])
        se = e.sum(1)
        lse[sl] = m + torch.log(se)
        ts = t[sl].clamp(min=0)
        tgt[sl] = torch.where(valid[sl], z.gather(1, ts[:, None])[:, 0], torch.zeros_like(m))
        mean[sl] = z.mean(1)
        ent[sl] = (e * z).sum(1) / se  # E_p[z]
        p = e / se[:, None]
        p[valid[sl].nonzero()[:, 0], ts[valid[sl]]] -= 1.0
        p *= (valid[sl].double() / nv)[:, None]  # mean cross-entropy over the valid rows
        dh[sl] = p @ w64
        dw += p.T @ h[sl].double()
        del z, e, p
    loss = float(((lse - tgt) * valid).sum() / nv)
    ctx.cache["ref"] = dict(h=h, w=w, t=t, valid=valid, nv=nv, lse=lse, tgt=tgt, mean=mean, ent=ent, dh=dh, dw=dw)
    ctx.cache["ref"]["loss"] = loss
    return ctx.cache["ref"]


def correctness_run(ctx: Ctx, case: str) -> dict:
    import torch

    import cce_dist
    import cce_dist.kernels as K
    from cce_dist.core.backend import ALPHA, NUM_COEFS

    r = _reference(ctx)
    h, w, t, valid = r["h"], r["w"], r["t"], r["valid"]
    n, d = h.shape
    v = w.shape[0]
    row: dict[str, Any] = {"N": n, "D": d, "V": v, "dtype": "bf16", "reference": "float64 of the bf16-rounded logits"}
    tol = {"stats_abs": 1e-3, "target_abs": 2e-2, "grad_rel_fro": 1e-2}
    row["tolerance"] = tol
    ok = True
    if case.startswith("forward"):
        lean = "no SUM" in case
        st = K.row_stats(
            h, w, None, t, vocab_start=0, softcap=None, temperature=None, need_sum=not lean, need_entropy=not lean
        )
        ctx.sync()
        st = st.double()
        lse = st[:, 0] + torch.log(st[:, 1])
        row["lse"] = _errs(lse, r["lse"])
        row["target"] = _errs(st[valid, 2], r["tgt"][valid])
        ok &= row["lse"]["max_abs"] <= tol["stats_abs"] and row["target"]["max_abs"] <= tol["target_abs"]
        if not lean:
            row["mean_logit"] = _errs(st[:, 3] * 2.0**32 / v, r["mean"])
            row["entropy_term"] = _errs(st[:, 4] / st[:, 1] + st[:, 0], r["ent"])  # E_p[z]
            ok &= (
                row["mean_logit"]["max_abs"] <= tol["stats_abs"] and row["entropy_term"]["max_abs"] <= tol["target_abs"]
            )
    elif case.startswith("backward"):
        sched = case.split()[1]
        coef = torch.zeros(n, NUM_COEFS, device=ctx.dev)
        coef[:, ALPHA] = valid.float() / r["nv"]
        dh, dw, _ = K.grads(
            h,
            w,
            None,
            t,
            r["lse"].float(),
            coef,
            vocab_start=0,
            softcap=None,
            temperature=None,
            need_hidden=True,
            need_weight=True,
            need_bias=False,
            deterministic=sched == "owner",
            _schedule=sched,
        )
        ctx.sync()
        row["schedule"] = sched
        row["dH"], row["dW"] = _errs(dh, r["dh"]), _errs(dw, r["dw"])
        ok &= row["dH"]["rel_fro"] <= tol["grad_rel_fro"] and row["dW"]["rel_fro"] <= tol["grad_rel_fro"]
        ok &= row["dH"]["nonfinite"] == 0 and row["dW"]["nonfinite"] == 0
    else:
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = cce_dist.linear_cross_entropy(hh, ww, t, impl="triton")
        loss.backward()
        ctx.sync()
        row["loss_abs_err"] = abs(float(loss) - r["loss"])
        row["dH"], row["dW"] = _errs(hh.grad, r["dh"]), _errs(ww.grad, r["dw"])
        ok &= row["loss_abs_err"] <= tol["stats_abs"]
        ok &= row["dH"]["rel_fro"] <= tol["grad_rel_fro"] and row["dW"]["rel_fro"] <= tol["grad_rel_fro"]
    row["within_tolerance"] = bool(ok)
    if not ok:
        row["status"] = "fail"
    return row


# --- peers --------------------------------------------------------------------------------------


def _shapes(ctx: Ctx) -> list[tuple[int, int, int]]:
    return DRY_SHAPES if ctx.dry else QUICK_SHAPES if ctx.quick else SHAPES


def peers_cases(ctx: Ctx) -> list[str]:
    return [f"{n}x{d}x{v} {m}" for n, d, v in _shapes(ctx) for m in METHODS]


def _materialized(h, w, t):
    import torch.nn.functional as F

    return F.cross_entropy(F.linear(h, w).float(), t)


class Skip(Exception):
    """A case that cannot run here (a peer not installed, a CUDA-only peer in a dry run)."""


def _method(ctx: Ctx, name: str) -> tuple[Callable, str]:
    """(fn(h, w, t) -> scalar loss, description)."""
    if name in ctx.cache.get("methods", {}):
        return ctx.cache["methods"][name]
    import torch

    import cce_dist

    if name == "materialized":
        m: tuple[Callable, str] = (_materialized, "F.cross_entropy(F.linear(h, w).float(), t)")
    elif name == "torch.compile":
        # dynamic=True: one compile serves every shape (a static compile per shape costs ~30 s each).
        # Dry run: the eager backend (an inductor build on a 2-core CPU takes minutes).
        backend = "eager" if ctx.dry else "inductor"
        m = (torch.compile(_materialized, dynamic=True, backend=backend), f"torch.compile(dynamic=True, {backend})")
    elif name.startswith("cce_dist"):
        eps = "auto" if "filter" in name else None
        m = (
            lambda h, w, t: cce_dist.linear_cross_entropy(h, w, t, impl="triton", filter_eps=eps),
            f"cce_dist.linear_cross_entropy(impl='triton', filter_eps={eps!r})",
        )
    elif name.startswith("apple_cce"):
        if ctx.dry:
            raise Skip("dry run: Apple's kernels need CUDA")
        try:
            from cut_cross_entropy import linear_cross_entropy as apple
        except Exception as e:  # noqa: BLE001
            raise Skip(f"cut-cross-entropy not importable: {type(e).__name__}: {e}") from e
        eps = None if "exact" in name else "high"
        m = (
            lambda h, w, t: apple(h, w, t, filter_eps=eps),
            f"cut_cross_entropy.linear_cross_entropy(filter_eps={eps!r})",
        )
    elif name == "liger":
        if ctx.dry:
            raise Skip("dry run: Liger's kernels need CUDA")
        try:
            from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        except Exception as e:  # noqa: BLE001
            raise Skip(f"liger-kernel not importable: {type(e).__name__}: {e}") from e
        lg = LigerFusedLinearCrossEntropyLoss()
        m = (lambda h, w, t: lg(w, h, t), "LigerFusedLinearCrossEntropyLoss()(w, h, t)")
    elif name == "trl":
        # TRL 1.16's fused LM head kernel (what its trainers call; Triton on CUDA, torch chunks elsewhere), with the
        # vocab tile its fused head passes; the cross-entropy is minus the mean logprob (no target is ignored here)
        try:
            from trl.kernels import ChunkedLogProbFunction
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as tile
        except Exception as e:  # noqa: BLE001
            raise Skip(f"trl not importable: {type(e).__name__}: {e}") from e

        def trl_ce(h, w, t):
            return -ChunkedLogProbFunction.apply(h, w, None, t, 1.0, tile, None, 1.0, ("log_probs",))[0].mean()

        m = (trl_ce, f"-trl.kernels.ChunkedLogProbFunction.apply(h, w, None, t, 1.0, {tile}, ...)[0].mean()")
    else:
        raise ValueError(name)
    ctx.cache.setdefault("methods", {})[name] = m
    return m


def _peer_reference(ctx: Ctx, shape):
    """fp32 materialized loss and gradients (TF32 off) of the bf16 inputs, cached per shape."""
    key = ("peer_ref", shape)
    if key not in ctx.cache:
        import torch

        ctx.cache = {k: v for k, v in ctx.cache.items() if not (isinstance(k, tuple) and k[0] == "peer_ref")}
        ctx.free()
        h, w, t = _inputs(ctx, *shape)
        h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            loss = _materialized(h32, w32, t)
            loss.backward()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        ctx.cache[key] = (h, w, t, float(loss), h32.grad, w32.grad)
        del h32, w32, loss
        ctx.free()
    return ctx.cache[key]


def peers_run(ctx: Ctx, case: str) -> dict:
    import torch

    dims, name = case.split(" ", 1)
    n, d, v = (int(x) for x in dims.split("x"))
    row: dict[str, Any] = {"N": n, "D": d, "V": v, "method": name, "dtype": "bf16"}
    fn, row["call"] = _method(ctx, name)
    h0, w0, t, ref_loss, ref_dh, ref_dw = _peer_reference(ctx, (n, d, v))
    h, w = h0.detach().clone().requires_grad_(), w0.detach().clone().requires_grad_()

    def fwd_bwd():
        h.grad = w.grad = None
        fn(h, w, t).backward()

    def fwd():
        fn(h, w, t)  # autograd records, as in training; the graph is dropped

    try:
        # 1. one call for the errors (and the compile / autotune, which stay out of the numbers below)
        t0 = time.perf_counter()
        loss = fn(h, w, t)
        loss.backward()
        ctx.sync()
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        row["loss"] = float(loss)
        row["loss_abs_err"] = abs(float(loss) - ref_loss)
        row["dH"], row["dW"] = _errs(h.grad, ref_dh), _errs(w.grad, ref_dw)
        del loss
        # 2. peak memory of one fwd+bwd beyond the inputs
        h.grad = w.grad = None
        ctx.free()
        if ctx.cuda:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fwd_bwd()
            torch.cuda.synchronize()
            row["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            row["grad_mb"] = (h.numel() + w.numel()) * h.element_size() / 2**20
            row["overhead_mb"] = row["peak_mb"] - row["grad_mb"]
        # 3. times
        row["fwd_bwd_ms"] = ctx.median_ms(fwd_bwd)
        if name not in GRAD_IN_FORWARD:
            row["fwd_ms"] = ctx.median_ms(fwd)
            row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
        else:
            row["note"] = "gradients are formed in the forward: fwd+bwd only"
        row["tflops_fwd_bwd"] = 6.0 * n * d * v / (row["fwd_bwd_ms"] * 1e-3) / 1e12
        row["timer"] = "cuda events" if ctx.cuda else "wall clock (dry run, CPU)"
    finally:
        h.grad = w.grad = None
        ctx.free()
    return row


# --- kernels ------------------------------------------------------------------------------------


KERNEL_CASES = {
    "forward": dict(kind="fwd"),
    "forward cross-entropy (no SUM / ENTROPY)": dict(kind="fwd", need_sum=False, need_entropy=False),
    "backward chunked (default)": dict(kind="bwd", _schedule="chunked"),
    "backward fused": dict(kind="bwd", _schedule="tiles"),
    "backward fused filter": dict(kind="bwd", _schedule="tiles", filter_eps=2.0**-12),
    "backward deterministic (owner-computes)": dict(kind="bwd", _schedule="owner", deterministic=True),
}


def kernels_cases(ctx: Ctx) -> list[str]:
    return list(KERNEL_CASES)


def _model_estimates(out: Path, gpu: str) -> tuple[dict, str]:
    """gpu_model's estimate (low, high) per launch label, from this run's gpu_model.json if there,
    else the committed one."""
    for p in (out / "gpu_model.json", REPO / "benchmarks" / "results" / "gpu_model.json"):
        if not p.exists():
            continue
        with contextlib.suppress(Exception):
            data = json.loads(p.read_text())
            gname = "H200 SXM" if "H200" in gpu else "H100 SXM"
            est: dict[str, list[float]] = {}
            for r in data.get("kernels", []):
                m = r.get(gname)
                if not m:
                    continue
                lo, hi = m.get("est_ms_low", m.get("est_ms")), m.get("est_ms_high", m.get("est_ms"))
                key = r["label"]
                if key.startswith("forward"):  # the autotuner keeps the fastest candidate
                    cur = est.get(key, [math.inf, math.inf])
                    est[key] = [min(cur[0], lo), min(cur[1], hi)]
                else:  # the kernels of one call run one after the other
                    cur = est.get(key, [0.0, 0.0])
                    est[key] = [cur[0] + lo, cur[1] + hi]
            src = (
                f"{p.relative_to(REPO) if p.is_relative_to(REPO) else p.name} (commit {data['env'].get('git_commit')})"
            )
            return est, src
    return {}, "none"


def kernels_run(ctx: Ctx, case: str) -> dict:
    import torch

    import cce_dist.kernels as K
    from cce_dist.core.backend import ALPHA, NUM_COEFS

    n, d, v = DRY_SHAPES[0] if ctx.dry else CORRECTNESS_SHAPE
    if "kin" not in ctx.cache:
        h, w, t = _inputs(ctx, n, d, v)
        st = K.row_stats(h, w, None, t, vocab_start=0, softcap=None, temperature=None)
        lse = (st[:, 0] + torch.log(st[:, 1])).contiguous()
        coef = torch.zeros(n, NUM_COEFS, device=ctx.dev)
        coef[:, ALPHA] = 1.0 / n
        ctx.cache["kin"] = (h, w, t, lse, coef)
    h, w, t, lse, coef = ctx.cache["kin"]
    spec = dict(KERNEL_CASES[case])
    kind = spec.pop("kind")
    common = dict(vocab_start=0, softcap=None, temperature=None)
    if kind == "fwd":

        def fn():
            K.row_stats(h, w, None, t, **common, **spec)
    else:

        def fn():
            K.grads(h, w, None, t, lse, coef, need_hidden=True, need_weight=True, need_bias=False, **common, **spec)

    row: dict[str, Any] = {"N": n, "D": d, "V": v, "kernel": case, "args": {k: str(x) for k, x in spec.items()}}
    if not ctx.dry:  # compile (or load) outside the timing
        fn()
        ctx.sync()
    row["measured_ms"] = ctx.median_ms(fn)
    est, src = _model_estimates(Path(os.environ.get("CCE_SUITE_OUT", ".")), row_env(ctx.dry)["gpu"] or "")
    if case in est and not ctx.dry:
        lo, hi = est[case]
        row.update(
            model_ms_low=lo, model_ms_high=hi, model_source=src, measured_over_model_high=row["measured_ms"] / hi
        )
    return row


# --- atomics ------------------------------------------------------------------------------------


def atomics_cases(ctx: Ctx) -> list[str]:
    return ["L2-resident 16 MB", "HBM 2.36 GB (dW at paper shape)"]


def atomics_run(ctx: Ctx, case: str) -> dict:
    """fp32 atomic-add payload throughput: ``index_add_`` (one atomicAdd per element, each row hit
    once) into an L2-resident buffer and into one the size of the paper shape's fp32 dW."""
    import torch

    nrows, d = (1736, 2304) if case.startswith("L2") else (256000, 2304)
    if ctx.dry:
        nrows, d = 64, 32
    out = torch.zeros(nrows, d, device=ctx.dev)
    src = torch.randn(nrows, d, device=ctx.dev)
    idx = torch.randperm(nrows, device=ctx.dev)
    ms = ctx.median_ms(lambda: out.index_add_(0, idx, src))
    return {"buffer": case, "bytes": src.numel() * 4, "ms": ms, "gb_per_s": src.numel() * 4 / ms / 1e6}


CHILD_STAGES: dict[str, tuple[Callable[[Ctx], list[str]], Callable[[Ctx, str], dict]]] = {
    "env": (env_cases, env_run),
    "correctness": (correctness_cases, correctness_run),
    "peers": (peers_cases, peers_run),
    "kernels": (kernels_cases, kernels_run),
    "atomics": (atomics_cases, atomics_run),
}


def _matches(case: str, var: str) -> bool:
    subs = [s for s in os.environ.get(var, "").split(",") if s]
    return any(s in case for s in subs)


def _cuda_alive() -> bool:
    import torch

    try:
        x = torch.ones(4, device="cuda")
        x.add_(1)
        torch.cuda.synchronize()
        return bool(x.sum().item() == 8)
    except Exception:  # noqa: BLE001
        return False


def child_main(stage: str, cases: list[str], out: Path, dry: bool, quick: bool, warmup: int, repeats: int) -> int:
    """Run ``cases`` of ``stage``; one row per case, appended as soon as it is known."""
    ctx = Ctx(dry, quick, warmup, repeats)
    env = row_env(dry)
    _, run = CHILD_STAGES[stage]
    for case in cases:
        print(f"@@start {json.dumps(case)}", flush=True)
        t0 = time.perf_counter()
        row: dict[str, Any] = {"stage": stage, "case": case}
        try:
            if _matches(case, "CCE_SUITE_CRASH"):
                print(f"[suite] CCE_SUITE_CRASH: the child dies at {case!r}", flush=True)
                os._exit(86)
            if _matches(case, "CCE_SUITE_HANG"):
                print(f"[suite] CCE_SUITE_HANG: the child hangs at {case!r}", flush=True)
                time.sleep(10**6)
            if _matches(case, "CCE_SUITE_FAIL"):
                raise RuntimeError(f"injected failure (CCE_SUITE_FAIL) at {case!r}")
            res = run(ctx, case)
            row.update(res)
            row.setdefault("status", "ok")
        except Skip as e:
            row.update(status="skipped", error=str(e)[:500])
        except Exception as e:  # noqa: BLE001 - every failure becomes a row; the next case runs
            row.update(
                status="error",
                error=f"{type(e).__name__}: {e}"[:3000],
                traceback=traceback.format_exc()[-4000:],
            )
        row["seconds"] = round(time.perf_counter() - t0, 2)
        row["env"] = env
        append_row(out, row)
        brief = {k: row.get(k) for k in ("status", "error", "seconds") if row.get(k) is not None}
        print(f"@@end {json.dumps(case)} {json.dumps(brief)[:600]}", flush=True)
        if row["status"] == "error":
            ctx.cache.clear()
            ctx.free()
            if ctx.cuda and not _cuda_alive():
                print("[suite] the CUDA context is unusable after that error: this child exits", flush=True)
                sys.stdout.flush()
                os._exit(3)
    return 0


# ------------------------------------------------------------------------------------------------
# parent side: the orchestrator
# ------------------------------------------------------------------------------------------------


class Suite:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.out = Path(a.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.dry = a.dry_run
        self.started = a.started or time.time()
        self.deadline = self.started + a.budget_s - RESERVE_S
        self.run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        os.environ.update(
            CCE_SUITE_RUN=self.run_id,
            CCE_SUITE_COMMIT=commit(),
            CCE_SUITE_TREE=tree_hash(),
            CCE_SUITE_OUT=str(self.out),
            PYTHONUNBUFFERED="1",
        )
        if self.dry:
            os.environ["TRITON_INTERPRET"] = "1"
        self.scale = 0.5 if self.dry else 1.0

    def log(self, msg: str) -> None:
        print(f"[suite {time.time() - self.started:6.1f}s] {msg}", flush=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def record(self, stage: str, case: str, status: str, error: str, **kw: Any) -> None:
        append_row(
            self.out,
            {
                "stage": stage,
                "case": case,
                "status": status,
                "error": error,
                "env": {"commit": os.environ["CCE_SUITE_COMMIT"]},
                **kw,
            },
        )

    def stage_budget(self, stage: str, after: list[str]) -> float:
        cap = self.a.stage_cap or STAGES[stage][0] * self.scale
        keep = sum(STAGES[s][2] * self.scale for s in after)
        return max(0.0, min(cap, self.left() - keep))

    def list_cases(self, stage: str) -> list[str]:
        class _C:  # the case lists depend on the flags only: no torch, no CUDA in the parent
            dry, quick = self.dry, self.a.quick

        return CHILD_STAGES[stage][0](_C)  # type: ignore[arg-type]

    def run_child_stage(self, stage: str, budget: float) -> None:
        cases = self.list_cases(stage)
        case_timeout = self.a.case_timeout or STAGES[stage][1] * (2 if self.dry else 1)
        stage_end = time.time() + budget
        restarts = 0
        while True:
            done = {r["case"] for r in read_rows(self.out, self.run_id) if r.get("stage") == stage}
            todo = [c for c in cases if c not in done]
            if not todo:
                return
            if time.time() > stage_end - 3 or restarts > 6:
                for c in todo:
                    self.record(stage, c, "skipped", f"not run: the stage's budget ({budget:.0f} s) ran out")
                return
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", stage, "--cases", json.dumps(todo)]
            cmd += ["--out", str(self.out), "--warmup", str(self.a.warmup), "--repeats", str(self.a.repeats)]
            cmd += ["--dry-run"] if self.dry else []
            cmd += ["--quick"] if self.a.quick else []
            rc, current, why = self._supervise(cmd, stage, case_timeout, stage_end)
            restarts += 1
            if current is not None:
                done = {r["case"] for r in read_rows(self.out, self.run_id) if r.get("stage") == stage}
                if current not in done:
                    self.record(stage, current, "error", why or f"the child process exited (rc={rc}) during this case")
            elif rc != 0:
                self.log(f"{stage}: child exited rc={rc} between cases")

    def _supervise(self, cmd: list[str], stage: str, case_timeout: float, stage_end: float):
        """Run one child, echo its output, kill it past the case timeout or the stage end.
        Returns (rc, the case it was in when it stopped or None, why it was killed)."""
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        lines: queue.Queue = queue.Queue()

        def pump():
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        current, since, why, eof = None, time.time(), None, False
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                line = ""
            if line is None:
                eof = True
            elif line:
                sys.stdout.write(f"  [{stage}] {line}")
                sys.stdout.flush()
                if line.startswith("@@start "):
                    current, since = json.loads(line[8:].strip()), time.time()
                elif line.startswith("@@end "):
                    current = None
            if eof and proc.poll() is not None:
                break
            now = time.time()
            if why is None and current is not None and now - since > case_timeout:
                why = f"timeout: the case ran past {case_timeout:.0f} s; its child was killed"
            if why is None and now > stage_end:
                why = "timeout: the stage's budget ran out during this case; its child was killed"
            if why is not None and proc.poll() is None:
                self.log(f"{stage}: {why} ({current!r})")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(), current, why

    def run_pytest(self, budget: float) -> None:
        """The CUDA tests: the kernel and distillation-kernel test files (compiled for real on a GPU),
        the ahead-of-time compile tests, and every ``gpu``-marked test; xdist and a per-test timeout
        where installed; JUnit XML under the output folder."""
        stage = "pytest"
        aot = "tests/test_aot_compile.py::"
        files = ["tests/test_kernels.py", "tests/test_distill_triton.py"]
        # the ahead-of-time compile tests for this machine's target only (the others run in CI on CPU)
        files += [f"{aot}test_every_selectable_kernel_compiles_within_limits[newest-sm_90]"]
        files += [f"{aot}test_distill_kernels_compile_within_limits[newest-sm_90]"]
        files += [
            f"{aot}test_selection_uses_reported_shared_memory_not_major",
            f"{aot}test_splits_follow_the_launched_tile",
        ]
        for p in sorted((REPO / "tests").glob("test_*.py")):
            rel = f"tests/{p.name}"
            if rel not in files and rel != aot[:-2] and "mark.gpu" in p.read_text():
                files.append(rel)
        have = {m: _importable(m) for m in ("xdist", "pytest_timeout")}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", "-rfE"]
        cmd += [f"--junitxml={self.out / JUNIT}", "-o", "junit_family=xunit1"]
        env = dict(os.environ)
        if self.dry:  # the CPU run checks the plumbing only: the gpu-marked tests (skipped here) of one file
            files = ["tests/test_kernels.py"]
            cmd += ["-m", "gpu"]
        else:
            env["CCE_SLOW"] = "1"  # the 64-bit-offset GPU test
            env.pop("TRITON_INTERPRET", None)
        if have["xdist"] and not self.dry:
            cmd += ["-n", str(min(8, max(2, (os.cpu_count() or 2) // 2)))]
        if have["pytest_timeout"]:
            cmd += ["--timeout", str(int(min(150, max(30, budget * 0.6))))]
        cmd += files
        self.log(f"pytest (budget {budget:.0f} s): {' '.join(cmd)}")
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
        killed = None
        try:
            rc = proc.wait(timeout=max(1.0, budget - 20))
        except subprocess.TimeoutExpired:
            killed = f"timeout: pytest ran past its budget ({budget:.0f} s); interrupted"
            proc.send_signal(signal.SIGINT)  # pytest writes its reports (the JUnit XML) on an interrupt
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        row: dict[str, Any] = {"command": " ".join(cmd), "rc": rc, "wall_s": round(time.time() - t0, 1), **have}
        row.update(junit_summary(self.out / JUNIT))
        status = "ok" if rc == 0 and not killed else "fail" if rc == 1 and not killed else "error"
        self.record(stage, "GPU tests", status, killed or ("" if rc == 0 else f"pytest rc={rc}"), **row)

    def start_gpu_model(self, budget: float) -> subprocess.Popen | None:
        """The static model (CPU only) in the background, beside the GPU tests; its compile is capped."""
        cmd = [sys.executable, "-m", "benchmarks.gpu_model", "--out", str(self.out)]
        cmd += ["--compile-budget", str(int(max(0, budget - 20)))]
        if self.dry:
            cmd += ["--no-compile"]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # its own AOT cache: the GPU tests' ahead-of-time compile tests write the shared one at the same time
        env["CCE_DIST_AOT_CACHE"] = os.path.join(tempfile.gettempdir(), "cce_suite_gpu_model_aot")
        self.log("gpu_model: " + " ".join(cmd))
        return subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)

    def finish_gpu_model(self, proc: subprocess.Popen | None, budget_end: float) -> None:
        if proc is None:
            return
        try:
            rc = proc.wait(timeout=max(1.0, budget_end - time.time()))
            err = "" if rc == 0 else f"gpu_model rc={rc} (see suite.log)"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc, err = proc.wait(), "timeout: gpu_model killed"
        self.record("gpu_model", "static model", "ok" if rc == 0 else "error", err, rc=rc)

    def main(self) -> None:
        stages = [s for s in ORDER if s in self.a.stages.split(",")] if self.a.stages else ORDER
        self.log(f"out {self.out}, run {self.run_id}, budget {self.a.budget_s:.0f} s, dry run {self.dry}")
        append_row(
            self.out,
            {
                "stage": "suite",
                "case": "start",
                "status": "ok",
                "argv": sys.argv,
                "budget_s": self.a.budget_s,
                "env": {"commit": os.environ["CCE_SUITE_COMMIT"], "tree": os.environ["CCE_SUITE_TREE"]},
            },
        )
        for i, stage in enumerate(stages):
            after = stages[i + 1 :]
            budget = self.stage_budget(stage, after)
            if budget < STAGES[stage][2] * self.scale:
                for c in self.list_cases(stage) if stage != "pytest" else ["GPU tests"]:
                    self.record(stage, c, "skipped", f"not run: {self.left():.0f} s left of the total budget")
                continue
            self.log(f"stage {stage}: budget {budget:.0f} s")
            t0 = time.time()
            try:
                if stage == "pytest":
                    model = self.start_gpu_model(budget) if "gpu_model" not in self.a.skip else None
                    self.run_pytest(budget)
                    self.finish_gpu_model(model, t0 + budget)
                else:
                    self.run_child_stage(stage, budget)
            except Exception as e:  # noqa: BLE001 - the orchestrator itself must carry on
                self.record(stage, "(stage)", "error", f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            self.log(f"stage {stage}: done in {time.time() - t0:.0f} s")
        if "gpu_model" in self.a.stages.split(",") and "pytest" not in stages:
            self.finish_gpu_model(self.start_gpu_model(60), time.time() + 60)
        render(self.out, self.run_id)
        self.log(f"wrote {self.out / JSONL} and {self.out / MD}")
        print(headline(self.out, self.run_id), flush=True)


def _importable(mod: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(mod) is not None


def junit_summary(path: Path) -> dict:
    if not path.exists():
        return {"junit": "missing"}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"junit": f"unreadable: {e}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    bad = []
    for tc in root.iter("testcase"):
        for tag in ("failure", "error"):
            el = tc.find(tag)
            if el is not None:
                bad.append(f"{tc.get('classname')}::{tc.get('name')}: {(el.get('message') or '')[:300]}")
    return {**tot, "failed_tests": bad[:60]}


# ------------------------------------------------------------------------------------------------
# markdown (from the JSONL alone)
# ------------------------------------------------------------------------------------------------


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.{nd}f}" if abs(x) >= 10**-nd or x == 0 else f"{x:.2e}"
    return str(x)


def headline(out: Path, run: str | None = None) -> str:
    """A compact plain-text summary, printed last (a device tool returns the tail of the output)."""
    lines = ["== gpu_suite headline (full tables in gpu_suite.md) =="]
    for r in read_rows(out, run):
        st, case = r.get("stage"), r.get("case")
        if st in ("suite", "env"):
            continue
        msg = f"{st:11s} {case[:58]:58s} {r.get('status', '?'):7s}"
        if st == "correctness" and r.get("status") in ("ok", "fail"):
            parts = [
                f"{k} {r[k]['rel_fro' if k in ('dH', 'dW') else 'max_abs']:.1e}" for k in ("lse", "dH", "dW") if k in r
            ]
            msg += " " + ", ".join(parts)
        elif st == "peers" and r.get("fwd_bwd_ms"):
            msg += f" fwd+bwd {r['fwd_bwd_ms']:.1f} ms"
            msg += f", fwd {r['fwd_ms']:.1f}" if "fwd_ms" in r else ""
            msg += f", peak {r['peak_mb']:.0f} MB" if "peak_mb" in r else ""
        elif st == "kernels" and r.get("measured_ms"):
            msg += f" {r['measured_ms']:.1f} ms"
            if r.get("model_ms_high"):
                msg += f" (model {r['model_ms_low']:.1f}-{r['model_ms_high']:.1f})"
        elif st == "atomics" and r.get("gb_per_s"):
            msg += f" {r['gb_per_s']:.0f} GB/s"
        elif st == "pytest":
            msg += " " + ", ".join(f"{r.get(k)} {k}" for k in ("tests", "failures", "errors", "skipped"))
        if r.get("status") in ("error", "fail", "skipped") and r.get("error"):
            msg += " | " + str(r["error"]).splitlines()[0][:150]
        lines.append(msg)
    return "\n".join(lines)


def _shape(r: dict) -> str:
    return f"{r['N']}x{r['D']}x{r['V']}" if "N" in r else ""


def render(out: Path, run: str | None = None) -> str:
    rows = read_rows(out, run)
    if not rows:
        md = f"# GPU suite\n\nNo rows in {out / JSONL}.\n"
        (out / MD).write_text(md)
        return md
    envr = next((r for r in rows if r.get("stage") == "env" and r.get("status") == "ok"), {})
    e = envr.get("env") or next((r["env"] for r in rows if "torch" in r.get("env", {})), rows[0].get("env", {}))
    by = {s: [r for r in rows if r.get("stage") == s] for s in ORDER + ["gpu_model", "suite"]}
    lines = [
        f"# GPU suite — {e.get('gpu')}, commit {e.get('commit')} (tree {e.get('tree')})",
        "",
        f"Run {rows[0].get('run')}, {rows[0].get('time')}; torch {e.get('torch')}, triton {e.get('triton')}, "
        f"cce_dist {e.get('cce_dist')}, cut-cross-entropy {e.get('cut_cross_entropy')}, liger-kernel "
        f"{e.get('liger_kernel')}, trl {e.get('trl')}, python {e.get('python')}, host {e.get('host')}"
        + (" — **dry run on CPU: plumbing only, no GPU numbers**" if e.get("dry_run") else "")
        + ".",
        f"Rendered from `{JSONL}` (`python benchmarks/gpu_suite.py --render --out DIR`).",
        "",
    ]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.get("status", "?")] = counts.get(r.get("status", "?"), 0) + 1
    lines += ["Rows by status: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), ""]
    if envr.get("device"):
        lines += [
            f"Device: {envr.get('device')} ({envr.get('sms')} SMs, {envr.get('memory_gib')} GiB, cc "
            f"{envr.get('capability')}, CUDA {envr.get('cuda')}); imports: cut_cross_entropy "
            f"{envr.get('import_cut_cross_entropy')}, liger_kernel {envr.get('import_liger_kernel')}, trl "
            f"{envr.get('import_trl')}.",
            "",
        ]
    if by["correctness"]:
        lines += [
            "## Correctness against float64 (bf16 inputs, logits rounded to bf16 once as the contract says)",
            "",
            "| case | status | shape | lse max abs | target max abs | dH rel (Frobenius) | dW rel | dH max rel | "
            "dW max rel | loss abs err | s | error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in by["correctness"]:
            lines.append(
                f"| {r['case']} | {r.get('status')} | {_shape(r)} | "
                f"{_f((r.get('lse') or {}).get('max_abs'))} | {_f((r.get('target') or {}).get('max_abs'))} | "
                f"{_f((r.get('dH') or {}).get('rel_fro'))} | {_f((r.get('dW') or {}).get('rel_fro'))} | "
                f"{_f((r.get('dH') or {}).get('max_rel'))} | {_f((r.get('dW') or {}).get('max_rel'))} | "
                f"{_f(r.get('loss_abs_err'))} | {_f(r.get('seconds'))} | {(r.get('error') or '')[:160]} |"
            )
        lines.append("")
    if by["peers"]:
        lines += [
            "## Methods side by side (bf16; fwd+bwd is the headline)",
            "",
            "fwd = forward with autograd recording; bwd = fwd+bwd - fwd, only where the forward does not already "
            "form the gradients (Liger: fwd+bwd only). Peak = allocated during one fwd+bwd beyond the inputs; "
            "overhead = peak - the returned bf16 gradients. Errors vs the float32 materialized program.",
            "",
            "| N x D x V | method | status | fwd+bwd ms | vs apple exact | vs apple high | fwd ms | bwd ms | TFLOP/s "
            "| peak MB | overhead MB | dH rel | dW rel | loss err | error |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in by["peers"]:
            shape = r["case"].split(" ", 1)[0]
            ok = [x for x in by["peers"] if x["case"].split(" ", 1)[0] == shape and x.get("fwd_bwd_ms")]
            ref = {x["case"].split(" ", 1)[1]: x["fwd_bwd_ms"] for x in ok}
            fb = r.get("fwd_bwd_ms")
            ratio = {
                k: (f"{fb / ref[k]:.2f}x" if fb and ref.get(k) else "") for k in ("apple_cce(exact)", "apple_cce(high)")
            }
            lines.append(
                f"| {shape} | {r['case'].split(' ', 1)[1]} | {r.get('status')} | {_f(fb)} | "
                f"{ratio['apple_cce(exact)']} | {ratio['apple_cce(high)']} | {_f(r.get('fwd_ms'))} | "
                f"{_f(r.get('bwd_ms'))} | {_f(r.get('tflops_fwd_bwd'), 0)} | {_f(r.get('peak_mb'), 0)} | "
                f"{_f(r.get('overhead_mb'), 0)} | {_f((r.get('dH') or {}).get('rel_fro'))} | "
                f"{_f((r.get('dW') or {}).get('rel_fro'))} | {_f(r.get('loss_abs_err'))} | "
                f"{(r.get('error') or '')[:160]} |"
            )
        lines.append("")
    if by["kernels"]:
        lines += [
            "## Each kernel alone at the paper shape vs benchmarks/gpu_model.py",
            "",
            "| kernel | status | measured ms | model ms (low-high) | measured / model high | error |",
            "|---|---|---|---|---|---|",
        ]
        for r in by["kernels"]:
            lo, hi = r.get("model_ms_low"), r.get("model_ms_high")
            lines.append(
                f"| {r['case']} | {r.get('status')} | {_f(r.get('measured_ms'))} | "
                f"{f'{lo:.1f}-{hi:.1f}' if lo is not None and hi is not None else ''} | "
                f"{_f(r.get('measured_over_model_high'))} | {(r.get('error') or '')[:160]} |"
            )
        src = next((r.get("model_source") for r in by["kernels"] if r.get("model_source")), None)
        lines += (["", f"Model: {src}."] if src else []) + [""]
    if by["atomics"]:
        lines += ["## fp32 atomic throughput (index_add_)", "", "| buffer | status | ms | GB/s |", "|---|---|---|---|"]
        lines += [
            f"| {r['case']} | {r.get('status')} | {_f(r.get('ms'))} | {_f(r.get('gb_per_s'), 0)} |"
            for r in by["atomics"]
        ]
        lines.append("")
    if by["pytest"]:
        r = by["pytest"][-1]
        lines += [
            "## GPU tests",
            "",
            f"{r.get('status')}: {r.get('tests', '?')} tests, {r.get('failures', '?')} failures, "
            f"{r.get('errors', '?')} errors, {r.get('skipped', '?')} skipped in {r.get('wall_s')} s (rc {r.get('rc')}; "
            f"xdist {r.get('xdist')}, pytest-timeout {r.get('pytest_timeout')}). {r.get('error') or ''}",
            "",
            f"`{r.get('command', '')}`",
            "",
        ]
        lines += [f"- {x}" for x in r.get("failed_tests") or []]
        lines.append("")
    if by["gpu_model"]:
        r = by["gpu_model"][-1]
        lines += [f"Static model (gpu_model.md beside this file): {r.get('status')} {r.get('error') or ''}", ""]
    errs = [r for r in rows if r.get("status") in ("error", "fail")]
    if errs:
        lines += ["## Errors and failures", ""]
        lines += [
            f"- **{r.get('stage')} / {r.get('case')}** ({r.get('status')}): {(r.get('error') or '')[:600]}"
            for r in errs
        ]
        lines.append("")
    md = "\n".join(lines)
    (out / MD).write_text(md)
    return md


# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "benchmarks" / "results" / "gpu"))
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("CCE_SUITE_DRY_RUN", "") not in ("", "0"))
    p.add_argument("--quick", action="store_true", help="the paper shape only in the peers stage")
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("CCE_SUITE_BUDGET_S", 480)))
    p.add_argument("--started", type=float, default=None, help="epoch seconds the budget counts from")
    p.add_argument("--stages", default="", help=f"comma-separated subset of {ORDER} (+ gpu_model)")
    p.add_argument("--skip", default="", help="comma-separated: gpu_model")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 1; dry run 0)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median reported (default 5; dry run 1)")
    p.add_argument("--case-timeout", type=float, default=None, help="seconds per case (default: per stage)")
    p.add_argument("--stage-cap", type=float, default=None, help="seconds per stage (default: per stage, STAGES)")
    p.add_argument("--render", action="store_true", help="only re-render gpu_suite.md from gpu_suite.jsonl")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cases", default="[]", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    out = Path(a.out)
    a.warmup = (0 if a.dry_run else 1) if a.warmup is None else a.warmup
    a.repeats = (1 if a.dry_run else 5) if a.repeats is None else a.repeats
    if a.render:
        print(render(out))
        return 0
    if a.child:
        if a.dry_run:
            os.environ["TRITON_INTERPRET"] = "1"
        return child_main(a.child, json.loads(a.cases), out, a.dry_run, a.quick, a.warmup, a.repeats)
    if not a.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_suite.py: no CUDA device; use --dry-run for the CPU plumbing run", file=sys.stderr)
            return 2
    Suite(a).main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
