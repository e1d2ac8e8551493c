"""Public entry point of knowledge distillation from two heads: validation, handshake, dispatch.

Shapes: ``student_hidden [..., D_s]``, ``student_weight [V_local, D_s]``, ``teacher_hidden
[..., D_t]``, ``teacher_weight [V_local, D_t]`` (the same vocab rows: one shard describes both),
``targets [...]`` (optional integer global ids). Under ``shard.sequence_parallel`` both hidden
tensors hold this rank's slice of the first dimension and ``targets`` the whole of it.
"""

from __future__ import annotations

import torch

from .core.options import DistillationOptions, Divergence, Impl, Reduction
from .core.shard import VocabShard
from .engine.data_parallel import all_targets, own_rows
from .engine.distill_autograd import DistillRows, FusedDistill
from .engine.driver import Call, StatsNeeds, options_for, plan_call
from .engine.prepare import grad_needs, is_dtensor, reduce_loss

Tensor = torch.Tensor


def _distill(sh, sw, th, tw, targets, sb, tb, opts: DistillationOptions):
    fused = opts.reduction != "none" and opts.grad_in_forward is not False and any(grad_needs(sh, sw, sb))
    fused = fused and not (opts.shard is not None and opts.shard.data_parallel)  # each rank's own upstream

    # what only distillation sends besides its options (the teacher's geometry follows from its validated rows)
    extra = (
        ("whether targets are given", targets is None),
        ("whether student_bias is given", sb is None),
        ("whether teacher_bias is given", tb is None),
        ("grad_in_forward (in effect)", fused),
    )
    call = Call("distillation", opts, sh, sw, targets, sb, StatsNeeds(), teacher=(th, tw, tb), extra=extra)
    rows, plan = plan_call(call)
    tw, tb = tw.detach(), None if tb is None else tb.detach()
    targets_all, valid_all = all_targets(plan, rows.targets, rows.valid)  # data_parallel: every rank's
    args = (rows.hidden, sw, sb, targets_all, valid_all, rows.teacher_hidden, tw, tb, plan, opts)
    if fused:  # every distillation pass forms the gradients in forward(row_grad=...)
        return FusedDistill.apply(*args)
    assert rows.valid is not None  # distillation's rows always carry it
    (loss_rows,) = own_rows(plan, DistillRows.apply(*args))  # data_parallel: this rank's rows
    return reduce_loss(loss_rows, rows.valid, opts.reduction, rows.shape)


