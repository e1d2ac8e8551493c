"""Public entry points of the one-head losses: each call runs the driver (:mod:`cce_dist.engine.driver`: validate,
handshake, plan), then its autograd Function.

Validation, target ids, dtype, implementation and reduction live in :mod:`cce_dist.engine.prepare`. Under
``torch.compile`` (and on the meta device) the same steps run, traced: the driver, the autograd Function and the
reduction; only the plan's backend differs, the custom ops of :mod:`cce_dist.engine.compile` running the
implementation the driver resolved. Every check and formula of the eager path holds there by construction.

Shapes: ``hidden [..., D]``, ``weight [V_local, D]``, ``targets [...]`` (integer global ids).
Under ``shard.sequence_parallel`` hidden holds this rank's slice of the first dimension:
``hidden.shape[0] * P == targets.shape[0]``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal, overload

import torch
from torch import nn

from .core.class_weight import ClassWeights
from .core.options import CrossEntropyOptions, FilterEps, Impl, LogprobOptions, Reduction
from .core.outputs import RowOutput, RowOutputs, row_outputs, stats_needed
from .core.shard import VocabShard
from .engine.autograd import CrossEntropyRows, FusedCrossEntropy, LogprobRows, Plan
from .engine.data_parallel import all_targets, own_rows
from .engine.driver import Call, StatsNeeds, options_for, plan_call
from .engine.prepare import (
    Prepared,
    check_class_weight_length,
    cross_entropy_result,
    grad_needs,
    is_dtensor,
    logprob_result,
)

Tensor = torch.Tensor


def _through_ops(hidden) -> bool:
    """Whether the call's backend is :mod:`cce_dist.engine.compile`'s custom ops: under torch.compile, and on the meta
    device, where their fake implementations give the outputs' and the gradients' shapes without computing."""
    return torch.compiler.is_compiling() or (isinstance(hidden, torch.Tensor) and hidden.device.type == "meta")


def _needs(opts: CrossEntropyOptions | LogprobOptions, class_weight=None) -> StatsNeeds:
    """The optional statistics a one-head call's outputs read."""
    needs = stats_needed(opts.row_outputs)
    smoothing = isinstance(opts, CrossEntropyOptions) and bool(opts.label_smoothing)
    return StatsNeeds(
        entropy=isinstance(opts, LogprobOptions) and opts.return_entropy,
        # with class weights the smoothing term's (weighted) sum is formed outside the implementation
        sum=needs["need_sum"] or (smoothing and class_weight is None),
        argmax=needs["need_argmax"],
        sumsq=needs["need_sumsq"],
    )


def _with_row_outputs(result, stats: Tensor, rows: Prepared, plan: Plan, opts: CrossEntropyOptions | LogprobOptions):
    """``result``, or ``(result, RowOutputs)`` when ``opts.row_outputs`` asks for any."""
    if not opts.row_outputs:
        return result
    valid = rows.targets != opts.ignore_index
    return result, row_outputs(
        stats, rows.targets, valid, opts.row_outputs, vocab_size=plan.vocab_size, shape=rows.shape
    )


def _integrations(hidden, weight, targets, bias, opts):
    """Hooks for inputs that need translating first: DTensor heads (cce_dist.tp.dtensor)."""
    if is_dtensor(weight) or is_dtensor(hidden):
        from .tp.dtensor import from_dtensor

        hidden, weight, targets, bias, opts = from_dtensor(hidden, weight, targets, bias, opts)
    return hidden, weight, targets, bias, opts


def _gradients_in_forward(opts: CrossEntropyOptions, class_weight) -> bool:
    """Whether a cross-entropy that needs gradients forms them in forward (the fused schedule, where the backend has
    one): a scalar loss with no other output, unless ``grad_in_forward=False``."""
    return (
        opts.reduction != "none"
        and not opts.return_lse
        and not opts.row_outputs
        and opts.grad_in_forward is not False
        # class weights' mean divides the z-loss by the token count, the cross-entropy by the weights' sum
        and not (class_weight is not None and opts.z_loss and opts.reduction == "mean")
        # data_parallel: each rank's loss has its own upstream gradient, known only in backward
        and not (opts.shard is not None and opts.shard.data_parallel)
    )


