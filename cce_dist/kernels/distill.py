"""Knowledge-distillation kernels: two heads' logit tiles per (token tile, vocab tile), never stored.

The numbers are those of :mod:`cce_dist.impl.torch_distill` (its module docstring has the formulas).
Per tile the student's and the teacher's logits are recomputed with the shared
:func:`._common.logit_tile` / :func:`._common.transform` path (each head with its own hidden size,
compute dtype, bias and softcap; one temperature):

    c_s = softcap_s(round(h_s @ W_s.T + b_s)),  z_s = c_s / T,  z_t = softcap_t(round(h_t @ W_t.T + b_t)) / T

Up to three launches, each over the same tiles (the teacher's tile is the one extra logit tile):

1. :func:`stats` -- per (token tile, vocab split) program, online MAX / SUMEXP of ``z_s`` and
   ``z_t`` and, with a hard-label term, of ``c_s`` (the student at T=1) with its TARGET value:
   ``float32 [k, N, NUM_STATS]`` (:mod:`cce_dist.core.stats` layout, k = 2 or 3), splits merged here.
   The caller combines them over a group (``reduce_stats``) into the global statistics. For the forward
   (reverse) KL the same pass also forms ``sum e_t ((z_t - m_t) - (z_s - m_s))`` (or with s and t
   swapped) relative to the running maxima, which :func:`cross_rows` turns into the divergence's
   per-row sum once the global statistics are known: one pass over the tiles for either KL.
2. :func:`rows` -- the JSD only (its ``lm = log(beta p_t + (1 - beta) p_s)`` needs both global
   statistics first): per-row sums ``sum p_t (lt - lm)`` and ``K = sum p_s (ls - lm)`` over this
   shard's vocab rows, ``float32 [N, 2]`` (:func:`rows` also computes either KL this way). The
   caller sums the per-row sums over a group (``reduce_rows``).
3. :func:`grads` -- from the global statistics, the per-row sums and a per-row upstream gradient
   ``g``: the gradient w.r.t. the student's raw logits, formed per tile, and its products
   ``dH_s += dz @ W_s``, ``dW_s += dz.T @ h_s``, ``db_s += colsum(dz)`` added to float32 outputs
   with ``tl.atomic_add`` (the pattern of :func:`.backward._grads_fused_kernel`; not bitwise
   repeatable), or with ``deterministic`` by a dH kernel owning token tiles and a dW / db kernel
   owning vocab tiles (load-add-store in a fixed order, as :mod:`.backward`'s deterministic mode).
   No teacher gradients.

The later launches take the global statistics as :func:`norms`, each head's row max ``M`` and
``log S``, and form every log-probability as ``(z - M) - log S`` (as ``log_softmax`` does), never
``z - lse``: ``lse = M + log S`` rounded to float32 errs by up to ulp(|lse|) (3.8e-6 at |lse| ~ 40),
an absolute error in every ``log p`` and a relative one in every ``p``, 30-100x the materialized
float32 program's near ``p = 1`` with large logits. Two per-row numbers per head instead of one
(a float64 lse would take the same registers and float64 arithmetic on every tile element).

No autograd and no torch.distributed here: :mod:`cce_dist.impl.triton_distill` passes the reductions.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from cce_dist.core.runtime import device_guard
from cce_dist.core.stats import MAX, NUM_STATS, SUM, SUMEXP, TARGET, combine_stack, empty_stats, normalizers

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
from .backward import swizzle

DIVERGENCES = ("kl", "reverse_kl", "jsd")
_MAX, _SUMEXP, _TARGET = tl.constexpr(MAX), tl.constexpr(SUMEXP), tl.constexpr(TARGET)
#: Column of block 0 of the statistics kernel's split slabs that holds the KL cross sum (the slot of the unused SUM).
CROSS_COL = SUM
_CROSS = tl.constexpr(CROSS_COL)


@triton.jit
def _tiles(
    S,
    T,
    offs_n,
    offs_v,
    N,
    V,
    cap_s,
    cap_t,
    temperature,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    HAS_CAP_S: tl.constexpr,
    HAS_CAP_T: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    PREC_S: tl.constexpr,
    PREC_T: tl.constexpr,
    INTERP_S: tl.constexpr,
    INTERP_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Both heads' fp32 tiles ``[BLOCK_N, BLOCK_V]``: ``(c_s, z_s, z_t, slope_s)`` with ``c_s`` the
    student's (softcapped) logits at T=1, ``z_s = c_s / T``, ``z_t`` the teacher's soft logits and
    ``slope_s = 1 - tanh(raw_s / cap_s)**2`` the softcap's chain factor (``_common.tanh_and_slope``).
    ``S`` / ``T``: each head's ``(H, W, Bias, D, stride_hn, stride_hd, stride_wv, stride_wd, stride_b)``."""
    raw = logit_tile(S, offs_n, offs_v, N, V, HAS_BS, PREC_S, INTERP_S, BLOCK_N, BLOCK_V, BLOCK_D)
    c_s, slope_s = transform(raw, cap_s, 1.0, HAS_CAP_S, False, USE_LIBDEVICE)
    raw = logit_tile(T, offs_n, offs_v, N, V, HAS_BT, PREC_T, INTERP_T, BLOCK_N, BLOCK_V, BLOCK_D)
    z_t, _t = transform(raw, cap_t, temperature, HAS_CAP_T, HAS_TEMP, USE_LIBDEVICE)
    if HAS_TEMP:
        z_s = c_s / temperature
    else:
        z_s = c_s
    return c_s, z_s, z_t, slope_s


