"""The autograd Functions of :func:`cce_dist.linear_distillation` (only the student gets gradients).

- :class:`DistillRows`: per-row loss ``float32 [N]``; backward recomputes each chunk of both heads
  from the saved global statistics (any upstream gradient; ``reduction="none"`` uses it).
- :class:`FusedDistill`: scalar (sum/mean) loss whose student gradients are formed during forward
  while the chunk's logits are held (the teacher's logits are computed once, not twice), held by
  :class:`cce_dist.engine.autograd.HeldGradients` as the cross-entropy's are.

Both run the implementation the driver resolved (``plan.backend.distill``, a
:class:`cce_dist.core.backend.DistillPass`), and save, refuse second-order gradients and finish the gradients with
the cross-entropy Functions' helpers. The teacher's
tensors arrive detached: they never receive a gradient.
"""

from __future__ import annotations

import torch

from ..core.backend import DistillPass
from ..core.options import DistillationOptions
from .autograd import GradientsFormedInForward, Plan, finish_grads, hold, needed_input_grads, save, saved_inputs
from .prepare import to_dtype


def _pass(plan: Plan) -> DistillPass:
    """The plan's distillation rows pass (the driver resolved a backend that has one)."""
    assert plan.backend.distill is not None
    return plan.backend.distill


def _heads(plan: Plan, opts: DistillationOptions, hs, ws, bs, ht, wt, bt, targets, valid):
    """The backend's ``Heads``: each head in its compute dtype (the hidden states are cast already)."""
    assert plan.teacher_dtype is not None  # the driver sets it for distillation
    return _pass(plan).Heads(
        hs,
        ws.to(plan.compute_dtype),
        to_dtype(bs, plan.compute_dtype),
        ht,
        wt.to(plan.teacher_dtype),
        to_dtype(bt, plan.teacher_dtype),
        targets,
        valid,
        plan.vocab_start,
        opts,
    )


def _gather(plan: Plan, student_hidden, teacher_hidden):
    """Both heads' hidden states in their compute dtypes, gathered over the group under sequence parallelism."""
    assert plan.teacher_dtype is not None
    comm = plan.comm
    return comm.gather_tokens(student_hidden.to(plan.compute_dtype)), comm.gather_tokens(
        teacher_hidden.to(plan.teacher_dtype)
    )


# DistillRows and FusedDistill take the same positional inputs (autograd.Function.apply has no keywords): the
# student's hidden, weight and bias first, as every Function here (cce_dist.engine.autograd.needed_input_grads reads
# them).
class DistillRows(torch.autograd.Function):
    """``(h_s [n, D_s], W_s [V_local, D_s], b_s, targets [N], valid [N], h_t [n, D_t], W_t, b_t)``
    ``-> loss float32 [N]``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, valid, t_hidden, t_weight, t_bias, plan: Plan, opts):
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            hs, ht = _gather(plan, hidden, t_hidden)
            heads = _heads(plan, opts, hs, weight, bias, ht, t_weight, t_bias, targets, valid)
            comm = plan.comm
            loss, stats, rows = _pass(plan).forward(heads, plan.chunk_tokens, comm.reduce_stats, comm.reduce_sum)[:3]
        save(ctx, plan, opts, hidden.dtype, hs, weight, bias, targets, valid, ht, t_weight, t_bias, stats, rows)
        return loss

    @staticmethod
    def backward(ctx, g):
        plan, opts, (hs, weight, bias, targets), valid, (ht, t_weight, t_bias, stats, rows) = saved_inputs(ctx)
        need = needed_input_grads(ctx, bias)
        with torch.autocast(device_type=hs.device.type, enabled=False):
            heads = _heads(plan, opts, hs, weight, bias, ht, t_weight, t_bias, targets, valid)
            dh, dw, db = _pass(plan).grads(
                heads, plan.chunk_tokens, stats, rows, g, need, **plan.backend_kwargs.get("grads", {})
            )
            return finish_grads(plan.comm, dh, dw, db, ctx.hidden_dtype, weight, bias) + (None,) * 7


class FusedDistill(GradientsFormedInForward):
    """Scalar loss (``reduction`` sum or mean) with the student's gradients formed in forward.

    Forward forms the gradients of the *sum* of the counted rows' losses (an upstream gradient of 1 per counted
    row, whatever the reduction: a logit gradient rounded to a float16 compute dtype at the mean's ``1 / n_valid``
    would sink into its subnormals); :class:`~cce_dist.engine.autograd.HeldGradients` holds them until backward applies
    the upstream scalar times the reduction's scale (``1 / n_valid``, formed on the device: the count is not read back
    to the host, which would stall it on every call). The graph supports a single backward (a second raises), and no
    ``create_graph=True`` (raises).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, valid, t_hidden, t_weight, t_bias, plan: Plan, opts):
        need = needed_input_grads(ctx, bias)
        comm = plan.comm
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            hs, ht = _gather(plan, hidden, t_hidden)
            heads = _heads(plan, opts, hs, weight, bias, ht, t_weight, t_bias, targets, valid)
            loss_rows, _, _, dh, dw, db = _pass(plan).forward(
                heads,
                plan.chunk_tokens,
                comm.reduce_stats,
                comm.reduce_sum,
                row_grad=1.0,
                need=need,
                **plan.backend_kwargs.get("grads", {}),
            )
            if dh is not None:
                dh = comm.reduce_hidden_grad(dh)
            count = valid.sum()
            scale = (1.0 / count.clamp(min=1).double()).float() if opts.reduction == "mean" else 1.0
            loss = loss_rows.sum() * scale
        hold(ctx, (dh, dw, db), (hidden, weight, bias), comm, valid, scale, count > 0, "this distillation loss")
        return loss