def _cross_entropy(hidden, weight, targets, bias, opts: CrossEntropyOptions, class_weight=None):
    compiling = _through_ops(hidden)
    if compiling:
        from .engine import compile as C

        C.check_compilable(hidden, weight, targets, bias, opts)
    else:
        hidden, weight, targets, bias, opts = _integrations(hidden, weight, targets, bias, opts)
    wants_grad = any(grad_needs(hidden, weight, bias))
    fused = wants_grad and _gradients_in_forward(opts, class_weight)
    extra = (
        ("whether any of hidden/weight/bias requires grad", wants_grad),
        ("grad_in_forward (in effect)", fused),
        ("class_weight's length", None if not isinstance(class_weight, torch.Tensor) else class_weight.numel()),
    )
    call = Call(
        "cross-entropy",
        opts,
        hidden,
        weight,
        targets,
        bias,
        class_weight=class_weight,
        extra=extra,
        needs=_needs(opts, class_weight),
        compiling=compiling,
    )
    rows, plan = plan_call(call)
    check_class_weight_length(class_weight, plan.vocab_size)  # every rank agreed on both in the handshake
    targets, _ = all_targets(plan, rows.targets)  # data_parallel: every rank's (the rows scored here)
    cw = None
    if class_weight is not None:
        cw = ClassWeights.of(
            class_weight,
            targets,
            targets != opts.ignore_index,
            vocab_start=plan.vocab_start,
            v_local=weight.shape[0],
            label_smoothing=opts.label_smoothing,
        )
    if fused and plan.backend.fused_cross_entropy is not None:
        return FusedCrossEntropy.apply(rows.hidden, weight, bias, rows.targets, plan, opts, cw)
    # with class weights the z-loss is added from the returned lse (cross_entropy_result)
    rows_opts = opts if cw is None or not opts.z_loss else opts.replace(z_loss=0.0)
    loss_rows, lse, stats = CrossEntropyRows.apply(rows.hidden, weight, bias, targets, plan, rows_opts, cw)
    if compiling:
        loss_rows, lse = C.first_order(loss_rows, lse)
    loss_rows, lse = own_rows(plan, loss_rows, lse)  # data_parallel: this rank's rows (no-op otherwise)
    own = plan.comm.own_rows
    result = cross_entropy_result(loss_rows, lse, rows, opts, None if cw is None else own(cw.rows))
    return _with_row_outputs(result, own(stats), rows, plan, opts)


def _logprobs(hidden, weight, targets, bias, opts: LogprobOptions):
    compiling = _through_ops(hidden)
    if compiling:
        from .engine import compile as C

        C.check_compilable(hidden, weight, targets, bias, opts)
    else:
        hidden, weight, targets, bias, opts = _integrations(hidden, weight, targets, bias, opts)
    extra = (("whether any of hidden/weight/bias requires grad", any(grad_needs(hidden, weight, bias))),)
    call = Call("logprobs", opts, hidden, weight, targets, bias, extra=extra, needs=_needs(opts), compiling=compiling)
    rows, plan = plan_call(call)
    lp, ent, stats = LogprobRows.apply(rows.hidden, weight, bias, all_targets(plan, rows.targets)[0], plan, opts)
    if compiling:
        lp, ent = C.first_order(lp, ent)
    lp, ent = own_rows(plan, lp, ent)  # data_parallel: this rank's rows (no-op otherwise)
    return _with_row_outputs(logprob_result(lp, ent, rows, opts), plan.comm.own_rows(stats), rows, plan, opts)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