@triton.jit
def _center(m):
    """``m``, or 0 where ``m = -inf`` (no finite logit yet): what the exponents are taken relative to, so that
    no lane forms ``-inf - -inf`` (NaN, discarded or not; a numpy warning in the interpreter)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _online(m, s, z, col_ok):
    """Fold a tile ``z`` (columns outside ``col_ok`` ignored) into the running row max ``m`` and
    ``s = sum exp(z - m)`` (``m = -inf``, ``s = 0`` before the first tile). Exponents are taken relative to
    :func:`_center` (no ``-inf - -inf`` while a row has no finite logit yet: ``exp(-inf) = 0`` is exact)."""
    z = tl.where(col_ok[None, :], z, float("-inf"))
    new_m = tl.maximum(m, tl.max(z, axis=1))
    c = _center(new_m)
    return new_m, s * tl.exp(m - c) + tl.sum(tl.exp(z - c[:, None]), axis=1)


@triton.jit
def _online_pair(m_a, s_a, m_b, s_b, x, z_a, z_b, col_ok):
    """:func:`_online` of both heads plus the KL's cross sum ``x = sum exp(z_a - m_a) * ((z_a - m_a) -
    (z_b - m_b))``, each logit taken relative to its head's running max (as the torch implementation
    does: no cancellation between large logits; a zero ``exp`` contributes 0, not 0 * inf)."""
    za = tl.where(col_ok[None, :], z_a, float("-inf"))
    zb = tl.where(col_ok[None, :], z_b, float("-inf"))
    new_a = tl.maximum(m_a, tl.max(za, axis=1))
    new_b = tl.maximum(m_b, tl.max(zb, axis=1))
    c_a = _center(new_a)  # = new_a wherever a row has a finite logit (:func:`_online`)
    c_b = _center(new_b)
    first = m_a == float("-inf")  # before the first tile: s = x = 0
    scale_a = tl.exp(m_a - c_a)  # 0 while m = -inf
    # the terms so far were relative to m_a, m_b: moving both adds (new_b - m_b) - (new_a - m_a) per unit of s_a
    # (each difference taken 0 where its head had no finite logit: then x is 0, or +inf already)
    shift = (c_b - tl.where(m_b == float("-inf"), c_b, m_b)) - (c_a - tl.where(first, c_a, m_a))
    x = tl.where(first, 0.0, (x + s_a * shift) * scale_a)
    ea = tl.exp(za - c_a[:, None])  # 0 outside col_ok (za = -inf there)
    eb = tl.exp(zb - c_b[:, None])
    # sum ea * d with d = (za - m_a) - (zb - m_b): a lane with ea = 0 adds 0 (selected before subtracting: no
    # -inf - -inf, no 0 * inf); one with ea > 0 and zb = -inf adds +inf (the plain program's)
    hot = ea != 0.0
    d = tl.where(hot, za - c_a[:, None], 0.0) - tl.where(hot, zb - c_b[:, None], 0.0)
    x += tl.sum(ea * d, axis=1)
    return new_a, s_a * scale_a + tl.sum(ea, axis=1), new_b, s_b * tl.exp(m_b - c_b) + tl.sum(eb, axis=1), x


@triton.jit
def _log_ratio(a, b, m_t, m_s, dl):
    """``y = (b - a) - dl`` per element of the tiles ``a = z_t - m_t``, ``b = z_s - m_s`` (returned too) for the
    per-row ``dl``: ``log p_s - log p_t`` with ``dl = log S_s - log S_t``, the JSD's ``log((1 - beta) p_s / (beta
    p_t))`` with ``dl`` less ``log((1 - beta) / beta)``. Formed alike by the rows and the gradient kernels, so
    the JSD's K and the gradient's ``ls - lm - K`` round alike."""
    a = a - m_t[:, None]
    b = b - m_s[:, None]
    # a lane masked in both heads (a = b = -inf) gives y = -inf, not -inf - -inf: its consumers select it out
    return a, b, (b - tl.where(b == float("-inf"), 0.0, a)) - dl[:, None]


@triton.jit
def _softplus_pair(y):
    """``(softplus(y), softplus(-y))``, ``softplus(y) = log(1 + exp(y))``: with ``y`` of :func:`_log_ratio`,
    ``log p_t - log M = -log beta - softplus(y)`` and ``log p_s - log M = -log(1 - beta) - softplus(-y)`` for
    the mixture ``M = beta p_t + (1 - beta) p_s`` (no cancellation between ``log p`` and ``log M``)."""
    soft = tl.log(1.0 + tl.exp(-tl.abs(y)))
    return tl.maximum(y, 0.0) + soft, tl.maximum(-y, 0.0) + soft


@triton.jit
def _row_norm(Norm, offs_n, row_ok, stride_norm, HEAD: tl.constexpr):
    """Head ``HEAD``'s global row max ``M`` and ``log S`` from ``Norm`` (:func:`norms`): ``log p = (z - M) - log S``."""
    at = Norm + offs_n * stride_norm + 2 * HEAD
    return tl.load(at, mask=row_ok, other=0.0), tl.load(at + 1, mask=row_ok, other=0.0)


