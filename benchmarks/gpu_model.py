"""Static performance model of the cce_dist kernels on H100 / H200, from their compiled cubins.

Question: before any GPU run, what should each kernel cost at the CCE paper shape (N=8192 tokens,
D=2304, V=256,000, bf16), what bounds it (tensor cores, elementwise, HBM or atomics), and which
backward schedule is worth having? The model is the plan for the first real GPU run: gpu_suite
measures the same kernels and puts the measured times next to these estimates.

Nothing here runs a kernel. Each launch is compiled for sm_90 exactly as the library would launch
it on that device (``cce_dist.kernels.aot``: the launcher's own plan and specialization, the
config the library selects from the device record), and the registers / shared memory of the
cubin give the occupancy. Every other number is an assumption, stated in ASSUMPTIONS and printed
with the results.

    python -m benchmarks.gpu_model --out benchmarks/results   # -> benchmarks/results/gpu_model.{md,json}
    python -m benchmarks.gpu_model --out DIR --compile-budget 40   # gpu_suite: at most 40 s of compiling,
                                                 # else the compiled fields of the committed result are reused
    python -m benchmarks.gpu_model --out DIR --no-compile          # no compile at all (seconds)

Writes ``gpu_model.json`` and ``gpu_model.md`` into ``--out`` and nothing else.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import close_env, env_info, md_table

N, D, V = 8192, 2304, 256_000
#: A larger call the backward schedules are also compared at: a micro-batch of 8 x 8192 tokens, where the
#: chunked schedule's dz of all rows no longer fits its 16 MB scratch and it walks row blocks as well.
N_BIG = 65_536

#: Device parameters (public datasheets, SXM parts) and modelling assumptions. Units: bytes, s, Hz.
GPUS = {
    "H100 SXM": dict(
        sms=132,
        clock_hz=1.83e9,
        peak_bf16=989e12,
        hbm_bps=3.35e12,
        l2_bytes=50 << 20,
        smem_per_sm=233_472,
        regs_per_sm=65_536,
    ),
    "H200 SXM": dict(
        sms=132,
        clock_hz=1.83e9,
        peak_bf16=989e12,
        hbm_bps=4.8e12,
        l2_bytes=50 << 20,
        smem_per_sm=233_472,
        regs_per_sm=65_536,
    ),
}
ASSUMPTIONS = {
    "peak_bf16": "dense bf16 tensor-core peak, 989 TFLOP/s (132 SMs x 4096 FLOP/clk x 1.83 GHz)",
    "calibration": "measured on H200 SXM machines (2026-10/11, outside this suite): an 8192^3 bf16 torch.matmul "
    "(cuBLAS) runs at 769-798 TFLOP/s on random data, ~80% of the 989 dense peak, and a device-to-device copy at "
    "~4.3 TB/s counting read + write, ~90% of the 4.8 TB/s datasheet. Those are ceilings for the best library "
    "GEMM and for streaming; every efficiency below is a range whose upper end is at or under them, and each "
    "estimate is given as low-high ms (low = every rate at its upper end, high = at its lower end)",
    "mma_efficiency": "a Triton wgmma main loop (non-persistent, cp.async/TMA-fed, no warp specialization) "
    "reaches 55-75% of peak with 128x128 (or larger) tiles, 8 warps and >= 3 stages, 45-65% with 64-row tiles; "
    "75% is the upper end (Triton's matmul tutorial on H100, below cuBLAS's measured 80%); scaled by the last "
    "wave's fill",
    "mufu": "exp2 / tanh on the SFU at 16 per clock per SM",
    "alu": "fp32 elementwise at 128 per clock per SM; the forward's online-softmax epilogue counts 16 ops per "
    "logit with all five statistics, 9 without SUM and ENTROPY (the cross-entropy without label smoothing: the "
    "entropy term's 4 ops and the SUM term's 3 are not compiled in) (+4 with softcap), the backward's dz 14 ops "
    "(+4 with softcap, +3 with filtering)",
    "epilogue_overlap": "none: Triton 3.9 runs a tile's elementwise epilogue after its K loop (no warp "
    "specialization), so elementwise time adds to the MMA time (conservative)",
    "atomics": "fp32 red.global.add (no return) to distinct L2-resident addresses at 0.75-1.5 TB/s of payload on "
    "H100/H200 (not measured; gpu_suite's atomic microbenchmark measures it on the first run)",
    "l2": "50 MB L2; a [BLOCK, D] operand tile shared by the programs of one swizzle group is read from HBM once "
    "per group; outputs larger than L2 are read-modify-written in HBM once per group that updates them",
    "hbm": "HBM at 80-90% of the datasheet bandwidth (3.35 TB/s H100, 4.8 TB/s H200; 90% measured for a copy)",
    "cublas": "the chunked schedule's torch GEMMs (bf16 operands, fp32 output C, short K: Vc = 1024 for dH) reach "
    "50-70% of the bf16 peak when compute-bound (70% is the upper end: below the 80% of a large square GEMM, for "
    "the short K and the fp32 C); each is max(FLOPs at that rate, its bytes at the HBM rate): dH += dz_c @ W_c "
    "reads and "
    "writes the fp32 dH (75 MB, > L2) once per chunk, dW_c = dz_c^T @ H reads H (38 MB) once per chunk",
    "chunk_scratch": "the chunked schedule's dz scratch [Nc, Vc] (<= 16 MB bf16) is written once and read twice per "
    "(row block, vocab chunk); counted at the HBM rate (conservative: it fits in L2 on H100/H200 and may never "
    "leave it). With several row blocks (N_BIG) each block after the first also reads and writes the chunk's fp32 "
    "dW rows, counted at the HBM rate too (they may stay in L2 between the blocks of one chunk)",
}
#: The two ends of every rate (fractions of the peak / datasheet bandwidth; atomics in payload bytes/s): "fast"
#: gives the low end of each estimate, "slow" the high end. Upper ends are at or below the H200 measurements
#: (ASSUMPTIONS["calibration"]).
EFFICIENCY = {
    "fast": dict(mma_big=0.75, mma_small=0.65, cublas=0.70, hbm=0.90, atomic_bps=1.5e12),
    "slow": dict(mma_big=0.55, mma_small=0.45, cublas=0.50, hbm=0.80, atomic_bps=0.75e12),
}
FAST, SLOW = EFFICIENCY["fast"], EFFICIENCY["slow"]
MUFU_PER_CLK, ALU_PER_CLK = 16, 128


def _compile_rows(budget_s: float | None = None) -> list[dict]:
    """Compile the launches for sm_90 in a subprocess without TRITON_INTERPRET (real compiler), within
    ``budget_s`` seconds (None: no limit). Raises RuntimeError when it fails or runs out of time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    code = r"""
import json, sys, torch
from dataclasses import asdict
from cce_dist.kernels import aot, config as C
props = C.KNOWN_DEVICES["sm_90"]
N, D, V = (int(x) for x in sys.argv[1:4])
cases = {
  "forward": aot.forward_launches(props, torch.bfloat16, N, D, V),
  "forward cross-entropy (no SUM / ENTROPY)": aot.forward_launches(props, torch.bfloat16, N, D, V, need_sum=False,
                                                                   need_entropy=False),
  "forward softcap": aot.forward_launches(props, torch.bfloat16, N, D, V, softcap=30.0)[:1],
  "backward fused": aot.backward_launches(props, torch.bfloat16, N, D, V, need_bias=False),
  "backward fused filter": aot.backward_launches(props, torch.bfloat16, N, D, V, filter_eps=2.0**-12),
  "backward deterministic (owner-computes)": aot.backward_launches(props, torch.bfloat16, N, D, V,
                                                                   deterministic=True, schedule="owner"),
  "backward chunked (default)": aot.backward_launches(props, torch.bfloat16, N, D, V, need_bias=False,
                                                      schedule="chunked")[:1],
}
rows = []
for label, launches in cases.items():
    for kernel, grid, args, kw in launches:
        r = asdict(aot.compile_launch(kernel, args, kw, 90))
        r.update(label=label, grid=list(grid))
        rows.append(r)
json.dump(rows, sys.stdout)
"""
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(N), str(D), str(V)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=budget_s,
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"the sm_90 compile ran past its budget ({budget_s:.0f} s)") from e
    if out.returncode != 0:
        last = next((x for x in reversed(out.stderr.splitlines()) if x.strip()), "")
        raise RuntimeError(f"the sm_90 compile failed: {last[:300]}\n" + out.stderr[-4000:])
    return json.loads(out.stdout)


