"""GPU suite: correctness, the peers side by side, each kernel alone, atomics, the GPU tests, spills.

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
- each stage runs in a child process with a time budget, each case with a timeout of at most a quarter
  of it; a case that raises (any Exception: a Triton CompilationError, a CUDA error, OOM) is recorded
  as an error row and the next case runs; a child that dies is recorded as an error, one that hangs (a
  poisoned CUDA context, a hung kernel) is killed at the timeout and its case recorded as a timeout,
  and a fresh child continues with the rest;
- a total budget (``--budget-s``, counted from ``--started``) bounds the whole run; stages are
  ordered by value (environment, correctness, peers, the static model, kernels, atomics, the GPU
  tests, less the ahead-of-time compiles CI covers, then the registers and spills of every kernel
  the run compiled, read from its own Triton cache: ``spill_rows``) and what a stage could not run is recorded
  as ``skipped``. The static model (benchmarks/gpu_model.py, CPU only) is built in the background
  from the start and waited for before the kernels stage, which compares with it: this run's model,
  never the committed one;
- the peers are imported exactly as measured (the environment row records ok or the error, and
  where from); their wheels (benchmarks/peer_wheels.txt, ``--check-wheels``) are appended to
  sys.path after the environment's own packages (``$CCE_SUITE_PEER_SITE``); a real run that cannot
  import a peer records errors, not skips;
- the exit code is 0 only when every case is ok (or skipped by design: a CUDA-only peer in the dry
  run), else 1; a summary of what ran, failed, errored, timed out and was skipped (and why) ends
  the output and gpu_suite.md.

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
    python benchmarks/gpu_suite.py --check-wheels .whl  # the carried wheels against peer_wheels.txt

``CCE_SUITE_FAIL=substr[,substr]`` makes every case whose id contains one of them raise, and
``CCE_SUITE_CRASH=substr`` makes the child die (os._exit) and ``CCE_SUITE_HANG=substr`` hang at such a
case: tests of the error paths (``--case-timeout`` / ``--stage-cap`` shorten the wait for the latter).
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

#: Per stage: (budget cap s, timeout of one case s, least budget to start it). The case timeout is at most a
#: quarter of the budget (Suite.case_timeout clamps it there too), so one hung case costs at most a quarter of
#: its stage and the rest still runs; a first call's compile / autotune fits in it. Dry run: half of each.
STAGES: dict[str, tuple[float, float, float]] = {
    "env": (120, 30, 5),
    "correctness": (80, 20, 10),
    "peers": (200, 50, 20),
    "gpu_model": (160, 160, 5),
    "kernels": (60, 15, 10),
    "atomics": (20, 5, 5),
    "pytest": (200, 200, 30),
    "spills": (60, 60, 10),
}
#: The static model (benchmarks/gpu_model.py, CPU only) starts in the background before the first stage and
#: is waited for at "gpu_model" (its budget is that wait; usually the model is done by then), so the kernels
#: stage compares with THIS run's model. Its sm_90 compile is capped at MODEL_COMPILE_S (a fresh compile took
#: 67 s on a loaded 2-core CPU); past the cap gpu_model reuses the committed compiled fields and says so.
MODEL_COMPILE_S = 120
ORDER = ["env", "correctness", "peers", "gpu_model", "kernels", "atomics", "pytest", "spills"]
#: The stages that are not run case by case in a child (their one case when they are skipped).
OWN_CASES = {"gpu_model": "static model", "pytest": "GPU tests", "spills": "compiled kernels"}
#: The Triton cache of a real run (``TRITON_CACHE_DIR``, under the temporary folder, per run): every stage and the
#: GPU tests compile into it, and the ``spills`` stage reads each kernel's registers and spills from it.
TRITON_CACHE_PREFIX = "cce_suite_triton_"
#: What a row's status may be: ok; fail = out of tolerance; error = raised / the child died; timeout = killed at
#: the case timeout or the stage's end; skipped = not run (the reason in ``error``, ``expected`` when the dry
#: run cannot run it by design, e.g. a CUDA-only peer).
STATUSES = ("ok", "fail", "error", "timeout", "skipped")
#: Seconds kept back at the end for rendering and the shell script's last lines.
RESERVE_S = 15.0


# ------------------------------------------------------------------------------------------------
# the peers: what each imports, the carried wheels
# ------------------------------------------------------------------------------------------------

#: The pinned wheels carried to the offline machine (benchmarks/fetch_peer_wheels.sh downloads them).
PEER_WHEELS = REPO / "benchmarks" / "peer_wheels.txt"
#: Where gpu_suite.sh installs them; gpu_suite.py appends it to sys.path (never before the image's packages).
PEER_SITE_ENV = "CCE_SUITE_PEER_SITE"
#: Per peer: its distribution and exactly what the suite imports from it (module, name), the import path the
#: measurement takes: the environment row imports these, not the lazy top-level package (``import trl``
#: succeeds without the ``datasets`` its trainer utilities need).
PEERS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "apple_cce": ("cut-cross-entropy", [("cut_cross_entropy", "linear_cross_entropy")]),
    "liger": (
        "liger-kernel",
        [("liger_kernel.transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss")],
    ),
    "trl": ("trl", [("trl.kernels", "ChunkedLogProbFunction"), ("trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE")]),
}


def peer_of(method: str) -> str | None:
    """The peer a method of METHODS measures (None: cce_dist or torch itself)."""
    return next((p for p in PEERS if method == p or method.startswith(p + "(")), None)


def peer_wheel_pins(path: Path = PEER_WHEELS) -> dict[str, str]:
    """``{normalized name: version}`` of the carried wheels; every line must pin one version with ``==``."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, ver = line.partition("==")
        if not sep or not ver.strip() or any(c in ver for c in "<>=!~*,; "):
            raise ValueError(f"{path.name}:{n}: {raw!r} does not pin one version with ==")
        key = name.strip().lower().replace("_", "-").replace(".", "-")
        if key in pins:
            raise ValueError(f"{path.name}:{n}: {key} pinned twice")
        pins[key] = ver.strip()
    return pins