@triton.jit
def _split(N, V, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """The rows of a row pass's program (pid_n, pid_s): ``(pid_s, offs_n, row_ok, v_lo, v_hi)``, its
    token tile and its vocab split ``[v_lo, v_hi)`` (a multiple of BLOCK_V wide, the last one cut at V)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    v_per_split = tl.cdiv(tl.cdiv(V, tl.num_programs(1)), BLOCK_V) * BLOCK_V
    v_lo = pid_s.to(tl.int64) * v_per_split
    return pid_s, offs_n, offs_n < N, v_lo, tl.minimum(v_lo + v_per_split, V)


# The kernels take the shared parameters in one order (the plan_* launchers build their arguments alike;
# test_kernel_parameter_lists_agree in tests/test_signatures.py checks the order, and tests/test_aot_compile.py
# compiles every launch the plans build): each names what it reads. ``S`` / ``T`` = each head's (H, W, Bias, D,
# stride_hn, stride_hd, stride_wv, stride_wd, stride_b), the HEAD tuple of :func:`._common.logit_tile`, travel to
# the helpers whole; everything else is written out in the helpers' parameter order, as in :mod:`.backward`
# (Triton 3.6 and 3.7 reject star-expanded arguments).
@triton.jit
def _distill_stats_kernel(
    HS,
    WS,
    BS,
    HT,
    WT,
    BT,
    Targets,
    Out,
    N,
    V,
    DS,
    DT,
    vocab_start,
    cap_s,
    cap_t,
    temperature,
    stride_hsn,
    stride_hsd,
    stride_wsv,
    stride_wsd,
    stride_bs,
    stride_htn,
    stride_htd,
    stride_wtv,
    stride_wtd,
    stride_bt,
    stride_t,
    stride_os,
    stride_ok,
    stride_on,
    HARD: tl.constexpr,
    CROSS: tl.constexpr,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    HAS_CAP_S: tl.constexpr,
    HAS_CAP_T: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    PREC_S: tl.constexpr,
    PREC_T: tl.constexpr,
    INTERP_S: tl.constexpr,
    INTERP_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """
    Pass 1: statistics of both heads over one vocab split.

    Parameters:
    HS, WS, BS (pointers): the student's hidden [N, DS], weight shard [V, DS] and bias [V] (if
        HAS_BS), one compute dtype; HT, WT, BT: the teacher's, [N, DT], [V, DT], [V] (its own dtype).
        Local vocab row j of both heads is global id vocab_start + j.
    Targets (pointer): [N] int64 global ids (read only when HARD).
    Out (pointer): fp32 [splits, k, N, NUM_STATS], zeroed: program (pid_n, pid_s) writes MAX and
        SUMEXP of z_s (k = 0), z_t (k = 1) and, when HARD, MAX / SUMEXP / TARGET of c_s (k = 2)
        over its split [pid_s * v_per_split, ...) of the vocab (v_per_split a multiple of BLOCK_V).
    CROSS (constexpr): 1 (forward KL) / 2 (reverse KL): also the cross sum of :func:`_online_pair`
        in column CROSS_COL of block 0, with a = teacher, b = student (1) or the reverse (2); its
        per-row divergence sum follows once the global statistics are known (:func:`cross_rows`). 0: none.
    cap_s, cap_t, temperature (float): used when HAS_CAP_S / HAS_CAP_T / HAS_TEMP.
    PREC_* / INTERP_* (constexpr): each head's dot precision and interpreter-bf16 flag.
    """
    S = (HS, WS, BS, DS, stride_hsn, stride_hsd, stride_wsv, stride_wsd, stride_bs)
    T = (HT, WT, BT, DT, stride_htn, stride_htd, stride_wtv, stride_wtd, stride_bt)
    pid_s, offs_n, row_ok, v_lo, v_hi = _split(N, V, BLOCK_N, BLOCK_V)
    if HARD:
        tgt = tl.load(Targets + offs_n * stride_t, mask=row_ok, other=-1).to(tl.int64) - vocab_start

    m_s = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s_s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    m_t = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s_t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    m_1 = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s_1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = offs_v < v_hi
        c_s, z_s, z_t, _t = _tiles(
            S, T, offs_n, offs_v, N, V, cap_s, cap_t, temperature, HAS_BS, HAS_BT, HAS_CAP_S, HAS_CAP_T, HAS_TEMP,
            USE_LIBDEVICE, PREC_S, PREC_T, INTERP_S, INTERP_T, BLOCK_N, BLOCK_V, BLOCK_D,
        )  # fmt: skip
        if CROSS == 1:  # forward KL: weighted by the teacher
            m_t, s_t, m_s, s_s, x = _online_pair(m_t, s_t, m_s, s_s, x, z_t, z_s, col_ok)
        elif CROSS == 2:  # reverse KL: by the student
            m_s, s_s, m_t, s_t, x = _online_pair(m_s, s_s, m_t, s_t, x, z_s, z_t, col_ok)
        else:
            m_s, s_s = _online(m_s, s_s, z_s, col_ok)
            m_t, s_t = _online(m_t, s_t, z_t, col_ok)
        if HARD:
            if HAS_TEMP:
                m_1, s_1 = _online(m_1, s_1, c_s, col_ok)
            hit = (offs_v[None, :] == tgt[:, None]) & col_ok[None, :]
            x_1 += tl.sum(tl.where(hit, c_s, 0.0), axis=1)

    out = Out + pid_s.to(tl.int64) * stride_os + offs_n * stride_on
    tl.store(out + _MAX, m_s, mask=row_ok)
    tl.store(out + _SUMEXP, s_s, mask=row_ok)
    tl.store(out + stride_ok + _MAX, m_t, mask=row_ok)
    tl.store(out + stride_ok + _SUMEXP, s_t, mask=row_ok)
    if CROSS != 0:
        tl.store(out + _CROSS, x, mask=row_ok)
    if HARD:
        if not HAS_TEMP:  # c_s is z_s
            m_1 = m_s
            s_1 = s_s
        tl.store(out + 2 * stride_ok + _MAX, m_1, mask=row_ok)
        tl.store(out + 2 * stride_ok + _SUMEXP, s_1, mask=row_ok)
        tl.store(out + 2 * stride_ok + _TARGET, x_1, mask=row_ok)


# Its parameter list follows _distill_stats_kernel's (plan_rows builds both alike; see the comment above).
@triton.jit
def _distill_rows_kernel(
    HS,
    WS,
    BS,
    HT,
    WT,
    BT,
    Norm,
    Out,
    N,
    V,
    DS,
    DT,
    cap_s,
    cap_t,
    temperature,
    log_beta,
    log1m_beta,
    stride_hsn,
    stride_hsd,
    stride_wsv,
    stride_wsd,
    stride_bs,
    stride_htn,
    stride_htd,
    stride_wtv,
    stride_wtd,
    stride_bt,
    stride_norm,
    stride_os,
    stride_on,
    DIV: tl.constexpr,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    HAS_CAP_S: tl.constexpr,
    HAS_CAP_T: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    PREC_S: tl.constexpr,
    PREC_T: tl.constexpr,
    INTERP_S: tl.constexpr,
    INTERP_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """
    Pass 2: the divergence's per-row sums over one vocab split.

    Norm (pointer): fp32 [N, >= 2, 2] (:func:`norms`): the global row max M and log S (S = sum exp(z - M)) of z_s
    (head 0) and z_t (head 1), row stride stride_norm. Out: fp32 [splits, N, 1 or 2] (column stride 1), each sum
    times the S of its weighting head (``p = e / S``, ``e = exp(z - M)``; :func:`rows` divides):
    DIV 0 (kl) ``sum e_t (lt - ls)``; 1 (reverse_kl) ``sum e_s (ls - lt)``; 2 (jsd) ``sum e_t (lt - lm)`` and
    ``sum e_s (ls - lm)`` with ``lm = log(beta p_t + (1 - beta) p_s)`` (``log_beta``, ``log1m_beta``: log beta,
    log(1 - beta)). A zero probability contributes 0 (not 0 * inf). Other parameters as in
    :func:`_distill_stats_kernel`.
    """
    S = (HS, WS, BS, DS, stride_hsn, stride_hsd, stride_wsv, stride_wsd, stride_bs)
    T = (HT, WT, BT, DT, stride_htn, stride_htd, stride_wtv, stride_wtd, stride_bt)
    pid_s, offs_n, row_ok, v_lo, v_hi = _split(N, V, BLOCK_N, BLOCK_V)
    m_s, l_s = _row_norm(Norm, offs_n, row_ok, stride_norm, 0)
    m_t, l_t = _row_norm(Norm, offs_n, row_ok, stride_norm, 1)
    # The sums are of e = exp(z - M) (the caller multiplies by 1 / S), weighting functions of y (_log_ratio):
    # one per-row number (dl) besides the maxima is live in the loop, not log S of both heads.
    dl = l_s - l_t
    if DIV == 2:
        dl = dl - (log1m_beta - log_beta)

    r0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    r1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        ok = row_ok[:, None] & (offs_v < v_hi)[None, :]
        _c, z_s, z_t, _t = _tiles(
            S, T, offs_n, offs_v, N, V, cap_s, cap_t, temperature, HAS_BS, HAS_BT, HAS_CAP_S, HAS_CAP_T, HAS_TEMP,
            USE_LIBDEVICE, PREC_S, PREC_T, INTERP_S, INTERP_T, BLOCK_N, BLOCK_V, BLOCK_D,
        )  # fmt: skip
        a, b, y = _log_ratio(z_t, z_s, m_t, m_s, dl)
        # Lanes past V (or past this split) hold finite logits of zero-filled loads: exp(z - M) would overflow
        # to inf where a head's row max M is below -88 (inf * 0 = NaN in the sums below). They weigh nothing.
        a = tl.where(ok, a, float("-inf"))
        b = tl.where(ok, b, float("-inf"))
        if DIV == 0:
            et = tl.exp(a)
            r0 -= tl.sum(et * tl.where(ok & (et != 0.0), y, 0.0), axis=1)
        elif DIV == 1:
            es = tl.exp(b)
            r0 += tl.sum(es * tl.where(ok & (es != 0.0), y, 0.0), axis=1)
        else:
            et = tl.exp(a)
            es = tl.exp(b)
            sp, sp_neg = _softplus_pair(y)
            r0 -= tl.sum(et * tl.where(ok & (et != 0.0), log_beta + sp, 0.0), axis=1)  # e_t (lt - lm)
            r1 -= tl.sum(es * tl.where(ok & (es != 0.0), log1m_beta + sp_neg, 0.0), axis=1)  # e_s (ls - lm)

    out = Out + pid_s.to(tl.int64) * stride_os + offs_n * stride_on
    tl.store(out, r0, mask=row_ok)
    if DIV == 2:
        tl.store(out + 1, r1, mask=row_ok)


@triton.jit
def _add_product(
    A,
    X,
    offs_x,
    x_ok,
    stride_xr,
    stride_xc,
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
    """``Out[offs_o, :D] += A @ X[offs_x, :D]``, ``BLOCK_D_OUT`` columns at a time: with fp32 atomics
    (ATOMIC, the fused backward's update) or by load-add-store (the deterministic kernels' update of
    rows they own). Rows of ``X`` outside ``x_ok`` read 0; rows of ``Out`` (fp32, unit column
    stride) outside ``o_ok`` are neither read nor written.

    The operation of :func:`.backward._add_products` with one product, kept apart for what the
    compiler and the GPU make of it: the load-add-store here adds the product to the loaded rows
    after the MMA (``_add_products`` accumulates into them: another fp32 summation order, so other
    deterministic bits), and the atomic update's pointers are formed before its mask (the other
    order cost the sm_90 forward-KL gradient kernel registers: see docs/design.md, "Distillation")."""
    offs_do = tl.arange(0, BLOCK_D_OUT).to(tl.int64)
    for d0 in range(0, D, BLOCK_D_OUT):
        d_ok = offs_do < D - d0
        x = tl.load(
            X + offs_x[:, None] * stride_xr + (d0 + offs_do)[None, :] * stride_xc,
            mask=x_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        part = mma(A, x, tl.zeros((A.shape[0], BLOCK_D_OUT), dtype=tl.float32), DOT_PRECISION, INTERP_BF16)
        ptrs = Out + offs_o[:, None] * stride_or + (d0 + offs_do)[None, :]
        msk = o_ok[:, None] & d_ok[None, :]
        if ATOMIC:
            tl.atomic_add(ptrs, part, mask=msk, sem="relaxed")
        else:
            tl.store(ptrs, tl.load(ptrs, mask=msk, other=0.0) + part, mask=msk)


@triton.jit
def _dz_tile(
    S,
    T,
    offs_n,
    offs_v,
    N,
    V,
    cap_s,
    cap_t,
    temperature,
    Targets,
    Norm,
    Aux,
    G,
    stride_t,
    stride_norm,
    vocab_start,
    log_beta,
    log1m_beta,
    soft_coef,
    hard_coef,
    DIV: tl.constexpr,
    HARD: tl.constexpr,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    HAS_CAP_S: tl.constexpr,
    HAS_CAP_T: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    PREC_S: tl.constexpr,
    PREC_T: tl.constexpr,
    INTERP_S: tl.constexpr,
    INTERP_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The student's ``d raw`` tile, fp32 ``[BLOCK_N, BLOCK_V]`` (see :func:`_distill_grads_kernel`), exactly 0
    outside the valid columns and in rows without gradient (even with non-finite logits: selected out), and the
    rows that are active (valid with a nonzero upstream gradient)."""
    row_ok = offs_n < N
    col_ok = offs_v < V
    g = tl.load(G + offs_n, mask=row_ok, other=0.0)
    active = row_ok & (g != 0.0)
    c_s, z_s, z_t, slope_s = _tiles(
        S, T, offs_n, offs_v, N, V, cap_s, cap_t, temperature, HAS_BS, HAS_BT, HAS_CAP_S, HAS_CAP_T, HAS_TEMP,
        USE_LIBDEVICE, PREC_S, PREC_T, INTERP_S, INTERP_T, BLOCK_N, BLOCK_V, BLOCK_D,
    )  # fmt: skip
    if HARD:  # first, so that c_s is dead before the soft term's tiles are formed
        m_1, l_1 = _row_norm(Norm, offs_n, row_ok, stride_norm, 2)
        tgt = tl.load(Targets + offs_n * stride_t, mask=row_ok, other=-1).to(tl.int64) - vocab_start
        p1 = tl.exp((c_s - m_1[:, None]) - l_1[:, None])
        hit = offs_v[None, :] == tgt[:, None]
        # at the target p1 - 1, exact near p1 = 1 (no cancellation against the other terms' scale)
        dz = (g * hard_coef)[:, None] * tl.where(hit, p1 - 1.0, p1)
    else:
        dz = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    m_s, l_s = _row_norm(Norm, offs_n, row_ok, stride_norm, 0)
    m_t, l_t = _row_norm(Norm, offs_n, row_ok, stride_norm, 1)
    dl = l_s - l_t
    if DIV == 2:
        dl = dl - (log1m_beta - log_beta)
    a, b, y = _log_ratio(z_t, z_s, m_t, m_s, dl)
    ls = b - l_s[:, None]
    ps = tl.exp(ls)
    if DIV == 0:
        d = ps - tl.exp(a - l_t[:, None])
    else:
        aux = tl.load(Aux + offs_n, mask=row_ok, other=0.0)
        # p_s (d - aux), 0 where p_s = 0: d selected (to 0) before the subtraction and the product, which see
        # neither -inf - -inf nor 0 * inf in those lanes
        if DIV == 1:  # ls - lt from the log-probabilities (R, from the statistics pass, sums their products)
            hot = ps != 0.0
            d = ps * ((tl.where(hot, ls, 0.0) - tl.where(hot, a - l_t[:, None], 0.0)) - aux[:, None])
        else:
            d = ps * tl.where(ps != 0.0, -(log1m_beta + _softplus_pair(y)[1]) - aux[:, None], 0.0)  # ls - lm - K
    dz += (g * soft_coef)[:, None] * d
    if HAS_CAP_S:
        dz = dz * slope_s
    return tl.where(active[:, None] & col_ok[None, :], dz, 0.0), active


