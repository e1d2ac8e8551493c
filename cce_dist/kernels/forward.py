"""Forward kernel: per-row statistics of the logits over one vocab shard, without materializing
them. See :mod:`cce_dist.core.stats` for the statistics and :mod:`cce_dist.core.backend` for the contract.

Tiling: program ``(pid_n, pid_s)`` owns the token tile ``pid_n`` and the ``pid_s``-th contiguous
range of the shard's vocab rows (a "split"). It walks its range in ``BLOCK_V`` tiles, recomputes
each logit tile with ``tl.dot`` (fp32 accumulation over ``BLOCK_D`` chunks of D), and folds it
into running per-row statistics held in registers (online max / rescaled sums, as in flash
attention). Each split writes one ``[N, 5]`` slab; when there is more than one split (small N on
a big GPU: more programs for occupancy) the slabs are merged with :func:`cce_dist.core.stats.combine_stack`.
Extra memory: ``splits * N * 5`` floats.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from cce_dist.core.runtime import device_guard
from cce_dist.core.stats import MAX, NUM_STATS, SUM_SCALE, SUMEXP, combine_stack, empty_stats

from . import config as _config
from ._common import (
    check_inputs,
    dot_precision,
    head_strides,
    interp_bf16,
    interpreting,
    logit_tile,
    rows_aligned,
    transform,
    transform_args,
    use_libdevice,
)

_SUM_SCALE = tl.constexpr(SUM_SCALE)  # the SUM column's exact power-of-two scale (cce_dist.core.stats)
_FLOOR = tl.constexpr(-3.4028234663852886e38)  # the lowest finite float32: where the running max starts


# Its logit_tile call is the backward's _dz_tile's and distillation's (bit-identical logits):
# test_logit_tile_calls_pass_its_parameters_in_order in tests/test_signatures.py checks every call.
@triton.jit
def _row_stats_kernel(
    H,
    W,
    Bias,
    Targets,
    Out,
    N,
    V,
    D,
    vocab_start,
    softcap,
    temperature,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    stride_b,
    stride_t,
    stride_os,
    stride_on,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_TEMP: tl.constexpr,
    NEED_SUM: tl.constexpr,
    NEED_ENTROPY: tl.constexpr,
    NEED_ARGMAX: tl.constexpr,
    NEED_SUMSQ: tl.constexpr,
    USE_LIBDEVICE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """
    Online row statistics of z = transform(round(H @ W.T + Bias)) over a range of vocab rows.

    Parameters:
    H (pointer): hidden states, [N, D], fp32 / bf16 / fp16.
    W (pointer): head weight shard, [V, D], same dtype as H; local row j is global id vocab_start + j.
    Bias (pointer): [V] same dtype, or a dummy when HAS_BIAS is False.
    Targets (pointer): [N] int64 global target ids (any id outside the shard never matches).
    Out (pointer): fp32 [splits, N, 7] output; columns MAX, SUMEXP, TARGET, SUM, ENTROPY, ARGMAX, SUMSQ.
    N, V, D (int): sizes. vocab_start (int): global id of local row 0.
    softcap, temperature (float): used when HAS_SOFTCAP / HAS_TEMP.
    NEED_SUM / NEED_ENTROPY (constexpr): accumulate the SUM (label smoothing) / ENTROPY columns;
    when False the column is written as 0 and its per-logit work (3-4 ops each) is not compiled in.
    NEED_ARGMAX / NEED_SUMSQ (constexpr): the row outputs' ARGMAX (the lowest global id of the max, as
    float32; +inf when not needed or the slice is empty; a NaN logit is the max, as for torch.argmax: MAX is
    then NaN and ARGMAX the first NaN's id) and SUMSQ (sum exp(2 (z - m)); 0 when not needed).
    The vocab is cut into ``tl.num_programs(1)`` splits of ``v_per_split`` rows, a multiple of
    BLOCK_V (so only the shard's last tile is ragged); program (pid_n, pid_s) covers
    [pid_s * v_per_split, min((pid_s + 1) * v_per_split, V)), possibly empty (then it writes the
    statistics of an empty slice, the identity of their merge).
    BLOCK_N, BLOCK_V, BLOCK_D (constexpr): token tile, vocab tile, reduction chunk.
    """
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    row_ok = offs_n < N
    tgt = tl.load(Targets + offs_n * stride_t, mask=row_ok, other=-1).to(tl.int64) - vocab_start

    v_per_split = tl.cdiv(tl.cdiv(V, tl.num_programs(1)), BLOCK_V) * BLOCK_V
    v_lo = pid_s.to(tl.int64) * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)

    # The running max starts at the lowest finite float, not -inf (flash attention's safe max, without a select): a
    # tile masked by a -inf bias, or a whole masked shard, forms exp(-inf - FLOOR) = 0, never exp(-inf - -inf) = NaN.
    # A row with no finite logit keeps m = FLOOR and s = 0; row_stats stores its MAX as -inf.
    m = tl.full((BLOCK_N,), _FLOOR, dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    e = tl.zeros((BLOCK_N,), dtype=tl.float32)
    q = tl.zeros((BLOCK_N,), dtype=tl.float32)
    am = tl.zeros((BLOCK_N,), dtype=tl.int64) + (V + vocab_start)  # past every id: set by the split's first tile
    nan_seen = tl.zeros((BLOCK_N,), dtype=tl.int1)  # NEED_ARGMAX: the row has a NaN logit (am is its first)
    HEAD = (H, W, Bias, D, stride_hn, stride_hd, stride_wv, stride_wd, stride_b)

    for v0 in range(v_lo, v_hi, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_ok = offs_v < v_hi
        raw = logit_tile(HEAD, offs_n, offs_v, N, V, HAS_BIAS, DOT_PRECISION, INTERP_BF16, BLOCK_N, BLOCK_V, BLOCK_D)
        z, _slope = transform(raw, softcap, temperature, HAS_SOFTCAP, HAS_TEMP, USE_LIBDEVICE)

        z_m = tl.where(col_ok[None, :], z, float("-inf"))
        tile_m = tl.max(z_m, axis=1)
        new_m = tl.maximum(m, tile_m)
        if NEED_ARGMAX:  # the tile's lowest id of its max; tiles come in increasing ids, so a tie keeps the earlier
            lane = tl.arange(0, BLOCK_V)  # int32 lanes: half the registers of the int64 offsets
            # torch.argmax's rule (cce_dist.core.stats.holds_max): a NaN is the max, the first one wins (tl.max skips
            # NaN). One reduction: a NaN lane's key is lane - BLOCK_V (< 0), a lane of the max its lane.
            arg_key = tl.where(z_m == tile_m[:, None], lane[None, :], BLOCK_V)
            tile_arg = tl.min(tl.where(z_m != z_m, lane[None, :] - BLOCK_V, arg_key), axis=1)
            tile_nan = tile_arg < 0
            tile_arg = tl.where(tile_nan, tile_arg + BLOCK_V, tile_arg)
            # the first tile sets it even where its max is -inf (every logit masked: torch.argmax's first id)
            take = ((tile_m > m) | tile_nan | (am == V + vocab_start)) & ~nan_seen
            am = tl.where(take, v0 + vocab_start + tile_arg, am)
            nan_seen = nan_seen | tile_nan
        # Re-express the running sums relative to new_m. m = FLOOR (no finite logit yet) has s = e = q = 0: take
        # scale = 0 and shift = 0 there.
        first = m == _FLOOR
        scale = tl.where(first, 0.0, tl.exp(m - new_m))
        shift = tl.where(first, 0.0, m - new_m)
        if NEED_ENTROPY:
            e = (e + s * shift) * scale
        if NEED_SUMSQ:
            q = q * (scale * scale)
        s = s * scale

        zc = z - new_m[:, None]  # new_m >= FLOOR: a -inf logit gives exp(-inf) = 0, never exp(-inf - -inf) = NaN
        p = tl.where(col_ok[None, :], tl.exp(zc), 0.0)
        s += tl.sum(p, axis=1)
        if NEED_SUMSQ:
            q += tl.sum(p * p, axis=1)
        if NEED_ENTROPY:
            # p == 0 (a -inf logit): its term is 0, not 0 * -inf, and no lane forms 0 * -inf even to discard it
            # (!=, so a NaN p still propagates)
            live = col_ok[None, :] & (p != 0.0)
            e += tl.sum(tl.where(live, p * tl.where(live, zc, 0.0), 0.0), axis=1)
        if NEED_SUM:
            a += tl.sum(tl.where(col_ok[None, :], z * _SUM_SCALE, 0.0), axis=1)  # scaled: cannot overflow
        hit = (offs_v[None, :] == tgt[:, None]) & col_ok[None, :]
        x += tl.sum(tl.where(hit, z, 0.0), axis=1)
        m = new_m

    if NEED_ARGMAX:  # a row with a NaN logit: MAX NaN, ARGMAX its first NaN (what combine_stack merges)
        m = tl.where(nan_seen, float("nan"), m)
    out = Out + pid_s.to(tl.int64) * stride_os + offs_n * stride_on
    tl.store(out + 0, m, mask=row_ok)
    tl.store(out + 1, s, mask=row_ok)
    tl.store(out + 2, x, mask=row_ok)
    tl.store(out + 3, a, mask=row_ok)
    tl.store(out + 4, e, mask=row_ok)
    found = am < V + vocab_start
    tl.store(out + 5, tl.where(found, am.to(tl.float32), float("inf")), mask=row_ok)
    tl.store(out + 6, q, mask=row_ok)


_INTERPRET = interpreting(_row_stats_kernel)
_TUNED: dict = {}


def _triton_config(c: _config.FwdConfig):
    return triton.Config(
        {"BLOCK_N": c.block_n, "BLOCK_V": c.block_v, "BLOCK_D": c.block_d},
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        maxnreg=c.maxnreg,
    )


def _tuned_kernel(configs: list[_config.FwdConfig]):
    """The forward kernel wrapped in a small autotuner over ``configs`` (the candidates :func:`plan_row_stats` picked
    for the device, dtype, epilogue, statistics and alignment), one per distinct candidate list."""
    key = tuple(configs)
    if key not in _TUNED:
        _TUNED[key] = triton.autotune(configs=[_triton_config(c) for c in configs], key=["D", "V"])(_row_stats_kernel)
    return _TUNED[key]


def _candidates(
    hidden, weight, props, precision: str, has_softcap: bool, lean: bool, heavy: bool, blocks, bias=False, temp=False
):
    """``(configs, props)``: the candidate :class:`~.config.FwdConfig` list (``blocks`` when given, the interpreter's
    config, else :func:`.config.forward_candidates` for ``props``, looked up from the tensors' device when None)
    and the device record the splits are picked for."""
    if blocks is not None:
        bn, bv, bd = blocks
        return [_config.FwdConfig(bn, bv, bd)], props
    if _INTERPRET:
        return [_config.INTERPRET_FWD], props
    if props is None:
        props = _config.DeviceProps.of(hidden.device)
    configs = _config.forward_candidates(
        props,
        hidden.dtype,
        precision == "tf32",
        has_softcap,
        rows_aligned(hidden, weight),
        lean=lean,
        heavy=heavy,
        bias=bias,
        temperature=temp,
    )
    return configs, props


def _splits_of(n: int, v: int, props, splits) -> Callable[[_config.FwdConfig], int]:
    """``splits_of(cfg)``: the vocab splits (grid axis 1) of a launch with ``cfg``: ``splits`` when given (tests),
    one in the interpreter or without a device record, else :func:`.config.pick_splits`."""

    def splits_of(c: _config.FwdConfig) -> int:
        if splits is not None:
            s = max(1, int(splits))
        elif _INTERPRET or props is None:
            s = 1
        else:
            s = _config.pick_splits(n, v, c.block_n, c.block_v, props)
        # Splits that would be empty after rounding to whole tiles are not launched.
        per = _config.cdiv(_config.cdiv(v, s), c.block_v) * c.block_v
        return min(s, _config.cdiv(v, per))

    return splits_of


def _flags(dtype, has_bias: bool, has_softcap: bool, has_temp: bool, needs: dict, precision: str) -> dict:
    """The kernel's constexpr keyword arguments (``needs``: plan_row_stats's ``need_*`` values by name), plus the
    FP-fusion compile option outside the interpreter."""
    flags = dict(
        HAS_BIAS=has_bias,
        HAS_SOFTCAP=has_softcap,
        HAS_TEMP=has_temp,
        NEED_SUM=bool(needs["need_sum"]),
        NEED_ENTROPY=bool(needs["need_entropy"]),
        NEED_ARGMAX=bool(needs["need_argmax"]),
        NEED_SUMSQ=bool(needs["need_sumsq"]),
        USE_LIBDEVICE=use_libdevice(_INTERPRET),
        DOT_PRECISION=precision,
        INTERP_BF16=interp_bf16(dtype, _INTERPRET),
    )
    if not _INTERPRET:
        flags["enable_fp_fusion"] = _config.ENABLE_FP_FUSION
    return flags


def plan_row_stats(
    hidden,
    weight,
    bias,
    targets,
    *,
    vocab_start,
    softcap,
    temperature,
    props=None,
    allow_tf32=None,
    need_sum=True,
    need_entropy=True,
    need_argmax=False,
    need_sumsq=False,
    _splits=None,
    _blocks=None,
):
    """Everything a launch of the forward kernel needs, without launching it.

    Returns ``(args, flags, configs, splits_of, out)``: the kernel's positional arguments, its
    constexpr keyword arguments (flags, plus the FP-fusion option), the candidate
    :class:`~.config.FwdConfig` list (the autotune set; one entry when fixed), ``splits_of(cfg)``
    giving the vocab splits (grid axis 1) for the config actually launched, and the output
    ``float32 [max splits, N, 5]``. Works on ``meta`` tensors (no allocation, no launch), which
    is how tests/test_aot_compile.py compiles exactly what a launch on ``props`` would.
    ``props``: :class:`~.config.DeviceProps` (default: the tensors' CUDA device).
    ``allow_tf32``: fp32 matmuls in TF32 (default: ``torch.backends.cuda.matmul.allow_tf32``).
    ``need_sum`` / ``need_entropy`` / ``need_argmax`` / ``need_sumsq``: compute those columns (see
    :func:`row_stats`).
    """
    n, d = hidden.shape
    v = weight.shape[0]
    has_softcap, has_temp, softcap_arg, temperature_arg = transform_args(softcap, temperature)
    precision = dot_precision(hidden.dtype, _INTERPRET, allow_tf32)
    needs = dict(need_sum=need_sum, need_entropy=need_entropy, need_argmax=need_argmax, need_sumsq=need_sumsq)
    lean, heavy = not any(needs.values()), bool(need_argmax or need_sumsq)
    configs, props = _candidates(
        hidden, weight, props, precision, has_softcap, lean, heavy, _blocks, bias is not None, has_temp
    )
    splits_of = _splits_of(n, v, props, _splits)
    out = torch.empty(max(splits_of(c) for c in configs), n, NUM_STATS, dtype=torch.float32, device=hidden.device)
    args = (
        hidden,
        weight,
        bias if bias is not None else hidden,
        targets,
        out,
        n,
        v,
        d,
        int(vocab_start),
        softcap_arg,
        temperature_arg,
        *head_strides(hidden, weight, bias),
        targets.stride(0),
        out.stride(0),
        out.stride(1),
    )
    flags = _flags(hidden.dtype, bias is not None, has_softcap, has_temp, needs, precision)
    return args, flags, configs, splits_of, out


# row_stats takes plan_row_stats's arguments (less the AOT-only props / allow_tf32) and passes them on.
def row_stats(
    hidden,
    weight,
    bias,
    targets,
    *,
    vocab_start,
    softcap,
    temperature,
    need_sum=True,
    need_entropy=True,
    need_argmax=False,
    need_sumsq=False,
    _splits=None,
    _blocks=None,
):
    """Per-row logit statistics of one vocab shard: ``float32 [N, NUM_STATS]``.

    ``hidden [N, D]``, ``weight [V_local, D]`` (same dtype: fp32/bf16/fp16), ``bias [V_local]`` or
    None, ``targets [N]`` int64 global ids. See :mod:`cce_dist.core.backend` for the exact definition.
    ``need_sum=False`` / ``need_entropy=False`` skip the SUM / ENTROPY statistics (their columns then
    carry no meaning): the cross-entropy without label smoothing reads neither, and the per-logit
    epilogue is about half as long without them. ``need_argmax`` / ``need_sumsq``: the row outputs' ARGMAX /
    SUMSQ columns (:mod:`cce_dist.core.outputs`).
    ``_splits`` / ``_blocks`` (tests only) force the number of vocab splits and the
    ``(BLOCK_N, BLOCK_V, BLOCK_D)`` tiles.
    """
    check_inputs(_INTERPRET, hidden, weight, bias, targets)
    n, d = hidden.shape
    v = weight.shape[0]
    device = hidden.device
    if n == 0:
        return torch.zeros(0, NUM_STATS, dtype=torch.float32, device=device)
    if v == 0:
        return empty_stats(n, device)

    targets = targets.to(torch.int64)
    args, flags, configs, splits_of, out = plan_row_stats(
        hidden,
        weight,
        bias,
        targets,
        vocab_start=vocab_start,
        softcap=softcap,
        temperature=temperature,
        need_sum=need_sum,
        need_entropy=need_entropy,
        need_argmax=need_argmax,
        need_sumsq=need_sumsq,
        _splits=_splits,
        _blocks=_blocks,
    )
    if len(configs) > 1 or (not _INTERPRET and _blocks is None):
        kernel = _tuned_kernel(configs)

        def cfg_of(meta) -> _config.FwdConfig:
            return _config.FwdConfig(meta["BLOCK_N"], meta["BLOCK_V"], meta["BLOCK_D"])

        grid = lambda meta: (_config.cdiv(n, meta["BLOCK_N"]), splits_of(cfg_of(meta)))  # noqa: E731
        with device_guard(device):  # Triton launches (and autotunes) on the current device
            kernel[grid](*args, **flags)
        # Tuning runs of other configs may have written more slabs; the final run of the chosen
        # config wrote exactly the first splits_of(chosen) of them.
        best = kernel.best_config.kwargs
        splits = splits_of(_config.FwdConfig(best["BLOCK_N"], best["BLOCK_V"], best["BLOCK_D"]))
    else:
        c = configs[0]
        splits = splits_of(c)
        launch = {} if _INTERPRET else dict(num_warps=c.num_warps, num_stages=c.num_stages, **_config.register_cap(c))
        with device_guard(device):
            _row_stats_kernel[(_config.cdiv(n, c.block_n), splits)](
                *args, **flags, BLOCK_N=c.block_n, BLOCK_V=c.block_v, BLOCK_D=c.block_d, **launch
            )
    stack = out[:splits]
    # A slice with no finite logit (every id masked by a -inf bias, or an empty split) kept the kernel's floor as its
    # max: store the merge's identity, -inf (SUMEXP is exactly 0 only there: a finite max contributes exp(0) = 1).
    # Here, not in the kernel: one select after the loop cost the sm_90 configs 16 B of spills (test_aot_compile).
    stack[..., MAX].masked_fill_(stack[..., SUMEXP] == 0, float("-inf"))
    return combine_stack(stack)
