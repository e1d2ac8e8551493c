"""The stable public path of the options (``cce_dist.options``), kept for code that imports them from here. The code
lives in :mod:`cce_dist.core.options`; this module only re-exports it (tests/test_layering.py)."""

from .core.options import (
    DEFAULT_CHUNK_SIZE,
    DIVERGENCES,
    HANDSHAKE_EXCLUDED,
    IMPLS,
    MIN_CHUNK_TOKENS,
    REDUCTIONS,
    CommonOptions,
    CrossEntropyOptions,
    DistillationOptions,
    Divergence,
    FilterEps,
    Impl,
    LogprobOptions,
    LossOptions,
    Reduction,
    coerce_numbers,
    handshake_options,
    real_scalar,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DIVERGENCES",
    "HANDSHAKE_EXCLUDED",
    "IMPLS",
    "MIN_CHUNK_TOKENS",
    "REDUCTIONS",
    "CommonOptions",
    "CrossEntropyOptions",
    "DistillationOptions",
    "Divergence",
    "FilterEps",
    "Impl",
    "LogprobOptions",
    "LossOptions",
    "Reduction",
    "coerce_numbers",
    "handshake_options",
    "real_scalar",
]