def check_wheels(folder: Path, path: Path = PEER_WHEELS) -> list[str]:
    """What is wrong with a folder of carried wheels against the pins (empty: nothing): a pin without its
    wheel, a wheel of another version or of no pin (two versions of one package stop the install)."""
    pins = peer_wheel_pins(path)
    problems, seen = [], {}
    for whl in sorted(Path(folder).glob("*.whl")):
        dist, ver = whl.name.split("-")[:2]
        key = dist.lower().replace("_", "-").replace(".", "-")
        if key not in pins:
            problems.append(f"{whl.name}: not in {path.name}")
        elif ver != pins[key]:
            problems.append(f"{whl.name}: {path.name} pins {key}=={pins[key]}")
        elif not {"py3", "py312", "cp312"} & set(whl.name[:-4].split("-")[-3].split(".")):
            problems.append(f"{whl.name}: not a wheel for CPython 3.12")
        seen.setdefault(key, []).append(whl.name)
    problems += [f"{k}=={v}: no wheel" for k, v in pins.items() if k not in seen]
    problems += [f"{k}: {len(v)} wheels ({', '.join(v)})" for k, v in seen.items() if len(v) > 1]
    return problems


def add_peer_site() -> str | None:
    """Append the carried wheels' folder (``$CCE_SUITE_PEER_SITE``) to the END of sys.path, with its .pth
    files, so that the image's own packages are always found first (PYTHONPATH would go before them)."""
    import site

    folder = os.environ.get(PEER_SITE_ENV)
    if not folder or not os.path.isdir(folder):
        return None
    folder = os.path.abspath(folder)
    if folder not in sys.path:
        site.addsitedir(folder)  # appends, like site-packages itself
    return folder


