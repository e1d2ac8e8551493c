"""The autograd Functions: the only place that touches ``ctx``.

Each Function receives the caller's tensors (original dtypes, hidden possibly sequence-sharded),
a :class:`Plan` (implementation, dtypes, communicator) and the frozen options. It casts to the
compute dtype, asks the backend for row statistics, combines them over the group, and forms the
outputs with :mod:`cce_dist.core.formulas`. Backward recomputes logits from the saved lse.

- :class:`CrossEntropyRows`: per-row loss and lse (any upstream gradient; ``reduction="none"``,
  ``return_lse`` and the triton path use it).
- :class:`LogprobRows`: per-row logprob and entropy.
- :class:`FusedCrossEntropy`: scalar (sum/mean) loss whose gradients are formed during forward
  (torch implementation; 3 GEMMs instead of 4) and scaled by the upstream scalar in backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core import formulas
from ..core.backend import Backend
from ..core.class_weight import ClassWeights, gamma_weights, sum_column
from ..core.options import CrossEntropyOptions, LogprobOptions
from ..core.stats import SUM
from ..core.stats import lse as log_sum_exp
from ..tp.collectives import Comm
from .prepare import autocast_available, to_dtype


@dataclass(frozen=True)
class Plan:
    """Everything a Function needs besides tensors and options, resolved once per call by the driver
    (:func:`cce_dist.engine.driver.plan_call`)."""

    #: the implementation (:mod:`cce_dist.impl.backends`), or under torch.compile its custom ops
    #: (:func:`cce_dist.engine.compile.ops_backend`)
    backend: Backend
    compute_dtype: torch.dtype  # the (student's) head's
    vocab_start: int
    vocab_size: int  # global (all shards)
    comm: Comm
    #: ``{"row_stats": {...}, "grads": {...}}``: the backend's keyword options, built once
    #: (:func:`cce_dist.engine.prepare.backend_kwargs`) and never changed after
    backend_kwargs: Mapping[str, Mapping[str, Any]]
    chunk_tokens: int = 0  # tokens per chunk of the chunked schedules: identical on every rank
    teacher_dtype: torch.dtype | None = None  # distillation: the teacher head's compute dtype


def _no_autocast(device: torch.device):
    if not autocast_available(device.type):  # "meta" has no autocast
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def _forward_stats(
    plan: Plan, hidden, weight, bias, targets, softcap, temperature, cw: ClassWeights | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, stats)``: the caller's tensors cast to the compute dtype, ``hidden`` gathered over the group
    (``h``), and the row statistics reduced over the group (the row outputs' columns too where the backend forms
    them: ``need_argmax`` / ``need_sumsq``). ``cw``: class weights whose smoothing term puts the weighted logit sum
    in the SUM column (:mod:`cce_dist.core.class_weight`), before the exchange sums it."""
    h = plan.comm.gather_tokens(hidden.to(plan.compute_dtype))
    w, b = weight.to(plan.compute_dtype), to_dtype(bias, plan.compute_dtype)
    local = plan.backend.row_stats(
        h,
        w,
        b,
        targets,
        vocab_start=plan.vocab_start,
        softcap=softcap,
        temperature=temperature,
        **plan.backend_kwargs.get("row_stats", {}),
    )
    col = sum_column(cw, h, w, b, softcap)
    if col is not None:
        local[:, SUM] = col
    kw = plan.backend_kwargs.get("row_stats", {})
    return h, plan.comm.reduce_stats(local, extras=bool(kw.get("need_argmax") or kw.get("need_sumsq")))


#: raised by every backward here when asked for a differentiable gradient (create_graph=True)
SECOND_ORDER_ERROR = (
    "cce_dist: second-order gradients (a backward with create_graph=True, e.g. for a gradient penalty) are not "
    "supported: the gradients are formed by fused, non-differentiable chunk loops. Compute the term that needs "
    "them from the materialized loss, F.cross_entropy(F.linear(hidden, weight, bias), targets) (or log_softmax for "
    "logprobs), or differentiate without create_graph=True"
)


def refuse_second_order() -> None:
    """Raise :data:`SECOND_ORDER_ERROR` when the running backward builds a graph (``create_graph=True``).

    The autograd engine runs a backward with grad mode on exactly when ``create_graph=True``; the gradients
    returned here would then silently lack their second-order term (``@once_differentiable`` raises only if the
    upstream gradient itself requires grad, which a gradient penalty's does not)."""
    if torch.is_grad_enabled():
        raise RuntimeError(SECOND_ORDER_ERROR)


