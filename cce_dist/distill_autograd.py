"""The autograd Functions of :func:`cce_dist.linear_distillation` (only the student gets gradients).

- :class:`DistillRows`: per-row loss ``float32 [N]``; backward recomputes each chunk of both heads
  from the saved global statistics (any upstream gradient; ``reduction="none"`` uses it).
- :class:`FusedDistill`: scalar (sum/mean) loss whose student gradients are formed during forward
  while the chunk's logits are held (the teacher's logits are computed once, not twice).

The teacher's tensors arrive detached: they never receive a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import distill_torch as DT
from . import distill_triton as DTR
from .autograd import finish_grads
from .options import DistillationOptions
from .parallel import Comm


@dataclass(frozen=True)
class DistillPlan:
    """What the Functions need besides tensors and options, resolved once per call."""

    student_dtype: torch.dtype
    teacher_dtype: torch.dtype
    vocab_start: int
    comm: Comm
    step: int  # tokens per chunk, identical on every rank of a group
    impl: str = "torch"  # "torch" (cce_dist.distill_torch) or "triton" (cce_dist.distill_triton)

    @property
    def module(self):
        """The implementation: both modules have ``Heads``, ``forward`` and ``grads`` with one contract."""
        return DTR if self.impl == "triton" else DT


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _heads(plan: DistillPlan, opts, hs, ws, bs, ht, wt, bt, targets, valid) -> DT.Heads:
    return plan.module.Heads(
        hs,
        ws.to(plan.student_dtype),
        _cast(bs, plan.student_dtype),
        ht,
        wt.to(plan.teacher_dtype),
        _cast(bt, plan.teacher_dtype),
        targets,
        valid,
        plan.vocab_start,
        opts,
    )


def _gather(plan: DistillPlan, student_hidden, teacher_hidden):
    comm = plan.comm
    hs = comm.gather_tokens(student_hidden.to(plan.student_dtype))
    ht = comm.gather_tokens(teacher_hidden.to(plan.teacher_dtype))
    return hs, ht


# DistillRows and FusedDistill take the same positional inputs (autograd.Function.apply has no keywords), so their
# forward signatures repeat the one list.
class DistillRows(torch.autograd.Function):
    """``(h_s [n, D_s], W_s [V_local, D_s], b_s, h_t [n, D_t], W_t, b_t, targets [N], valid [N])``
    ``-> loss float32 [N]``."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        t_hidden,
        t_weight,
        t_bias,
        targets,
        valid,
        plan: DistillPlan,
        opts: DistillationOptions,
    ):
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            hs, ht = _gather(plan, hidden, t_hidden)
            heads = _heads(plan, opts, hs, weight, bias, ht, t_weight, t_bias, targets, valid)
            loss, stats, rows = plan.module.forward(heads, plan.step, plan.comm.reduce_stats, plan.comm.reduce_sum)[:3]
        ctx.save_for_backward(hs, weight, bias, ht, t_weight, t_bias, targets, valid, stats, rows)
        ctx.plan, ctx.opts, ctx.hidden_dtype = plan, opts, hidden.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        plan = ctx.plan
        hs, weight, bias, ht, t_weight, t_bias, targets, valid, stats, rows = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need = (need_h, need_w, need_b and bias is not None)
        with torch.autocast(device_type=hs.device.type, enabled=False):
            heads = _heads(plan, ctx.opts, hs, weight, bias, ht, t_weight, t_bias, targets, valid)
            dh, dw, db = plan.module.grads(heads, plan.step, stats, rows, g, need)
            return finish_grads(plan.comm, dh, dw, db, ctx.hidden_dtype, weight, bias) + (None,) * 7


class FusedDistill(torch.autograd.Function):
    """Scalar loss (``reduction`` sum or mean) with the student's gradients formed in forward.

    Forward holds the gradients (in their final dtypes) until backward multiplies them by the
    upstream scalar in place, so the graph supports a single backward (a second raises).
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        t_hidden,
        t_weight,
        t_bias,
        targets,
        valid,
        plan: DistillPlan,
        opts: DistillationOptions,
    ):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need = (need_h, need_w, need_b and bias is not None)
        comm = plan.comm
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            hs, ht = _gather(plan, hidden, t_hidden)
            heads = _heads(plan, opts, hs, weight, bias, ht, t_weight, t_bias, targets, valid)
            scale: float | torch.Tensor = 1.0
            if opts.reduction == "mean":  # 1 / n_valid on the device (from float64, as the Python number was): the
                # count is not read back to the host, which would stall it on every call
                scale = (1.0 / valid.sum().clamp(min=1).double()).float()
            loss_rows, _, _, dh, dw, db = plan.module.forward(
                heads, plan.step, comm.reduce_stats, comm.reduce_sum, row_grad=scale, need=need
            )
            if dh is not None:
                dh = comm.reduce_hidden_grad(dh).to(hidden.dtype)
            loss = loss_rows.sum() * scale
        ctx.grads = [dh, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype)]
        return loss

    @staticmethod
    def backward(ctx, g):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "cce_dist: this distillation loss formed its gradients in forward (grad_in_forward), so it can be "
                "used by one backward only; pass grad_in_forward=False to backward through it more than once"
            )
        ctx.grads = None
        for t in grads:  # also for g == 1 (exact): asking whether it is 1 would read it back to the host
            if t is not None:
                t.mul_(g.to(t.dtype))
        return tuple(grads) + (None,) * 7
