"""Triton kernels of cce_dist (installed as ``cce_dist.kernels``).

Implements the backend contract of :mod:`cce_dist.backend` for one vocab shard:

- :func:`row_stats` — per-row statistics ``float32 [N, 5]`` of the logits (forward);
- :func:`grads` — ``(d_hidden, d_weight, d_bias)`` in float32 from the global ``lse`` and the
  per-row coefficients (backward), with optional gradient filtering and a deterministic mode.

No autograd and no torch.distributed here. Triton is imported lazily, so ``available()`` can be
asked on machines without it. On CPU tensors the kernels only run under the Triton interpreter:
``TRITON_INTERPRET=1`` must be set before triton is first imported.
"""

from __future__ import annotations

import os

__all__ = ["available", "row_stats", "grads"]

# Capabilities (the cce_dist.backend.Backend protocol).
NAME = "triton"
FUSED_CHUNKING = False
SUPPORTS_FILTERING = True
DETERMINISTIC_OPTION = True  # the default backward uses float atomics
ROW_STATS_OPTIONS: frozenset[str] = frozenset({"need_entropy", "need_sum"})
GRADS_OPTIONS: frozenset[str] = frozenset()


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """True when triton imports and either CUDA is available or TRITON_INTERPRET=1 is set."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    if _interpret_env():
        return True
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# The signature mirrors cce_dist.backend.Backend.row_stats plus the options this backend declares, and the call below
# passes it on to .forward.row_stats (imported lazily, so this package imports without triton).
def row_stats(
    hidden, weight, bias, targets, *, vocab_start, softcap, temperature, need_entropy=True, need_sum=True, **kw
):
    """Per-row logit statistics ``float32 [N, NUM_STATS]``; see :func:`.forward.row_stats`
    (``need_entropy`` / ``need_sum``: compute those columns)."""
    from .forward import row_stats as _row_stats

    return _row_stats(
        hidden,
        weight,
        bias,
        targets,
        vocab_start=vocab_start,
        softcap=softcap,
        temperature=temperature,
        need_entropy=need_entropy,
        need_sum=need_sum,
        **kw,
    )


# The signature mirrors cce_dist.backend.Backend.grads, and the call below passes it on to .backward.grads.
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
    **kw,
):
    """``(d_hidden, d_weight, d_bias)`` in float32 (None where not needed); see
    :func:`.backward.grads`."""
    from .backward import grads as _grads

    return _grads(
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
        **kw,
    )