# The three gradient kernels take one parameter list: plan_grads passes one argument list to the fused
# kernel or to both deterministic kernels, each reading what it needs.
@triton.jit
def _distill_grads_kernel(
    HS,
    WS,
    BS,
    HT,
    WT,
    BT,
    Targets,
    Norm,
    Aux,
    G,
    DH,
    DW,
    DB,
    N,
    V,
    DS,
    DT,
    vocab_start,
    cap_s,
    cap_t,
    temperature,
    log_beta,
    log1m_beta,
    soft_coef,
    hard_coef,
    stride_hsn,
    stride_hsd,
    stride_wsv,
    stride_wsd,
    stride_bs,
    stride_htn,
    stride_htd,
    stride_wtv,
    stride_wtd,
    stride_bt,
    stride_t,
    stride_norm,
    stride_dhn,
    stride_dwv,
    DIV: tl.constexpr,
    HARD: tl.constexpr,
    NEED_DH: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    HAS_CAP_S: tl.constexpr,
    HAS_CAP_T: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    PREC_S: tl.constexpr,
    PREC_T: tl.constexpr,
    INTERP_S: tl.constexpr,
    INTERP_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    """
    Student gradients over (token tile, vocab tile) pairs, grouped for L2 reuse; fp32 atomics.

    Norm (pointer): fp32 [N, k, 2] (:func:`norms`): the global row max M and log S of z_s, z_t and, when HARD,
    c_s. Aux: fp32 [N] the
    per-row sum the gradient needs (reverse_kl: R; jsd: K; unused for kl). G: fp32 [N] upstream
    gradient per row (0: the row contributes exactly 0). With ``gs = G * soft_coef`` (soft_coef
    = soft scale x (1 - beta for jsd) / T) and ``wg = G * hard_coef``:

        dz = gs * (p_s - p_t | p_s (ls - lt - R) | p_s (ls - lm - K)) + wg * (p1 - onehot)
        draw = dz * (1 - tanh(raw_s / cap_s)**2) (HAS_CAP_S);  dH += draw @ W_s, dW += draw.T @ h_s, db += colsum

    ``draw`` rounded to the student's compute dtype before the two matmuls (fp32 accumulation).
    DH fp32 [N, DS], DW fp32 [V, DS], DB fp32 [V] (where NEED_*), zeroed, unit column stride.
    Other parameters as in :func:`_distill_stats_kernel` / :func:`_distill_rows_kernel`.
    """
    pid_n, pid_v = swizzle(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP_N)
    S = (HS, WS, BS, DS, stride_hsn, stride_hsd, stride_wsv, stride_wsd, stride_bs)
    T = (HT, WT, BT, DT, stride_htn, stride_htd, stride_wtv, stride_wtd, stride_bt)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_v = pid_v.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    col_ok = offs_v < V
    dz, active = _dz_tile(
        S, T, offs_n, offs_v, N, V, cap_s, cap_t, temperature, Targets, Norm, Aux, G, stride_t, stride_norm,
        vocab_start, log_beta, log1m_beta, soft_coef, hard_coef, DIV, HARD, HAS_BS, HAS_BT, HAS_CAP_S, HAS_CAP_T,
        HAS_TEMP, USE_LIBDEVICE, PREC_S, PREC_T, INTERP_S, INTERP_T, BLOCK_N, BLOCK_V, BLOCK_D,
    )  # fmt: skip
    if NEED_DB:
        tl.atomic_add(DB + offs_v, tl.sum(dz, axis=0), mask=col_ok, sem="relaxed")
    dzc = round_to(dz, HS.dtype.element_ty, INTERP_S)
    if NEED_DH:
        _add_product(
            dzc, WS, offs_v, col_ok, stride_wsv, stride_wsd, DH, offs_n, offs_n < N, stride_dhn, DS, True, PREC_S,
            INTERP_S, BLOCK_D_OUT,
        )  # fmt: skip
    if NEED_DW:
        _add_product(
            tl.trans(dzc), HS, offs_n, active, stride_hsn, stride_hsd, DW, offs_v, col_ok, stride_dwv, DS, True, PREC_S,
            INTERP_S, BLOCK_D_OUT,
        )  # fmt: skip


# Parameter list: _distill_grads_kernel's (one argument list for the three gradient kernels).
@triton.jit
def _distill_dh_kernel(
    HS,
    WS,
    BS,
    HT,
    WT,
    BT,
    Targets,
    Norm,
    Aux,
    G,
    DH,
    DW,
    DB,
    N,
    V,
    DS,
    DT,
    vocab_start,
    cap_s,
    cap_t,
    temperature,
    log_beta,
    log1m_beta,
    soft_coef,
    hard_coef,
    stride_hsn,
    stride_hsd,
    stride_wsv,
    stride_wsd,
    stride_bs,
    stride_htn,
    stride_htd,
    stride_wtv,
    stride_wtd,
    stride_bt,
    stride_t,
    stride_norm,
    stride_dhn,
    stride_dwv,
    DIV: tl.constexpr,
    HARD: tl.constexpr,
    NEED_DH: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    HAS_CAP_S: tl.constexpr,
    HAS_CAP_T: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    PREC_S: tl.constexpr,
    PREC_T: tl.constexpr,
    INTERP_S: tl.constexpr,
    INTERP_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    """
    Deterministic dH: program ``pid`` owns token rows [pid * BLOCK_N, ...) of DH and walks the vocab
    tiles in order, updating them by load-add-store (no float atomics: bitwise repeatable).
    Parameters as in :func:`_distill_grads_kernel` (DW, DB, NEED_DW, NEED_DB, GROUP_N unused).
    """
    S = (HS, WS, BS, DS, stride_hsn, stride_hsd, stride_wsv, stride_wsd, stride_bs)
    T = (HT, WT, BT, DT, stride_htn, stride_htd, stride_wtv, stride_wtd, stride_bt)
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        dz, _active = _dz_tile(
            S, T, offs_n, offs_v, N, V, cap_s, cap_t, temperature, Targets, Norm, Aux, G, stride_t, stride_norm,
            vocab_start, log_beta, log1m_beta, soft_coef, hard_coef, DIV, HARD, HAS_BS, HAS_BT, HAS_CAP_S, HAS_CAP_T,
            HAS_TEMP, USE_LIBDEVICE, PREC_S, PREC_T, INTERP_S, INTERP_T, BLOCK_N, BLOCK_V, BLOCK_D,
        )  # fmt: skip
        dzc = round_to(dz, HS.dtype.element_ty, INTERP_S)
        _add_product(
            dzc, WS, offs_v, offs_v < V, stride_wsv, stride_wsd, DH, offs_n, offs_n < N, stride_dhn, DS, False, PREC_S,
            INTERP_S, BLOCK_D_OUT,
        )  # fmt: skip


# Parameter list: _distill_grads_kernel's (one argument list for the three gradient kernels).
@triton.jit
def _distill_dw_kernel(
    HS,
    WS,
    BS,
    HT,
    WT,
    BT,
    Targets,
    Norm,
    Aux,
    G,
    DH,
    DW,
    DB,
    N,
    V,
    DS,
    DT,
    vocab_start,
    cap_s,
    cap_t,
    temperature,
    log_beta,
    log1m_beta,
    soft_coef,
    hard_coef,
    stride_hsn,
    stride_hsd,
    stride_wsv,
    stride_wsd,
    stride_bs,
    stride_htn,
    stride_htd,
    stride_wtv,
    stride_wtd,
    stride_bt,
    stride_t,
    stride_norm,
    stride_dhn,
    stride_dwv,
    DIV: tl.constexpr,
    HARD: tl.constexpr,
    NEED_DH: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    HAS_BS: tl.constexpr,
    HAS_BT: tl.constexpr,
    HAS_CAP_S: tl.constexpr,
    HAS_CAP_T: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    PREC_S: tl.constexpr,
    PREC_T: tl.constexpr,
    INTERP_S: tl.constexpr,
    INTERP_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D_OUT: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    """
    Deterministic dW / db: program ``pid`` owns vocab rows [pid * BLOCK_V, ...) of DW and DB and walks
    the token tiles in order, updating DW by load-add-store and summing db in registers (one store).
    Parameters as in :func:`_distill_grads_kernel` (DH, NEED_DH, GROUP_N unused).
    """
    S = (HS, WS, BS, DS, stride_hsn, stride_hsd, stride_wsv, stride_wsd, stride_bs)
    T = (HT, WT, BT, DT, stride_htn, stride_htd, stride_wtv, stride_wtd, stride_bt)
    offs_v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V).to(tl.int64)
    col_ok = offs_v < V
    db = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        dz, active = _dz_tile(
            S, T, offs_n, offs_v, N, V, cap_s, cap_t, temperature, Targets, Norm, Aux, G, stride_t, stride_norm,
            vocab_start, log_beta, log1m_beta, soft_coef, hard_coef, DIV, HARD, HAS_BS, HAS_BT, HAS_CAP_S, HAS_CAP_T,
            HAS_TEMP, USE_LIBDEVICE, PREC_S, PREC_T, INTERP_S, INTERP_T, BLOCK_N, BLOCK_V, BLOCK_D,
        )  # fmt: skip
        if NEED_DB:
            db += tl.sum(dz, axis=0)
        if NEED_DW:
            dzt = tl.trans(round_to(dz, HS.dtype.element_ty, INTERP_S))
            _add_product(
                dzt, HS, offs_n, active, stride_hsn, stride_hsd, DW, offs_v, col_ok, stride_dwv, DS, False, PREC_S,
                INTERP_S, BLOCK_D_OUT,
            )  # fmt: skip
    if NEED_DB:
        tl.store(DB + offs_v, db, mask=col_ok)


_INTERPRET = interpreting(_distill_stats_kernel)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------


def distill_config(
    props: _config.DeviceProps,
    dtype: torch.dtype,
    tf32: bool = True,
    deterministic: bool = False,
    compiler: tuple[int, int] | None = None,
    aligned: bool = True,
) -> _config.BwdConfig:
    """The one config of all launches on ``props`` for the wider of the heads' compute dtypes
    ``dtype`` (fp32 when either head is fp32). Each program holds two logit tiles (and in the
    backward their softmax terms) besides the gradient products, so the tiles are the backward's
    64-row ones with the softcap epilogue, and with TF32 on mma.sync (register accumulators) 64-wide
    vocab tiles: 64 x 128 spilled there (the forward KL's statistics pass). Checked with the
    real compiler for every target (tests/test_aot_compile.py). ``deterministic``: the tiles of the
    deterministic gradient kernels (their load-add-store epilogue; 32-row tiles on mma.sync).
    The spills these choices avoid: docs/design.md, "Distillation". ``compiler``: the Triton ``(major, minor)``
    that compiles the kernels (default: the installed one): Triton 3.6 held the TF32 gradient kernel on tcgen05 to
    128 registers over 8 warps and spilled 32 B (the JSD with a TF32 teacher; 3.7: 16 B), so there (before 3.8) it
    gets 16-wide gradient chunks (155 registers, no spill; 4 warps instead made the statistics and rows kernels,
    which share the config, spill), as do the deterministic kernels on mma.sync (benchmarks/results/aot_spills.md).
    ``aligned``: every head's rows start on 16-byte boundaries (:func:`._common.rows_aligned`); without it no load is
    vectorized and the address arithmetic holds more registers: 64 x 128 tiles spilled 24-320 B on every target, 64 x
    64 still 8-240 B with every feature on, so the vocab tiles are at most 32 wide with 32-wide K chunks (fp32 IEEE
    and the deterministic ones on mma.sync: 32 x 16 / 32 x 32 with 16-wide chunks)."""
    if compiler is None:
        compiler = _config.triton_version()
    if props.mma == "none" or (dtype == torch.float32 and not tf32):
        c = _config.FP32_BWD
    else:
        c = _distill_tiles(props, dtype, tf32, deterministic, compiler, aligned)
    if props.mma in ("mma", "tcgen05") and c.maxnreg is None:
        # ptxas held the kernels to 128-168 registers on mma.sync and tcgen05 and spilled 8-24 B (sm_120, Triton
        # 3.6-3.9: the deterministic dH / dW kernels with both softcaps, a temperature and a hard label, the
        # statistics of a bf16 student with a TF32 teacher; sm_100, 3.9: the gradients of that pair); narrower tiles
        # and chunks, or more warps, only moved the spill. The cap at 255 lets it keep them in registers
        # (benchmarks/results/aot_spills_pairs.md, aot_spills_triples.md).
        c = dataclasses.replace(c, maxnreg=255)
    if props.consumer_blackwell and dtype != torch.float32:
        # and the 16-bit statistics pass with both softcaps, a temperature and a hard label spilled 8-32 B at 255
        # registers with 128-wide vocab tiles (sm_120, Triton 3.7-3.9)
        c = dataclasses.replace(c, block_v=min(c.block_v, 64))
    if not aligned:
        # rows not 16-byte aligned: no load is vectorized and the address arithmetic holds more registers; 64 x 128
        # tiles spilled 24-320 B on every target, 64 x 64 (32 x 32 in fp32 IEEE) still 8-240 B with every feature
        # on (the triples level, Triton 3.9): half those vocab tiles, 32-wide K chunks
        c = dataclasses.replace(c, block_v=max(16, min(c.block_v, 64) // 2), block_d=min(c.block_d, 32))
    return c


def _distill_tiles(props, dtype, tf32, deterministic, compiler, aligned) -> _config.BwdConfig:
    """:func:`distill_config`'s tiles, chunks, warps and stages."""
    if deterministic and props.mma == "mma" and not aligned:
        return _config.BwdConfig(32, 64, 16, 16, group_n=8, num_warps=4, num_stages=2)
    if deterministic and props.mma == "mma":
        # the load-add-store epilogue next to both heads' tiles spilled at 64 x 64 on sm_120 (docs/design.md); Triton
        # 3.6 still spilled 8 B in the dH kernel (sm_80 / sm_86, every epilogue on): 16-wide gradient chunks there
        return _config.BwdConfig(32, 64, 32, 16 if compiler < (3, 7) else 32, group_n=8, num_warps=4, num_stages=2)
    c = _config.backward_config(props, dtype, tf32=tf32, softcap=True, deterministic=deterministic, compiler=compiler)
    if props.mma == "mma" and dtype == torch.float32 and c.block_v > 64:
        c = dataclasses.replace(c, block_v=64)
    if props.consumer_blackwell and dtype == torch.float32:
        # TF32 on sm_120 in 16-wide K chunks (two k=8 steps): 32-wide ones spilled 8 B at 255 registers in the
        # statistics pass with both softcaps, a temperature and a hard label (Triton 3.9,
        # benchmarks/results/aot_spills_pairs.md); on sm_80 / sm_86 16-wide ones spill 8-24 B instead
        c = dataclasses.replace(c, block_d=16)
    if props.mma == "tcgen05" and dtype == torch.float32 and not deterministic and compiler < (3, 9):
        # TF32 gradients with 32-wide chunks spill before 3.9 (Triton 3.8: 16 B in the gradients kernel); with 3.8 the
        # reverse-KL statistics with every epilogue on (a bf16 student, a TF32 teacher) spilled 16 B at 255 registers
        # with 128-wide vocab tiles (16-wide K chunks instead spilled 16-32 B in the other statistics passes)
        c = dataclasses.replace(c, block_d_out=16, block_v=64 if compiler == (3, 8) else c.block_v)
    if props.mma == "tcgen05" and dtype != torch.float32 and compiler == (3, 6):
        # Triton 3.6 spilled 8-16 B in the JSD's statistics pass with 64-wide K chunks (sm_100, bf16 / fp16)
        c = dataclasses.replace(c, block_d=min(c.block_d, 32))
    if props.mma == "tcgen05" and dtype != torch.float32 and compiler == (3, 7):
        # Triton 3.7 held that pass to 128 registers and spilled 32 B (fp16); 32-wide chunks spilled 8-32 B in other
        # kernels there, the cap at 255 nowhere
        c = dataclasses.replace(c, maxnreg=255)
    return c


class _Launch:
    """The pieces every launch shares: tensors, scalars, constexpr flags and the config."""

    def __init__(self, hs, ws, bs, ht, wt, bt, softcap, temperature, props, allow_tf32, blocks, deterministic=False):
        self.n, self.ds = hs.shape
        self.v, self.dt = ws.shape[0], ht.shape[1]
        interpret = _INTERPRET
        # the student's softcap with the shared temperature, the teacher's alone (transform's arguments)
        has_cap_s, has_temp, cap_s, temp = transform_args(softcap[0], temperature)
        has_cap_t, _no_temp, cap_t, _one = transform_args(softcap[1], None)
        prec_s = dot_precision(hs.dtype, interpret, allow_tf32)
        prec_t = dot_precision(ht.dtype, interpret, allow_tf32)
        if blocks is not None:
            self.cfg = _config.BwdConfig(*blocks, group_n=2)
        elif interpret:
            self.cfg = _config.INTERPRET_BWD
        else:
            if props is None:
                props = _config.DeviceProps.of(hs.device)
            wide = torch.float32 if torch.float32 in (hs.dtype, ht.dtype) else hs.dtype
            # TF32 config only when every fp32 head runs its matmuls in TF32
            tf32 = all(p == "tf32" for p, dt in ((prec_s, hs.dtype), (prec_t, ht.dtype)) if dt == torch.float32)
            self.cfg = distill_config(props, wide, tf32, deterministic, aligned=rows_aligned(hs, ws, ht, wt))
        self.props = props
        self.tensors = (hs, ws, bs if bs is not None else hs, ht, wt, bt if bt is not None else ht)
        self.sizes = (self.n, self.v, self.ds, self.dt)
        self.scalars = (cap_s, cap_t, temp)
        self.strides = (*head_strides(hs, ws, bs), *head_strides(ht, wt, bt))
        c = self.cfg
        self.flags = dict(
            HAS_BS=bs is not None,
            HAS_BT=bt is not None,
            HAS_CAP_S=has_cap_s,
            HAS_CAP_T=has_cap_t,
            HAS_TEMP=has_temp,
            USE_LIBDEVICE=use_libdevice(interpret),
            PREC_S=prec_s,
            PREC_T=prec_t,
            INTERP_S=interp_bf16(hs.dtype, interpret),
            INTERP_T=interp_bf16(ht.dtype, interpret),
            BLOCK_N=c.block_n,
            BLOCK_V=c.block_v,
            BLOCK_D=c.block_d,
        )
        self.options = (
            {}
            if interpret
            else dict(
                num_warps=c.num_warps,
                num_stages=c.num_stages,
                enable_fp_fusion=_config.ENABLE_FP_FUSION,
                **_config.register_cap(c),
            )
        )

    def splits(self, forced: int | None) -> int:
        """Vocab splits of the two row passes (grid axis 1), none of them empty."""
        c = self.cfg
        if forced is not None:
            s = max(1, int(forced))
        elif self.props is None:
            s = 1
        else:
            s = _config.pick_splits(self.n, self.v, c.block_n, c.block_v, self.props)
        per = _config.cdiv(_config.cdiv(self.v, s), c.block_v) * c.block_v
        return min(s, _config.cdiv(self.v, per))


def _check(hs, ws, bs, ht, wt, bt, rows_like, softcap) -> None:
    """Validate both heads before any launch (``rows_like``: any ``[N]`` tensor of the call)."""
    check_inputs(_INTERPRET, hs, ws, bs, rows_like)
    check_inputs(_INTERPRET, ht, wt, bt, rows_like)
    if wt.shape[0] != ws.shape[0]:
        raise ValueError(f"the heads must hold the same vocab rows: W_s {tuple(ws.shape)}, W_t {tuple(wt.shape)}")
    if len(softcap) != 2:
        raise ValueError(f"softcap must be a pair (student, teacher), got {softcap!r}")


def _log_mix_weights(beta) -> tuple[float, float]:
    """``(log beta, log(1 - beta))``, the JSD mixture's weights as the kernels take them."""
    return math.log(beta), math.log1p(-beta)


def _cross_flag(cross) -> int:
    if cross not in (None, "kl", "reverse_kl"):
        raise ValueError(f"cross must be None, 'kl' or 'reverse_kl', got {cross!r}")
    return {None: 0, "kl": 1, "reverse_kl": 2}[cross]


# Each plan_* takes its launcher's arguments (stats, rows, grads; plus the device record and the TF32
# switch that a launch reads from the device and torch), and the launcher passes them on
# (test_distill_plans_take_their_launchers_arguments in tests/test_signatures.py compares the signatures; the
# argument tuples built here are compiled against the kernels by tests/test_aot_compile.py and run by the
# interpreter tests).
def plan_stats(
    hs,
    ws,
    bs,
    ht,
    wt,
    bt,
    targets,
    *,
    vocab_start,
    softcap,
    temperature,
    hard,
    cross=None,
    props=None,
    allow_tf32=None,
    _splits=None,
    _blocks=None,
):
    """Pass 1 without launching: ``((kernel, grid, args, kwargs), out [splits, k, N, NUM_STATS])``.

    Works on ``meta`` tensors (tests/test_aot_compile.py compiles exactly this launch for ``props``).
    Arguments as in :func:`stats`; ``props`` / ``allow_tf32`` as in :func:`.forward.plan_row_stats`."""
    ln = _Launch(hs, ws, bs, ht, wt, bt, softcap, temperature, props, allow_tf32, _blocks)
    k = 3 if hard else 2
    splits = ln.splits(_splits)
    out = torch.zeros(splits, k, ln.n, NUM_STATS, dtype=torch.float32, device=hs.device)
    args = (*ln.tensors, targets, out, *ln.sizes, int(vocab_start), *ln.scalars, *ln.strides, targets.stride(0))
    args += out.stride()[:3]
    grid = (_config.cdiv(ln.n, ln.cfg.block_n), splits)
    kwargs = dict(HARD=bool(hard), CROSS=_cross_flag(cross), **ln.flags, **ln.options)
    return (_distill_stats_kernel, grid, args, kwargs), out


def plan_rows(
    hs,
    ws,
    bs,
    ht,
    wt,
    bt,
    norm,
    *,
    divergence,
    beta,
    softcap,
    temperature,
    props=None,
    allow_tf32=None,
    _splits=None,
    _blocks=None,
):
    """Pass 2 without launching: ``((kernel, grid, args, kwargs), out [splits, N, n_rows])`` (the per-split sums
    times S, see :func:`_distill_rows_kernel`). Arguments as in :func:`rows`."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    ln = _Launch(hs, ws, bs, ht, wt, bt, softcap, temperature, props, allow_tf32, _blocks)
    jsd = divergence == "jsd"
    splits = ln.splits(_splits)
    out = torch.empty(splits, ln.n, 2 if jsd else 1, dtype=torch.float32, device=hs.device)
    args = (*ln.tensors, norm, out, *ln.sizes, *ln.scalars, *_log_mix_weights(beta), *ln.strides, norm.stride(0))
    args += out.stride()[:2]
    grid = (_config.cdiv(ln.n, ln.cfg.block_n), splits)
    kwargs = dict(DIV=DIVERGENCES.index(divergence), **ln.flags, **ln.options)
    return (_distill_rows_kernel, grid, args, kwargs), out


def plan_grads(
    hs,
    ws,
    bs,
    ht,
    wt,
    bt,
    targets,
    norm,
    aux,
    g,
    *,
    vocab_start,
    divergence,
    beta,
    softcap,
    temperature,
    soft_coef,
    hard_coef,
    need_hidden,
    need_weight,
    need_bias,
    deterministic=False,
    props=None,
    allow_tf32=None,
    _blocks=None,
):
    """The backward without launching: ``(dh, dw, db, launches)`` (zeroed fp32 outputs or None;
    ``launches`` a list of ``(kernel, grid, args, kwargs)``, empty when there is nothing to do).
    Arguments as in :func:`grads`."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    ln = _Launch(hs, ws, bs, ht, wt, bt, softcap, temperature, props, allow_tf32, _blocks, deterministic)
    need_bias = bool(need_bias) and bs is not None
    f32 = dict(dtype=torch.float32, device=hs.device)
    dh = torch.zeros(ln.n, ln.ds, **f32) if need_hidden else None
    dw = torch.zeros(ln.v, ln.ds, **f32) if need_weight else None
    db = torch.zeros(ln.v, **f32) if need_bias else None
    if ln.n == 0 or ln.v == 0 or not (need_hidden or need_weight or need_bias):
        return dh, dw, db, []
    c = ln.cfg
    outs = tuple(x if x is not None else g for x in (dh, dw, db))  # g: never dereferenced (NEED_* False)
    coefs = (*_log_mix_weights(beta), float(soft_coef), float(hard_coef))
    args = (*ln.tensors, targets, norm, aux, g, *outs, *ln.sizes, int(vocab_start), *ln.scalars, *coefs, *ln.strides)
    args += (targets.stride(0), norm.stride(0), *(x.stride(0) if x is not None else 0 for x in (dh, dw)))
    kwargs = dict(
        DIV=DIVERGENCES.index(divergence),
        HARD=norm.shape[1] > 2 and float(hard_coef) != 0.0,
        NEED_DH=dh is not None,
        NEED_DW=dw is not None,
        NEED_DB=db is not None,
        **ln.flags,
        BLOCK_D_OUT=c.block_d_out,
        GROUP_N=c.group_n,
        **ln.options,
    )
    if not deterministic:
        grid = (_config.cdiv(ln.n, c.block_n) * _config.cdiv(ln.v, c.block_v),)
        return dh, dw, db, [(_distill_grads_kernel, grid, args, kwargs)]
    launches = []
    if dh is not None:
        launches.append((_distill_dh_kernel, (_config.cdiv(ln.n, c.block_n),), args, kwargs))
    if dw is not None or db is not None:
        launches.append((_distill_dw_kernel, (_config.cdiv(ln.v, c.block_v),), args, kwargs))
    return dh, dw, db, launches


def stats(
    hs, ws, bs, ht, wt, bt, targets, *, vocab_start, softcap, temperature, hard, cross=None, _splits=None, _blocks=None
):
    """This shard's partial statistics and, for a KL, what its per-row divergence sum needs.

    Returns ``(stats, slabs)``: ``stats float32 [k, N, NUM_STATS]`` (k = 3 with ``hard``, else 2):
    MAX / SUMEXP of the student's soft logits (0), the teacher's (1) and with ``hard`` MAX / SUMEXP
    / TARGET of the student's logits at T=1 (2), the other columns 0. ``cross`` = ``"kl"`` or
    ``"reverse_kl"``: ``slabs`` are the per-split ``float32 [splits, 2, N, NUM_STATS]`` that
    :func:`cross_rows` turns into this shard's divergence sums once the global statistics are known
    (the same pass: no second launch for either KL); None: ``slabs`` is None.

    ``hs [N, D_s]`` / ``ws [V_local, D_s]`` / ``bs [V_local]`` or None: the student, one compute
    dtype (fp32 / bf16 / fp16); ``ht [N, D_t]`` / ``wt [V_local, D_t]`` / ``bt``: the teacher, its
    own compute dtype; ``targets [N]`` int64 global ids (local row j is id ``vocab_start + j``);
    ``softcap`` a pair ``(student, teacher)`` of None or a number; ``temperature`` > 0.
    ``_splits`` / ``_blocks`` (tests only): vocab splits, ``(BLOCK_N, BLOCK_V, BLOCK_D, BLOCK_D_OUT)``.
    """
    _cross_flag(cross)
    k = 3 if hard else 2
    n, v = hs.shape[0], ws.shape[0]
    if n == 0 or v == 0:
        empty = torch.stack([empty_stats(n, hs.device)] * k)
        return empty, (empty[None, :2] if cross is not None else None)
    heads = (hs, ws, bs, ht, wt, bt)
    _check(*heads, targets, softcap)
    targets = targets.to(torch.int64)
    (kernel, grid, args, kwargs), out = plan_stats(
        *heads,
        targets,
        vocab_start=vocab_start,
        softcap=softcap,
        temperature=temperature,
        hard=hard,
        cross=cross,
        _splits=_splits,
        _blocks=_blocks,
    )
    with device_guard(hs.device):  # Triton launches on the current device
        kernel[grid](*args, **kwargs)
    local = torch.stack([combine_stack(out[:, i]) for i in range(k)])
    local[0, :, CROSS_COL] = 0.0  # the cross sum's slot, not a statistic
    return local, (out[:, :2] if cross is not None else None)


def norms(stats):
    """``float32 [N, k, 2]``, what the later launches take of the global statistics ``stats float32 [N, k,
    NUM_STATS]`` (:mod:`cce_dist.core.stats` layout, one block per head): per head the row max ``M`` and ``log S``,
    ``S = sum exp(z - M)``, so that ``log p = (z - M) - log S`` is formed without the rounding of ``M + log S``."""
    return torch.stack([stats[..., MAX], torch.log(stats[..., SUMEXP])], -1).to(torch.float32).contiguous()


def cross_rows(slabs, stats, *, cross):
    """This shard's forward (``cross="kl"``) or reverse KL sums ``float32 [N, 1]`` from the split
    ``slabs`` of :func:`stats` and the global statistics ``stats float32 [N, >= 2, NUM_STATS]`` (student,
    teacher): ``sum_j p_a,j (log p_a,j - log p_b,j) = sum_splits c_a (x + (l_a - l_b) s_a)`` with
    ``(c, l)`` the split max's :func:`cce_dist.core.stats.normalizers` (``p = exp(z - m) c``, ``log p = (z - m) + l``),
    a the weighting head (teacher for kl)."""
    ia = {"kl": 1, "reverse_kl": 0}[cross]
    ib = 1 - ia
    # [splits, N] against the rows' [N] global statistics (broadcast over the splits)
    c_a, l_a = normalizers(slabs[:, ia, :, MAX], stats[:, ia])
    l_b = normalizers(slabs[:, ib, :, MAX], stats[:, ib])[1]
    term = c_a * (slabs[:, 0, :, CROSS_COL] + (l_a - l_b) * slabs[:, ia, :, SUMEXP])
    # an empty split (or a head with no finite logit there) adds 0 (c_a = 0), never 0 * nan
    return torch.where(c_a == 0, 0.0, term).sum(0)[:, None]


def rows(hs, ws, bs, ht, wt, bt, norm, *, divergence, beta, softcap, temperature, _splits=None, _blocks=None):
    """This shard's partial per-row divergence sums ``float32 [N, n_rows]`` (n_rows = 2 for jsd: the
    teacher part ``sum p_t (lt - lm)`` and ``K = sum p_s (ls - lm)``; else 1) given ``norm float32
    [N, >= 2, 2]`` (:func:`norms`) of the global statistics of the student's (head 0) and the teacher's (1)
    soft logits.
    Other arguments as in :func:`stats`."""
    n, v = hs.shape[0], ws.shape[0]
    width = 2 if divergence == "jsd" else 1
    if n == 0 or v == 0:
        return torch.zeros(n, width, dtype=torch.float32, device=hs.device)
    norm = norm.to(torch.float32).contiguous()  # the kernel reads each row's entries at unit stride
    heads = (hs, ws, bs, ht, wt, bt)
    _check(*heads, norm[:, 0, 0], softcap)
    (kernel, grid, args, kwargs), out = plan_rows(
        *heads,
        norm,
        divergence=divergence,
        beta=beta,
        softcap=softcap,
        temperature=temperature,
        _splits=_splits,
        _blocks=_blocks,
    )
    with device_guard(hs.device):
        kernel[grid](*args, **kwargs)
    inv_s = torch.exp(-norm[:, :2, 1])  # 1 / S of the student (0) and the teacher (1)
    return out.sum(0) * (inv_s[:, [1, 0]] if divergence == "jsd" else inv_s[:, 1 if divergence == "kl" else 0, None])


def grads(
    hs,
    ws,
    bs,
    ht,
    wt,
    bt,
    targets,
    norm,
    aux,
    g,
    *,
    vocab_start,
    divergence,
    beta,
    softcap,
    temperature,
    soft_coef,
    hard_coef,
    need_hidden,
    need_weight,
    need_bias,
    deterministic=False,
    _blocks=None,
):
    """The student's float32 gradients ``(dh [N, D_s] partial over this shard, dw [V_local, D_s],
    db [V_local])`` of ``sum_i g_i * loss_i`` (None where not needed or without bias).

    ``norm float32 [N, k, 2]``: :func:`norms` of the global statistics of :func:`stats`' heads (head 2, the
    student at T=1, only with a hard-label term); ``aux float32 [N]``: reverse_kl's R or jsd's K (global; ignored
    for kl); ``g float32 [N]`` per-row upstream gradient, 0 for rows without one. The loss is
    ``soft_coef * T / (1 - beta for jsd) * D + hard_coef * CE``: ``soft_coef`` already holds the
    divergence's scale, the jsd's ``1 - beta`` and ``1 / T``. ``deterministic``: no float atomics
    (a dH kernel owning token tiles and a dW / db kernel owning vocab tiles, each walking the other
    axis in order: bitwise repeatable, one more recompute of both heads' tiles).
    Other arguments as in :func:`stats`.
    """
    heads = (hs, ws, bs, ht, wt, bt)
    _check(*heads, targets, softcap)
    targets = targets.to(torch.int64)
    dh, dw, db, launches = plan_grads(
        *heads,
        targets,
        norm.to(torch.float32).contiguous(),
        aux.to(torch.float32).contiguous(),
        g.to(torch.float32).contiguous(),
        vocab_start=vocab_start,
        divergence=divergence,
        beta=beta,
        softcap=softcap,
        temperature=temperature,
        soft_coef=soft_coef,
        hard_coef=hard_coef,
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
        deterministic=deterministic,
        _blocks=_blocks,
    )
    with device_guard(hs.device):
        for kernel, grid, args, kwargs in launches:
            kernel[grid](*args, **kwargs)
    return dh, dw, db
