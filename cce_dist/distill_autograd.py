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
from .autograd import finish_grads, refuse_second_order
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


def _held_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype :class:`FusedDistill` holds a gradient in from forward to backward: bfloat16 for bfloat16
    tensors, else float32 (float16: its exponent range; float32: its own; float64: as accumulated)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


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
        refuse_second_order()  # create_graph=True: the recomputing chunk loop is not differentiable
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

    Forward forms the gradients of the *sum* of the counted rows' losses (an upstream gradient of 1 per
    counted row, whatever the reduction: a logit gradient rounded to a float16 compute dtype at the mean's
    ``1 / n_valid`` would sink into its subnormals) and holds them (``ctx.grads``) until backward, which
    multiplies them in float32 by the upstream scalar times the reduction's scale (``1 / n_valid`` on the
    device for ``mean``) and rounds once to each tensor's dtype, as :class:`cce_dist.autograd.FusedCrossEntropy`:

    - float16 / float32 tensors: held as float32 (fp16's range would overflow under a loss scale of 2**16
      or flush the small entries; the scale is never applied to an fp16 number);
    - bfloat16 tensors: held in bfloat16 (float32's exponent range; half the bytes), scaled in float32.

    An entry that is exactly 0 at unit upstream gradient (an ignored row's hidden gradient; everything when no
    row counts) stays exactly 0 whatever the upstream value (selected, not multiplied: ``0 * inf`` is NaN),
    as the materialized program's ``torch.where`` over the ignored rows gives. The graph supports a single
    backward (a second raises), and no ``create_graph=True`` (raises).
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
                heads, plan.step, comm.reduce_stats, comm.reduce_sum, row_grad=1.0, need=need
            )
            if dh is not None:
                dh = comm.reduce_hidden_grad(dh)
            loss = loss_rows.sum() * scale
        ctx.grad_dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.grads = [None if t is None else t.to(_held_dtype(dt)) for t, dt in zip((dh, dw, db), ctx.grad_dtypes)]
        ctx.scale = scale
        return loss

    @staticmethod
    def backward(ctx, g):
        refuse_second_order()
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "cce_dist: this distillation loss formed its gradients in forward (grad_in_forward), so it can be "
                "used by one backward only; pass grad_in_forward=False to backward through it more than once"
            )
        ctx.grads = None
        # float32 (a loss scale of 2**16 is inf as an fp16 number); also for g == 1: asking would read it back
        factor = g.to(torch.float32) * ctx.scale
        out = []
        for t, dtype in zip(grads, ctx.grad_dtypes):
            if t is None:
                out.append(None)
                continue
            zero = t == 0  # before scaling: 0 * inf (loss / 0 with no counted row) must stay 0, not NaN
            t = t.mul_(factor) if t.dtype == torch.float32 else t.float().mul_(factor)
            out.append(t.masked_fill_(zero, 0.0).to(dtype))
        return tuple(out) + (None,) * 7
