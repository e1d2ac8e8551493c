"""The stable public path of the device runtime (``cce_dist.runtime``: the float32-output GEMM, free memory, the
device guard, the ``cce_dist`` logger), kept for code that imports it from here. The code lives in
:mod:`cce_dist.core.runtime`; this module only re-exports it (tests/test_layering.py)."""

from .core.runtime import device_guard, f32_out_gemm, free_bytes, logger, matmul_f32, mm_f32

__all__ = ["device_guard", "f32_out_gemm", "free_bytes", "logger", "matmul_f32", "mm_f32"]
