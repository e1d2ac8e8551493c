"""Public entry points: the eager driver (handshake, plan, dispatch to the autograd Functions).

Validation, target ids, dtype, implementation and reduction live in :mod:`cce_dist.prepare`, shared with the
compiled path (:mod:`cce_dist.compile`).

Shapes: ``hidden [..., D]``, ``weight [V_local, D]``, ``targets [...]`` (integer global ids).
Under ``shard.sequence_parallel`` hidden holds this rank's slice of the first dimension:
``hidden.shape[0] * P == targets.shape[0]``.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import nn

from . import torch_impl
from .autograd import CrossEntropyRows, FusedCrossEntropy, LogprobRows, Plan
from .backend import Backend
from .options import (
    CommonOptions,
    CrossEntropyOptions,
    FilterEps,
    Impl,
    LogprobOptions,
    Reduction,
    handshake_options,
)
from .parallel import Comm, Layout, VocabShard, handshake
from .prepare import (
    Prepared,
    backend_kwargs,
    check_target_range,
    cross_entropy_result,
    grad_needs,
    is_dtensor,
    logprob_result,
    prepare_rows,
    resolve_backend,
    resolve_filter_eps,
)

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------
# the eager driver
# ----------------------------------------------------------------------------------------------


def _plan(
    hidden,
    weight,
    targets,
    bias,
    opts: CommonOptions,
    form: str,
    extra: tuple[tuple[str, object], ...],
    *,
    need_entropy: bool,
    need_sum: bool,
) -> tuple[Prepared, Plan]:
    """Validate (locally, then with the group), flatten and plan: the rows and the :class:`Plan` of one call.

    ``need_entropy`` / ``need_sum``: which optional statistics the output form reads (for the backends that can
    skip them)."""
    shard = opts.shard
    error: BaseException | None = None
    rows: Prepared | None = None
    backend: Backend = torch_impl
    try:
        prepared = prepare_rows(hidden, weight, targets, bias, opts, check_ids=True)
        backend = resolve_backend(opts.impl, hidden.device, hidden.shape[-1])
        rows = prepared
    except (TypeError, ValueError, RuntimeError) as e:
        error = e

    if shard is None or shard.world_size == 1:
        if error is not None:
            raise error
        assert rows is not None
        v_total = weight.shape[0] if shard is None else shard.stop
        if shard is not None and shard.start != 0:
            raise ValueError(f"a single-rank VocabShard must start at 0, got start={shard.start}")
        layout = Layout(vocab_size=v_total, n_tokens=rows.targets.numel(), max_local=weight.shape[0])
    else:
        layout, rows = _exchange(shard, error, rows, hidden, weight, bias, opts, form, extra, backend.NAME)

    kw = backend_kwargs(
        backend,
        chunk_size=opts.chunk_size,
        need_entropy=need_entropy,
        need_sum=need_sum,
        filter_eps=resolve_filter_eps(opts, rows.compute_dtype),
        deterministic=opts.deterministic,
    )
    plan = Plan(
        backend=backend,
        compute_dtype=rows.compute_dtype,
        vocab_start=0 if shard is None else shard.start,
        vocab_size=layout.vocab_size,
        comm=Comm(shard, layout),
        backend_kwargs=kw,
        # from values every rank agreed on, so the fused schedule's per-chunk collectives line up
        fused_chunk_tokens=torch_impl.chunk_tokens(layout.n_tokens, layout.max_local, opts.chunk_size),
    )
    return rows, plan


def _exchange(
    shard: VocabShard,
    error: BaseException | None,
    rows: Prepared | None,
    hidden,
    weight,
    bias,
    opts: CommonOptions,
    form: str,
    extra: tuple[tuple[str, object], ...],
    backend_name: str,
) -> tuple[Layout, Prepared]:
    """A group of more than one rank: the handshake (or, with ``check=False``, the vocab size alone).

    Raises this rank's ``error`` after telling the others, so none is left waiting in a collective."""
    sp = shard.sequence_parallel
    n_local = hidden.shape[0] if (rows is not None and sp) else 0
    n_tokens = rows.targets.numel() if rows is not None else 0
    # Everything that decides which collectives run, and with what sizes, must agree; each is named, so a
    # disagreement names what differs. The resolved implementation too: the torch one forms scalar-loss gradients in
    # forward with one statistics collective per token chunk, the triton one issues a single one.
    named = (
        (("the loss", form),)
        + handshake_options(opts)
        + extra
        + (
            ("sequence_parallel", sp),
            ("reduce_hidden_grad", shard.reduce_hidden_grad),
            ("stats_collective", shard.stats_collective),
            ("the compute dtype", str(None if rows is None else rows.compute_dtype)),
            ("which of hidden/weight/bias require grad", grad_needs(hidden, weight, bias)),
            ("the implementation (torch/triton) that impl= resolved to", backend_name),
        )
    )
    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    if not shard.check:
        if error is not None:
            raise error  # documented: without the handshake a rank-local error can strand the others
        assert rows is not None
        layout = _cheap_layout(shard, n_tokens, device)
        # No handshake, but the global vocab is known now: an id >= V still raises (on this rank), as a
        # single-device call would, instead of contributing no target logit (loss = lse).
        check_target_range(rows.targets, opts.ignore_index, layout.vocab_size)
        return layout, rows
    # every keyword by name (api.py and distill.py pass their own values): mypy checks the call against handshake's
    # signature, and tests/test_signatures.py that both callers pass every keyword
    layout = handshake(
        shard,
        error,
        n_tokens=n_tokens,
        n_local_tokens=n_local,
        hidden_dim=hidden.shape[-1] if error is None else 0,
        options=named,
        targets=None if rows is None else rows.targets,
        ignore_index=opts.ignore_index,
        device=device,
    )
    assert rows is not None  # handshake raised this rank's error, if any, on every rank
    return layout, rows


