"""Pieces shared by the forward and backward kernels: the logit-tile recompute and its transform.

All helpers here are ``@triton.jit`` device functions plus a few host-side checks. A logit tile is
always produced the same way, so forward statistics and backward recomputation see bit-identical
logits for the same tile:

    acc = sum_d h[n, d] * W[v, d]      tl.dot, fp32 accumulation, over BLOCK_D chunks of D
    raw = fp32(round_to_input_dtype(acc + bias[v]))
    c   = softcap * tanh(raw / softcap)     (HAS_SOFTCAP)
    z   = c / temperature                   (HAS_TEMP; temperature == 1 skips the division)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # libdevice's tanh is accurate to ~1 ulp; the interpreter has no libdevice.
    from triton.language.extra import libdevice
except Exception:  # pragma: no cover - very old triton
    libdevice = None


def interpreting(kernel) -> bool:
    """True when ``kernel`` was built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_inputs(interpret: bool, hidden: torch.Tensor, weight: torch.Tensor, bias, targets) -> None:
    """Validate shapes/devices before any launch; raise a clear error for CPU tensors."""
    if not interpret and not hidden.is_cuda:
        raise RuntimeError(
            "cce_dist.kernels got CPU tensors: the Triton kernels need a CUDA device. Set "
            "TRITON_INTERPRET=1 in the environment *before* triton is first imported to run them "
            "on the CPU (slow; meant for tests), or use impl='torch'."
        )
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [N, D] and weight [V_local, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must already share the compute dtype")
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported compute dtype {hidden.dtype}")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [V_local] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    devs = {t.device for t in (hidden, weight, targets) if t is not None}
    if bias is not None:
        devs.add(bias.device)
    if len(devs) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devs))}")


def rows_aligned(*tensors: torch.Tensor) -> bool:
    """Every row of these ``[rows, D]`` tensors starts on a 16-byte boundary, contiguous along D: what the
    compiler's divisibility specialization needs for vectorized / asynchronous loads (configs differ without it)."""
    return all(
        t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1 for t in tensors
    )


def head_strides(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, ...]:
    """The strides of :func:`logit_tile`'s HEAD as a launch passes them: ``(stride_hn, stride_hd, stride_wv,
    stride_wd, stride_b)`` of ``hidden [N, D]``, ``weight [V, D]`` and ``bias [V]`` (0 without a bias)."""
    return (*hidden.stride(), *weight.stride(), bias.stride(0) if bias is not None else 0)


def transform_args(softcap: float | None, temperature: float | None) -> tuple[bool, bool, float, float]:
    """``(HAS_SOFTCAP, HAS_TEMP, softcap, temperature)`` as :func:`transform` takes them: a softcap of None or 0 and
    a temperature of None or 1 are off (their value then 1.0, never read)."""
    cap = float(softcap) if softcap is not None and softcap != 0 else None
    temp = float(temperature) if temperature is not None and float(temperature) != 1.0 else None
    return cap is not None, temp is not None, 1.0 if cap is None else cap, 1.0 if temp is None else temp


def interp_bf16(dtype: torch.dtype, interpret: bool) -> bool:
    """Work around two bf16 bugs of the Triton 3.x interpreter (not of the GPU compiler):
    its tl.dot multiplies bf16 operands as their raw uint16 bits, and its fp32 -> bf16 cast
    truncates instead of rounding to nearest even. With this flag, bf16 tiles are widened to fp32
    before tl.dot (exact: bf16 products are exact in fp32, and the GPU's bf16 dot accumulates in
    fp32 too) and fp32 -> bf16 rounding is done by integer arithmetic on the bits (RTNE)."""
    return interpret and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype, interpret: bool, allow_tf32: bool | None = None) -> str:
    """fp32 inputs: exact ('ieee') unless TF32 matmuls are allowed (``allow_tf32``; default:
    whether torch itself allows them); other dtypes: irrelevant ('ieee')."""
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    if dtype == torch.float32 and not interpret and allow_tf32:
        return "tf32"
    return "ieee"


