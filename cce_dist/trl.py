"""TRL's trainers on cce_dist's head: one call, :func:`patch`.

TRL 1.16 gives its SFT, DPO, GRPO, KTO and RLOO trainers a fused LM head (``trl.trainer.utils.add_fused_lm_head``):
``model(..., labels=labels, fused_lm_head=True)`` runs the backbone and scores each next-token label with a chunked
kernel (``trl.kernels.ChunkedLogProbFunction``), returning per-token ``log_probs``, ``entropy``,
``log_sum_sq_probs``, ``mean_logits`` and ``is_top1``. :func:`patch` makes every such head, installed before or
after the call, score with :func:`cce_dist.linear_logprobs` instead (its entropy, and its ``row_outputs`` for the
other three): TRL's own code keeps reading the configuration (temperature, ``final_logit_softcapping``, the logit
scale), selecting and shifting the labels, masking and reducing, so its output contract is unchanged; only the
per-token scoring is cce_dist's.

- The logit scale TRL applies before the softcap (``logit_scale``, ``logits_scaling``, ...) is folded exactly into
  the softcap and the temperature: ``softcap(s * raw) / T = softcap'(raw) / T'`` with ``softcap' = softcap / s`` and
  ``T' = T / s``.
- The projection runs in TRL's compute dtype: the autocast dtype, else the hidden states' (the head is cast to it
  where they differ, as TRL's kernel does tile by tile).
- ``tensor_parallel=True``: a head whose weight is a ``Shard(0)`` DTensor on a 1-D tensor-parallel mesh is scored
  vocab-parallel (:mod:`cce_dist.tp.dtensor`), without the ``full_tensor()`` gather TRL does for FSDP. Every rank of
  that mesh must score the same tokens (tensor parallelism, not FSDP's data-parallel shards); the handshake raises
  on every rank where they differ.

TRL's DistillationTrainer scores its two heads with ``trl.kernels.ChunkedDivergenceFunction``: :func:`patch` puts
:class:`CceDivergence` (:func:`cce_dist.linear_distillation`) in its place, for forward KL, reverse KL and the
generalized JSD, each head's logit scale and softcap folded exactly. TRL still gathers a DTensor head there
(``tensor_parallel`` applies to the per-token head above); the student's entropy, a gradient-free metric, costs one
more student logit pass.

Not differentiable: ``log_sum_sq_probs``, ``mean_logits``, ``is_top1`` (as in TRL). :func:`unpatch` restores TRL.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .api import linear_logprobs
from .core.options import Divergence
from .core.outputs import RowOutput
from .distill import linear_distillation

__all__ = ["MIN_TRL_VERSION", "CceDivergence", "CceLogProbs", "is_patched", "patch", "unpatch"]

MIN_TRL_VERSION = (1, 16)

#: TRL's per-token field -> cce_dist's row output
_ROW_OUTPUTS: dict[str, RowOutput] = {
    "log_sum_sq_probs": "log_sum_sq_probs",
    "mean_logits": "mean_logit",
    "is_top1": "is_top1",
}

_SAVED: dict[str, Any] = {}
#: the name under which trl.trainer.utils holds the per-token kernel its fused head calls
_KERNEL = "_ChunkedLogProbFunction"
#: the name under which trl.trainer.distillation_trainer holds its two-head divergence kernel
_DIVERGENCE = "ChunkedDivergenceFunction"


def _trl_utils():
    try:
        import trl
        import trl.trainer.utils as utils
    except ImportError as e:  # pragma: no cover - the message is the test
        raise ImportError(f"cce_dist.trl needs TRL >= 1.16: pip install 'cce_dist[trl]' ({e})") from e
    version = tuple(int(p) for p in trl.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRL_VERSION or not hasattr(utils, _KERNEL):
        raise ImportError(
            f"cce_dist.trl needs TRL >= {'.'.join(map(str, MIN_TRL_VERSION))} (its fused LM head); found "
            f"{trl.__version__}"
        )
    return utils


class _NeverGathered:
    """Stands for ``DTensor`` in TRL's fused head under ``tensor_parallel=True``: no weight is an instance, so TRL
    hands the vocab-sharded DTensor to cce_dist instead of gathering it."""


class CceLogProbs:
    """cce_dist in the place of ``trl.kernels.ChunkedLogProbFunction``: ``apply`` takes its arguments and returns its
    five per-token outputs (None where not in ``outputs``)."""

    @staticmethod
    def apply(
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = ("log_probs",),
    ):
        """``hidden [N, H]``, ``weight [V, H]`` (or a vocab-sharded DTensor), ``bias [V]`` or None, ``targets [N]``
        ids -> ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each ``[N]`` or None.
        ``chunk_size`` (TRL's vocab tile) is not used: cce_dist sizes its own."""
        del chunk_size
        scale = float(logit_scale)
        if not scale > 0:
            raise ValueError(f"cce_dist.trl: the model's logit scale must be > 0 to fold it into T, got {logit_scale}")
        softcap = None if not final_logit_softcapping else float(final_logit_softcapping) / scale
        weight, bias = _in_compute_dtype(hidden, weight, bias)  # TRL's kernel projects in the hidden states' dtype
        rows: tuple[RowOutput, ...] = tuple(_ROW_OUTPUTS[name] for name in _ROW_OUTPUTS if name in outputs)
        out = linear_logprobs(
            hidden,
            weight,
            targets,
            bias=bias,
            softcap=softcap,
            temperature=float(temperature) / scale,
            return_entropy="entropy" in outputs,
            row_outputs=rows,
        )
        first, extra = out if rows else (out, None)
        logp, entropy = first if "entropy" in outputs else (first, None)
        fields = {name: None if extra is None else getattr(extra, row) for name, row in _ROW_OUTPUTS.items()}
        return logp, entropy, fields["log_sum_sq_probs"], fields["mean_logits"], fields["is_top1"]


class CceDivergence:
    """cce_dist in the place of ``trl.kernels.ChunkedDivergenceFunction`` (the DistillationTrainer's head): ``apply``
    takes its arguments and returns its per-token ``(divergence, student entropy)``, from
    :func:`cce_dist.linear_distillation` (``beta`` 0: forward KL, 1: reverse KL, else the generalized JSD with TRL's
    mixture ``(1 - beta) p_s + beta p_t``, which is cce_dist's; no ``T**2`` factor, as in TRL) and, for the
    gradient-free entropy, :func:`cce_dist.linear_logprobs`.

    Each head's logit scale ``s`` is folded exactly: the shared temperature becomes ``T / s_student``, each softcap
    ``softcap / s_student``, and the teacher's hidden states and bias (frozen; no weight copy) are multiplied by
    ``s_teacher / s_student``."""

    @staticmethod
    def apply(
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        student_bias: torch.Tensor | None,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        teacher_bias: torch.Tensor | None,
        beta: float,
        temperature: float = 1.0,
        student_logit_scale: float = 1.0,
        student_final_logit_softcapping: float | None = None,
        teacher_logit_scale: float = 1.0,
        teacher_final_logit_softcapping: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``student_hidden [N, H_s]``, ``student_weight [V, H_s]``, ``teacher_hidden [N, H_t]``, ``teacher_weight
        [V, H_t]`` (biases ``[V]`` or None) -> ``(divergence float32 [N], entropy float32 [N])``; only the divergence
        is differentiable, w.r.t. the student's tensors."""
        s_s, s_t = float(student_logit_scale), float(teacher_logit_scale)
        if not (s_s > 0 and s_t > 0):
            raise ValueError(
                f"cce_dist.trl: the models' logit scales must be > 0 to fold them into T, got {s_s} and {s_t}"
            )
        caps = tuple(
            None if not cap else float(cap) / s_s
            for cap in (student_final_logit_softcapping, teacher_final_logit_softcapping)
        )
        t_eff = float(temperature) / s_s
        student_weight, student_bias = _in_compute_dtype(student_hidden, student_weight, student_bias)
        teacher_weight, teacher_bias = _in_compute_dtype(teacher_hidden, teacher_weight, teacher_bias)
        if s_t != s_s:  # the teacher's raw logits times s_t / s_s, through its (small) hidden states and bias
            r = s_t / s_s
            teacher_hidden = teacher_hidden * r
            teacher_bias = None if teacher_bias is None else teacher_bias * r
        divergence: Divergence = "kl" if beta == 0.0 else "reverse_kl" if beta == 1.0 else "jsd"
        loss = linear_distillation(
            student_hidden,
            student_weight,
            teacher_hidden.detach(),
            teacher_weight.detach(),
            divergence=divergence,
            beta=beta if divergence == "jsd" else 0.5,
            temperature=t_eff,
            scale_by_temperature_squared=False,
            reduction="none",
            student_bias=student_bias,
            teacher_bias=None if teacher_bias is None else teacher_bias.detach(),
            softcap=caps,
        )
        with torch.no_grad():
            ids = torch.zeros(student_hidden.shape[0], dtype=torch.int64, device=student_hidden.device)
            _, entropy = linear_logprobs(
                student_hidden,
                student_weight,
                ids,
                bias=student_bias,
                softcap=caps[0],
                temperature=t_eff,
                return_entropy=True,
            )
        return loss, entropy


def _in_compute_dtype(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The head in TRL's compute dtype for these hidden states: the autocast dtype, else theirs."""
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    if weight.dtype != dtype:
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return weight, bias


def patch(*, tensor_parallel: bool = False) -> None:
    """Make TRL's fused LM head score with cce_dist, for every model TRL gave one or will give one (see the module
    docstring). ``tensor_parallel``: score a ``Shard(0)`` DTensor head vocab-parallel instead of gathering it.
    Calling it again replaces the setting. Raises ImportError without TRL >= 1.16."""
    utils = _trl_utils()
    import trl.trainer.distillation_trainer as distillation

    if not _SAVED:
        _SAVED.update(
            kernel=getattr(utils, _KERNEL),
            dtensor=getattr(utils, "DTensor"),  # noqa: B009
            divergence=getattr(distillation, _DIVERGENCE),
        )
    setattr(utils, _KERNEL, CceLogProbs)
    setattr(utils, "DTensor", _NeverGathered if tensor_parallel else _SAVED["dtensor"])  # noqa: B010
    setattr(distillation, _DIVERGENCE, CceDivergence)


def unpatch() -> None:
    """Restore TRL's own fused head kernels (and its DTensor gather)."""
    if not _SAVED:
        raise ValueError("cce_dist.trl is not patched")
    utils = sys.modules["trl.trainer.utils"]
    setattr(utils, _KERNEL, _SAVED["kernel"])
    setattr(utils, "DTensor", _SAVED["dtensor"])  # noqa: B010
    setattr(sys.modules["trl.trainer.distillation_trainer"], _DIVERGENCE, _SAVED["divergence"])
    _SAVED.clear()


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return bool(_SAVED)