def import_peer(peer: str) -> tuple[dict, dict[str, Any]]:
    """Import what ``peer`` needs; ``(record, {name: object})``. The record says ok or the error, the
    version and the file each module came from (the carried folder or the image)."""
    import importlib

    dist, needs = PEERS[peer]
    rec: dict[str, Any] = {
        "dist": dist,
        "version": _version(dist),
        "imports": [f"from {m} import {a}" for m, a in needs],
    }
    got: dict[str, Any] = {}
    try:
        for mod, attr in needs:
            got[attr] = getattr(importlib.import_module(mod), attr)
        rec["status"] = "ok"
        rec["from"] = {m: getattr(sys.modules[m], "__file__", None) for m, _ in needs}
    except Exception as e:  # noqa: BLE001 - any failure to import is the peer's row
        rec["status"] = "error"
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
    return rec, got


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
    # What each peer's measurement imports (not the lazy top-level package), where it came from, and where the
    # carried wheels sit on sys.path (after the image's site-packages, never before).
    row["peer_site"] = os.environ.get(PEER_SITE_ENV)
    row["peer_site_position"] = (
        f"{sys.path.index(row['peer_site'])} of {len(sys.path)}" if row["peer_site"] in sys.path else None
    )
    row["peers"] = {p: import_peer(p)[0] for p in PEERS}
    bad = {p: r["error"] for p, r in row["peers"].items() if r["status"] != "ok"}
    if bad and not ctx.dry:  # a real run measures every peer: one that does not import is the run's error
        row["status"] = "error"
        row["error"] = "; ".join(f"{p} does not import: {e}" for p, e in bad.items())
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
    """A case that cannot run here by design (a CUDA-only peer in a dry run): an expected skip."""


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
        apple = _peer(ctx, "apple_cce", cuda_only=True)["linear_cross_entropy"]
        eps = None if "exact" in name else "high"
        m = (
            lambda h, w, t: apple(h, w, t, filter_eps=eps),
            f"cut_cross_entropy.linear_cross_entropy(filter_eps={eps!r})",
        )
    elif name == "liger":
        lg = _peer(ctx, "liger", cuda_only=True)["LigerFusedLinearCrossEntropyLoss"]()
        m = (lambda h, w, t: lg(w, h, t), "LigerFusedLinearCrossEntropyLoss()(w, h, t)")
    elif name == "trl":
        # TRL 1.16's fused LM head kernel (what its trainers call; Triton on CUDA, torch chunks elsewhere), with the
        # vocab tile its fused head passes; the cross-entropy is minus the mean logprob (no target is ignored here)
        got = _peer(ctx, "trl", cuda_only=False)
        chunked, tile = got["ChunkedLogProbFunction"], got["_CHUNKED_LOGPROB_CHUNK_SIZE"]

        def trl_ce(h, w, t):
            return -chunked.apply(h, w, None, t, 1.0, tile, None, 1.0, ("log_probs",))[0].mean()

        m = (trl_ce, f"-trl.kernels.ChunkedLogProbFunction.apply(h, w, None, t, 1.0, {tile}, ...)[0].mean()")
    else:
        raise ValueError(name)
    ctx.cache.setdefault("methods", {})[name] = m
    return m


def _peer(ctx: Ctx, peer: str, cuda_only: bool) -> dict[str, Any]:
    """What ``peer`` is measured with. The dry run skips a CUDA-only peer (expected) and one not installed on
    the CPU machine; a real run that cannot import a peer raises: the case is an error, never a silent skip."""
    if ctx.dry and cuda_only:
        raise Skip(f"dry run: {PEERS[peer][0]}'s kernels need CUDA")
    rec, got = import_peer(peer)
    if rec["status"] != "ok":
        if ctx.dry:
            raise Skip(f"dry run: {PEERS[peer][0]} does not import here: {rec['error']}")
        raise ImportError(f"peer {peer} ({PEERS[peer][0]}) does not import: {rec['error']}")
    return got


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
    """This run's gpu_model estimate (low, high) per launch label, from the gpu_model.json the suite built
    under ``out`` before the kernels stage (stage "gpu_model"), and where it came from. Never the committed
    benchmarks/results/gpu_model.json: that one measures another commit's kernels, maybe with another Triton.
    ``({}, why)`` when this run has no model."""
    run = os.environ.get("CCE_SUITE_RUN")
    built = [r for r in read_rows(out, run) if r.get("stage") == "gpu_model"]
    p = out / "gpu_model.json"
    if not built or built[-1].get("status") != "ok" or not p.exists():
        why = (built[-1].get("error") or built[-1].get("status")) if built else "the model stage has not run"
        return {}, f"none: this run built no model ({why})"
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
    return est, f"gpu_model.json of this run {run} ({gname}; {data.get('compile_source')})"


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
    # this run's model (the dry run compares too: the plumbing is what it checks, not the numbers)
    est, src = _model_estimates(Path(os.environ.get("CCE_SUITE_OUT", ".")), row_env(ctx.dry)["gpu"] or "")
    row["model_source"] = src
    if case in est:
        lo, hi = est[case]
        row.update(model_ms_low=lo, model_ms_high=hi, measured_over_model_high=row["measured_ms"] / hi)
    elif est:
        row["model_source"] += f"; no estimate labelled {case!r}"
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
            row.update(status="skipped", error=str(e)[:500], expected=True)
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


