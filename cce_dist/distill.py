"""Public entry point of knowledge distillation from two heads: validation, handshake, dispatch.

Shapes: ``student_hidden [..., D_s]``, ``student_weight [V_local, D_s]``, ``teacher_hidden
[..., D_t]``, ``teacher_weight [V_local, D_t]`` (the same vocab rows: one shard describes both),
``targets [...]`` (optional integer global ids). Under ``shard.sequence_parallel`` both hidden
tensors hold this rank's slice of the first dimension and ``targets`` the whole of it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .core.options import DistillationOptions, Divergence, Impl, Reduction
from .core.shard import VocabShard
from .engine.data_parallel import all_targets, own_rows
from .engine.distill_autograd import DistillRows, FusedDistill
from .engine.driver import Call, plan_call
from .engine.prepare import (
    Prepared,
    as_rows,
    check_head,
    check_target_range,
    check_targets,
    compute_dtype,
    grad_needs,
    known_vocab,
    reduce_loss,
    resolve_distill_backend,
    token_shape,
)

Tensor = torch.Tensor


def _prepare(sh, sw, th, tw, targets, sb, tb, opts: DistillationOptions) -> Prepared:
    """Local checks (every rank, before any collective; errors name the argument) and the rows: the student's
    hidden ``[n, D_s]``, the teacher's (detached) ``[n, D_t]``, the target ids ``int64 [N]`` (``ignore_index``
    everywhere without targets, with every row counted)."""
    check_head(sh, sw, sb, opts.shard, prefix="student_")
    check_head(th, tw, tb, opts.shard, prefix="teacher_", ref=("student_hidden", sh))
    if tw.shape[0] != sw.shape[0]:
        raise ValueError(
            f"teacher_weight.shape[0] ({tw.shape[0]}) must equal student_weight.shape[0] "
            f"({sw.shape[0]}): both heads must hold the same vocabulary rows"
        )
    if tuple(th.shape[:-1]) != tuple(sh.shape[:-1]):
        raise ValueError(
            f"teacher_hidden.shape[:-1] {tuple(th.shape[:-1])} must equal student_hidden.shape[:-1] "
            f"{tuple(sh.shape[:-1])} (one teacher row per student row)"
        )
    shard = opts.shard
    if shard is not None and shard.sequence_parallel and shard.world_size > 1 and sh.dim() < 2:
        raise ValueError("sequence_parallel needs student_hidden/teacher_hidden [n/P, ..., D]")
    shape = token_shape(sh, shard)
    if targets is None:
        if opts.hard_label_weight > 0:
            raise ValueError(
                f"hard_label_weight={opts.hard_label_weight} needs targets (the ids of the CE term); "
                "pass targets or hard_label_weight=0"
            )
        n = math.prod(shape)
        t = torch.full((n,), opts.ignore_index, dtype=torch.long, device=sh.device)
        valid = torch.ones(n, dtype=torch.bool, device=sh.device)
    else:
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a torch.Tensor or None, got {type(targets).__name__}")
        check_targets(targets, sh, shard, hidden_name="student_hidden")
        t = targets.to(torch.int64).reshape(-1)
        check_target_range(t, opts.ignore_index, known_vocab(sw, shard))
        valid = t != opts.ignore_index
    return Prepared(
        as_rows(sh),
        t,
        shape,
        compute_dtype(sh, sw),
        valid=valid,
        teacher_hidden=as_rows(th.detach()),
        teacher_dtype=compute_dtype(th, tw),
    )


def _distill(sh, sw, th, tw, targets, sb, tb, opts: DistillationOptions):
    fused = opts.reduction != "none" and opts.grad_in_forward is not False and any(grad_needs(sh, sw, sb))
    fused = fused and not (opts.shard is not None and opts.shard.data_parallel)  # each rank's own upstream

    def extra(rows: Prepared | None) -> tuple[tuple[str, Any], ...]:
        """What only distillation sends (besides its options): the teacher head's geometry, which arguments are
        given, and whether the gradients are formed in forward."""
        return (
            ("the teacher's compute dtype", str(None if rows is None else rows.teacher_dtype)),
            (
                "the teacher's hidden size (teacher_hidden.shape[-1] = teacher_weight.shape[1])",
                None if rows is None else th.shape[-1],
            ),
            ("whether targets are given", targets is None),
            ("whether student_bias is given", sb is None),
            ("whether teacher_bias is given", tb is None),
            ("grad_in_forward (in effect)", fused),
        )

    call = Call(
        form="distillation",
        opts=opts,
        hidden=sh,
        weight=sw,
        bias=sb,
        prepare=lambda: _prepare(sh, sw, th, tw, targets, sb, tb, opts),
        # a zero hidden size (either head) runs the torch implementation
        resolve=lambda rows: resolve_distill_backend(opts.impl, sh.device, min(sh.shape[-1], th.shape[-1])),
        extra=extra,
        head="student_",
    )
    rows, plan = plan_call(call)
    tw, tb = tw.detach(), None if tb is None else tb.detach()
    targets_all, valid_all = all_targets(plan, rows.targets, rows.valid)  # data_parallel: every rank's
    args = (rows.hidden, sw, sb, targets_all, valid_all, rows.teacher_hidden, tw, tb, plan, opts)
    if fused and plan.backend.FUSED_CHUNKING:
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
        student_weight: ``[V_local, D_s]`` the student's (shard of the) LM head.
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
    opts = DistillationOptions.from_keywords(
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
    return _distill(
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, student_bias, teacher_bias, opts
    )