# The return type follows return_lse / return_entropy. Each overload repeats the keyword list (typing needs it in
# full); the implementation after them documents it.
@overload
def linear_cross_entropy(  # type: ignore[overload-overlap]  # row_outputs=() matches the last overload too
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    class_weight: Tensor | None = ...,
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
    row_outputs: tuple[()] = ...,
) -> Tensor: ...
@overload
def linear_cross_entropy(  # type: ignore[overload-overlap]  # row_outputs=() matches the last overload too
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    class_weight: Tensor | None = ...,
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
    row_outputs: tuple[()] = ...,
) -> tuple[Tensor, Tensor]: ...
@overload
def linear_cross_entropy(  # type: ignore[overload-overlap]  # row_outputs=() matches the last overload too
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    class_weight: Tensor | None = ...,
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
    row_outputs: tuple[()] = ...,
) -> Tensor | tuple[Tensor, Tensor]: ...
@overload
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = ...,
    class_weight: Tensor | None = ...,
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
    row_outputs: Collection[RowOutput],
) -> tuple[Tensor | tuple[Tensor, Tensor], RowOutputs]: ...


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    class_weight: Tensor | None = None,
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
    row_outputs: Collection[RowOutput] = (),
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor | tuple[Tensor, Tensor], RowOutputs]:
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
        class_weight: ``[V]`` floating, the whole (global) vocabulary's weights on every rank, or None:
            ``F.cross_entropy(weight=)``'s per-class weights (each rank reads its shard's slice). The
            target's weight scales its row, label smoothing weighs each class by its weight, and
            ``mean`` divides by the sum of the counted targets' weights (0 when that sum is 0).
            A constant: it must not require grad. ``z_loss`` is added per token, unweighted (``mean``:
            over the counted tokens, as Liger does). With ``label_smoothing``: no ``"mean_logit"`` row
            output, and with a softcap too one more logit pass in forward.
        ignore_index: targets equal to it contribute 0 loss and no gradient.
        reduction: ``"mean"`` over non-ignored tokens (0, not NaN, when all are ignored),
            ``"sum"`` or ``"none"`` (per-token loss, targets' shape, 0 at ignored positions).
        label_smoothing: PyTorch's definition, over the full (global) vocabulary.
        z_loss: coefficient of ``lse**2`` added per valid token.
        softcap: Gemma-style logit soft-capping, or None.
        shift: position ``i`` predicts ``targets[..., i + shift]`` (True = 1); the last ``shift``
            positions are ignored. Only the targets are shifted (hidden is never copied).
        shard: a :class:`VocabShard` for a vocab-parallel head, or None for one device. With
            ``data_parallel=True`` (FSDP2) each rank passes its own ``hidden [n_r, ..., D]`` /
            ``targets [n_r, ...]`` and gets the loss of its own tokens (docs/fsdp.md).
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
        filter_eps: triton impl: gradient filtering threshold (None = exact, "auto", or a number in [0, 1)).
        deterministic: triton impl: bitwise reproducible backward (no float atomics).
        row_outputs: any of ``"predicted"``, ``"is_top1"``, ``"log_sum_sq_probs"``, ``"mean_logit"``
            (:class:`cce_dist.RowOutputs`): per-token outputs from the same row statistics, not
            differentiable; a scalar loss with them forms its gradients in backward.

    Returns:
        float32 loss: a scalar for ``mean``/``sum``, targets' shape for ``none``; with
        ``return_lse``: ``(loss, lse)``; with ``row_outputs``: ``(that, RowOutputs)``.
        Differentiable (once) w.r.t. hidden, weight and bias;
        gradients come back in each tensor's dtype. Second-order gradients (``create_graph=True``)
        raise a RuntimeError: compute a gradient penalty from the materialized loss instead.
    """
    opts = options_for(CrossEntropyOptions, shard, hidden).from_keywords(
        ignore_index=ignore_index,
        shard=shard,
        impl=impl,
        chunk_size=chunk_size,
        deterministic=deterministic,
        softcap=softcap,
        shift=shift,
        filter_eps=filter_eps,
        row_outputs=row_outputs,
        reduction=reduction,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        return_lse=return_lse,
        grad_in_forward=grad_in_forward,
    )
    return _cross_entropy(hidden, weight, targets, bias, opts, class_weight)


@overload
def linear_logprobs(  # type: ignore[overload-overlap]  # row_outputs=() matches the last overload too
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
    row_outputs: tuple[()] = ...,
) -> Tensor: ...
@overload
def linear_logprobs(  # type: ignore[overload-overlap]  # row_outputs=() matches the last overload too
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
    row_outputs: tuple[()] = ...,
) -> tuple[Tensor, Tensor]: ...
@overload
def linear_logprobs(  # type: ignore[overload-overlap]  # row_outputs=() matches the last overload too
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
    row_outputs: tuple[()] = ...,
) -> Tensor | tuple[Tensor, Tensor]: ...
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
    row_outputs: Collection[RowOutput],
) -> tuple[Tensor | tuple[Tensor, Tensor], RowOutputs]: ...


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
    row_outputs: Collection[RowOutput] = (),
) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor | tuple[Tensor, Tensor], RowOutputs]:
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
        row_outputs: as in :func:`linear_cross_entropy`, of the tempered distribution.

    Returns:
        float32 ``logprobs`` of targets' shape (0 at ignored positions, never positive); with
        ``return_entropy``: ``(logprobs, entropy)`` (entropy 0 at ignored positions); with
        ``row_outputs``: ``(that, RowOutputs)``. Differentiable
        once; second-order gradients (``create_graph=True``) raise a RuntimeError.
    """
    opts = options_for(LogprobOptions, shard, hidden).from_keywords(
        ignore_index=ignore_index,
        shard=shard,
        impl=impl,
        chunk_size=chunk_size,
        deterministic=deterministic,
        softcap=softcap,
        shift=shift,
        filter_eps=filter_eps,
        row_outputs=row_outputs,
        temperature=temperature,
        return_entropy=return_entropy,
    )
    return _logprobs(hidden, weight, targets, bias, opts)


class LinearCrossEntropy(nn.Module):
    """Module form of :func:`linear_cross_entropy`; takes the same keyword options.

    ``forward(hidden [..., D], weight [V_local, D], targets [...], bias=None, class_weight=None)``
    (``class_weight [V]`` as in :func:`linear_cross_entropy`). The options are held in one frozen
    :class:`cce_dist.CrossEntropyOptions` (``.options``).
    """

    def __init__(self, **options) -> None:
        super().__init__()
        self.options = CrossEntropyOptions(**options)

    def forward(
        self,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        bias: Tensor | None = None,
        class_weight: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor] | tuple[Tensor | tuple[Tensor, Tensor], RowOutputs]:
        return _cross_entropy(hidden, weight, targets, bias, self.options, class_weight)

    def extra_repr(self) -> str:
        defaults = CrossEntropyOptions()
        changed = [
            f"{k}={getattr(self.options, k)!r}"
            for k in self.options.__dataclass_fields__
            if getattr(self.options, k) != getattr(defaults, k)
        ]
        return ", ".join(changed)