def _cheap_layout(shard: VocabShard, n_tokens: int, device: torch.device) -> Layout:
    """check=False: learn only the global vocab and the largest shard (one tiny all-reduce)."""
    import torch.distributed as dist

    buf = torch.tensor([shard.stop, shard.local_size], dtype=torch.int64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=shard.group)
    v, max_local = (int(x) for x in buf.tolist())
    return Layout(vocab_size=v, n_tokens=n_tokens, max_local=max_local)


def _integrations(hidden, weight, targets, bias, opts):
    """Hooks for inputs that need translating first: DTensor heads (cce_dist.dtensor)."""
    if is_dtensor(weight) or is_dtensor(hidden):
        from .dtensor import from_dtensor

        hidden, weight, targets, bias, opts = from_dtensor(hidden, weight, targets, bias, opts)
    return hidden, weight, targets, bias, opts


def _cross_entropy(hidden, weight, targets, bias, opts: CrossEntropyOptions) -> Tensor | tuple[Tensor, Tensor]:
    if torch.compiler.is_compiling():
        from .compile import compiled_cross_entropy

        return compiled_cross_entropy(hidden, weight, targets, bias, opts)
    hidden, weight, targets, bias, opts = _integrations(hidden, weight, targets, bias, opts)
    wants_grad = any(grad_needs(hidden, weight, bias))
    fused = opts.reduction != "none" and not opts.return_lse and opts.grad_in_forward is not False and wants_grad
    extra = (("whether any of hidden/weight/bias requires grad", wants_grad), ("grad_in_forward (in effect)", fused))
    rows, plan = _plan(
        hidden,
        weight,
        targets,
        bias,
        opts,
        "cross-entropy",
        extra,
        need_entropy=False,
        need_sum=bool(opts.label_smoothing),
    )
    if fused and plan.backend.FUSED_CHUNKING:
        return FusedCrossEntropy.apply(rows.hidden, weight, bias, rows.targets, plan, opts)
    loss_rows, lse = CrossEntropyRows.apply(rows.hidden, weight, bias, rows.targets, plan, opts)
    return cross_entropy_result(loss_rows, lse, rows, opts)


def _logprobs(hidden, weight, targets, bias, opts: LogprobOptions) -> Tensor | tuple[Tensor, Tensor]:
    if torch.compiler.is_compiling():
        from .compile import compiled_logprobs

        return compiled_logprobs(hidden, weight, targets, bias, opts)
    hidden, weight, targets, bias, opts = _integrations(hidden, weight, targets, bias, opts)
    extra = (("whether any of hidden/weight/bias requires grad", any(grad_needs(hidden, weight, bias))),)
    rows, plan = _plan(
        hidden, weight, targets, bias, opts, "logprobs", extra, need_entropy=opts.return_entropy, need_sum=False
    )
    lp, ent = LogprobRows.apply(rows.hidden, weight, bias, rows.targets, plan, opts)
    return logprob_result(lp, ent, rows, opts)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


