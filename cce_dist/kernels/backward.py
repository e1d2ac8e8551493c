"""Backward kernels: gradients w.r.t. hidden states, head weight and bias of one vocab shard,
recomputing logit tiles from the global ``lse`` instead of storing logits or probabilities.

For a tile of rows I and vocab rows J (see :mod:`cce_dist.core.backend` for the coefficients):

    z, s  = transform(round(h_I @ W_J.T + b_J))         same code path as the forward kernel
    p     = exp(z - lse_I)
    dz    = (p - [j == t_i]) * ALPHA + p * DELTA * (z - lse_I) + BETA * [j == t_i] + GAMMA
            (the p-terms 0 where p == 0)
    draw  = dz / temperature * s                          (each factor only when enabled; s = 1 - t^2,
                                                         _common.tanh_and_slope)
    dH_I += draw @ W_J        dW_J += draw.T @ h_I        db_J += colsum(draw)

``draw`` is rounded to the compute dtype before the two gradient matmuls (what a materialized
backward in that dtype does; fp32 stays fp32); both matmuls accumulate in fp32.

Schedules (``_schedule``; see :func:`grads`):

- ``"chunked"``, the default at every N (``deterministic=True`` too), with a scratch of at most
  ``config.CHUNK_SCRATCH_BYTES`` = 16 MB: the shard's vocab is walked in chunks of Vc columns and,
  where needed, the tokens in row blocks of Nc rows (:func:`.config.chunk_shape`). All N rows form
  one block whenever ``config.CHUNK_MIN_COLS`` = 1024 columns of dz ``[N, Vc]`` in the compute
  dtype fit the scratch (N up to about 8192 in bf16); Vc is then the widest multiple of BLOCK_V
  that fits (1024 for N = 8192 in bf16). Beyond that the rows are split into equal blocks of a
  multiple of BLOCK_N rows (8 blocks of 8192 for N = 65,536 in bf16) and Vc is again the widest
  that fits. Per chunk, per row block, :func:`_dz_store_kernel` recomputes the logit tiles (the
  same tile loop and dz epilogue as the fused kernel: softcap, bias, filtering, every coefficient)
  and stores ``draw`` rounded to the compute dtype, exactly as the fused kernel rounds it before
  its matmuls, plus fp32 per-token-tile column sums for db; then two torch GEMMs with fp32 output:
  ``dW[chunk] (+)= draw.T @ H[rows]`` (written by the first row block, added to by the next) and
  ``dH[rows] += draw @ W[chunk]``. No atomics; chunks and row blocks run in a fixed order, so
  results are bitwise repeatable. ``benchmarks/gpu_model.py`` estimates it well ahead of the
  per-tile kernel at the CCE paper shape on H100 and at N = 65,536 (no atomic traffic; the price is
  the fp32 dH read and written by each chunk's GEMM), and of the owner-computes kernels: see
  docs/design.md, "Why chunked is the default", and benchmarks/results/gpu_model.md, "Backward
  schedules on H100 SXM".
- ``"tiles"`` (the fallback where the chunked schedule cannot run: less free CUDA memory than its
  scratch): one fused kernel over all (token
  tile, vocab tile) pairs, grouped for L2 reuse as in the Triton matmul tutorial. Each program
  recomputes its logit tile once and adds its dH / dW / db contributions to the fp32 outputs with
  ``tl.atomic_add``, in ``BLOCK_D_OUT``-wide column chunks. No scratch memory at all beyond the
  fp32 gradients, but its fp32 atomics bound it (their traffic at the paper shape: the same two
  places).
- ``"owner"`` (``deterministic=True`` where the chunked schedule cannot run: too little free memory,
  or ``torch.use_deterministic_algorithms`` without a pinned cuBLAS workspace): no float atomics and
  no scratch. A dH kernel gives each program one token tile and walks the vocab tiles in order; a
  dW/db kernel gives each program one vocab tile and walks the token tiles in order. Each output
  block is owned by exactly one program, which updates it by a plain load-add-store per tile (a
  [BLOCK_N, D] or [BLOCK_V, D] block does not fit in registers for real D), and db is summed in
  registers and written once. Every addition happens in a fixed order, so results are bitwise
  repeatable. Costs one extra logit recompute (4 matmuls vs 3) and moves its outputs through HBM.

Gradient filtering (``filter_eps``): a tile is skipped when every p-term in it is small relative
to its row's coefficients, |p * (ALPHA + DELTA * (z - lse))| <= filter_eps * max(|ALPHA|, |BETA - ALPHA|, |DELTA|)
(for cross-entropy and logprobs that is p * |1 + 2 zl lse| <= filter_eps roughly: the CCE paper's
"p below the dtype's resolution", independent of the upstream gradient's scale, e.g. 1/N of a
mean), unless it holds a target with BETA != ALPHA, so the target term stays exact. Rows with all-zero
coefficients never keep a tile alive. The GAMMA (uniform label
smoothing) term is handled exactly too: without a softcap it is dropped from the tiles and added
analytically by the launcher (dH_i += GAMMA_i / T * colsum(W), dW_j += sum_i GAMMA_i / T * h_i,
db_j += sum_i GAMMA_i / T); with a softcap its per-logit factor 1 - t^2 is not separable, so tiles
with any GAMMA != 0 row are never skipped.
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from cce_dist.core.backend import ALPHA, BETA, DELTA, GAMMA, NUM_COEFS
from cce_dist.core.class_weight import head_direction
from cce_dist.core.runtime import device_guard, f32_out_gemm, free_bytes, logger, mm_f32

from . import config as _config
from ._common import (
    check_inputs,
    dot_precision,
    head_strides,
    interp_bf16,
    interpreting,
    logit_tile,
    mma,
    round_to,
    rows_aligned,
    transform,
    transform_args,
    use_libdevice,
)

# The kernels pass the arguments they share with _dz_tile and _add_products written out, in the
# helpers' parameter order (which follows the kernels'), each such call kept on a few lines by
# ``# fmt: skip``. Not as ``tl.constexpr`` tuples star-expanded in the call (``*flags``): Triton 3.6
# and 3.7 reject starred arguments (3.8 accepts them). The head itself travels as logit_tile's HEAD tuple.


# Its logit_tile call is the forward kernel's (test_logit_tile_calls_pass_its_parameters_in_order in
# tests/test_signatures.py checks every call): bit-identical logits.
@triton.jit
def _dz_tile(
    offs_n,
    offs_v,
    H,
    W,
    Bias,
    Targets,
    LSE,
    Coef,
    GammaW,
    N,
    V,
    D,
    vocab_start,
    softcap,
    temperature,
    filter_eps,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    stride_b,
    stride_t,
    stride_cn,
    stride_ck,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    FILTER: tl.constexpr,
    GAMMA_IN_TILE: tl.constexpr,
    HAS_GAMMA_W: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Gradient w.r.t. the raw logits of one tile, fp32 [BLOCK_N, BLOCK_V] (0 outside the valid
    rows / columns, and exactly 0 in rows whose coefficients are all zero even when their logits
    are not finite), whether the tile must be kept (always True without FILTER), and the rows
    that are active (valid with a nonzero coefficient)."""
    row_ok = offs_n < N
    col_ok = offs_v < V
    HEAD = (H, W, Bias, D, stride_hn, stride_hd, stride_wv, stride_wd, stride_b)
    raw = logit_tile(HEAD, offs_n, offs_v, N, V, HAS_BIAS, DOT_PRECISION, INTERP_BF16, BLOCK_N, BLOCK_V, BLOCK_D)
    z, slope = transform(raw, softcap, temperature, HAS_SOFTCAP, HAS_TEMP, USE_LIBDEVICE)

    lse = tl.load(LSE + offs_n, mask=row_ok, other=0.0)
    crow = Coef + offs_n * stride_cn
    alpha = tl.load(crow + 0 * stride_ck, mask=row_ok, other=0.0)
    beta = tl.load(crow + 1 * stride_ck, mask=row_ok, other=0.0)
    gamma = tl.load(crow + 2 * stride_ck, mask=row_ok, other=0.0)
    delta = tl.load(crow + 3 * stride_ck, mask=row_ok, other=0.0)
    tgt = tl.load(Targets + offs_n * stride_t, mask=row_ok, other=-1).to(tl.int64) - vocab_start
    # Inactive rows (ignored tokens, zero upstream gradient) must give exactly 0, not p * 0 = NaN
    # when their hidden state is not finite: select them out rather than multiply.
    active = row_ok & ((alpha != 0.0) | (beta != 0.0) | (gamma != 0.0) | (delta != 0.0))
    ok = active[:, None] & col_ok[None, :]
    hit = (offs_v[None, :] == tgt[:, None]) & ok

    zc = z - lse[:, None]  # log p: small wherever p matters, however large the logits
    p = tl.exp(zc)
    # p == 0 (a -inf logit, e.g. a masked token's -inf bias) contributes exactly 0, not 0 * inf: its log p is
    # replaced by 0 before any product, so no lane forms 0 * -inf even where the result is then discarded.
    # (!= rather than >: a NaN p must still propagate.)
    live = ok & (p != 0.0)
    zc = tl.where(live, zc, 0.0)
    pterm = tl.where(live, p * (alpha[:, None] + delta[:, None] * zc), 0.0)
    if FILTER:
        # Relative to each row's coefficient scale, so the threshold does not depend on the
        # upstream gradient's magnitude (a mean over many tokens makes every ALPHA tiny).
        # beta - alpha: the target term's coefficient on its own (BETA is the target's excess over ALPHA)
        scale = tl.maximum(tl.maximum(tl.abs(alpha), tl.abs(beta - alpha)), tl.abs(delta))
        # reduced to the tile's verdict here, before dz is formed, so no mask tile stays live
        small = tl.abs(pterm) <= filter_eps * scale[:, None]
        keep = tl.min(tl.where(small, 1, 0)) == 0
        keep = keep | (tl.max(tl.where(hit & (beta[:, None] != alpha[:, None]), 1, 0)) > 0)
        if GAMMA_IN_TILE:
            keep = keep | (tl.max(tl.where(row_ok & (gamma != 0.0), 1, 0)) > 0)
    # At the target: (p - 1) * ALPHA + BETA (+ the DELTA term); p - 1 is exact near p = 1, so the
    # small terms of BETA (z-loss, smoothing, entropy) are not lost to a cancellation with ALPHA.
    dterm = tl.where(live, p * delta[:, None] * zc, 0.0)
    tterm = (p - 1.0) * alpha[:, None] + beta[:, None] + dterm
    dz = tl.where(hit, tterm, pterm)
    if GAMMA_IN_TILE:
        if HAS_GAMMA_W:  # class weights: the uniform term weighs each vocab row (GammaW: fp32 [V])
            # 0 outside the tile's valid rows (gamma = 0 there) and columns (gw = 0): no mask tile needed
            gw = tl.load(GammaW + offs_v, mask=col_ok, other=0.0)
            dz += gamma[:, None] * gw[None, :]
        else:
            dz += tl.where(ok, gamma[:, None], 0.0)
    if HAS_TEMP:
        dz = dz / temperature
    if HAS_SOFTCAP:
        dz = dz * slope
    dz = tl.where(ok, dz, 0.0)

    if not FILTER:
        keep = True
    return dz, keep, active