def use_libdevice(interpret: bool) -> bool:
    return (not interpret) and libdevice is not None and os.environ.get("CCE_DIST_NO_LIBDEVICE") != "1"


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERP_BF16: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (nearest even). Returns DTYPE, or with INTERP_BF16 an
    fp32 tensor holding the bf16-rounded values (NaN/inf are not special-cased there)."""
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, INTERP_BF16: tl.constexpr):
    """acc + a @ b with fp32 accumulation (see :func:`interp_bf16` for INTERP_BF16)."""
    if INTERP_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def logit_tile(
    HEAD,
    offs_n,
    offs_v,
    N,
    V,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERP_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Raw logits of one [BLOCK_N, BLOCK_V] tile, rounded to the input dtype, returned as fp32.

    ``HEAD``: the head as one tuple ``(H, W, Bias, D, stride_hn, stride_hd, stride_wv, stride_wd, stride_b)``
    (hidden states [N, D], weight [V, D], bias [V]; a stride the launcher specialized to 1 stays a constexpr
    inside the tuple). ``offs_n`` / ``offs_v`` are int64 row / vocab offsets; rows >= N and columns >= V load
    zeros (callers mask them afterwards). Offsets are int64 so ``n * stride`` cannot overflow.
    """
    H, W, Bias, D, stride_hn, stride_hd, stride_wv, stride_wd, stride_b = HEAD
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    h_ptrs = H + offs_n[:, None] * stride_hn + offs_d[None, :] * stride_hd
    w_ptrs = W + offs_v[None, :] * stride_wv + offs_d[:, None] * stride_wd
    row_ok = offs_n[:, None] < N
    col_ok = offs_v[None, :] < V
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        h = tl.load(h_ptrs, mask=row_ok & (offs_d[None, :] < D - d0), other=0.0)
        w = tl.load(w_ptrs, mask=col_ok & (offs_d[:, None] < D - d0), other=0.0)
        acc = mma(h, w, acc, DOT_PRECISION, INTERP_BF16)
        h_ptrs += BLOCK_D * stride_hd
        w_ptrs += BLOCK_D * stride_wd
    if HAS_BIAS:
        b = tl.load(Bias + offs_v * stride_b, mask=offs_v < V, other=0.0).to(tl.float32)
        acc += b[None, :]
    # One rounding to the compute dtype, like F.linear's output in that dtype.
    return round_to(acc, H.dtype.element_ty, INTERP_BF16).to(tl.float32)


@triton.jit
def tanh_and_slope(x, USE_LIBDEVICE: tl.constexpr):
    """``(tanh x, 1 - tanh(x)**2)`` in fp32.

    On GPU ``libdevice.tanh`` (about 1 ulp) and the slope ``1 - t * t``: the same formula and accuracy
    as the materialized program's autograd (``grad * (1 - y**2)`` from torch's tanh). Elsewhere (the
    interpreter) ``e = exp(-2|x|)``, ``tanh |x| = (1 - e) / (1 + e)`` (a few 1e-8 absolute error:
    callers multiply by the softcap, so ~1 ulp of the cap) and the slope ``4e / (1 + e)**2`` from the
    same ``e``: ``1 - t * t`` there would keep only that tanh's rounding where it saturates (slopes of
    1e-3 with 1e-4 relative error: fp32 gradients up to 8x less accurate than the materialized
    program's, found by the long fuzz run)."""
    if USE_LIBDEVICE:
        t = libdevice.tanh(x)
        return t, 1.0 - t * t
    else:
        e = tl.exp(-2.0 * tl.abs(x))
        y = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -y, y), 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def transform(
    raw, softcap, temperature, HAS_SOFTCAP: tl.constexpr, HAS_TEMP: tl.constexpr, USE_LIBDEVICE: tl.constexpr
):
    """raw -> (z, slope): ``z = softcap * tanh(raw / softcap) / temperature`` (each step only when
    enabled) and the softcap's chain factor ``slope = 1 - tanh(raw / softcap)**2`` for the backward
    (see :func:`tanh_and_slope`; 1 without a softcap; dead code, removed by the compiler, where unused)."""
    if HAS_SOFTCAP:
        t, slope = tanh_and_slope(raw / softcap, USE_LIBDEVICE)
        c = softcap * t
    else:
        slope = tl.full(raw.shape, 1.0, tl.float32)
        c = raw
    if HAS_TEMP:
        z = c / temperature
    else:
        z = c
    return z, slope