# The return type follows return_lse / return_entropy. Each overload repeats the keyword list (typing needs it in
# full); the implementation after them documents it.
@overload
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    ignore_index: int = ...,
    reduction: Reduction = ...,
    label_smoothing: float = ...,
    z_loss: float = ...,
    softcap: float | None = ...,
    shift: bool | int = ...,
    shard: VocabShard | None = ...,
    impl: Impl = ...,
    return_lse: Literal[False] = ...,
    chunk_size: int | None = ...,
    grad_in_forward: bool | None = ...,
    filter_eps: FilterEps = ...,
    deterministic: bool = ...,
) -> Tensor: ...
@overload
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    ignore_index: int = ...,
    reduction: Reduction = ...,
    label_smoothing: float = ...,
    z_loss: float = ...,
    softcap: float | None = ...,
    shift: bool | int = ...,
    shard: VocabShard | None = ...,
    impl: Impl = ...,
    return_lse: Literal[True],
    chunk_size: int | None = ...,
    grad_in_forward: bool | None = ...,
    filter_eps: FilterEps = ...,
    deterministic: bool = ...,
) -> tuple[Tensor, Tensor]: ...
@overload
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    ignore_index: int = ...,
    reduction: Reduction = ...,
    label_smoothing: float = ...,
    z_loss: float = ...,
    softcap: float | None = ...,
    shift: bool | int = ...,
    shard: VocabShard | None = ...,
    impl: Impl = ...,
    return_lse: bool = ...,
    chunk_size: int | None = ...,
    grad_in_forward: bool | None = ...,
    filter_eps: FilterEps = ...,
    deterministic: bool = ...,
) -> Tensor | tuple[Tensor, Tensor]: ...


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    shift: bool | int = False,
    shard: VocabShard | None = None,
    impl: Impl = "auto",
    return_lse: bool = False,
    chunk_size: int | None = None,
    grad_in_forward: bool | None = None,
    filter_eps: FilterEps = None,
    deterministic: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``targets`` without materializing logits.

    Computes exactly ``F.cross_entropy(F.linear(hidden, W, b), targets, ignore_index=...,
    reduction=..., label_smoothing=...)`` (plus ``z_loss * lse**2`` per valid token, and a
    ``softcap * tanh(z / softcap)`` on the logits when given) with float32 accumulation.

    Args:
        hidden: ``[..., D]`` floating point (cast to the compute dtype: the weight's dtype, or the
            autocast dtype when autocast is on). Under ``shard.sequence_parallel``: ``[n/P, ..., D]``.
        weight: ``[V_local, D]`` the (shard of the) LM head; ``V_local = V`` without ``shard``.
        targets: ``[...]`` integer global ids in ``[0, V)`` or ``ignore_index`` (any integer dtype,
            compared as int64);
            ``targets.shape == hidden.shape[:-1]`` (the gathered shape under sequence parallelism).
        bias: ``[V_local]`` or None.
        ignore_index: targets equal to it contribute 0 loss and no gradient.
        reduction: ``"mean"`` over non-ignored tokens (0, not NaN, when all are ignored),
            ``"sum"`` or ``"none"`` (per-token loss, targets' shape, 0 at ignored positions).
        label_smoothing: PyTorch's definition, over the full (global) vocabulary.
        z_loss: coefficient of ``lse**2`` added per valid token.
        softcap: Gemma-style logit soft-capping, or None.
        shift: position ``i`` predicts ``targets[..., i + shift]`` (True = 1); the last ``shift``
            positions are ignored. Only the targets are shifted (hidden is never copied).
        shard: a :class:`VocabShard` for a vocab-parallel head, or None for one device.
        impl: ``"auto"`` (triton for CUDA tensors when it imports, else torch), ``"torch"``,
            ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``).
        return_lse: also return the float32 per-token log-sum-exp (targets' shape).
        chunk_size: torch impl: logits (tokens x vocab entries) held at once (memory/speed knob);
            None = ``max(2**24, 256 * V_local)`` (at least 256 tokens per chunk).
        grad_in_forward: torch impl: for a scalar loss with gradients, form the gradients during
            forward (3 GEMMs instead of 4; a single backward; the gradients are held until backward,
            in float32 for float16 tensors and in their own dtype otherwise, and backward applies the
            upstream gradient, e.g. a loss scale, in float32 before rounding them once to each
            tensor's dtype). None = whenever it applies.
        filter_eps: triton impl: gradient filtering threshold (None = exact, "auto").
        deterministic: triton impl: bitwise reproducible backward (no float atomics).

    Returns:
        float32 loss: a scalar for ``mean``/``sum``, targets' shape for ``none``; with
        ``return_lse``: ``(loss, lse)``. Differentiable (once) w.r.t. hidden, weight and bias;
        gradients come back in each tensor's dtype. Second-order gradients (``create_graph=True``)
        raise a RuntimeError: compute a gradient penalty from the materialized loss instead.
    """
    opts = CrossEntropyOptions(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        shift=shift,
        shard=shard,
        impl=impl,
        return_lse=return_lse,
        chunk_size=chunk_size,
        grad_in_forward=grad_in_forward,
        filter_eps=filter_eps,
        deterministic=deterministic,
    )
    return _cross_entropy(hidden, weight, targets, bias, opts)


@overload
def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    softcap: float | None = ...,
    temperature: float = ...,
    ignore_index: int = ...,
    shift: bool | int = ...,
    shard: VocabShard | None = ...,
    impl: Impl = ...,
    return_entropy: Literal[False] = ...,
    chunk_size: int | None = ...,
    filter_eps: FilterEps = ...,
    deterministic: bool = ...,
) -> Tensor: ...
@overload
def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    softcap: float | None = ...,
    temperature: float = ...,
    ignore_index: int = ...,
    shift: bool | int = ...,
    shard: VocabShard | None = ...,
    impl: Impl = ...,
    return_entropy: Literal[True],
    chunk_size: int | None = ...,
    filter_eps: FilterEps = ...,
    deterministic: bool = ...,
) -> tuple[Tensor, Tensor]: ...
@overload
def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    softcap: float | None = ...,
    temperature: float = ...,
    ignore_index: int = ...,
    shift: bool | int = ...,
    shard: VocabShard | None = ...,
    impl: Impl = ...,
    return_entropy: bool = ...,
    chunk_size: int | None = ...,
    filter_eps: FilterEps = ...,
    deterministic: bool = ...,
) -> Tensor | tuple[Tensor, Tensor]: ...


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    shift: bool | int = False,
    shard: VocabShard | None = None,
    impl: Impl = "auto",
    return_entropy: bool = False,
    chunk_size: int | None = None,
    filter_eps: FilterEps = None,
    deterministic: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of each target (and optionally the entropy) without materializing logits.

    With ``z = softcap(hidden @ weight.T + bias) / temperature``: ``logprob = z_t - logsumexp(z)``
    and ``entropy = -sum_j softmax(z)_j * log softmax(z)_j``, accumulated in float32. The RL
    (PPO/GRPO) form: both outputs take arbitrary per-token upstream gradients.

    Args:
        hidden, weight, targets, bias, ignore_index, shift, shard, impl, chunk_size, filter_eps,
        deterministic: as in :func:`linear_cross_entropy`.
        softcap: Gemma-style logit soft-capping (applied before the temperature), or None.
        temperature: the logits are divided by it; > 0.
        return_entropy: also return the (differentiable) entropy.

    Returns:
        float32 ``logprobs`` of targets' shape (0 at ignored positions, never positive); with
        ``return_entropy``: ``(logprobs, entropy)`` (entropy 0 at ignored positions). Differentiable
        once; second-order gradients (``create_graph=True``) raise a RuntimeError.
    """
    opts = LogprobOptions(
        ignore_index=ignore_index,
        softcap=softcap,
        shift=shift,
        shard=shard,
        impl=impl,
        chunk_size=chunk_size,
        filter_eps=filter_eps,
        deterministic=deterministic,
        temperature=temperature,
        return_entropy=return_entropy,
    )
    return _logprobs(hidden, weight, targets, bias, opts)


class LinearCrossEntropy(nn.Module):
    """Module form of :func:`linear_cross_entropy`; takes the same keyword options.

    ``forward(hidden [..., D], weight [V_local, D], targets [...], bias=None)``. The options are
    held in one frozen :class:`cce_dist.CrossEntropyOptions` (``.options``).
    """

    def __init__(self, **options) -> None:
        super().__init__()
        self.options = CrossEntropyOptions(**options)

    def forward(
        self, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        return _cross_entropy(hidden, weight, targets, bias, self.options)

    def extra_repr(self) -> str:
        defaults = CrossEntropyOptions()
        changed = [
            f"{k}={getattr(self.options, k)!r}"
            for k in self.options.__dataclass_fields__
            if getattr(self.options, k) != getattr(defaults, k)
        ]
        return ", ".join(changed)