def needed_input_grads(ctx, bias) -> tuple[bool, bool, bool]:
    """Whether hidden, weight and bias (when there is one) need a gradient: the first three inputs of every
    Function here."""
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    return bool(need_h), bool(need_w), bool(need_b and bias is not None)


def _backward_grads(
    ctx,
    plan: Plan,
    saved,
    coef: torch.Tensor,
    lse: torch.Tensor,
    softcap,
    temperature,
    cw: ClassWeights | None = None,
):
    """``saved = (h, weight, bias, targets)``: read from ``ctx.saved_tensors`` once by the caller (non-reentrant
    checkpointing allows each saved tensor to be unpacked only once). ``cw``: class weights, whose smoothing term
    the implementation weighs per vocab row (``GAMMA * w_j``)."""
    h, weight, bias, targets = saved
    need_h, need_w, need_b = needed_input_grads(ctx, bias)
    with _no_autocast(h.device):
        w = weight.to(plan.compute_dtype)
        b = to_dtype(bias, plan.compute_dtype)
        dh, dw, db = plan.backend.grads(
            h,
            w,
            b,
            targets,
            lse,
            coef,
            vocab_start=plan.vocab_start,
            softcap=softcap,
            temperature=temperature,
            need_hidden=need_h,
            need_weight=need_w,
            need_bias=need_b,
            gamma_weights=gamma_weights(cw),
            **plan.backend_kwargs.get("grads", {}),
        )
        return finish_grads(plan.comm, dh, dw, db, ctx.hidden_dtype, weight, bias)


def finish_grads(comm: Comm, dh, dw, db, hidden_dtype: torch.dtype, weight, bias):
    """``(d_hidden, d_weight, d_bias)`` as returned to autograd: ``dh`` reduced over the group (the
    sequence-parallel reduce-scatter or the tensor-parallel all-reduce), ``dw`` / ``db`` divided by a data-parallel
    shard's factor, and each gradient (or ``None``) cast to its tensor's dtype."""
    if dh is not None:
        dh = comm.reduce_hidden_grad(dh).to(hidden_dtype)
    dw, db = comm.param_grad(dw), comm.param_grad(db)
    return (
        dh,
        None if dw is None else dw.to(weight.dtype),
        None if db is None else db.to(bias.dtype),
    )


def save(ctx, plan: Plan, opts, hidden_dtype: torch.dtype, *tensors: torch.Tensor | None) -> None:
    """Save ``(h, weight, bias, targets, valid, *row tensors)`` and the call's plan, options and hidden dtype."""
    ctx.save_for_backward(*tensors)
    ctx.plan, ctx.opts, ctx.hidden_dtype = plan, opts, hidden_dtype


def saved_inputs(ctx):
    """``(plan, opts, (h, weight, bias, targets), valid, (row tensors))`` as :func:`save` left them, after refusing
    a second-order backward. ``ctx.saved_tensors`` is read once (non-reentrant checkpointing unpacks each saved
    tensor only once)."""
    refuse_second_order()
    saved = ctx.saved_tensors
    return ctx.plan, ctx.opts, saved[:4], saved[4], saved[5:]


def cross_entropy_terms(
    plan: Plan, opts: CrossEntropyOptions, valid: torch.Tensor, cw: ClassWeights | None
) -> formulas.CrossEntropyTerms:
    """Cross-entropy's formulas for one call: its options, the global vocabulary, the counted rows, class weights."""
    return formulas.CrossEntropyTerms(
        valid,
        label_smoothing=opts.label_smoothing,
        z_loss=opts.z_loss,
        vocab_size=plan.vocab_size,
        class_weights=None if cw is None else cw.terms,
    )


