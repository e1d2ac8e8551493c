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

- FSDP2 with a head that :func:`cce_dist.fsdp.shard_lm_head` distributed over the data-parallel mesh (whatever
  ``tensor_parallel`` is): TRL does not gather it; each rank's tokens are scored on the group's vocab shards
  (``shard=cce_dist.fsdp.head_shard(head)``, docs/fsdp.md), so no ``V x D`` tensor moves. Any other DTensor head is
  gathered by TRL as before (unless ``tensor_parallel=True``).

TRL's DistillationTrainer scores its two heads with ``trl.kernels.ChunkedDivergenceFunction``: :func:`patch` puts
:class:`CceDivergence` (:func:`cce_dist.linear_distillation`) in its place, for forward KL, reverse KL and the
generalized JSD, each head's logit scale and softcap folded exactly. TRL still gathers a DTensor head there
(``tensor_parallel`` applies to the per-token head above), except heads sharded by
:func:`cce_dist.fsdp.shard_lm_head`: the student's and the teacher's must then both be sharded so (the same rows on
each rank), and are scored in place (TRL's ``_chunked_divergence_loss`` is wrapped to hand them over ungathered). The
student's entropy, a gradient-free metric, costs one more student logit pass.

Not differentiable: ``log_sum_sq_probs``, ``mean_logits``, ``is_top1`` (as in TRL). :func:`unpatch` restores TRL.
"""

from __future__ import annotations

import contextvars
import sys
from typing import Any

import torch

from .api import linear_logprobs
from .core.options import Divergence
from .core.outputs import RowOutput
from .core.shard import VocabShard
from .distill import linear_distillation
from .fsdp import head_shard
from .tp.dtensor import DATA_PARALLEL_MARK

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
#: the DistillationTrainer's function around that kernel (it gathers DTensor heads before calling it)
_DIVERGENCE_LOSS = "_chunked_divergence_loss"
#: the data-parallel shard of the heads :func:`_divergence_loss` handed to TRL's divergence loss as local rows
_DATA_PARALLEL_HEADS: contextvars.ContextVar[VocabShard | None] = contextvars.ContextVar(
    "cce_dist_trl_data_parallel_heads", default=None
)


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


def _is_unmarked_dtensor(obj: Any) -> bool:
    """A DTensor that :func:`cce_dist.fsdp.shard_lm_head` did not mark as data-parallel."""
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor) and not hasattr(obj, DATA_PARALLEL_MARK)


class _GatheredUnlessDataParallelMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return _is_unmarked_dtensor(obj)


class _GatheredUnlessDataParallel(metaclass=_GatheredUnlessDataParallelMeta):
    """Stands for ``DTensor`` in TRL's fused head by default: every DTensor is an instance (TRL gathers it with
    ``full_tensor()``) except a head :func:`cce_dist.fsdp.shard_lm_head` sharded, which cce_dist scores in place."""


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
        shard = head_shard(weight)  # before the cast, which drops shard_lm_head's mark (None for any other head)
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
            shard=shard,
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
    ``s_teacher / s_student``.

    Heads that :func:`cce_dist.fsdp.shard_lm_head` sharded (FSDP2's data-parallel mesh) are scored in place, each
    rank's own tokens (``shard=cce_dist.fsdp.head_shard(student_weight)``): the student's and the teacher's must both
    be sharded so, with the same rows on every rank (ValueError otherwise)."""

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
        shard = _heads_shard(student_weight, teacher_weight)
        if shard is not None:  # both heads' local rows (the gradient reaches the student's DTensor through to_local)
            student_weight, student_bias, teacher_weight, teacher_bias = (
                _local(t) for t in (student_weight, student_bias, teacher_weight, teacher_bias)
            )
        else:
            shard = _handed_over_shard(student_weight, teacher_weight)
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
            shard=shard,
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
                shard=shard,
            )
        return loss, entropy


