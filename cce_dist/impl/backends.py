"""The implementations as :class:`~cce_dist.core.backend.Backend` values: :data:`TORCH` and :func:`triton`.

Each declares its capabilities once, here, beside the primitives it is made of, so the engine asks a backend what it
can do (``backend.fused_cross_entropy is None``, ``backend.supports_filtering``), never which one it is. The Triton
backend is built on first use: building it imports :mod:`cce_dist.kernels` (not triton itself, which its
``row_stats`` / ``grads`` import when first called).
"""

from __future__ import annotations

from ..core.backend import Backend, DistillPass
from . import torch_cross_entropy, torch_distill

__all__ = ["TORCH", "by_name", "triton"]

#: The torch implementation: exact (``filter_eps`` is accepted and ignored) and always deterministic, with the fused
#: scalar-loss schedule (3 GEMMs instead of 4) and torch distillation.
TORCH = Backend(
    name="torch",
    row_stats=torch_cross_entropy.row_stats,
    grads=torch_cross_entropy.grads,
    fused_cross_entropy=torch_cross_entropy.fused_cross_entropy,
    distill=DistillPass(
        Heads=torch_distill.Heads,
        forward=torch_distill.forward,
        grads=torch_distill.grads,
        grads_options=frozenset(),
    ),
    supports_filtering=False,
    deterministic_option=False,
    row_stats_options=frozenset({"chunk_size", "need_entropy", "need_sum", "need_argmax", "need_sumsq"}),
    grads_options=frozenset({"chunk_size"}),
)


#: :func:`triton`'s backend once built. A plain memo, not ``functools.cache``: under torch.compile the driver reaches
#: :func:`triton` through :func:`by_name`, and Dynamo warns of "silent incorrectness" at every cache-wrapped function
#: it traces (tests/test_compile_regressions.py); the resolution before tracing has built it by then.
_TRITON: list[Backend] = []


def triton() -> Backend:
    """The Triton implementation (:mod:`cce_dist.kernels`): filtering, float atomics unless ``deterministic``, no
    fused cross-entropy schedule (its backward kernels need the global statistics first), Triton distillation."""
    if not _TRITON:
        _TRITON.append(_build_triton())
    return _TRITON[0]


def _build_triton() -> Backend:
    from .. import kernels
    from . import triton_distill

    return Backend(
        name="triton",
        row_stats=kernels.row_stats,
        grads=kernels.grads,
        fused_cross_entropy=None,
        distill=DistillPass(
            Heads=triton_distill.Heads,
            forward=triton_distill.forward,
            grads=triton_distill.grads,
            grads_options=frozenset({"deterministic"}),
        ),
        supports_filtering=True,
        deterministic_option=True,
        row_stats_options=frozenset({"need_entropy", "need_sum", "need_argmax", "need_sumsq"}),
        grads_options=frozenset(),
    )


def by_name(name: str) -> Backend:
    """The backend whose ``name`` is ``name`` ("torch" or "triton")."""
    if name == TORCH.name:
        return TORCH
    if name == "triton":
        return triton()
    raise ValueError(f"unknown implementation {name!r}: 'torch' or 'triton'")