class CrossEntropyRows(torch.autograd.Function):
    """``(hidden [n, D], weight [V_local, D], bias, targets [N]) -> (loss float32 [N], lse float32 [N], stats)``;
    ``stats`` (the global row statistics ``float32 [N, NUM_STATS]``, for :mod:`cce_dist.core.outputs`) is not
    differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, plan: Plan, opts: CrossEntropyOptions, cw: ClassWeights | None):
        with _no_autocast(hidden.device):
            h, stats = _forward_stats(plan, hidden, weight, bias, targets, opts.softcap, 1.0, cw)
            valid = targets != opts.ignore_index
            loss, lse = cross_entropy_terms(plan, opts, valid, cw).rows(stats)
            residual = formulas.lse_residual(stats)
        save(ctx, plan, opts, hidden.dtype, h, weight, bias, targets, valid, lse, residual)
        ctx.cw = cw
        ctx.mark_non_differentiable(stats)
        return loss, lse, stats

    @staticmethod
    def backward(ctx, g_loss, g_lse, _g_stats):
        plan, opts, saved, valid, (lse, residual) = saved_inputs(ctx)
        cw = ctx.cw
        coef = cross_entropy_terms(plan, opts, valid, cw).coef(lse, g_loss=g_loss, g_lse=g_lse, residual=residual)
        return _backward_grads(ctx, plan, saved, coef, lse, opts.softcap, 1.0, cw) + (None, None, None, None)


class LogprobRows(torch.autograd.Function):
    """``(hidden, weight, bias, targets) -> (logprob float32 [N], entropy float32 [N], stats)`` (``stats`` as
    :class:`CrossEntropyRows`')."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, plan: Plan, opts: LogprobOptions):
        with _no_autocast(hidden.device):
            h, stats = _forward_stats(plan, hidden, weight, bias, targets, opts.softcap, opts.temperature)
            valid = targets != opts.ignore_index
            lp, ent = formulas.logprob_rows(stats, valid)
        save(ctx, plan, opts, hidden.dtype, h, weight, bias, targets, valid, stats)
        ctx.mark_non_differentiable(stats)
        return lp, ent, stats

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_stats):
        plan, opts, saved, valid, (stats,) = saved_inputs(ctx)
        coef = formulas.logprob_coef(stats, valid, g_lp, g_ent if opts.return_entropy else None)
        return _backward_grads(ctx, plan, saved, coef, log_sum_exp(stats), opts.softcap, opts.temperature) + (
            None,
            None,
            None,
        )


class GradientsFormedInForward(torch.autograd.Function):
    """The backward of every Function whose gradients are formed in forward and held by :func:`hold`."""

    @staticmethod
    def backward(ctx, *upstream):
        refuse_second_order()
        return ctx.held.release(upstream[0]) + (None,) * ctx.n_other_inputs


def hold(ctx, grads, tensors, comm: Comm, valid: torch.Tensor, scale, any_valid, what: str) -> None:
    """Hold ``grads = (d_hidden, d_weight, d_bias)`` of the Function's first three inputs ``tensors`` on ``ctx``
    (:class:`HeldGradients`): ``scale`` and ``any_valid`` as there, the rows of ``d_hidden`` that count from
    ``valid bool [N]`` (this rank's under sequence parallelism), ``what`` names the loss in the one-backward error."""
    dh = grads[0]
    ctx.held = HeldGradients(
        grads,
        tensors,
        scale=scale,
        valid_rows=None if dh is None else comm.local_rows(valid),
        any_valid=any_valid,
        what=f"{what} formed its gradients in forward (grad_in_forward)",
    )
    ctx.n_other_inputs = len(ctx.needs_input_grad) - len(grads)


