"""Public entry point of knowledge distillation from two heads: validation, handshake, dispatch.

Shapes: ``student_hidden [..., D_s]``, ``student_weight [V_local, D_s]``, ``teacher_hidden
[..., D_t]``, ``teacher_weight [V_local, D_t]`` (the same vocab rows: one shard describes both),
``targets [...]`` (optional integer global ids). Under ``shard.sequence_parallel`` both hidden
tensors hold this rank's slice of the first dimension and ``targets`` the whole of it.
"""

from __future__ import annotations

import math

import torch

from .distill_autograd import DistillPlan, DistillRows, FusedDistill
from .options import DistillationOptions, Divergence, Impl, Reduction, handshake_options
from .parallel import Comm, Layout, VocabShard, handshake
from .prepare import check_target_range, compute_dtype, grad_needs, resolve_backend, resolve_deterministic
from .torch_impl import chunk_tokens

Tensor = torch.Tensor


def _check(sh, sw, th, tw, targets, sb, tb, opts: DistillationOptions) -> None:
    """Local checks (every rank, before any collective); errors name the argument."""
    named = (
        ("student_hidden", sh),
        ("student_weight", sw),
        ("teacher_hidden", th),
        ("teacher_weight", tw),
        ("student_bias", sb),
        ("teacher_bias", tb),
    )
    for name, t in named:
        if t is None and name.endswith("bias"):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.device != sh.device:
            raise ValueError(f"{name} is on {t.device} but student_hidden is on {sh.device}")
    for who, h, w, b in (("student", sh, sw, sb), ("teacher", th, tw, tb)):
        if w.dim() != 2:
            raise ValueError(f"{who}_weight must be 2-D [V_local, D], got shape {tuple(w.shape)}")
        if h.dim() < 1 or h.shape[-1] != w.shape[1]:
            raise ValueError(
                f"{who}_hidden's last dimension ({tuple(h.shape)}) must equal {who}_weight.shape[1] ({w.shape[1]})"
            )
        if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[0]):
            raise ValueError(f"{who}_bias must have shape [{w.shape[0]}] ({who}_weight.shape[0]), got {tuple(b.shape)}")
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
    if shard is not None and sw.shape[0] != shard.local_size:
        raise ValueError(
            f"student_weight.shape[0] and teacher_weight.shape[0] ({sw.shape[0]}) must equal the shard "
            f"size stop - start = {shard.local_size}"
        )
    sp = shard is not None and shard.sequence_parallel and shard.world_size > 1
    if sp and sh.dim() < 2:
        raise ValueError("sequence_parallel needs student_hidden/teacher_hidden [n/P, ..., D]")
    if targets is None:
        if opts.hard_label_weight > 0:
            raise ValueError(
                f"hard_label_weight={opts.hard_label_weight} needs targets (the ids of the CE term); "
                "pass targets or hard_label_weight=0"
            )
        return
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor or None, got {type(targets).__name__}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor of class ids, got dtype {targets.dtype}")
    if targets.device != sh.device:
        raise ValueError(f"targets is on {targets.device} but student_hidden is on {sh.device}")
    want = _token_shape(sh, shard)
    if tuple(targets.shape) != want:
        raise ValueError(
            f"targets must have shape {want} (student_hidden.shape[:-1]"
            f"{', times tp_size along dim 0 under sequence parallelism' if sp else ''}), "
            f"got {tuple(targets.shape)}"
        )


def _token_shape(hidden: Tensor, shard: VocabShard | None) -> tuple:
    shape = tuple(hidden.shape[:-1])
    if shard is not None and shard.sequence_parallel and shard.world_size > 1:
        shape = (shape[0] * shard.world_size,) + shape[1:]
    return shape


def _resolve_impl(opts: DistillationOptions, sh: Tensor, th: Tensor) -> str:
    """``"torch"`` or ``"triton"`` for ``opts.impl`` (``"auto"``: torch, on every device: the Triton
    kernels have been checked in Triton's interpreter and compiled for GPU targets, not yet timed on
    one). Raises RuntimeError (naming ``impl``) where the kernels cannot run."""
    if opts.impl != "triton":
        return "torch"
    # a zero hidden size runs the torch implementation (after the same availability checks)
    return resolve_backend("triton", sh.device, min(sh.shape[-1], th.shape[-1])).NAME