def linear_distillation(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor | None = None,
    *,
    divergence: Divergence = "kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    scale_by_temperature_squared: bool = True,
    hard_label_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    softcap: None | float | tuple = None,
    shard: VocabShard | None = None,
    impl: Impl = "auto",
    chunk_size: int | None = None,
    grad_in_forward: bool | None = None,
    deterministic: bool = False,
):
    """Distillation loss between a teacher's and a student's next-token distributions, from hidden states.

    With ``z_s = softcap_s(h_s @ W_s.T + b_s) / T`` and ``z_t = softcap_t(h_t @ W_t.T + b_t) / T``
    (each projection rounded to its head's compute dtype, then float32), ``p = softmax(z)``:

    - ``kl``: ``KL(p_t || p_s) = sum_j p_t,j (log p_t,j - log p_s,j)`` (Hinton et al.'s soft loss)
    - ``reverse_kl``: ``KL(p_s || p_t)``
    - ``jsd``: ``beta * KL(p_t || M) + (1 - beta) * KL(p_s || M)``, ``M = beta p_t + (1 - beta) p_s``

    per row ``loss = (1 - w) * T**2 * D + w * CE(softcap_s(h_s @ W_s.T + b_s), target)``, ``w =
    hard_label_weight``; the ``T**2`` (Hinton et al.: keeps the soft gradients' magnitude as T
    changes) is dropped with ``scale_by_temperature_squared=False`` (Liger's fused linear JSD and
    distillation losses apply no such factor). Rows whose target is ``ignore_index`` give 0.
    Neither head's ``[N, V]`` logits are materialized; only the student gets gradients.

    Args:
        student_hidden: ``[..., D_s]`` floating point (cast to the student's compute dtype: its
            weight's dtype, or the autocast dtype). Under ``shard.sequence_parallel``: ``[n/P, ..., D_s]``.
        student_weight: ``[V_local, D_s]`` the student's (shard of the) LM head, or a DTensor: ``Shard(0)`` on a 1-D
            mesh (the shard derived from its placement, as for :func:`cce_dist.linear_cross_entropy`) or
            ``Replicate()``; then ``teacher_weight`` must be a DTensor placed alike (the same vocab rows), and the
            hidden states, biases and targets may be DTensors on that mesh as for the cross-entropy.
        teacher_hidden: ``[..., D_t]`` (same leading shape as the student's; any float dtype); frozen.
        teacher_weight: ``[V_local, D_t]`` the teacher's head rows, the same vocab rows as the student's; frozen.
        targets: ``[...]`` integer global ids in ``[0, V)`` or ``ignore_index``, or None (every row
            counts; no hard-label term). ``targets.shape == student_hidden.shape[:-1]`` (gathered
            shape under sequence parallelism).
        divergence: ``"kl"``, ``"reverse_kl"`` or ``"jsd"``.
        beta: the JSD's mixing weight in (0, 1).
        temperature: both heads' logits are divided by it (after the softcap).
        scale_by_temperature_squared: multiply the divergence by ``T**2`` (default True).
        hard_label_weight: weight ``w`` in [0, 1] of the cross-entropy on ``targets``.
        ignore_index: rows whose target equals it contribute 0 loss and no gradient.
        reduction: ``"mean"`` over counted rows (0 when none), ``"sum"`` or ``"none"``.
        student_bias, teacher_bias: ``[V_local]`` or None.
        softcap: None, one number for both heads, or ``(student, teacher)``.
        shard: a :class:`VocabShard` describing both heads' vocab rows and the group, or None;
            ``data_parallel=True``: each rank passes its own rows and gets its own loss (docs/fsdp.md).
        impl: ``"auto"`` (the torch implementation), ``"torch"`` (any device) or ``"triton"`` (the Triton
            kernels: CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``; all tokens in one pass,
            so ``chunk_size`` does not apply).
        chunk_size: logits per head per token chunk, as for the cross-entropy (None:
            ``max(2**24, 256 * V_local)``); a chunk holds three (forward KL) or four float32
            blocks of that size (plus the softcap's tanh), never an ``[N, V]`` one.
        grad_in_forward: for a scalar loss with gradients, form them during forward (one pass
            over the teacher; a single backward). None = whenever it applies.
        deterministic: ``impl="triton"``: gradients without float atomics (bitwise repeatable; one
            more recompute of both heads' tiles); also on under ``torch.use_deterministic_algorithms(True)``.
            The torch implementation always is.

    Collectives under a group of P ranks: the handshake (one all-gather), then per token chunk
    one statistics combine (MAX + SUM all-reduces or one all-gather) and one SUM all-reduce of
    the per-row divergence sums; in backward one dH all-reduce (reduce-scatter under sequence
    parallelism).

    Returns:
        float32 loss: a scalar for ``mean``/``sum``, ``student_hidden.shape[:-1]`` for ``none``.
        Gradients flow to ``student_hidden``, ``student_weight`` and ``student_bias`` only, each
        in its own dtype.

    Not under ``torch.compile`` nor on the meta device: it raises NotImplementedError there (no custom op traces it
    yet); call it outside the compiled region, e.g. behind ``torch.compiler.disable``.
    """
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "cce_dist.linear_distillation does not support torch.compile yet (its chunked eager loops and their "
            "host reads cannot be traced): call it outside the compiled region, e.g. "
            "torch.compiler.disable(cce_dist.linear_distillation)(...) inside the compiled model"
        )
    if any(isinstance(t, Tensor) and t.device.type == "meta" for t in (student_hidden, teacher_hidden)):
        raise NotImplementedError(
            "cce_dist.linear_distillation has no meta-device implementation (linear_cross_entropy and "
            "linear_logprobs have one): its result is a float32 scalar for reduction 'mean'/'sum' and "
            "student_hidden.shape[:-1] for 'none'; run it on real tensors"
        )
    opts = options_for(DistillationOptions, shard, student_hidden).from_keywords(
        ignore_index=ignore_index,
        shard=shard,
        impl=impl,
        chunk_size=chunk_size,
        deterministic=deterministic,
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        scale_by_temperature_squared=scale_by_temperature_squared,
        hard_label_weight=hard_label_weight,
        reduction=reduction,
        softcap=softcap,
        grad_in_forward=grad_in_forward,
    )
    args = (student_hidden, student_weight, teacher_hidden, teacher_weight, targets, student_bias, teacher_bias)
    if any(is_dtensor(t) for t in args):  # DTensor heads (cce_dist.tp.dtensor), as for the cross-entropy
        from .tp.dtensor import distillation_from_dtensor

        *args, opts = distillation_from_dtensor(*args, opts)
    return _distill(*args, opts)
