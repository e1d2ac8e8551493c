"""Triton kernels of cce_dist (installed as ``cce_dist.kernels``).

Implements the backend contract of :mod:`cce_dist.core.backend` for one vocab shard:

- :func:`row_stats` — per-row statistics ``float32 [N, 5]`` of the logits (forward);
- :func:`grads` — ``(d_hidden, d_weight, d_bias)`` in float32 from the global ``lse`` and the
  per-row coefficients (backward), with optional gradient filtering and a deterministic mode.

No autograd and no torch.distributed here. Triton is imported lazily, so ``available()`` can be
asked on machines without it. On CPU tensors the kernels only run under the Triton interpreter:
``TRITON_INTERPRET=1`` must be set before triton is first imported.

The kernels are compiled and tested (tests/test_aot_compile.py, the interpreter tests) with every
Triton in :data:`TRITON_RANGE`; :func:`unsupported` says why the installed one cannot be used.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

__all__ = [
    "TRITON_RANGE",
    "available",
    "grads",
    "row_stats",
    "unsupported",
]

#: The Triton releases ``(major, minor)`` the kernels are compiled and tested with, inclusive: 3.6
#: (pinned by torch 2.10 / 2.11) to 3.9. Outside it ``impl="auto"`` takes the torch path.
TRITON_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((3, 6), (3, 9))


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def unsupported() -> str | None:
    """Why the kernels cannot run with the installed Triton (None when they can): it does not
    import, or its version is outside :data:`TRITON_RANGE` (kernels compiled by an untested Triton
    may fail to compile, or compile to something slower, at the first call)."""
    try:
        import triton
    except Exception as e:  # noqa: BLE001 - any import failure means "no triton"
        return f"triton does not import ({type(e).__name__}: {e})"
    from .config import parse_version

    version = getattr(triton, "__version__", "unknown")
    lo, hi = TRITON_RANGE
    try:
        ok = lo <= parse_version(version) <= hi
    except ValueError:
        ok = False
    if not ok:
        return (
            f"Triton {version} is outside the range the cce_dist kernels are tested with "
            f"({lo[0]}.{lo[1]} to {hi[0]}.{hi[1]})"
        )
    return None


def available() -> bool:
    """True when a supported Triton (:func:`unsupported` is None) imports and either CUDA is
    available or TRITON_INTERPRET=1 is set."""
    if unsupported() is not None:
        return False
    if _interpret_env():
        return True
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# row_stats and grads are .forward.row_stats and .backward.grads themselves, imported on first use (so this package
# imports without triton): their signatures are those functions' own, nothing restates them.
# tests/test_signatures.py checks that each public keyword beyond the contract's is an option
# cce_dist.impl.backends.triton() declares.
if TYPE_CHECKING:  # pragma: no cover
    from .backward import grads
    from .forward import row_stats

_LAZY = {"row_stats": ".forward", "grads": ".backward"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups find it directly
    return value
