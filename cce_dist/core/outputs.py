"""Row outputs: what trainers read of the head besides the loss, from the same row statistics.

``row_outputs=`` of :func:`cce_dist.linear_cross_entropy` and :func:`cce_dist.linear_logprobs` asks for any of
:data:`ROW_OUTPUTS`; the call then returns ``(its usual result, RowOutputs)``. Each is a function of the row
statistics the loss gathers anyway (:mod:`cce_dist.core.stats`: the argmax travels with the max, ``sum exp(2 (z - m))``
beside ``sum exp(z - m)``), so under tensor parallelism they come from the same statistics exchange (no collective
more), and nothing is formed when none is asked for. None is differentiable (as in TRL and Liger).

Of the distribution the call scores: ``z = softcap(hidden @ weight.T + bias)`` for the cross-entropy,
``z / temperature`` for the logprobs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from .stats import log_sum_sq_probs, mean_logit, predicted

RowOutput = Literal["predicted", "is_top1", "log_sum_sq_probs", "mean_logit"]
ROW_OUTPUTS: tuple[RowOutput, ...] = ("predicted", "is_top1", "log_sum_sq_probs", "mean_logit")

__all__ = ["ROW_OUTPUTS", "RowOutput", "RowOutputs", "check_row_outputs", "row_outputs"]


@dataclass(frozen=True)
class RowOutputs:
    """The requested row outputs, each of the targets' shape (None where not requested); not differentiable.

    predicted         int64: the predicted token, ``argmax_j z_j`` as a global id (the lowest id on a tie, as
                      ``torch.argmax``; where the row has a NaN logit, the lowest id of a NaN, as
                      ``torch.argmax``); -1 at ignored positions (Liger's ``return_predicted_tokens``)
    is_top1           bool: the target is the predicted token; False at ignored positions. Token accuracy is
                      ``is_top1.sum() / (targets != ignore_index).sum()``
    log_sum_sq_probs  float32: ``log sum_j p_j**2`` (TRL's WPO weight); 0 at ignored positions
    mean_logit        float32: ``mean_j z_j`` over the whole (global) vocabulary; 0 at ignored positions
    """

    predicted: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logit: torch.Tensor | None = None


def check_row_outputs(value: object) -> tuple[RowOutput, ...]:
    """``row_outputs=`` as a tuple of names in :data:`ROW_OUTPUTS` order (a single name, or any iterable of them;
    repeats dropped); raises naming the option."""
    names: Iterable[object]
    if isinstance(value, str):
        names = (value,)
    elif isinstance(value, Iterable):
        names = tuple(value)
    else:
        raise TypeError(f"row_outputs must be a name or a collection of names from {ROW_OUTPUTS}, got {value!r}")
    unknown = [n for n in names if n not in ROW_OUTPUTS]
    if unknown:
        raise ValueError(f"row_outputs: unknown output(s) {unknown}; choose from {ROW_OUTPUTS}")
    return tuple(n for n in ROW_OUTPUTS if n in names)


def stats_needed(names: tuple[RowOutput, ...]) -> dict[str, bool]:
    """The optional statistics columns the outputs read: ``need_argmax``, ``need_sumsq``, ``need_sum``."""
    return {
        "need_argmax": "predicted" in names or "is_top1" in names,
        "need_sumsq": "log_sum_sq_probs" in names,
        "need_sum": "mean_logit" in names,
    }


def row_outputs(
    stats: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    names: tuple[RowOutput, ...],
    *,
    vocab_size: int,
    shape: tuple[int, ...],
) -> RowOutputs:
    """The outputs ``names`` from the global statistics ``stats float32 [N, NUM_STATS]``, the target ids ``int64
    [N]`` and ``valid bool [N]``, reshaped to ``shape``."""
    out: dict[str, torch.Tensor] = {}
    if "predicted" in names or "is_top1" in names:
        ids = predicted(stats)  # never INT64_MIN from casting a non-finite ARGMAX
        ids = torch.where(valid, ids, torch.full_like(ids, -1))
        if "predicted" in names:
            out["predicted"] = ids.reshape(shape)
        if "is_top1" in names:
            out["is_top1"] = (valid & (ids == targets)).reshape(shape)
    zero = torch.zeros((), dtype=torch.float32, device=stats.device)
    if "log_sum_sq_probs" in names:
        out["log_sum_sq_probs"] = torch.where(valid, log_sum_sq_probs(stats), zero).reshape(shape)
    if "mean_logit" in names:
        out["mean_logit"] = torch.where(valid, mean_logit(stats, vocab_size), zero).reshape(shape)
    return RowOutputs(**out)