@triton.jit
def swizzle(pid, num_n, num_v, GROUP_N: tl.constexpr):
    """``(pid_n, pid_v)`` of work item ``pid`` on a ``num_n x num_v`` grid walked in grouped order:
    ``GROUP_N`` token tiles take the vocab tiles together, so a W tile is reused from L2 by the
    group (as in the Triton matmul tutorial)."""
    per_group = GROUP_N * num_v
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    return first_n + (pid % per_group) % group_size, (pid % per_group) // group_size


@triton.jit
def _add_products(
    A0,
    X0,
    offs_0,
    ok_0,
    stride_0r,
    stride_0c,
    A1,
    X1,
    offs_1,
    ok_1,
    stride_1r,
    stride_1c,
    Out,
    offs_o,
    o_ok,
    stride_or,
    D,
    ATOMIC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
):
    """``Out[offs_o, :D] += A0 @ X0[offs_0, :D] (+ A1 @ X1[offs_1, :D])``, ``BLOCK_D_OUT`` columns
    at a time, in fp32: the gradient products of every backward kernel.

    Rows of ``X*`` outside ``ok_*`` read as 0; ``A1`` None: a single product (``X1``... unused).
    ``Out``: fp32 with unit column stride; rows outside ``o_ok`` are neither read nor written.
    ``ATOMIC``: add with relaxed fp32 atomics (the output rows are shared), else load-add-store
    (the calling program owns them). Each ``X`` comes with ``(offs, ok, stride_row, stride_col)``."""
    offs_do = tl.arange(0, BLOCK_D_OUT).to(tl.int64)
    for d0 in range(0, D, BLOCK_D_OUT):
        d_ok = offs_do < D - d0
        xa = tl.load(
            X0 + offs_0[:, None] * stride_0r + (d0 + offs_do)[None, :] * stride_0c,
            mask=ok_0[:, None] & d_ok[None, :],
            other=0.0,
        )
        if A1 is not None:
            xb = tl.load(
                X1 + offs_1[:, None] * stride_1r + (d0 + offs_do)[None, :] * stride_1c,
                mask=ok_1[:, None] & d_ok[None, :],
                other=0.0,
            )
        if ATOMIC:
            acc = tl.zeros((A0.shape[0], BLOCK_D_OUT), dtype=tl.float32)
        else:
            acc = tl.load(
                Out + offs_o[:, None] * stride_or + (d0 + offs_do)[None, :],
                mask=o_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
        acc = mma(A0, xa, acc, DOT_PRECISION, INTERP_BF16)
        if A1 is not None:
            acc = mma(A1, xb, acc, DOT_PRECISION, INTERP_BF16)
        if ATOMIC:
            tl.atomic_add(
                Out + offs_o[:, None] * stride_or + (d0 + offs_do)[None, :],
                acc,
                mask=o_ok[:, None] & d_ok[None, :],
                sem="relaxed",
            )
        else:
            tl.store(
                Out + offs_o[:, None] * stride_or + (d0 + offs_do)[None, :], acc, mask=o_ok[:, None] & d_ok[None, :]
            )


# The four kernels take the shared parameters in one order (plan_grads() builds their arguments from the same
# pieces; tests/test_signatures.py's test_kernel_parameter_lists_agree checks the order, and tests/test_aot_compile.py
# compiles every launch plan_grads() builds): each names what it reads and passes the shared part on to the helpers as
# written out above.
@triton.jit
def _grads_fused_kernel(
    H,
    W,
    Bias,
    Targets,
    LSE,
    Coef,
    GammaW,
    DH,
    DW,
    DB,
    N,
    V,
    D,
    vocab_start,
    softcap,
    temperature,
    filter_eps,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    stride_b,
    stride_t,
    stride_cn,
    stride_ck,
    stride_dhn,
    stride_dwv,
    NEED_DH: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    FILTER: tl.constexpr,
    GAMMA_IN_TILE: tl.constexpr,
    HAS_GAMMA_W: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    """
    Fused backward over (token tile, vocab tile) pairs; contributions added with fp32 atomics.

    Parameters:
    H (pointer): hidden states [N, D], fp32 / bf16 / fp16.
    W (pointer): weight shard [V, D], same dtype. Bias (pointer): [V] same dtype (if HAS_BIAS).
    Targets (pointer): [N] int64 global ids. LSE (pointer): fp32 [N] global log-sum-exp.
    Coef (pointer): fp32 [N, 4] per-row ALPHA, BETA, GAMMA, DELTA.
    DH (pointer): fp32 [N, D] (if NEED_DH), DW: fp32 [V, D] (if NEED_DW), DB: fp32 [V] (if
        NEED_DB); all zero-initialised by the caller, contiguous along D.
    filter_eps (float): threshold when FILTER. GROUP_N (constexpr): token tiles per L2 group.
    """
    pid_n, pid_v = swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP_N)

    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    row_ok = offs_n < N
    col_ok = offs_v < V
    dz, keep, active = _dz_tile(
        offs_n, offs_v, H, W, Bias, Targets, LSE, Coef, GammaW, N, V, D, vocab_start, softcap, temperature,
        filter_eps, stride_hn, stride_hd, stride_wv, stride_wd, stride_b, stride_t, stride_cn, stride_ck, HAS_BIAS,
        HAS_SOFTCAP, HAS_TEMP, FILTER, GAMMA_IN_TILE, HAS_GAMMA_W, USE_LIBDEVICE, DOT_PRECISION, INTERP_BF16,
        BLOCK_N, BLOCK_V, BLOCK_D,
    )  # fmt: skip
    if keep:
        if NEED_DB:
            tl.atomic_add(DB + offs_v, tl.sum(dz, axis=0), mask=col_ok, sem="relaxed")
        dzc = round_to(dz, H.dtype.element_ty, INTERP_BF16)
        if NEED_DH:
            _add_products(
                dzc, W, offs_v, col_ok, stride_wv, stride_wd, None, W, offs_v, col_ok, stride_wv, stride_wd, DH, offs_n,
                row_ok, stride_dhn, D, True, DOT_PRECISION, INTERP_BF16, BLOCK_D_OUT,
            )  # fmt: skip
        if NEED_DW:
            _add_products(
                tl.trans(dzc), H, offs_n, active, stride_hn, stride_hd, None, H, offs_n, active, stride_hn, stride_hd,
                DW, offs_v, col_ok, stride_dwv, D, True, DOT_PRECISION, INTERP_BF16, BLOCK_D_OUT,
            )  # fmt: skip


# Its parameter list is _grads_fused_kernel's, with the dz scratch and the db partial sums in place of the gradients
# (plan_grads() builds both from the same pieces; test_kernel_parameter_lists_agree in tests/test_signatures.py).
@triton.jit
def _dz_store_kernel(
    H,
    W,
    Bias,
    Targets,
    LSE,
    Coef,
    GammaW,
    DZ,
    DBP,
    N,
    V,
    D,
    vocab_start,
    softcap,
    temperature,
    filter_eps,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    stride_b,
    stride_t,
    stride_cn,
    stride_ck,
    stride_dzn,
    stride_dbp,
    NEED_DB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    FILTER: tl.constexpr,
    GAMMA_IN_TILE: tl.constexpr,
    HAS_GAMMA_W: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    """
    One (row block, vocab chunk) pair of the chunked backward: the gradient w.r.t. the raw logits of
    every (token tile, vocab tile) pair, stored instead of multiplied (no atomics; the launcher's
    GEMMs use it).

    W / Bias / vocab_start / V describe the chunk (a row slice of the shard); H / Targets / LSE /
    Coef / N the row block (views starting at a multiple of BLOCK_N rows). DZ (pointer): [N, V]
    scratch in the compute dtype, row stride ``stride_dzn``, unit column stride; each element
    written once with dz rounded to the MMA operand dtype exactly as the fused kernel rounds it
    before its matmuls (0 in filtered-out tiles, which the fused kernel skips). DBP (pointer): fp32
    ``[cdiv(N, BLOCK_N), V]`` (if NEED_DB), row ``pid_n`` = this token tile's column sums of the
    unrounded dz (what the fused kernel adds to db), summed over tiles by the launcher in a fixed
    order. Other parameters as in :func:`_grads_fused_kernel`.
    """
    pid_n, pid_v = swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP_N)

    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    col_ok = offs_v < V
    dz, keep, active = _dz_tile(
        offs_n, offs_v, H, W, Bias, Targets, LSE, Coef, GammaW, N, V, D, vocab_start, softcap, temperature,
        filter_eps, stride_hn, stride_hd, stride_wv, stride_wd, stride_b, stride_t, stride_cn, stride_ck, HAS_BIAS,
        HAS_SOFTCAP, HAS_TEMP, FILTER, GAMMA_IN_TILE, HAS_GAMMA_W, USE_LIBDEVICE, DOT_PRECISION, INTERP_BF16,
        BLOCK_N, BLOCK_V, BLOCK_D,
    )  # fmt: skip
    dz = tl.where(keep, dz, 0.0)
    if NEED_DB:
        tl.store(DBP + pid_n.to(tl.int64) * stride_dbp + offs_v, tl.sum(dz, axis=0), mask=col_ok)
    dzc = round_to(dz, H.dtype.element_ty, INTERP_BF16).to(DZ.dtype.element_ty)
    tl.store(DZ + offs_n[:, None] * stride_dzn + offs_v[None, :], dzc, mask=(offs_n < N)[:, None] & col_ok[None, :])


@triton.jit
def _grads_dh_kernel(
    H,
    W,
    Bias,
    Targets,
    LSE,
    Coef,
    GammaW,
    DH,
    N,
    V,
    D,
    vocab_start,
    softcap,
    temperature,
    filter_eps,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    stride_b,
    stride_t,
    stride_cn,
    stride_ck,
    stride_dhn,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    FILTER: tl.constexpr,
    GAMMA_IN_TILE: tl.constexpr,
    HAS_GAMMA_W: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
):
    """
    Deterministic dH: program ``pid`` owns rows [pid * BLOCK_N, ...) of DH (fp32 [N, D], zeroed)
    and adds the contribution of each vocab tile, in vocab order, by load-add-store.
    Other parameters as in :func:`_grads_fused_kernel`.
    """
    pid = tl.program_id(0)
    offs_n = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_ok = offs_n < N
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = offs_v < V
        dz, keep, active = _dz_tile(
            offs_n, offs_v, H, W, Bias, Targets, LSE, Coef, GammaW, N, V, D, vocab_start, softcap, temperature,
            filter_eps, stride_hn, stride_hd, stride_wv, stride_wd, stride_b, stride_t, stride_cn, stride_ck, HAS_BIAS,
            HAS_SOFTCAP, HAS_TEMP, FILTER, GAMMA_IN_TILE, HAS_GAMMA_W, USE_LIBDEVICE, DOT_PRECISION, INTERP_BF16,
            BLOCK_N, BLOCK_V, BLOCK_D,
        )  # fmt: skip
        if keep:
            dzc = round_to(dz, H.dtype.element_ty, INTERP_BF16)
            _add_products(
                dzc, W, offs_v, col_ok, stride_wv, stride_wd, None, W, offs_v, col_ok, stride_wv, stride_wd, DH, offs_n,
                row_ok, stride_dhn, D, False, DOT_PRECISION, INTERP_BF16, BLOCK_D_OUT,
            )  # fmt: skip


# The transpose of _grads_dh_kernel (the roles of the token and vocab axes swapped), kept as its
# own kernel: each owner kernel has its own config and grid, and a fused pair would hold both states.
@triton.jit
def _grads_dw_kernel(
    H,
    W,
    Bias,
    Targets,
    LSE,
    Coef,
    GammaW,
    DW,
    DB,
    N,
    V,
    D,
    vocab_start,
    softcap,
    temperature,
    filter_eps,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    stride_b,
    stride_t,
    stride_cn,
    stride_ck,
    stride_dwv,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    FILTER: tl.constexpr,
    GAMMA_IN_TILE: tl.constexpr,
    HAS_GAMMA_W: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
):
    """
    Deterministic dW / db: program ``pid`` owns vocab rows [pid * BLOCK_V, ...) of DW (fp32
    [V, D], zeroed) and DB (fp32 [V]); it walks the token tiles in order, updating DW by
    load-add-store and summing db in registers (one store at the end).
    Other parameters as in :func:`_grads_fused_kernel`.
    """
    pid = tl.program_id(0)
    offs_v = pid.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    col_ok = offs_v < V
    db = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        dz, keep, active = _dz_tile(
            offs_n, offs_v, H, W, Bias, Targets, LSE, Coef, GammaW, N, V, D, vocab_start, softcap, temperature,
            filter_eps, stride_hn, stride_hd, stride_wv, stride_wd, stride_b, stride_t, stride_cn, stride_ck, HAS_BIAS,
            HAS_SOFTCAP, HAS_TEMP, FILTER, GAMMA_IN_TILE, HAS_GAMMA_W, USE_LIBDEVICE, DOT_PRECISION, INTERP_BF16,
            BLOCK_N, BLOCK_V, BLOCK_D,
        )  # fmt: skip
        if keep:
            if NEED_DB:
                db += tl.sum(dz, axis=0)
            if NEED_DW:
                dzt = tl.trans(round_to(dz, H.dtype.element_ty, INTERP_BF16))
                _add_products(
                    dzt, H, offs_n, active, stride_hn, stride_hd, None, H, offs_n, active, stride_hn, stride_hd, DW,
                    offs_v, col_ok, stride_dwv, D, False, DOT_PRECISION, INTERP_BF16, BLOCK_D_OUT,
                )  # fmt: skip
    if NEED_DB:
        tl.store(DB + offs_v, db, mask=col_ok)


_INTERPRET = interpreting(_grads_fused_kernel)

# Rows of ``hidden`` per chunk when the launcher forms sum_i GAMMA_i * h_i: caps the fp32 copy of
# a chunk at ~8 MB.
_GAMMA_CHUNK_BYTES = 8 << 20


def _add_uniform_term(hidden, weight, gamma, dh, dw, db, gamma_weights=None) -> None:
    """Exact contribution of the GAMMA term when it was left out of the tiles (no softcap):
    draw_ij = gamma_i (already divided by the temperature) times ``gamma_weights[j]`` (1 when None) for every
    local vocab row j."""
    if dh is not None:
        # Every gamma 0 (no label smoothing) adds exactly 0, also for a weight with inf columns (0 * inf would be
        # NaN): decided on the device, without reading gamma back to the host.
        if gamma_weights is None:
            col = weight.sum(0, dtype=torch.float32)
        else:
            col = head_direction(weight, gamma_weights)
        dh.addr_(gamma, torch.where((gamma != 0).any(), col, torch.zeros((), dtype=col.dtype, device=col.device)))
    if dw is not None:
        n, d = hidden.shape
        rows = max(1, _GAMMA_CHUNK_BYTES // (4 * max(d, 1)))
        u = torch.zeros(d, dtype=torch.float32, device=hidden.device)
        for i in range(0, n, rows):
            g = gamma[i : i + rows]
            # Rows with gamma == 0 stay out even when their hidden state is not finite.
            hc = torch.where((g != 0)[:, None], hidden[i : i + rows].float(), 0.0)
            u.add_(g @ hc)
        if gamma_weights is None:
            dw.add_(u)
        else:
            dw.addr_(gamma_weights, u)
    if db is not None:
        db.add_(gamma.sum() if gamma_weights is None else gamma.sum() * gamma_weights)


#: Values of ``_schedule`` (see :func:`grads`); None picks one.
SCHEDULES = ("chunked", "tiles", "owner")


class _HostStep:
    """A host-side step in a launch list, called like a kernel (``step[grid](*args)``): the chunked
    schedule's torch GEMMs between its kernel launches."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.fn


def _chunk_shape(n: int, v: int, block_n: int, block_v: int, elt: int, need_bias: bool, max_rows=None):
    """``(Nc, Vc)`` of the chunked schedule: :func:`.config.chunk_shape` (scratch within
    ``CHUNK_SCRATCH_BYTES`` at any ``n``), with Vc capped at ``INTERPRET_CHUNK_COLS`` in the interpreter
    so that the tests' tiny shards walk several chunks."""
    nc, vc = _config.chunk_shape(n, v, block_n, block_v, elt, need_bias, max_rows)
    if _INTERPRET:
        vc = min(vc, _config.INTERPRET_CHUNK_COLS)
    return nc, vc


def _chunked_verdict(device: torch.device, deterministic: bool) -> tuple[bool, str]:
    """``(fits, why)``: whether the chunked schedule can run (at any N: its row blocks keep the scratch within
    ``CHUNK_SCRATCH_BYTES``), and a reason for the log. On a CUDA device it needs that much memory available to an
    allocation (:func:`cce_dist.core.runtime.free_bytes`: the driver's free memory plus what torch's caching allocator
    holds reserved but unused; the driver alone counts the allocator's cache as used, which in a warmed-up training
    loop would push every call onto the atomic schedule); and, for ``deterministic`` under
    ``torch.use_deterministic_algorithms``, cuBLAS pinned to a fixed workspace (else torch refuses the GEMMs)."""
    if device.type != "cuda":
        return True, f"{device.type} tensors"
    if deterministic and torch.are_deterministic_algorithms_enabled():
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            return False, "torch.use_deterministic_algorithms without CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8"
    free = free_bytes(device)
    need = _config.CHUNK_SCRATCH_BYTES
    if free < need:
        return False, f"chunked scratch did not fit: {free} bytes free (driver + allocator cache) < {need}"
    return True, f"{free} bytes free >= {need} of scratch"


def _chunked_launches(
    hidden, weight, bias, targets, lse, coef, gamma_w, dh, dw, db, scalars, flags, group_n, launch, max_rows=None
):
    """The chunked schedule: the shard's vocab in chunks of Vc columns and the tokens in row blocks
    of Nc rows (:func:`_chunk_shape`; one block holding every row unless the scratch needs more).
    Per chunk, per row block in order: :func:`_dz_store_kernel` on the block's rows (views of
    hidden / targets / lse / coef starting at a multiple of BLOCK_N rows, so they stay 16-byte
    aligned) fills the dz scratch ``[Nc, Vc]``, then torch GEMMs use it: ``dW[chunk] (+)= dz^T @
    H[rows]`` (written by the first block, added to by the next ones, which follow each other, so
    those dW rows may stay in L2),
    ``dH[rows] += dz @ W[chunk]`` (fp32), ``db[chunk] (+)=`` the column sums of the block's token
    tiles. No atomics; every sum runs in a fixed order, so results are bitwise repeatable.
    ``max_rows``: see :func:`plan_grads`'s ``_chunk_rows``."""
    n, v = hidden.shape[0], weight.shape[0]
    bn, bv = flags["BLOCK_N"], flags["BLOCK_V"]
    dz_flags = {k: val for k, val in flags.items() if k != "BLOCK_D_OUT"}
    nc, vc = _chunk_shape(n, v, bn, bv, hidden.element_size(), db is not None, max_rows)
    scratch = torch.empty(nc, vc, dtype=hidden.dtype, device=hidden.device)
    dbp = torch.empty(_config.cdiv(nc, bn), vc, dtype=torch.float32, device=hidden.device) if db is not None else lse
    h_rows = hidden
    if dw is not None and hidden.device.type != "meta":
        # dz is 0 in rows with all-zero coefficients, but 0 * inf = NaN in the GEMM: such rows of H
        # must read as 0 (as the fused kernel's masked loads do), in a copy of H.
        # Unconditionally (one elementwise pass over H): asking whether any such row exists would read a
        # device value back to the host, a sync in every backward (and no CUDA-graph capture).
        idle = (coef == 0).all(1)
        h_rows = torch.where(idle[:, None], torch.zeros((), dtype=hidden.dtype, device=hidden.device), hidden)

    def gemms(c0: int, c1: int, r0: int, r1: int) -> None:
        dz = scratch[: r1 - r0, : c1 - c0]
        first = r0 == 0
        if dh is not None:
            mm_f32(dh[r0:r1], dz, weight[c0:c1], accumulate=True)
        if dw is not None:
            mm_f32(dw[c0:c1], dz.T, h_rows[r0:r1], accumulate=not first)
        if db is not None:
            part = dbp[: _config.cdiv(r1 - r0, bn), : c1 - c0]
            if first:
                torch.sum(part, 0, out=db[c0:c1])
            else:
                db[c0:c1].add_(part.sum(0))

    # Built once and shared by every chunk's launches (a launch only reads them): a 256k-column shard plans about
    # 250 chunks per row block on every backward call, so the loop below only slices the chunk and packs arguments.
    kwargs = dict(NEED_DB=db is not None, GROUP_N=group_n, **dz_flags, **launch)
    pre, post = scalars[2:3], (*scalars[4:], scratch.stride(0), dbp.stride(0))
    blocks = []  # (r0, r1, the block's views, its token tiles)
    for r0 in range(0, n, nc):
        r1 = min(n, r0 + nc)
        blocks.append((r0, r1, (hidden[r0:r1],), (targets[r0:r1], lse[r0:r1], coef[r0:r1]), _config.cdiv(r1 - r0, bn)))
    launches = []
    for c0 in range(0, v, vc):
        c1 = min(v, c0 + vc)
        cols, start, tiles_v = c1 - c0, scalars[3] + c0, _config.cdiv(c1 - c0, bv)
        chunk = (weight[c0:c1], bias[c0:c1] if bias is not None else hidden)
        gw_c = gamma_w[c0:c1] if gamma_w is not None else lse  # the chunk's class weights (or never read)
        for r0, r1, h_r, rows, tiles_n in blocks:
            args = (*h_r, *chunk, *rows, gw_c, scratch, dbp, r1 - r0, cols, *pre, start, *post)
            launches.append((_dz_store_kernel, (tiles_n * tiles_v,), args, kwargs))
            launches.append((_HostStep(gemms), None, (c0, c1, r0, r1), {}))
    return launches


def _log_plan(schedule, why, hidden, weight, blocks, launch, max_rows, bias) -> None:
    """The debug line naming the backward schedule :func:`plan_grads` chose, why, its config and its GEMM path."""
    n, v = hidden.shape[0], weight.shape[0]
    extra = ""
    if schedule == "chunked":
        nc, vc = _chunk_shape(n, v, blocks[0], blocks[1], hidden.element_size(), bias is not None, max_rows)
        low = hidden.dtype != torch.float32
        gemm = "float32" if not low else "float32-output" if f32_out_gemm(hidden.device, hidden.dtype) else "upcast"
        extra = f", chunks of {nc} rows x {vc} columns, {gemm} GEMMs"
    logger.debug(
        "cce_dist backward: schedule=%s (%s); N=%d V_local=%d D=%d %s; blocks (N, V, D, D_out)=%s, "
        "(group_n, warps, stages, maxnreg)=%s%s",
        schedule,
        why,
        n,
        v,
        hidden.shape[1],
        str(hidden.dtype).replace("torch.", ""),
        blocks,
        launch,
        extra,
    )


def _pick_schedule(requested, device: torch.device, deterministic: bool) -> tuple[str, str]:
    """``(schedule, why)``: ``requested`` (``_schedule``) checked, or the default: chunked where its
    scratch fits, else owner-computes when ``deterministic``, else tiles."""
    if requested not in (None, *SCHEDULES):
        raise ValueError(f"_schedule must be None or one of {SCHEDULES}, got {requested!r}")
    if deterministic and requested == "tiles":
        raise ValueError(
            f"_schedule={requested!r} adds with float atomics: not deterministic; use 'chunked' or 'owner'"
        )
    if requested is not None:
        return requested, "requested (_schedule)"
    fits, why = _chunked_verdict(device, deterministic)
    return ("chunked" if fits else "owner" if deterministic else "tiles"), why


def _outputs(schedule: str, n: int, d: int, v: int, device, need_hidden: bool, need_weight: bool, need_bias: bool):
    """The fp32 ``(dh, dw, db)`` (None where not needed), zeroed, except a chunked ``dw``: the chunked
    schedule's first row block writes each row of dW (the next ones add to it), so no zero fill."""
    f32 = dict(dtype=torch.float32, device=device)
    dh = torch.zeros(n, d, **f32) if need_hidden else None
    written = schedule == "chunked" and n > 0 and d > 0
    dw = (torch.empty if written else torch.zeros)(v, d, **f32) if need_weight else None
    db = torch.zeros(v, **f32) if need_bias else None
    return dh, dw, db


def _tuning(hidden, weight, schedule, props, precision, has_softcap, filt, class_weights, has_bias, blocks):
    """``(blocks, (group_n, warps, stages, maxnreg), props)``: the tile sizes ``(BLOCK_N, BLOCK_V, BLOCK_D,
    BLOCK_D_OUT)`` and launch parameters from ``_blocks`` (tests), the interpreter's config or
    :func:`.config.backward_config` for ``props`` (the tensors' CUDA device when None)."""
    if blocks is not None:
        return tuple(blocks), (2, 4, 2, None), props
    if _INTERPRET:
        c = _config.INTERPRET_BWD
    else:
        if props is None:
            props = _config.DeviceProps.of(hidden.device)
        c = _config.backward_config(
            props,
            hidden.dtype,
            tf32=precision == "tf32",
            softcap=has_softcap,
            filtering=filt,
            deterministic=schedule == "owner",  # the chunked dz kernel is the fused kernel's first half
            class_weights=class_weights,
            ragged_rows=hidden.shape[0] % 16 != 0,
            aligned=rows_aligned(hidden, weight),
            bias=has_bias,
        )
    return (c.block_n, c.block_v, c.block_d, c.block_d_out), (c.group_n, c.num_warps, c.num_stages, c.maxnreg), props


def _kernel_args(
    hidden, weight, bias, targets, lse, coef, gamma_w, vocab_start, softcap, temperature, filter_eps, precision, blocks
):
    """``(common, scalars, flags)``: the tensors, runtime scalars and constexprs every backward
    kernel takes, in the kernels' parameter order."""
    n, d = hidden.shape
    has_softcap, has_temp, softcap_arg, temperature_arg = transform_args(softcap, temperature)
    filt = filter_eps is not None
    gw = gamma_w if gamma_w is not None else lse  # never read without HAS_GAMMA_W
    common = (hidden, weight, bias if bias is not None else hidden, targets, lse, coef, gw)
    scalars = (
        n,
        weight.shape[0],
        d,
        int(vocab_start),
        softcap_arg,
        temperature_arg,
        float(filter_eps) if filt else 0.0,
        *head_strides(hidden, weight, bias),
        targets.stride(0),
        coef.stride(0),
        coef.stride(1),
    )
    bn, bv, bd, bdo = blocks
    flags = dict(
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=has_softcap,
        HAS_TEMP=has_temp,
        FILTER=filt,
        GAMMA_IN_TILE=not (filt and not has_softcap),
        HAS_GAMMA_W=gamma_w is not None,
        USE_LIBDEVICE=use_libdevice(_INTERPRET),
        DOT_PRECISION=precision,
        INTERP_BF16=interp_bf16(hidden.dtype, _INTERPRET),
        BLOCK_N=bn,
        BLOCK_V=bv,
        BLOCK_D=bd,
        BLOCK_D_OUT=bdo,
    )
    return common, scalars, flags


def _tiles_launches(common, scalars, flags, dh, dw, db, group_n, launch):
    """The per-tile schedule: one fused kernel over every (token tile, vocab tile) pair, fp32 atomics."""
    n, v = scalars[0], scalars[1]
    dummy = common[4]  # lse, never dereferenced: the matching NEED_* flag is False
    grid = (_config.cdiv(n, flags["BLOCK_N"]) * _config.cdiv(v, flags["BLOCK_V"]),)
    outs = tuple(g if g is not None else dummy for g in (dh, dw, db))
    out_strides = tuple(g.stride(0) if g is not None else 0 for g in (dh, dw))
    need = dict(NEED_DH=dh is not None, NEED_DW=dw is not None, NEED_DB=db is not None)
    kwargs = dict(**need, GROUP_N=group_n, **flags, **launch)
    return [(_grads_fused_kernel, grid, (*common, *outs, *scalars, *out_strides), kwargs)]


def _owner_launches(common, scalars, flags, dh, dw, db, props, tuned, launch):
    """The owner-computes schedule: a dH kernel over token tiles, a dW/db kernel over vocab tiles.
    ``tuned``: the blocks came from the device's config (not ``_blocks``), so the dH kernel may halve
    its token tile."""
    n, v = scalars[0], scalars[1]
    dummy = common[4]  # lse, never dereferenced: the matching NEED_* flag is False
    launches = []
    if dh is not None:
        dh_flags = flags
        # One program per token tile: halve the tile when that leaves SMs idle, but not below
        # the 64 rows a wgmma / tcgen05 instruction needs (it would fall back to mma.sync).
        bn = flags["BLOCK_N"]
        smallest = 64 if props is not None and props.mma in ("wgmma", "tcgen05") else 16
        if props is not None and tuned and _config.cdiv(n, bn) < props.sms and bn // 2 >= smallest:
            dh_flags = dict(flags, BLOCK_N=bn // 2)
        grid = (_config.cdiv(n, dh_flags["BLOCK_N"]),)
        launches.append((_grads_dh_kernel, grid, (*common, dh, *scalars, dh.stride(0)), dict(**dh_flags, **launch)))
    if dw is not None or db is not None:
        outs = (dw if dw is not None else dummy, db if db is not None else dummy)
        args = (*common, *outs, *scalars, dw.stride(0) if dw is not None else 0)
        kwargs = dict(NEED_DW=dw is not None, NEED_DB=db is not None, **flags, **launch)
        launches.append((_grads_dw_kernel, (_config.cdiv(v, flags["BLOCK_V"]),), args, kwargs))
    return launches


# plan_grads() takes grads()'s arguments (plus the device record and the TF32 switch that a launch reads
# from the device and torch), and grads() passes them on: test_backward_plan_takes_grads_arguments in
# tests/test_signatures.py compares the two signatures.
def plan_grads(
    hidden,
    weight,
    bias,
    targets,
    lse,
    coef,
    *,
    vocab_start,
    softcap,
    temperature,
    need_hidden,
    need_weight,
    need_bias,
    filter_eps=None,
    deterministic=False,
    gamma_weights=None,
    props=None,
    allow_tf32=None,
    _blocks=None,
    _schedule=None,
    _chunk_rows=None,
):
    """Everything the backward launches need, without launching: ``(dh, dw, db, launches)``.

    ``dh`` / ``dw`` / ``db`` are the fp32 outputs (None where not needed; zeroed, except a chunked
    ``dw`` whose rows the chunks write); ``launches`` is a list of ``(kernel, grid, args, kwargs)``
    to run in order as ``kernel[grid](*args, **kwargs)`` (kwargs hold the constexprs and the compile
    options; the chunked schedule's torch GEMMs are :class:`_HostStep` entries called the same way).
    Works on ``meta`` tensors, which is how
    tests/test_aot_compile.py compiles exactly what a launch on ``props`` would.
    ``props``: :class:`~.config.DeviceProps` (default: the tensors' CUDA device).
    ``allow_tf32``: fp32 matmuls in TF32 (default: ``torch.backends.cuda.matmul.allow_tf32``).
    Other arguments as in :func:`grads`.
    """
    n, d = hidden.shape
    device = hidden.device
    need_bias = bool(need_bias) and bias is not None
    schedule, why = _pick_schedule(_schedule, device, deterministic)
    dh, dw, db = _outputs(schedule, n, d, weight.shape[0], device, need_hidden, need_weight, need_bias)
    if n == 0 or weight.shape[0] == 0 or d == 0 or not (need_hidden or need_weight or need_bias):
        return dh, dw, db, []

    has_softcap = transform_args(softcap, temperature)[0]
    precision = dot_precision(hidden.dtype, _INTERPRET, allow_tf32)
    blocks, (group_n, warps, stages, maxnreg), props = _tuning(
        hidden,
        weight,
        schedule,
        props,
        precision,
        has_softcap,
        filter_eps is not None,
        gamma_weights is not None,
        bias is not None,
        _blocks,
    )
    launch = {} if _INTERPRET else dict(num_warps=warps, num_stages=stages, enable_fp_fusion=_config.ENABLE_FP_FUSION)
    if maxnreg is not None and not _INTERPRET:
        launch["maxnreg"] = maxnreg
    if logger.isEnabledFor(logging.DEBUG):
        _log_plan(schedule, why, hidden, weight, blocks, (group_n, warps, stages, maxnreg), _chunk_rows, bias)
    common, scalars, flags = _kernel_args(
        hidden,
        weight,
        bias,
        targets,
        lse,
        coef,
        gamma_weights,
        vocab_start,
        softcap,
        temperature,
        filter_eps,
        precision,
        blocks,
    )
    if schedule == "chunked":
        launches = _chunked_launches(
            hidden,
            weight,
            bias,
            targets,
            lse,
            coef,
            gamma_weights,
            dh,
            dw,
            db,
            scalars,
            flags,
            group_n,
            launch,
            _chunk_rows,
        )
    elif schedule == "tiles":
        launches = _tiles_launches(common, scalars, flags, dh, dw, db, group_n, launch)
    else:
        launches = _owner_launches(common, scalars, flags, dh, dw, db, props, _blocks is None, launch)
    return dh, dw, db, launches


def grads(
    hidden,
    weight,
    bias,
    targets,
    lse,
    coef,
    *,
    vocab_start,
    softcap,
    temperature,
    need_hidden,
    need_weight,
    need_bias,
    filter_eps=None,
    deterministic=False,
    gamma_weights=None,
    _blocks=None,
    _schedule=None,
    _chunk_rows=None,
):
    """Gradients of one vocab shard: ``(d_hidden [N, D], d_weight [V_local, D], d_bias [V_local])``,
    float32, None where not needed (``d_bias`` is None when ``bias`` is None).

    ``hidden [N, D]`` / ``weight [V_local, D]`` / ``bias [V_local]``: compute dtype (fp32, bf16 or
    fp16); ``targets [N]`` int64 global ids; ``lse`` fp32 [N] global log-sum-exp; ``coef`` fp32
    [N, 4] (ALPHA, BETA, GAMMA, DELTA); ``gamma_weights`` fp32 [V_local] or None: the GAMMA term is
    ``GAMMA_i * gamma_weights[j]`` (class weights), ``GAMMA_i`` when None. ``filter_eps``: skip tiles whose
    p-terms are all below it relative to their row's coefficient scale (see the module docstring; None = exact).
    ``deterministic``: no float atomics, bitwise repeatable.
    ``_blocks`` (tests only): ``(BLOCK_N, BLOCK_V, BLOCK_D, BLOCK_D_OUT)``. ``_schedule`` (tests and
    benchmarks; None picks one, see the module docstring): ``"chunked"`` (per vocab chunk and row
    block, a kernel stores dz and two torch GEMMs consume it: no atomics, deterministic, 16 MB of
    scratch at any N; the default, for ``deterministic`` too), ``"tiles"`` (one program per tile
    pair, fp32 atomics; the fallback where the chunked one cannot run: less free CUDA memory than
    its scratch) or ``"owner"`` (the owner-computes kernels: deterministic
    without scratch; ``deterministic``'s fallback, also under ``torch.use_deterministic_algorithms``
    without a pinned ``CUBLAS_WORKSPACE_CONFIG``). ``_chunk_rows`` (tests only): at most this many
    rows per row block of the chunked schedule (rounded down to a multiple of BLOCK_N), so that tiny
    shapes walk several row blocks as a large N does.
    """
    check_inputs(_INTERPRET, hidden, weight, bias, targets)
    n = hidden.shape[0]
    if lse.shape != (n,):
        raise ValueError(f"lse must be [N] = [{n}], got {tuple(lse.shape)}")
    if coef.shape != (n, NUM_COEFS):
        raise ValueError(f"coef must be [N, {NUM_COEFS}] = [{n}, {NUM_COEFS}], got {tuple(coef.shape)}")
    targets = targets.to(torch.int64)
    lse = lse.to(torch.float32).contiguous()
    coef = coef.to(torch.float32)
    if gamma_weights is not None:
        if gamma_weights.shape != (weight.shape[0],):
            raise ValueError(f"gamma_weights must be [V_local] = [{weight.shape[0]}], got {tuple(gamma_weights.shape)}")
        gamma_weights = gamma_weights.to(torch.float32).contiguous()
    dh, dw, db, launches = plan_grads(
        hidden,
        weight,
        bias,
        targets,
        lse,
        coef,
        vocab_start=vocab_start,
        softcap=softcap,
        temperature=temperature,
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
        filter_eps=filter_eps,
        deterministic=deterministic,
        gamma_weights=gamma_weights,
        _blocks=_blocks,
        _schedule=_schedule,
        _chunk_rows=_chunk_rows,
    )
    with device_guard(hidden.device):  # Triton launches on the current device
        for kernel, grid, args, kwargs in launches:
            kernel[grid](*args, **kwargs)

    has_softcap, _has_temp, _cap, temp = transform_args(softcap, temperature)
    if launches and filter_eps is not None and not has_softcap:  # GAMMA was left out of the tiles
        gamma = coef[:, GAMMA] / temp if temp != 1.0 else coef[:, GAMMA]
        _add_uniform_term(hidden, weight, gamma, dh, dw, db, gamma_weights)
    return dh, dw, db


__all__ = ["grads", "ALPHA", "BETA", "GAMMA", "DELTA"]