#: The test files the GPU stage runs whole: they run the kernels compiled for the GPU they find (CI runs them
#: in Triton's interpreter only). Every other file with ``gpu``-marked tests joins them.
PYTEST_FILES = ["tests/test_kernels.py", "tests/test_distill_triton.py"]
#: Never on the GPU's time: CI covers them on CPU. test_aot_compile.py compiles the sm_90 (and every other)
#: matrix with the real compiler and no GPU; the oldest-Triton interpreter tests interpret.
PYTEST_CPU_COVERED = ["tests/test_aot_compile.py", "tests/test_interpreter_oldest_triton.py"]


def pytest_files() -> list[str]:
    files = list(PYTEST_FILES)
    for p in sorted((REPO / "tests").glob("test_*.py")):
        rel = f"tests/{p.name}"
        if rel not in files and rel not in PYTEST_CPU_COVERED and "mark.gpu" in p.read_text():
            files.append(rel)
    return files


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
        else:  # a cache of this run's own: the spills stage reads what this run compiled, nothing older
            os.environ["TRITON_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), TRITON_CACHE_PREFIX + self.run_id)
        self.model: subprocess.Popen | None = None  # benchmarks/gpu_model.py, started before the first stage

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
        cap = self.a.stage_cap or STAGES[stage][0]
        keep = sum(STAGES[s][2] for s in after)
        return max(0.0, min(cap, self.left() - keep))

    def case_timeout(self, stage: str, budget: float) -> float:
        """A case's timeout: the stage's (or --case-timeout), at most a quarter of the stage's budget, so that
        one hung case leaves three quarters to the others."""
        return min(self.a.case_timeout or STAGES[stage][1], budget / 4)

    def list_cases(self, stage: str) -> list[str]:
        class _C:  # the case lists depend on the flags only: no torch, no CUDA in the parent
            dry, quick = self.dry, self.a.quick

        return CHILD_STAGES[stage][0](_C)  # type: ignore[arg-type]

    def run_child_stage(self, stage: str, budget: float) -> None:
        cases = self.list_cases(stage)
        case_timeout = self.case_timeout(stage, budget)
        self.log(f"{stage}: {len(cases)} cases, {case_timeout:.0f} s each at most")
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
                    status = "timeout" if why else "error"
                    self.record(stage, current, status, why or f"the child process exited (rc={rc}) during this case")
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
        """The CUDA tests: the files that run the kernels compiled for this GPU (PYTEST_FILES) and every
        other ``gpu``-marked file, not what CI already covers on CPU (PYTEST_CPU_COVERED: the ahead-of-time
        compile matrix above all, which CI compiles for sm_90 with both ends of the Triton range); xdist and
        a per-test timeout (a quarter of the budget) where installed; JUnit XML under the output folder."""
        stage = "pytest"
        files = pytest_files()
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
            cmd += ["--timeout", str(int(min(150, max(30, budget / 4))))]
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

    def run_spills(self, budget: float) -> None:
        """Registers and spills of every kernel this run compiled (its Triton cache, ``TRITON_CACHE_DIR``; read
        with ``cce_dist.kernels.resources.scan_cache``): one row per cce_dist kernel, ``fail`` when a compiled
        variant spills more than ``SPILL_BOUND`` (none), the bound tests/test_aot_compile.py asserts without a
        GPU; one row for the peers' kernels (informative: their spills are theirs). A run that compiled no
        cce_dist kernel is an error (the cache did not reach the stages)."""
        stage, case = "spills", OWN_CASES["spills"]
        if self.dry:
            self.record(stage, case, "skipped", "dry run: the interpreter compiles no kernel", expected=True)
            return
        cache = os.environ.get("TRITON_CACHE_DIR", "")
        t0 = time.time()
        done: queue.Queue = queue.Queue()

        def scan():
            try:
                from cce_dist.kernels.resources import scan_cache

                done.put(scan_cache(cache, jobs=min(16, os.cpu_count() or 2)))
            except Exception as e:  # noqa: BLE001 - recorded below
                done.put(e)

        threading.Thread(target=scan, daemon=True).start()
        try:
            got = done.get(timeout=max(1.0, budget - 2))
        except queue.Empty:
            self.record(stage, case, "timeout", f"timeout: reading {cache} ran past {budget:.0f} s")
            return
        if isinstance(got, Exception):
            self.record(stage, case, "error", f"{type(got).__name__}: {got}", cache=cache)
            return
        for row in spill_rows(got, cache):
            row["wall_s"] = round(time.time() - t0, 1)
            self.record(**row)

    def start_gpu_model(self) -> None:
        """benchmarks/gpu_model.py (CPU only: the sm_90 compile and the model) in the background from the
        start, so that it is built before the kernels stage compares with it. Its compile is capped
        (MODEL_COMPILE_S); past the cap gpu_model reuses the committed compiled fields and says so (its
        compile_source, which the model's row and every kernels row carry)."""
        stages = self.stages()
        if "gpu_model" not in stages:
            return
        cap = min(MODEL_COMPILE_S, self.left() - 10)
        cmd = [sys.executable, "-m", "benchmarks.gpu_model", "--out", str(self.out)]
        cmd += ["--no-compile"] if self.dry else ["--compile-budget", str(int(max(0, cap)))]
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
        # its own AOT cache (and Triton cache in it: its kernels are compiled for sm_90, not launched): nothing else
        # compiles into it, and a stale shared one is never read
        env["CCE_DIST_AOT_CACHE"] = os.path.join(tempfile.gettempdir(), f"cce_suite_gpu_model_aot_{self.run_id}")
        self.log("gpu_model (background): " + " ".join(cmd))
        self.model = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
        self.model_started = time.time()

    def finish_gpu_model(self, budget: float) -> None:
        """Wait for the model (at most ``budget`` s more) and record it: ok, error or timeout."""
        proc, self.model = self.model, None
        if proc is None:
            self.record("gpu_model", "static model", "error", "gpu_model was not started")
            return
        try:
            rc = proc.wait(timeout=max(1.0, budget))
            status, err = ("ok", "") if rc == 0 else ("error", f"gpu_model rc={rc} (see suite.log)")
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            rc, status = proc.wait(), "timeout"
            err = f"timeout: gpu_model still running {budget:.0f} s into its stage; killed"
        src = None
        with contextlib.suppress(Exception):
            src = json.loads((self.out / "gpu_model.json").read_text()).get("compile_source")
        self.record(
            "gpu_model",
            "static model",
            status,
            err,
            rc=rc,
            wall_s=round(time.time() - self.model_started, 1),
            compile_source=src,
        )

    def stages(self) -> list[str]:
        """ORDER, or the --stages subset of it, less --skip."""
        want, skip = set(self.a.stages.split(",")) - {""}, set(self.a.skip.split(","))
        return [s for s in ORDER if (not want or s in want) and s not in skip]

    def main(self) -> int:
        """Every stage in ORDER, then the markdown and the summary; returns the exit code (exit_code())."""
        stages = self.stages()
        self.log(f"out {self.out}, run {self.run_id}, budget {self.a.budget_s:.0f} s, dry run {self.dry}")
        append_row(
            self.out,
            {
                "stage": "suite",
                "case": "start",
                "status": "ok",
                "argv": sys.argv,
                "budget_s": self.a.budget_s,
                "stages": stages,
                "env": {"commit": os.environ["CCE_SUITE_COMMIT"], "tree": os.environ["CCE_SUITE_TREE"]},
            },
        )
        self.start_gpu_model()
        for i, stage in enumerate(stages):
            after = stages[i + 1 :]
            budget = self.stage_budget(stage, after)
            if budget < STAGES[stage][2]:
                for c in [OWN_CASES[stage]] if stage in OWN_CASES else self.list_cases(stage):
                    self.record(stage, c, "skipped", f"not run: {self.left():.0f} s left of the total budget")
                continue
            self.log(f"stage {stage}: budget {budget:.0f} s")
            t0 = time.time()
            try:
                if stage == "pytest":
                    self.run_pytest(budget)
                elif stage == "gpu_model":
                    self.finish_gpu_model(budget)
                elif stage == "spills":
                    self.run_spills(budget)
                else:
                    self.run_child_stage(stage, budget)
            except Exception as e:  # noqa: BLE001 - the orchestrator itself must carry on
                self.record(stage, "(stage)", "error", f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            self.log(f"stage {stage}: done in {time.time() - t0:.0f} s")
        if self.model is not None:  # its stage was skipped: it must not outlive the suite
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.model.pid, signal.SIGKILL)
            self.model.wait()
        rc = exit_code(read_rows(self.out, self.run_id))
        append_row(self.out, {"stage": "suite", "case": "summary", "status": "ok", "exit_code": rc})
        render(self.out, self.run_id)
        self.log(f"wrote {self.out / JSONL} and {self.out / MD}")
        print(headline(self.out, self.run_id), flush=True)
        print(summary(read_rows(self.out, self.run_id)), flush=True)
        return rc


def spill_rows(recs: list[dict], cache: str) -> list[dict]:
    """The ``spills`` stage's rows (``Suite.record`` keywords) from ``scan_cache``'s records: per cce_dist kernel
    its variants, registers and spills (``fail`` past ``SPILL_BOUND``, ``error`` where a cubin could not be read),
    then the peers' kernels in one informative row; an ``error`` row when no cce_dist kernel was compiled."""
    from cce_dist.kernels.resources import SPILL_BOUND, describe

    def stats(group: list[dict]) -> dict[str, Any]:
        read = [r for r in group if "error" not in r]
        return {
            "variants": len(group),
            "archs": sorted({r.get("arch") for r in group if r.get("arch") is not None}),
            "max_registers": max((r["registers"] for r in read), default=None),
            "max_spill_bytes": max((r["spill"] for r in read), default=None),
            "max_shared": max((r.get("shared") or 0 for r in read), default=None),
            "unreadable": [f"{r['cubin']}: {r['error']}" for r in group if "error" in r][:10],
        }

    def variant(r: dict) -> str:
        return f"{r.get('hash', '')[:12]} {describe(r)}: {r['spill']} B"

    ours = [r for r in recs if r["ours"]]
    if not ours:
        names = sorted({r["name"] for r in recs})[:20]
        why = f"no cce_dist kernel in the run's Triton cache {cache} ({len(recs)} cubins: {names})"
        return [dict(stage="spills", case=OWN_CASES["spills"], status="error", error=why, cache=cache)]
    rows = []
    for name in sorted({r["name"] for r in ours}):
        group = [r for r in ours if r["name"] == name]
        st = stats(group)
        over = [r for r in group if "error" not in r and r["spill"] > SPILL_BOUND]
        status = "error" if st["unreadable"] else "fail" if over else "ok"
        error = (
            f"{len(st['unreadable'])} cubin(s) unreadable"
            if st["unreadable"]
            else f"{len(over)} of {len(group)} variants spill past {SPILL_BOUND} B"
            if over
            else ""
        )
        rows.append(
            dict(stage="spills", case=name, status=status, error=error, spilling=[variant(r) for r in over][:20], **st)
        )
    peers = [r for r in recs if not r["ours"]]
    if peers:
        st = stats(peers)
        per = {
            n: max((r.get("spill", 0) for r in peers if r["name"] == n), default=0) for n in {r["name"] for r in peers}
        }
        rows.append(
            dict(
                stage="spills",
                case="peers' kernels (informative)",
                status="ok",
                error="",
                max_spill_by_kernel=per,
                **st,
            )
        )
    return rows


def exit_code(rows: list[dict]) -> int:
    """0 when every case of the run is ok or skipped by design (``expected``: a CUDA-only peer in the dry
    run); 1 when any case failed, errored, timed out, or was not run for want of time or a peer."""
    return int(any(bad(r) for r in rows))


def bad(r: dict) -> bool:
    st = r.get("status")
    return st in ("fail", "error", "timeout") or (st == "skipped" and not r.get("expected"))


def summary(rows: list[dict]) -> str:
    """What ran, passed, failed, errored, timed out and was skipped (and why), and the exit code: the last
    lines of the output (a device tool returns its tail)."""
    cases = [r for r in rows if r.get("stage") != "suite"]
    n = {st: sum(r.get("status") == st for r in cases) for st in STATUSES}
    ran = len(cases) - n["skipped"]
    expected = sum(r.get("status") == "skipped" and bool(r.get("expected")) for r in cases)
    rc = exit_code(rows)
    lines = [
        "== gpu_suite summary ==",
        f"{len(cases)} cases: {ran} ran ({n['ok']} ok, {n['fail']} failed, {n['error']} errored, "
        f"{n['timeout']} timed out), {n['skipped']} skipped ({expected} by design, {n['skipped'] - expected} "
        "for want of time or a peer)",
    ]
    for r in cases:
        if r.get("status") != "ok":
            why = str(r.get("error") or "").splitlines()[0][:200] if r.get("error") else ""
            tag = " (by design)" if r.get("expected") else ""
            lines.append(f"  {r.get('status'):8s} {r.get('stage')} / {r.get('case')}{tag}: {why}")
    lines.append(f"exit {rc}" + (": a case failed, errored, timed out or was not run" if rc else ": every case ok"))
    return "\n".join(lines)


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
        if st == "env":
            for p, rec in (r.get("peers") or {}).items():
                lines.append(f"{'env':11s} peer {p:53s} {rec.get('status', '?'):7s} {rec.get('error') or ''}"[:240])
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
        elif st == "spills" and r.get("variants"):
            msg += f" {r['variants']} compiled, max {r['max_registers']} registers, max spill {r['max_spill_bytes']} B"
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
            f"{envr.get('capability')}, CUDA {envr.get('cuda')}).",
            "",
        ]
    if envr.get("peers"):
        lines += [
            f"Peers (what each measurement imports; carried wheels in {envr.get('peer_site')}, at sys.path "
            f"position {envr.get('peer_site_position')}):",
            "",
        ]
        for p, rec in envr["peers"].items():
            where = "; ".join(f"{m} from {f}" for m, f in (rec.get("from") or {}).items())
            lines.append(
                f"- {p} ({rec.get('dist')} {rec.get('version')}): {rec.get('status')}"
                + (f", {where}" if where else "")
                + (f" — {rec.get('error')}" if rec.get("error") else "")
            )
        lines.append("")
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
    if by["spills"]:
        lines += [
            "## Registers and spills of every kernel this run compiled (its Triton cache, cuobjdump)",
            "",
            "| kernel | status | variants | targets | max registers | max spill B | max shared B | spilling |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['case']} | {r.get('status')} | {_f(r.get('variants'))} | {_f(r.get('archs'))} | "
            f"{_f(r.get('max_registers'))} | {_f(r.get('max_spill_bytes'))} | {_f(r.get('max_shared'))} | "
            f"{'; '.join(r.get('spilling') or []) or (r.get('error') or '')[:160]} |"
            for r in by["spills"]
        ]
        lines.append("")
    if by["gpu_model"]:
        r = by["gpu_model"][-1]
        lines += [
            f"Static model (gpu_model.md beside this file, built by this run in {r.get('wall_s')} s): "
            f"{r.get('status')} {r.get('error') or ''} ({r.get('compile_source')})",
            "",
        ]
    errs = [r for r in rows if r.get("status") in ("error", "fail", "timeout")]
    if errs:
        lines += ["## Errors and failures", ""]
        lines += [
            f"- **{r.get('stage')} / {r.get('case')}** ({r.get('status')}): {(r.get('error') or '')[:600]}"
            for r in errs
        ]
        lines.append("")
    lines += ["## Summary", "", "```", summary(rows), "```", ""]
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
    p.add_argument("--stages", default="", help=f"comma-separated subset of {ORDER}")
    p.add_argument("--skip", default="", help="comma-separated stages not to run")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 1; dry run 0)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median reported (default 5; dry run 1)")
    p.add_argument("--case-timeout", type=float, default=None, help="seconds per case (default: per stage)")
    p.add_argument("--stage-cap", type=float, default=None, help="seconds per stage (default: per stage, STAGES)")
    p.add_argument("--render", action="store_true", help="only re-render gpu_suite.md from gpu_suite.jsonl")
    p.add_argument("--check-wheels", default=None, metavar="DIR", help=f"check DIR's wheels against {PEER_WHEELS.name}")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cases", default="[]", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    out = Path(a.out)
    a.warmup = (0 if a.dry_run else 1) if a.warmup is None else a.warmup
    a.repeats = (1 if a.dry_run else 5) if a.repeats is None else a.repeats
    if a.render:
        print(render(out))
        return 0
    if a.check_wheels:
        problems = check_wheels(Path(a.check_wheels))
        print("\n".join(problems) or f"{a.check_wheels}: one wheel per pin of {PEER_WHEELS.name}")
        return 1 if problems else 0
    add_peer_site()
    if a.child:
        if a.dry_run:
            os.environ["TRITON_INTERPRET"] = "1"
        return child_main(a.child, json.loads(a.cases), out, a.dry_run, a.quick, a.warmup, a.repeats)
    if not a.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_suite.py: no CUDA device; use --dry-run for the CPU plumbing run", file=sys.stderr)
            return 2
    return Suite(a).main()


if __name__ == "__main__":
    sys.exit(main())