def _distill(sh, sw, th, tw, targets, sb, tb, opts: DistillationOptions):
    shard = opts.shard
    error: BaseException | None = None
    t = None
    impl = "torch"
    try:
        _check(sh, sw, th, tw, targets, sb, tb, opts)
        impl = _resolve_impl(opts, sh, th)
        local_vocab = sw.shape[0] if shard is None else (shard.stop if shard.world_size == 1 else None)
        if targets is not None:
            check_target_range(targets, opts.ignore_index, local_vocab)
            t = targets.long()
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    wants_grad = any(grad_needs(sh, sw, sb))
    fused = opts.reduction != "none" and opts.grad_in_forward is not False and wants_grad
    s_dtype = compute_dtype(sh, sw) if error is None else None
    t_dtype = compute_dtype(th, tw) if error is None else None
    if shard is None or shard.world_size == 1:
        if error is not None:
            raise error
        if shard is not None and shard.start != 0:
            raise ValueError(f"a single-rank VocabShard must start at 0, got start={shard.start}")
        n_tokens = math.prod(sh.shape[:-1])
        layout = Layout(vocab_size=sw.shape[0], n_tokens=n_tokens, max_local=sw.shape[0])
        shape = tuple(sh.shape[:-1])
    else:
        sp = shard.sequence_parallel
        shape = _token_shape(sh, shard) if error is None else ()
        n_tokens = math.prod(shape) if error is None else 0
        n_local = sh.shape[0] if (error is None and sp) else 0
        # Everything that decides which collectives run, and with what sizes, must agree; each is named (the options
        # after their dataclass fields), so a disagreement names what differs.
        named = (
            (("the loss", "distillation"),)
            + handshake_options(opts)
            + (
                ("the implementation (torch/triton) that impl= resolved to", impl),  # per token chunk or per call
                ("sequence_parallel", sp),
                ("reduce_hidden_grad", shard.reduce_hidden_grad),
                ("stats_collective", shard.stats_collective),
                ("the student's compute dtype", str(s_dtype)),
                ("the teacher's compute dtype", str(t_dtype)),
                (
                    "the teacher's hidden size (teacher_hidden.shape[-1] = teacher_weight.shape[1])",
                    None if error is not None else th.shape[-1],
                ),
                ("whether targets are given", targets is None),
                ("whether student_bias is given", sb is None),
                ("whether teacher_bias is given", tb is None),
                ("which of student_hidden/student_weight/student_bias require grad", grad_needs(sh, sw, sb)),
                ("grad_in_forward (in effect)", fused),
            )
        )
        if not shard.check:
            if error is not None:
                raise error  # documented: without the handshake a rank-local error can strand the others
            raise ValueError(
                "linear_distillation needs VocabShard(check=True): its handshake checks that every rank "
                "holds the same vocabulary rows of both heads"
            )
        # every keyword by name (api.py and distill.py pass their own values): mypy checks the call against handshake's
        # signature, and tests/test_signatures.py that both callers pass every keyword
        layout = handshake(
            shard,
            error,
            n_tokens=n_tokens,
            n_local_tokens=n_local,
            hidden_dim=sh.shape[-1] if error is None else 0,
            options=named,
            targets=t,
            ignore_index=opts.ignore_index,
            device=sh.device if isinstance(sh, Tensor) else torch.device("cpu"),
        )
    assert s_dtype is not None and t_dtype is not None  # an input error was raised above
    n = layout.n_tokens
    if t is None:
        t1 = torch.full((n,), -1, dtype=torch.long, device=sh.device)
        valid = torch.ones(n, dtype=torch.bool, device=sh.device)
    else:
        t1 = t.reshape(-1)
        valid = t1 != opts.ignore_index
    opts = opts.replace(deterministic=resolve_deterministic(opts.deterministic))  # read when the loss is called
    plan = DistillPlan(
        student_dtype=s_dtype,
        teacher_dtype=t_dtype,
        vocab_start=0 if shard is None else shard.start,
        comm=Comm(shard, layout),
        step=chunk_tokens(n, layout.max_local, opts.chunk_size),
        impl=impl,
    )
    # not reshape(-1, d): with a zero hidden size the row count cannot be inferred from 0 elements
    h2 = sh.reshape(math.prod(sh.shape[:-1]), sh.shape[-1])
    th2 = th.detach().reshape(math.prod(th.shape[:-1]), th.shape[-1])
    tw, tb = tw.detach(), None if tb is None else tb.detach()
    if fused:
        return FusedDistill.apply(h2, sw, sb, th2, tw, tb, t1, valid, plan, opts)
    rows = DistillRows.apply(h2, sw, sb, th2, tw, tb, t1, valid, plan, opts)
    if opts.reduction == "none":
        return rows.reshape(shape)
    if opts.reduction == "sum":
        return rows.sum()
    return rows.sum() / valid.sum().clamp(min=1)


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
        shard: a :class:`VocabShard` describing both heads' vocab rows and the group, or None.
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
    """
    opts = DistillationOptions(
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        scale_by_temperature_squared=scale_by_temperature_squared,
        hard_label_weight=hard_label_weight,
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=softcap,
        shard=shard,
        impl=impl,
        chunk_size=chunk_size,
        grad_in_forward=grad_in_forward,
        deterministic=deterministic,
    )
    return _distill(
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, student_bias, teacher_bias, opts
    )
