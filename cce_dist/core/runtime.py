"""What the implementations ask of the device at run time, in one place: the float32-output GEMM, free memory, the
device a launch runs on, and the library's logger.

Used by the torch implementation (:mod:`cce_dist.impl.torch_cross_entropy`) and by the Triton kernels' host code
(``cce_dist.kernels``); it imports nothing from cce_dist, so it sits below every other module.

- :func:`mm_f32` / :func:`matmul_f32`: ``a @ b`` of bf16 / fp16 operands with a float32 result and float32
  accumulation. On CUDA this is one GEMM with ``out_dtype=torch.float32`` where the build has it; whether it does is
  decided once per ``(device, dtype)`` by a tiny probe (:func:`f32_out_gemm`) and cached, never by catching errors
  of the real call, so an out-of-memory error or an asynchronous device error raised there reaches the caller. Where
  the probe fails (an older torch, the CPU build) the operands are upcast to float32 (the same values: bf16 / fp16
  products are exact in float32), much slower on a GPU (docs/design.md, "Host code on the device"): logged once as
  a warning on CUDA.
- :func:`free_bytes`: what an allocation of that size can use on a CUDA device: the driver's free memory plus
  what torch's caching allocator holds reserved but unused.
- :func:`device_guard`: ``torch.cuda.device(d)`` for a CUDA device (a Triton launch runs on the *current*
  device, not the tensors'), a no-op context elsewhere.
- :func:`constant_result`: Dynamo's ``assume_constant_result`` without importing Dynamo when cce_dist is
  imported (the public decorator imports ``torch._dynamo``: 2 s of every ``import cce_dist``).
- :data:`logger` (``logging.getLogger("cce_dist")``): debug lines name the backward schedule the kernels chose
  and why, and the GEMM path; ``logging.getLogger("cce_dist").setLevel(logging.DEBUG)`` (with a handler, e.g.
  ``logging.basicConfig()``) shows them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["constant_result", "device_guard", "f32_out_gemm", "free_bytes", "logger", "matmul_f32", "mm_f32"]

logger = logging.getLogger("cce_dist")

_F = TypeVar("_F", bound=Callable[..., Any])


def constant_result(fn: _F) -> _F:
    """Dynamo's ``assume_constant_result(fn)`` (public in ``torch.compiler``): under torch.compile ``fn`` is called,
    its result a constant of the graph, never traced. The public decorator imports ``torch._dynamo`` (2 s on a CPU,
    most of ``import cce_dist``), so this sets the mark it sets, which Dynamo reads when it meets ``fn`` (torch
    2.10-2.15; tests/test_compile.py compares the two, tests/test_torch_floor.py finds the reader in each torch
    checked): Dynamo is imported when the user's program compiles, not before."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


#: ``(device, dtype) -> whether torch.mm / torch.addmm with out_dtype=torch.float32 work there`` (probed once)
_F32_OUT: dict[tuple[torch.device, torch.dtype], bool] = {}


def _is_device_error(e: BaseException) -> bool:
    """An error of the device (out of memory, an asynchronous kernel fault), not a missing kernel."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    accel = getattr(torch, "AcceleratorError", None)  # CUDA errors from torch 2.8 on
    return accel is not None and isinstance(e, accel)


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the float32-output GEMMs :func:`mm_f32` uses run on ``device`` for ``dtype`` and give the values of
    the float32 GEMM of the upcast operands (a few 16 x 16 products, one of them on a transposed operand)."""
    a = (torch.arange(256, dtype=torch.float32, device=device).reshape(16, 16) % 7 - 3).to(dtype)
    b = (torch.arange(256, dtype=torch.float32, device=device).reshape(16, 16) % 5 - 2).to(dtype)
    want = a.float() @ b.float()
    try:
        out = torch.mm(a, b, out_dtype=torch.float32)
        torch.mm(a.T, b, out_dtype=torch.float32, out=out)
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        ok = out.dtype == torch.float32 and bool(torch.equal(out, a.float().T @ b.float() + want))
    except (RuntimeError, TypeError, NotImplementedError) as e:
        if _is_device_error(e):
            raise
        first = (str(e).splitlines() or [""])[0]
        logger.debug("cce_dist: no float32-output GEMM for %s on %s (%s: %s)", dtype, device, type(e).__name__, first)
        return False
    return ok


@constant_result
def f32_out_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`mm_f32` runs one GEMM with a float32 result for ``dtype`` operands on ``device``: bf16 / fp16 on
    CUDA where the build has ``out_dtype`` (probed on first use, then cached); never elsewhere (the CPU build: the
    operands are upcast, which gives the same values). A constant of the process: under torch.compile (the class
    weights' logit sum, traced) it is called, not traced (the probe reads its result back)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    key = (device, dtype)
    ok = _F32_OUT.get(key)
    if ok is None and device.type != "cuda":
        return False
    if ok is None:
        ok = _F32_OUT[key] = _probe(device, dtype)
        if ok:
            logger.debug("cce_dist: %s GEMMs on %s write float32 directly (out_dtype=torch.float32)", dtype, device)
        else:
            logger.warning(
                "cce_dist: torch %s has no float32-output GEMM for %s on %s: the gradient GEMMs upcast their operands "
                "to float32 (the same values, ~10x slower); a newer torch avoids this",
                torch.__version__,
                dtype,
                device,
            )
    return ok


def mm_f32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b`` with a float32 ``out`` and float32 accumulation, in place (see the module docstring).
    Errors of the GEMM itself (out of memory, device faults) are never caught."""
    if a.dtype == torch.float32:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif a.is_cuda and f32_out_gemm(a.device, a.dtype):
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:
        out.addmm_(a.float(), b.float())
    else:
        torch.mm(a.float(), b.float(), out=out)


def matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as a new float32 tensor with float32 accumulation (see :func:`mm_f32`)."""
    if a.dtype != torch.float32 and a.is_cuda and f32_out_gemm(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def free_bytes(device: torch.device) -> int:
    """Bytes an allocation on the CUDA ``device`` can use without growing past the device: the driver's free memory
    plus what torch's caching allocator holds reserved but unused (a warmed-up training loop keeps most of its
    memory there, and the driver reports it as used)."""
    free = torch.cuda.mem_get_info(device)[0]
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(int(cached), 0)


def device_guard(device: torch.device) -> Any:
    """A context making ``device`` the current CUDA device (``torch.cuda.device``) when it is one, else a no-op:
    Triton launches on the current device, so a launch for tensors on ``cuda:1`` while ``cuda:0`` is current would
    run on the wrong device."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