class FusedCrossEntropy(GradientsFormedInForward):
    """Scalar loss (``reduction`` sum or mean) with gradients formed in forward (torch impl).

    Forward forms the gradients for an upstream gradient of a power of two near 1 per valid row (``unit`` times the
    mean's ``1 / n_valid``), so a logit gradient rounded to a low-precision compute dtype keeps its bits instead of
    sinking into that dtype's subnormals at ``1 / n_valid``. :class:`HeldGradients` holds them until backward, which
    multiplies them in float32 by the upstream scalar divided by ``unit`` (a power of two for the scales GradScaler
    uses, so multiplying a bf16 value is exact) and rounds once to each tensor's dtype.

    The graph supports a single backward (a second raises).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, plan: Plan, opts: CrossEntropyOptions, cw: ClassWeights | None):
        need_h, need_w, need_b = needed_input_grads(ctx, bias)
        comm = plan.comm
        with _no_autocast(hidden.device):
            h = comm.gather_tokens(hidden.to(plan.compute_dtype))
            w, b = weight.to(plan.compute_dtype), to_dtype(bias, plan.compute_dtype)
            valid = targets != opts.ignore_index
            n_valid = int(valid.sum().item())
            scale = 1.0
            if opts.reduction == "mean":
                # torch's normalizer: the number of counted rows, or with class weights the sum of their weights
                total = max(n_valid, 1) if cw is None else float(cw.rows.sum().item())
                scale = 1.0 / total if total != 0 else 0.0  # the weights sum to 0: the mean is 0, its gradient too
            unit = 2.0 ** (1 - math.frexp(scale)[1])  # |scale| * unit in [1, 2); a power of two, so exact to undo
            terms = cross_entropy_terms(plan, opts, valid, cw)
            assert plan.backend.fused_cross_entropy is not None  # the driver chose this Function for it
            loss_rows, _, dh, dw, db = plan.backend.fused_cross_entropy(
                h,
                w,
                b,
                targets,
                terms,
                scale * unit,
                vocab_start=plan.vocab_start,
                softcap=opts.softcap,
                chunk_tokens_=plan.chunk_tokens,
                need_hidden=need_h,
                need_weight=need_w,
                need_bias=need_b,
                reduce_stats=comm.reduce_stats if comm.active else None,
                need_sum=bool(opts.label_smoothing) and cw is None,
                sum_column=sum_column(cw, h, w, b, opts.softcap),
                gamma_weights=gamma_weights(cw),
            )
            if dh is not None:
                dh = comm.reduce_hidden_grad(dh)
            loss = loss_rows.sum() * scale
        hold(ctx, (dh, dw, db), (hidden, weight, bias), comm, valid, 1.0 / unit, n_valid > 0, "this loss")
        return loss


class HeldGradients:
    """Gradients formed in forward, held until backward applies the upstream gradient: the one place that does so,
    for every loss whose gradients are formed in forward (:class:`FusedCrossEntropy`,
    :class:`cce_dist.engine.distill_autograd.FusedDistill`).

    The gradients arrive float32, formed for an upstream gradient of 1 per counted row times ``1 / scale``; backward
    multiplies them in float32 by the upstream value times ``scale`` (a Python number, or a 0-dim float32 tensor
    where forming it on the host would read the device) and rounds once to each tensor's dtype. Held as:

    - float16 / float32 tensors: float32. fp16's narrow exponent range would overflow or flush a gradient scaled by a
      loss scale (GradScaler's ``(loss * 2**k).backward()``), so the scale is applied before the rounding, never to
      an fp16 gradient or as an fp16 number.
    - bfloat16 tensors: bfloat16 (float32's exponent range; half the bytes), multiplied in float32.

    A gradient that the plain program gives as exactly 0 whatever the upstream value stays exactly 0 (selected, not
    multiplied: ``0 * inf`` is NaN): the hidden rows that do not count (``valid_rows``, this rank's rows of
    ``d_hidden``) and everything when no row counts (``any_valid``: a bool, or a 0-dim bool tensor on the device).
    Released once: a second backward raises, naming ``what`` and the remedy (``grad_in_forward=False``)."""

    def __init__(
        self,
        grads: tuple[torch.Tensor | None, ...],
        tensors: tuple[torch.Tensor | None, ...],
        *,
        scale: float | torch.Tensor,
        valid_rows: torch.Tensor | None,
        any_valid: bool | torch.Tensor,
        what: str,
    ) -> None:
        self.dtypes = [None if t is None else t.dtype for t in tensors]
        self.grads: list[torch.Tensor | None] | None = [
            None if g is None or dt is None else g.to(held_dtype(dt)) for g, dt in zip(grads, self.dtypes)
        ]
        self.scale, self.valid_rows, self.any_valid, self.what = scale, valid_rows, any_valid, what

    def release(self, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The gradients for the upstream gradient ``g`` (a scalar tensor), each in its tensor's dtype."""
        grads = self.grads
        if grads is None:
            raise RuntimeError(
                f"cce_dist: {self.what}, whose gradients can be used by one backward only; pass "
                "grad_in_forward=False to backward through the graph more than once"
            )
        self.grads = None
        factor = g.to(torch.float32) * self.scale  # float32: a loss scale of 2**16 is inf as an fp16 number
        if isinstance(self.any_valid, torch.Tensor):  # no row counts: 0 whatever g is (inf * 0 would be NaN)
            factor = torch.where(self.any_valid, factor, torch.zeros_like(factor))
        elif not self.any_valid:
            factor = torch.zeros_like(factor)
        out: list[torch.Tensor | None] = []
        for i, (t, dtype) in enumerate(zip(grads, self.dtypes)):
            if t is None or dtype is None:
                out.append(None)
                continue
            # float32 (ours, an accumulator): scaled in place; bfloat16: multiplied in float32; then rounded once
            scaled = t.mul_(factor) if t.dtype == torch.float32 else t.float() * factor
            if i == 0 and self.valid_rows is not None:  # d_hidden: a row that does not count stays exactly 0
                scaled = torch.where(self.valid_rows.unsqueeze(-1), scaled, torch.zeros_like(scaled))
            out.append(scaled.to(dtype))
        self.valid_rows = None
        return tuple(out)


def held_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :class:`HeldGradients` holds a gradient in from forward to backward: bfloat16 for bfloat16
    tensors, else float32 (float16: its exponent range; float32: its own; float64: as accumulated)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