#: Fields of a kernel row that come from its compiled cubin (reused from a saved result without a compile).
COMPILED_FIELDS = (
    "kernel",
    "label",
    "grid",
    "constexprs",
    "num_warps",
    "num_stages",
    "registers",
    "stack",
    "local",
    "shared",
    "mma",
)


def _saved_rows(path: Path) -> tuple[list[dict], str]:
    """The compile-derived fields of the kernel rows of a saved result (and its commit), for a run
    that may not compile (``--no-compile``, or a compile over its budget)."""
    data = json.loads(path.read_text())
    rows = [{k: r[k] for k in COMPILED_FIELDS if k in r} for r in data.get("kernels", [])]
    return rows, str(data.get("env", {}).get("git_commit", "?"))


def occupancy(r: dict, g: dict) -> int:
    """Resident blocks per SM from the cubin's registers and shared memory."""
    warps = r["num_warps"]
    regs_per_warp = math.ceil(r["registers"] * 32 / 256) * 256
    by_regs = g["regs_per_sm"] // (regs_per_warp * warps)
    by_smem = g["smem_per_sm"] // (r["shared"] + 1024)  # 1 KB per block reserved by the driver
    return max(0, min(by_regs, by_smem, 64 // warps, 32))


def model_range(r: dict, g: dict) -> dict:
    """:func:`model` at both ends of the rates: the fast end's breakdown, plus ``est_ms_low`` /
    ``est_ms_high`` and ``frac_peak_low`` / ``frac_peak_high`` (of the useful FLOPs), and the bound at
    the slow end."""
    fast, slow = model(r, g, FAST), model(r, g, SLOW)
    out = {k: v for k, v in fast.items() if k not in ("est_ms", "frac_peak", "frac_peak_executed", "bound")}
    for k in ("t_mma_ms", "t_hbm_ms", "t_atomic_ms"):
        out[k + "_slow"] = slow[k]
    out.update(
        est_ms_low=fast["est_ms"],
        est_ms_high=slow["est_ms"],
        bound=fast["bound"],
        bound_slow=slow["bound"],
        frac_peak_low=slow["frac_peak"],
        frac_peak_high=fast["frac_peak"],
        frac_peak_executed_low=slow["frac_peak_executed"],
        frac_peak_executed_high=fast["frac_peak_executed"],
    )
    return out


def model(r: dict, g: dict, e: dict) -> dict:
    """Time and bounds of one compiled launch on GPU ``g`` at the paper shape, with the rates ``e``
    (one end of EFFICIENCY)."""
    c = r["constexprs"]
    bn, bv, warps = c["BLOCK_N"], c["BLOCK_V"], r["num_warps"]
    kern = r["kernel"]
    softcap, filt = c.get("HAS_SOFTCAP", False), c.get("FILTER", False)
    logits = N * V
    wbytes, hbytes = V * D * 2, N * D * 2
    programs = math.prod(r["grid"])
    blocks = occupancy(r, g)
    slots = g["sms"] * max(blocks, 1)
    waves = math.ceil(programs / slots)
    fill = programs / (waves * slots)
    if kern == "_dz_store_kernel":
        # All chunks together: the same tiles as the forward (one recompute GEMM), dz stored once.
        programs = math.ceil(N / bn) * math.ceil(V / bv)
        waves = math.ceil(programs / slots)
        fill = programs / (waves * slots)
    if kern == "_row_stats_kernel":
        mma_flops, useful = 2 * logits * D, 2 * logits * D
        lean = not (c.get("NEED_SUM", True) or c.get("NEED_ENTROPY", True))
        alu = (9 if lean else 16) + (4 if softcap else 0)
        mufu = 1 + (1 if softcap else 0)
        # Programs of one split walk the same W rows together: W from HBM once, H from L2.
        hbm = wbytes + hbytes + programs * 0
        atomic_bytes = 0
    elif kern == "_dz_store_kernel":
        mma_flops, useful = 2 * logits * D, 0  # the gradient FLOPs are the torch GEMMs' (chunked_gemms)
        alu = 14 + (4 if softcap else 0) + (3 if filt else 0)
        mufu = 1 + (1 if softcap else 0)
        vc = chunk_columns(bv)
        # Per chunk: W_c from HBM once, H re-read (38 MB > what L2 keeps next to W_c) once; dz written.
        hbm = wbytes + math.ceil(V / vc) * hbytes + logits * 2
        atomic_bytes = 0
    else:
        per_tile_mma = {
            "_grads_fused_kernel": 3,
            "_grads_dh_kernel": 2,
            "_grads_dw_kernel": 2,
        }[kern]
        mma_flops = per_tile_mma * 2 * logits * D
        useful = {"_grads_fused_kernel": 4, "_grads_dh_kernel": 2, "_grads_dw_kernel": 2}[kern] * logits * D
        alu = 14 + (4 if softcap else 0) + (3 if filt else 0)
        mufu = 1 + (1 if softcap else 0)
        if kern == "_grads_fused_kernel":
            group = c.get("GROUP_N", 8)
            groups = math.ceil(N / (bn * group))
            # W re-read per group of token tiles; dW (fp32, > L2) read-modify-written per group.
            hbm = groups * wbytes + hbytes + groups * 2 * V * D * 4 + 2 * N * D * 4
            atomic_bytes = (math.ceil(V / bv) * N * D + math.ceil(N / bn) * V * D) * 4
        elif kern == "_grads_dh_kernel":
            # Each program owns [BLOCK_N, D] fp32 of dH (load-add-store per vocab tile): the
            # resident programs' blocks exceed L2, so every update goes to HBM.
            hbm = math.ceil(N / bn) * wbytes + hbytes + math.ceil(V / bv) * N * D * 4 * 2
            atomic_bytes = 0
        else:
            hbm = wbytes + math.ceil(V / bv) * hbytes + math.ceil(N / bn) * V * D * 4 * 2
            atomic_bytes = 0
    eff = e["mma_big"] if (bn >= 128 or bv >= 256) and warps >= 8 else e["mma_small"]
    t_mma = mma_flops / (g["peak_bf16"] * eff * fill)
    per_s = g["sms"] * g["clock_hz"]
    t_elem = logits * (alu / (ALU_PER_CLK * per_s) + mufu / (MUFU_PER_CLK * per_s))
    t_hbm = hbm / (g["hbm_bps"] * e["hbm"])
    t_atomic = atomic_bytes / e["atomic_bps"]
    bounds = {"tensor+elementwise": t_mma + t_elem, "hbm": t_hbm, "atomics": t_atomic}
    t = max(bounds.values())
    executed = mma_flops
    if kern == "_dz_store_kernel":
        useful = 4 * logits * D  # the chunked backward's total, for the % of peak below
        executed = mma_flops + 4 * logits * D  # the recompute plus the two torch GEMMs
        t += chunked_gemms(g, chunk_columns(bv), e)["t_ms"] / 1e3
    return dict(
        programs=programs,
        blocks_per_sm=blocks,
        waves=waves,
        last_wave_fill=round(fill, 3),
        mma_tflop=mma_flops / 1e12,
        useful_tflop=useful / 1e12,
        hbm_gb=hbm / 1e9,
        atomic_gb=atomic_bytes / 1e9,
        t_mma_ms=t_mma * 1e3,
        t_elem_ms=t_elem * 1e3,
        t_hbm_ms=t_hbm * 1e3,
        t_atomic_ms=t_atomic * 1e3,
        est_ms=t * 1e3,
        bound=max(bounds, key=bounds.get),
        frac_peak=useful / t / g["peak_bf16"],
        # flash-attention's convention: every MMA FLOP run, the backward's logit recompute included
        frac_peak_executed=executed / t / g["peak_bf16"],
    )


def chunk_shape(bv: int, n: int = N, bn: int = 128, elt: int = 2) -> tuple[int, int]:
    """(Nc, Vc) of the chunked schedule for ``n`` tokens without a bias: the library's own sizing
    (``kernels.config.chunk_shape``: 16 MB of scratch, row blocks only where 1024 columns of all rows
    do not fit)."""
    from cce_dist.kernels.config import chunk_shape as shape

    return shape(n, V, bn, bv, elt, False)


def chunk_columns(bv: int, elt: int = 2) -> int:
    """Vc of the chunked schedule at the paper shape."""
    return chunk_shape(bv, N, elt=elt)[1]


def chunked_gemms(g: dict, vc: int, e: dict, n: int = N, nc: int | None = None) -> dict:
    """The chunked schedule's torch GEMMs over all (vocab chunk, row block) pairs: dH[rows] += dz @ W_c
    and dW_c (+)= dz^T @ H[rows], each max(compute at ``e["cublas"]``, bytes at the HBM rate), plus the
    scratch reads; row blocks of ``nc`` rows (default: one block of all ``n``)."""
    nc = nc or n
    chunks, blocks = math.ceil(V / vc), math.ceil(n / nc)
    hbm_bps = g["hbm_bps"] * e["hbm"]
    t_dh = t_dw = 0.0
    for b in range(blocks):
        rows = min(nc, n - b * nc)
        flops = 2 * rows * vc * D / (g["peak_bf16"] * e["cublas"])
        t_dh += max(flops, (2 * rows * D * 4 + rows * vc * 2 + vc * D * 2) / hbm_bps)
        # the first block writes dW_c, the next ones read and write it
        t_dw += max(flops, (rows * D * 2 + rows * vc * 2 + vc * D * 4 * (1 if b == 0 else 2)) / hbm_bps)
    return dict(
        chunks=chunks,
        blocks=blocks,
        t_dh_ms=chunks * t_dh * 1e3,
        t_dw_ms=chunks * t_dw * 1e3,
        t_ms=chunks * (t_dh + t_dw) * 1e3,
    )


def _rng(lo: float, hi: float, nd: int = 1) -> str:
    return f"{lo:.{nd}f}-{hi:.{nd}f}"


def schedules(g: dict, n: int = N) -> list[dict]:
    """Backward schedules compared on atomic bytes and estimated time (128x128 tiles, bf16) for ``n``
    tokens: all of them at the paper's N, the per-tile, chunked and owner-computes ones at another.
    Each row's time is a range: ``est_ms_low`` (every rate at its upper end) to ``est_ms_high``."""
    fast, slow = _schedules(g, n, FAST), _schedules(g, n, SLOW)
    out = []
    for f, s in zip(fast, slow):
        parts = {k: _rng(f[k], s[k], 0) for k in f if k.startswith("t_") and k.endswith("_ms")}
        out.append(
            dict(
                schedule=f["schedule"],
                atomic_gb=f["atomic_gb"],
                scratch_mb=f["scratch_mb"],
                est_ms_low=f["est_ms"],
                est_ms_high=s["est_ms"],
                frac_peak_low=s["frac_peak"],
                frac_peak_high=f["frac_peak"],
                note=f["note"].format(**parts),
            )
        )
    return out


def _schedules(g: dict, n: int, e: dict) -> list[dict]:
    """:func:`schedules` at one end of the rates (``note`` is a template for the ranges of its ``t_*_ms``)."""
    bn = bv = 128
    logits = n * V
    grad_flops = 4 * logits * D
    t_recompute = 2 * logits * D / (g["peak_bf16"] * e["mma_big"])
    t_grad = grad_flops / (g["peak_bf16"] * e["mma_big"])
    base_atomics = (V // bv * n * D + n // bn * V * D) * 4
    groups = n // (bn * 8)  # swizzle groups of 8 token tiles: each read-modify-writes dW (> L2) once
    at = "" if n == N else f" at N = {n:,}"
    rows = []

    def add(name, atomics, scratch, grad_frac, hbm_rmw, note):
        t = max(t_recompute + t_grad * grad_frac, atomics / e["atomic_bps"], hbm_rmw / (g["hbm_bps"] * e["hbm"]))
        rows.append(
            dict(
                schedule=name + at,
                atomic_gb=atomics / 1e9,
                scratch_mb=scratch / 2**20,
                est_ms=t * 1e3,
                frac_peak=grad_flops / t / g["peak_bf16"],
                note=note,
            )
        )

    add(
        "per-tile 128x128 (_schedule='tiles'; the fallback where the chunked one cannot run)",
        base_atomics,
        0,
        1.0,
        groups * 2 * V * D * 4,
        "one atomic per output element per tile pair",
    )
    if n == N:
        add(
            "fused 128x256 (Blackwell TMEM acc)",
            (V // 256 * n * D + n // bn * V * D) * 4,
            0,
            1.0,
            groups * 2 * V * D * 4,
            "acc 128x256 fp32 only fits in tensor memory; 0.75x atomics",
        )
        add(
            "2x2 super-tiles (not shipped: the Triton kernel spilled)",
            base_atomics / 2,
            132 * 3 * bn * bv * 2,
            1.0,
            groups / 2 * 2 * V * D * 4,
            "persistent, 3 bf16 dz tiles parked per program (12.4 MB scratch): 0.5x atomics",
        )
        for f in (0.5, 0.9):
            add(
                f"fused + filtering, {int(f * 100)}% tiles skipped",
                base_atomics * (1 - f),
                0,
                1 - f,
                groups * 2 * V * D * 4 * (1 - f),
                "the skip rate depends on the data (see filter_effect.md)",
            )
    nc, vc = chunk_shape(bv, n)
    cg = chunked_gemms(g, vc, e, n, nc)
    t_store = (n * V * 2 + (math.ceil(V / vc) * n * D * 2)) / (g["hbm_bps"] * e["hbm"])
    t = max(t_recompute, t_store) + cg["t_ms"] / 1e3  # as model(): the dz kernel's own bound, then the GEMMs
    blocks = f"{cg['blocks']} row blocks of {nc} tokens x " if cg["blocks"] > 1 else ""
    rows.append(
        dict(
            schedule="chunked dz (default, _schedule='chunked'; also deterministic=True)" + at,
            atomic_gb=0.0,
            scratch_mb=nc * vc * 2 / 2**20,
            est_ms=t * 1e3,
            frac_peak=grad_flops / t / g["peak_bf16"],
            t_dh_ms=cg["t_dh_ms"],
            t_dw_ms=cg["t_dw_ms"],
            note=f"{blocks}{cg['chunks']} chunks of {vc} columns: Triton recompute + dz store, then cuBLAS dH "
            "({t_dh_ms} ms) and dW ({t_dw_ms} ms); no atomics, bitwise repeatable",
        )
    )
    # Owner-computes: two kernels one after the other, each bound by its own MMA or HBM time, with the traffic of
    # model()'s rows (the dH kernel's 64-row tiles re-read W per token tile; the dW kernel re-reads H per vocab tile).
    wbytes, hbytes, bw = V * D * 2, n * D * 2, g["hbm_bps"] * e["hbm"]
    t_dh = max(
        4 * logits * D / (g["peak_bf16"] * e["mma_small"]),
        (math.ceil(n / 64) * wbytes + hbytes + math.ceil(V / bv) * n * D * 8) / bw,
    )
    t_dw = max(
        4 * logits * D / (g["peak_bf16"] * e["mma_big"]),
        (wbytes + math.ceil(V / bv) * hbytes + math.ceil(n / bn) * V * D * 8) / bw,
    )
    rows.append(
        dict(
            schedule="deterministic (owner-computes, load-add-store)" + at,
            atomic_gb=0.0,
            scratch_mb=0.0,
            est_ms=(t_dh + t_dw) * 1e3,
            frac_peak=grad_flops / (t_dh + t_dw) / g["peak_bf16"],
            t_dh_ms=t_dh * 1e3,
            t_dw_ms=t_dw * 1e3,
            note="no atomics; each update is an HBM read+write (blocks exceed L2); 4 matmuls (dH kernel "
            "{t_dh_ms} ms, dW kernel {t_dw_ms} ms)",
        )
    )
    return rows


def render(p: dict) -> str:
    e = p["env"]
    out = [
        f"# Static GPU model of the cce_dist kernels (N={N}, D={D}, V={V}, bf16)",
        "",
        f"- date {e['date']}, git `{e['git_commit']}`, triton {e.get('triton')}, compiled for sm_90 "
        "(the config the library selects from the H100/H200 device record)",
        f"- kernels: {p.get('compile_source', 'compiled in this run')}",
        "- Nothing was run on a GPU: registers, spills and shared memory are from the cubins "
        "(`cuobjdump --dump-resource-usage`); every other figure follows from the assumptions below. Every "
        "estimate is a range, low-high: low with every rate at the upper end of its range (at or under what was "
        "measured on an H200 here), high with every rate at its lower end.",
        f"- regenerate: `{p.get('command', COMMAND)}`",
        "",
        "## Assumptions",
        "",
    ]
    out += [f"- **{k}**: {v}" for k, v in p["assumptions"].items()]
    out += [
        "",
        "| rate | low end (slow) | high end (fast) |",
        "|---|---|---|",
    ]
    for k in FAST:
        lo, hi = p["efficiency"]["slow"][k], p["efficiency"]["fast"][k]
        fmt = (lambda x: f"{x / 1e12:.2f} TB/s") if k == "atomic_bps" else (lambda x: f"{100 * x:.0f}%")
        out.append(f"| {k} | {fmt(lo)} | {fmt(hi)} |")
    if p["kernels"]:
        out += ["", "## Compiled kernels (sm_90)", ""]
        out.append(
            md_table(
                [
                    "launch",
                    "kernel",
                    "tile (N x V x D)",
                    "warps/stages",
                    "regs",
                    "spill B",
                    "smem KB",
                    "blocks/SM",
                    "programs",
                    "mma",
                ],
                [
                    [
                        r["label"],
                        r["kernel"],
                        f"{r['constexprs']['BLOCK_N']}x{r['constexprs']['BLOCK_V']}x{r['constexprs']['BLOCK_D']}",
                        f"{r['num_warps']}/{r['num_stages']}",
                        r["registers"],
                        r["stack"] + r["local"],
                        round(r["shared"] / 1024, 1),
                        r["H100 SXM"]["blocks_per_sm"],
                        r["H100 SXM"]["programs"],
                        ",".join(r["mma"]),
                    ]
                    for r in p["kernels"]
                ],
            )
        )
    for gname in GPUS:
        if p["kernels"]:
            out += ["", f"## Estimated time on {gname}", ""]
            out.append(
                md_table(
                    [
                        "launch",
                        "kernel",
                        "MMA TFLOP",
                        "HBM GB",
                        "atomic GB",
                        "t_mma ms",
                        "t_elem ms",
                        "t_hbm ms",
                        "t_atomic ms",
                        "est ms",
                        "bound (fast / slow end)",
                        "% of bf16 peak (useful FLOPs)",
                        "% of bf16 peak (executed FLOPs)",
                    ],
                    [
                        [
                            r["label"],
                            r["kernel"],
                            round(m["mma_tflop"], 2),
                            round(m["hbm_gb"], 1),
                            round(m["atomic_gb"], 1),
                            _rng(m["t_mma_ms"], m["t_mma_ms_slow"], 2),
                            round(m["t_elem_ms"], 2),
                            _rng(m["t_hbm_ms"], m["t_hbm_ms_slow"], 2),
                            _rng(m["t_atomic_ms"], m["t_atomic_ms_slow"], 2),
                            _rng(m["est_ms_low"], m["est_ms_high"], 2),
                            m["bound"] if m["bound"] == m["bound_slow"] else f"{m['bound']} / {m['bound_slow']}",
                            _rng(100 * m["frac_peak_low"], 100 * m["frac_peak_high"]),
                            _rng(100 * m["frac_peak_executed_low"], 100 * m["frac_peak_executed_high"]),
                        ]
                        for r in p["kernels"]
                        for m in [r[gname]]
                    ],
                )
            )
        out += ["", f"### Backward schedules on {gname} (atomic traffic vs time)", ""]
        out.append(
            md_table(
                ["schedule", "atomic GB", "scratch MB", "est ms", "% of peak (useful FLOPs)", "note"],
                [
                    [
                        s["schedule"],
                        round(s["atomic_gb"], 1),
                        round(s["scratch_mb"], 1),
                        _rng(s["est_ms_low"], s["est_ms_high"]),
                        _rng(100 * s["frac_peak_low"], 100 * s["frac_peak_high"]),
                        s["note"],
                    ]
                    for s in p["schedules"][gname]
                ],
            )
        )
    out += ["", "## Reading", ""] + [f"- {x}" for x in p["reading"]]
    out += ["", "## Plan for the first GPU run", ""] + [f"{i + 1}. {x}" for i, x in enumerate(p["plan"])]
    return "\n".join(out) + "\n"


def _r(m: dict, nd: int = 1, key: str = "est_ms") -> str:
    """``low-high`` of an estimate (``key`` = est_ms or frac_peak, the latter in %)."""
    if key == "est_ms":
        return _rng(m["est_ms_low"], m["est_ms_high"], nd)
    return _rng(100 * m[key + "_low"], 100 * m[key + "_high"], 0)


def reading_and_plan(rows: list[dict], sched: dict) -> tuple[list[str], list[str]]:
    big = [s for s in sched["H100 SXM"] if s["schedule"].endswith(f"at N = {N_BIG:,}")]
    big_tiles, big_chk, big_owner = (next(s for s in big if s["schedule"].startswith(k)) for k in ("per", "chu", "det"))
    top = {s["schedule"].split(" ")[0]: s for s in sched["H200 SXM"] if "at N =" not in s["schedule"]}
    reading = []
    if rows:
        h100 = {r["label"] + "/" + r["kernel"]: r["H100 SXM"] for r in rows}
        fwd = min((r["H100 SXM"] for r in rows if r["label"] == "forward"), key=lambda m: m["est_ms_low"])
        ce_fwd = min(
            (r["H100 SXM"] for r in rows if r["label"].startswith("forward cross-entropy")),
            key=lambda m: m["est_ms_low"],
        )
        chk = h100["backward chunked (default)/_dz_store_kernel"]
        det_lo = sum(m["est_ms_low"] for k, m in h100.items() if k.startswith("backward deterministic"))
        det_hi = sum(m["est_ms_high"] for k, m in h100.items() if k.startswith("backward deterministic"))
        bwd = h100["backward fused/_grads_fused_kernel"]
        reading += [
            f"Forward (best autotune candidate): {_r(fwd)} ms on H100, {_r(fwd, key='frac_peak')}% of bf16 peak, "
            f"bound by {fwd['bound']}; the elementwise epilogue costs {fwd['t_elem_ms']:.1f} ms of it. Without the "
            f"SUM and ENTROPY statistics (the cross-entropy without label smoothing) {_r(ce_fwd)} ms, "
            f"{_r(ce_fwd, key='frac_peak')}% (a 128x256 tile is spill-free there and joins the candidates, but the "
            "model credits it no more MMA efficiency than 128x128). The rest of the gap to the MMA ceiling is the "
            "epilogue running after each tile's MMAs: overlapping them needs warp specialization, which Triton "
            "offers only on Blackwell (`tl.range(warp_specialize=True)`).",
            f"Per-tile fused backward (`_schedule='tiles'`): {_r(bwd)} ms, {_r(bwd, key='frac_peak')}% of peak, "
            f"bound by {bwd['bound_slow']}: {bwd['atomic_gb']:.0f} GB of fp32 atomics against "
            f"{bwd['mma_tflop']:.0f} TFLOP of MMA ({_rng(bwd['t_mma_ms'], bwd['t_mma_ms_slow'], 0)} ms). "
            "Unless atomics run far faster than assumed, atomic traffic, not tensor cores, "
            "sets the time of every schedule that adds with atomics.",
            f"Chunked dz (the default GPU schedule at every N, in 16 MB of scratch): {_r(chk)} ms on H100 "
            f"(recompute kernel {_rng(chk['t_mma_ms'] + chk['t_elem_ms'], chk['t_mma_ms_slow'] + chk['t_elem_ms'])} "
            f"ms + the two torch GEMMs), {_r(chk, key='frac_peak')}% of peak, against {_r(bwd)} ms for the per-tile "
            f"fused kernel and {_rng(det_lo, det_hi)} ms for the owner-computes deterministic kernels: no atomics at "
            "all, so it is also what deterministic=True runs. Counted in useful FLOPs (4 N*V*D) it stays below the "
            "55% target: with 6 N*V*D FLOPs for 4 useful ones (the recompute), even 75% MMA efficiency caps any "
            "recompute schedule at 50%; the dH GEMMs (K = Vc = 1024) also read and write the fp32 dH once per chunk. "
            "Counted as flash-attention counts its backward (every MMA FLOP run, recompute included) it is "
            f"{_r(chk, key='frac_peak_executed')}% of peak.",
        ]
    reading += [
        "Atomic bytes scale as N*V*D*(1/BLOCK_V + 1/BLOCK_N); for a fixed register budget (the 128x128 fp32 "
        "accumulator) the square tile is already optimal, so halving them needs a larger effective tile: "
        "2x2 super-tiles with three dz tiles parked in a per-program scratch (12.4 MB) halve them "
        "(implemented once, and removed: its kernel spilled with every Triton from 3.6 to 3.9); "
        "filtering removes them in proportion to the skipped tiles, but its epilogue needs 64-row tiles to "
        "stay spill-free, which costs 1.5x the atomics when few tiles are skipped (row 'backward fused "
        "filter': no skips assumed).",
        f"On H200 (schedule table) at N = {N:,}: chunked {_r(top['chunked'])} ms, per-tile {_r(top['per-tile'])} "
        f"ms, owner-computes {_r(top['deterministic'])} ms.",
        f"At N = {N_BIG:,} (a micro-batch of 8 x 8192 tokens) the dz of all rows no longer fits the scratch even "
        f"for a 128-column chunk, so the chunked schedule walks {big_chk['note'].split(':')[0]}: "
        f"{_r(big_chk, 0)} ms on H100 against {_r(big_tiles, 0)} ms for the per-tile kernel "
        f"({big_tiles['atomic_gb']:.0f} GB of atomics) and {_r(big_owner, 0)} ms for the owner-computes kernels "
        "(schedule table; everything scales with N, and each row block after the first also reads and writes the "
        "chunk's fp32 dW rows).",
        "The owner-computes deterministic kernels move their outputs through HBM and are the slowest; they remain "
        "as `_schedule='owner'` (and deterministic=True's fallback where the chunked schedule cannot run: too little "
        "free memory for its scratch, or deterministic algorithms without a pinned cuBLAS workspace).",
    ]
    plan = [
        "Run `bash benchmarks/gpu_suite.sh` (benchmarks/README.md): correctness of every schedule, the peers, "
        "each kernel alone next to these ranges (gpu_suite.md), fp32 atomics, the GPU tests.",
        "Replace the atomic range by gpu_suite's measured fp32 atomic throughput (L2-resident and HBM-sized "
        "buffers), and narrow the MMA / cuBLAS ranges to the measured kernel times; re-run this model.",
        "If the chunked schedule is not the fastest backward, the GEMM / scratch assumptions are wrong; check that "
        "torch.addmm(out_dtype=float32, out=dH) runs as one cuBLAS GEMM without an fp32 copy of the operands.",
        "Profile one forward launch (ncu --set full --clock-control none) for achieved occupancy and the "
        "epilogue's share.",
    ]
    return reading, plan


COMMAND = "python -m benchmarks.gpu_model --out benchmarks/results"


def write(out: Path, payload: dict) -> str:
    """``gpu_model.json`` first (the data survives a rendering error), then ``gpu_model.md``, both in
    ``out`` and nowhere else."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_model.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    md = render(payload)
    (out / "gpu_model.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="folder for gpu_model.{json,md} (nothing else)")
    ap.add_argument(
        "--compile-budget",
        type=float,
        default=None,
        help="seconds for the sm_90 compile (default: no limit); past it, the compiled fields of a saved "
        "result are reused (--reuse), or the per-kernel tables are left out",
    )
    ap.add_argument("--no-compile", action="store_true", help="do not compile: reuse a saved result's kernel rows")
    ap.add_argument(
        "--reuse",
        default=str(Path(__file__).resolve().parent / "results" / "gpu_model.json"),
        help="saved gpu_model.json whose compiled fields (registers, shared memory, grid) are reused without a compile",
    )
    a = ap.parse_args(argv)
    started = time.perf_counter()
    import triton

    env = env_info(triton=triton.__version__)
    out = Path(a.out)
    source = f"compiled for sm_90 in this run (triton {triton.__version__})"
    compile_error = None
    try:
        if a.no_compile:
            raise RuntimeError("--no-compile")
        rows = _compile_rows(a.compile_budget)
    except RuntimeError as e:
        why, compile_error = str(e).splitlines()[0], str(e)[-4000:]
        reuse = Path(a.reuse)
        if reuse.exists():
            rows, from_commit = _saved_rows(reuse)
            source = f"not compiled ({why}): compiled fields reused from {reuse.name} of commit {from_commit}"
        else:
            rows, source = [], f"not compiled ({why}) and no saved result: per-kernel tables left out"
        print(f"gpu_model: {source}", file=sys.stderr)
    for r in rows:
        for gname, g in GPUS.items():
            r[gname] = model_range(r, g)
    sched = {gname: schedules(g) + schedules(g, N_BIG) for gname, g in GPUS.items()}
    reading, plan = reading_and_plan(rows, sched)
    payload = {
        "env": close_env(env, started),
        "command": COMMAND
        if out.resolve() == (REPO_RESULTS).resolve()
        else f"python -m benchmarks.gpu_model --out {a.out}",
        "compile_source": source,
        "compile_error": compile_error,
        "shape": dict(N=N, D=D, V=V, dtype="bf16"),
        "gpus": GPUS,
        "assumptions": ASSUMPTIONS,
        "efficiency": EFFICIENCY,
        "kernels": rows,
        "schedules": sched,
        "reading": reading,
        "plan": plan,
    }
    print(write(out, payload))


REPO_RESULTS = Path(__file__).resolve().parent / "results"

if __name__ == "__main__":
    main()