def _local(t: Any) -> Any:
    """The local tensor of a DTensor (None and plain tensors unchanged)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _heads_shard(student_weight: Any, teacher_weight: Any) -> VocabShard | None:
    """The data-parallel shard of a student and a teacher head both sharded by :func:`cce_dist.fsdp.shard_lm_head`
    with the same rows on this rank (the student's shard, which describes both), None when neither is; ValueError
    naming the head that is not (or not alike)."""
    student, teacher = head_shard(student_weight), head_shard(teacher_weight)
    if student is None and teacher is None:
        return None
    if student is None or teacher is None:
        sharded, other = ("student", "teacher") if teacher is None else ("teacher", "student")
        raise ValueError(
            f"cce_dist.trl: the {sharded}'s lm_head is sharded by cce_dist.fsdp.shard_lm_head but the {other}'s "
            f"({other}_weight: {type(student_weight if student is None else teacher_weight).__name__}) is not: "
            f"distillation scores both heads on the same vocab rows, so call cce_dist.fsdp.shard_lm_head on the "
            f"{other} too (on the same mesh), or on neither"
        )
    import torch.distributed as dist

    if (student.start, student.stop) != (teacher.start, teacher.stop) or dist.get_process_group_ranks(
        student.group
    ) != dist.get_process_group_ranks(teacher.group):
        raise ValueError(
            f"cce_dist.trl: the student's and the teacher's lm_head are sharded differently (this rank holds rows "
            f"[{student.start}, {student.stop}) of student_weight and [{teacher.start}, {teacher.stop}) of "
            "teacher_weight, or other meshes): shard both with cce_dist.fsdp.shard_lm_head on the same mesh, with "
            "the same vocabulary size"
        )
    return student


def _handed_over_shard(student_weight: torch.Tensor, teacher_weight: torch.Tensor) -> VocabShard | None:
    """The shard :func:`_divergence_loss` set for these local head rows (None outside it); ValueError if the rows
    TRL passed on are not the local rows it handed over."""
    shard = _DATA_PARALLEL_HEADS.get()
    if shard is None:
        return None
    rows = shard.stop - shard.start
    for name, w in (("student_weight", student_weight), ("teacher_weight", teacher_weight)):
        if w.dim() != 2 or w.shape[0] != rows:
            raise ValueError(
                f"cce_dist.trl: {name} has shape {tuple(w.shape)}, not this rank's {rows} rows of the head sharded by "
                "cce_dist.fsdp.shard_lm_head that cce_dist handed to TRL's divergence loss (a TRL version that "
                "changes the heads before its kernel?)"
            )
    return shard


def _divergence_loss(
    student_hidden_states: torch.Tensor,
    teacher_hidden_states: torch.Tensor,
    student_lm_head_weight: torch.Tensor,
    teacher_lm_head_weight: torch.Tensor,
    *args: Any,
    **kwargs: Any,
):
    """TRL's ``_chunked_divergence_loss`` (saved by :func:`patch`), which gathers DTensor heads with
    ``full_tensor()``: heads sharded by :func:`cce_dist.fsdp.shard_lm_head` are handed to it as their local rows
    instead (and their biases), with their data-parallel shard set for :class:`CceDivergence`; other heads unchanged."""
    original = _SAVED["divergence_loss"]
    shard = _heads_shard(student_lm_head_weight, teacher_lm_head_weight)
    if shard is None:
        return original(
            student_hidden_states,
            teacher_hidden_states,
            student_lm_head_weight,
            teacher_lm_head_weight,
            *args,
            **kwargs,
        )
    for name in ("student_lm_head_bias", "teacher_lm_head_bias"):
        if name in kwargs:
            kwargs[name] = _local(kwargs[name])
    token = _DATA_PARALLEL_HEADS.set(shard)
    try:
        return original(
            student_hidden_states,
            teacher_hidden_states,
            _local(student_lm_head_weight),
            _local(teacher_lm_head_weight),
            *(_local(a) for a in args),
            **kwargs,
        )
    finally:
        _DATA_PARALLEL_HEADS.reset(token)


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
    docstring). ``tensor_parallel``: score a ``Shard(0)`` DTensor head vocab-parallel instead of gathering it. A head
    sharded by :func:`cce_dist.fsdp.shard_lm_head` is never gathered, whatever ``tensor_parallel`` is (data-parallel:
    each rank's own tokens). Calling it again replaces the setting. Raises ImportError without TRL >= 1.16."""
    utils = _trl_utils()
    import trl.trainer.distillation_trainer as distillation

    if not _SAVED:
        _SAVED.update(
            kernel=getattr(utils, _KERNEL),
            dtensor=getattr(utils, "DTensor"),  # noqa: B009
            divergence=getattr(distillation, _DIVERGENCE),
            divergence_loss=getattr(distillation, _DIVERGENCE_LOSS),
        )
    setattr(utils, _KERNEL, CceLogProbs)
    setattr(utils, "DTensor", _NeverGathered if tensor_parallel else _GatheredUnlessDataParallel)  # noqa: B010
    setattr(distillation, _DIVERGENCE, CceDivergence)
    setattr(distillation, _DIVERGENCE_LOSS, _divergence_loss)


def unpatch() -> None:
    """Restore TRL's own fused head kernels (and its DTensor gather)."""
    if not _SAVED:
        raise ValueError("cce_dist.trl is not patched")
    utils = sys.modules["trl.trainer.utils"]
    setattr(utils, _KERNEL, _SAVED["kernel"])
    setattr(utils, "DTensor", _SAVED["dtensor"])  # noqa: B010
    distillation = sys.modules["trl.trainer.distillation_trainer"]
    setattr(distillation, _DIVERGENCE, _SAVED["divergence"])
    setattr(distillation, _DIVERGENCE_LOSS, _SAVED["divergence_loss"])
    _SAVED.clear()


def is_patched() -> bool:
    """Whether :func:`patch` is in effect."""
    return bool(_SAVED)
