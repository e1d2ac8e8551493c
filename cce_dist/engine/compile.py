"""torch.compile support: the loss as ``torch.library`` custom ops with an autograd formula.

:func:`cce_dist.linear_cross_entropy` / :func:`cce_dist.linear_logprobs` call into this module
when ``torch.compiler.is_compiling()``. Dynamo then sees, instead of the chunked Python loops of
the eager path (data-dependent control flow, ``.item()``), four opaque ops:

``cce_dist::ce_rows(hidden, weight, bias, targets, ...) -> (loss_rows, lse, lse_residual)``
``cce_dist::ce_rows_backward(...) -> (d_hidden, d_weight, d_bias)``
``cce_dist::logprob_rows(...) -> (logprob, entropy, stats)``
``cce_dist::logprob_rows_backward(...) -> (d_hidden, d_weight, d_bias)``

Each has a fake (meta) implementation, so shapes propagate without running it, and the forward
ops carry their backward through ``torch.library.register_autograd``. The options are passed as
scalar op arguments. Shifting the targets, flattening and the ``mean``/``sum`` reductions are
plain torch ops around them, so ``torch.compile(fullgraph=True)`` of a model that calls the loss
traces without a graph break and gives the eager numbers.

Everything before the ops is the eager path's own (:mod:`cce_dist.api` runs the driver's validation and plan,
:func:`cce_dist.driver.plan_call`, at trace time), so each eager check holds under compile; a refused call raises
while Dynamo traces it (under ``fullgraph=True`` torch reports it as an "Observed exception" graph break that names
the error). Inside the ops the implementation the driver resolved runs (the torch implementation on CPU, the Triton
one for CUDA tensors with ``impl="auto"``/``"triton"``), on one device. Under compile:

- ``shard`` (tensor parallelism) and DTensor inputs raise ``NotImplementedError``: run the
  vocab-parallel loss outside the compiled region (``torch.compiler.disable``) instead.
- ``grad_in_forward`` is ignored (the backward recomputes the logits from the saved lse).
- targets of any integer dtype are converted to int64 ids before the ops (as eager does); ids out
  of range raise (eager's check) when the op runs, not at trace time, on the shifted ids.
- second-order gradients are not supported: run eagerly (``backend="eager"``) the backward raises
  the library's error for ``create_graph=True``; behind AOTAutograd (``aot_eager``, ``inductor``)
  torch raises "torch.compile with aot_autograd does not currently support double backward" when
  the second-order graph is differentiated.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from ..core import formulas
from ..core import stats as S
from ..core.class_weight import ClassWeights, gamma_weights, row_weights, sum_column
from ..core.options import CrossEntropyOptions, LogprobOptions
from ..core.outputs import RowOutput, stats_needed
from .autograd import Plan, needed_input_grads, refuse_second_order
from .prepare import (
    Prepared,
    backend_kwargs,
    check_target_range,
    cross_entropy_result,
    is_dtensor,
    logprob_result,
    resolve_backend,
    resolve_filter_eps,
    to_dtype,
)

__all__ = ["check_compilable", "compiled_cross_entropy", "compiled_logprobs"]


# ----------------------------------------------------------------------------------------------
# eager bodies of the ops (run on real tensors; free to use Python control flow)
# ----------------------------------------------------------------------------------------------


def _stats(
    hidden,
    weight,
    bias,
    targets,
    *,
    compute_dtype,
    softcap,
    temperature,
    impl,
    chunk_size,
    need_entropy,
    need_sum,
    row_outputs: str,
):
    """The row statistics; ``row_outputs``: the op argument (the names joined by commas) whose columns to form.

    ``impl``: the implementation the driver resolved at trace time ("torch" / "triton"), which validated the
    options and the row outputs against it."""
    backend = resolve_backend(impl, hidden.device, hidden.shape[-1])
    needs = stats_needed(cast("tuple[RowOutput, ...]", tuple(n for n in row_outputs.split(",") if n)))
    kw = backend_kwargs(
        backend,
        chunk_size=chunk_size,
        need_entropy=need_entropy,
        need_sum=need_sum or needs["need_sum"],
        filter_eps=None,
        deterministic=False,
        need_argmax=needs["need_argmax"],
        need_sumsq=needs["need_sumsq"],
    )
    with torch.autocast(hidden.device.type, enabled=False):
        return backend.row_stats(
            hidden.to(compute_dtype),
            weight.to(compute_dtype),
            to_dtype(bias, compute_dtype),
            targets,
            vocab_start=0,
            softcap=softcap,
            temperature=temperature,
            **kw["row_stats"],
        )


def _grads(
    hidden,
    weight,
    bias,
    targets,
    lse,
    coef,
    *,
    compute_dtype,
    softcap,
    temperature,
    impl,
    chunk_size,
    filter_eps,
    deterministic,
    need_hidden,
    need_weight,
    need_bias,
    class_weights: ClassWeights | None = None,
):
    """The gradients from ``coef``; ``class_weights``: the implementation weighs their smoothing term per vocab row
    (:mod:`cce_dist.class_weight`)."""
    backend = resolve_backend(impl, hidden.device, hidden.shape[-1])
    # deterministic: torch.use_deterministic_algorithms is read when the op runs, as eager reads it when the loss is
    # called
    kw = backend_kwargs(
        backend,
        chunk_size=chunk_size,
        need_entropy=False,
        need_sum=True,
        filter_eps=filter_eps,
        deterministic=deterministic,
    )
    need_bias = need_bias and bias is not None
    with torch.autocast(hidden.device.type, enabled=False):
        h, w, b = hidden.to(compute_dtype), weight.to(compute_dtype), to_dtype(bias, compute_dtype)
        dh, dw, db = backend.grads(
            h,
            w,
            b,
            targets,
            lse,
            coef,
            vocab_start=0,
            softcap=softcap,
            temperature=temperature,
            need_hidden=need_hidden,
            need_weight=need_weight,
            need_bias=need_bias,
            gamma_weights=gamma_weights(class_weights),
            **kw["grads"],
        )
    # unused gradients come back as distinct empty tensors (outputs of a custom op must not alias)
    return (
        hidden.new_empty(0) if dh is None else dh.to(hidden.dtype),
        hidden.new_empty(0) if dw is None else dw.to(weight.dtype),
        hidden.new_empty(0) if db is None else db.to(bias.dtype),
    )


# ----------------------------------------------------------------------------------------------
# cross-entropy rows
# ----------------------------------------------------------------------------------------------
# torch.library.custom_op reads each op's schema from its annotated signature, so every op spells out its
# arguments in full. A backward op takes its forward op's tensors, what the forward saved and the upstream gradients,
# then the forward op's options (ctx.args, passed on positionally) and the three need_* flags:
# tests/test_signatures.py checks each backward op's parameters against its forward op's. _stats and _grads take
# their options by keyword, so a call cannot pass them in the wrong order.


@torch.library.custom_op("cce_dist::ce_rows", mutates_args=())
def _ce_rows(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    class_weight: Tensor | None,
    compute_dtype: torch.dtype,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    impl: str,
    chunk_size: int | None,
    row_outputs: str,
    filter_eps: float | None,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    del filter_eps, deterministic  # backward-only options
    vocab = weight.shape[0]
    check_target_range(targets, ignore_index, vocab)  # eager's check, when the op runs (a host read)
    valid = targets != ignore_index
    cw = _class_weights(class_weight, targets, valid, vocab, label_smoothing)
    stats = _stats(
        hidden,
        weight,
        bias,
        targets,
        compute_dtype=compute_dtype,
        softcap=softcap,
        temperature=1.0,
        impl=impl,
        chunk_size=chunk_size,
        need_entropy=False,
        need_sum=bool(label_smoothing) and cw is None,
        row_outputs=row_outputs,
    )
    if gamma_weights(cw) is not None:
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, b = hidden.to(compute_dtype), weight.to(compute_dtype), to_dtype(bias, compute_dtype)
            stats[:, S.SUM] = sum_column(cw, h, w, b, softcap)
    loss, lse = formulas.cross_entropy_rows(
        stats,
        valid,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        vocab_size=vocab,
        class_weights=None if cw is None else cw.terms,
    )
    return loss, lse, formulas.lse_residual(stats), stats


def _class_weights(class_weight, targets, valid, vocab: int, label_smoothing: float) -> ClassWeights | None:
    return (
        None
        if class_weight is None
        else ClassWeights.of(
            class_weight, targets, valid, vocab_start=0, v_local=vocab, label_smoothing=label_smoothing
        )
    )


@_ce_rows.register_fake
def _(hidden, *rest):  # shapes only: the outputs depend on the number of rows alone
    n = hidden.shape[0]
    rows = tuple(hidden.new_empty(n, dtype=torch.float32) for _ in range(3))
    return rows + (hidden.new_empty(n, S.NUM_STATS, dtype=torch.float32),)


@torch.library.custom_op("cce_dist::ce_rows_backward", mutates_args=())
def _ce_rows_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    class_weight: Tensor | None,
    lse: Tensor,
    lse_residual: Tensor,
    g_loss: Tensor,
    g_lse: Tensor,
    compute_dtype: torch.dtype,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    impl: str,
    chunk_size: int | None,
    row_outputs: str,
    filter_eps: float | None,
    deterministic: bool,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    valid = targets != ignore_index
    cw = _class_weights(class_weight, targets, valid, weight.shape[0], label_smoothing)
    coef = formulas.cross_entropy_coef(
        lse,
        valid,
        g_loss,
        g_lse,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        vocab_size=weight.shape[0],
        residual=lse_residual,
        class_weights=None if cw is None else cw.terms,
    )
    return _grads(
        hidden,
        weight,
        bias,
        targets,
        lse,
        coef,
        compute_dtype=compute_dtype,
        softcap=softcap,
        temperature=1.0,
        impl=impl,
        chunk_size=chunk_size,
        filter_eps=filter_eps,
        deterministic=deterministic,
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
        class_weights=cw,
    )


def _fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias):
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        torch.empty_like(bias) if (need_bias and bias is not None) else hidden.new_empty(0),
    )


@_ce_rows_backward.register_fake
def _(hidden, weight, bias, *rest):
    # shapes only; the op's last three arguments are need_hidden, need_weight, need_bias
    return _fake_grads(hidden, weight, bias, *rest[-3:])


def _ce_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, class_weight = inputs[:5]
    ctx.save_for_backward(hidden, weight, bias, targets, class_weight, output[1], output[2])
    ctx.args = inputs[5:]  # compute_dtype, ignore_index, label_smoothing, z_loss, softcap, impl, chunk, rows, fe, det


def _refuse_second_order() -> None:
    """The eager autograd Functions' rule (cce_dist.autograd.refuse_second_order), where it can be told: run eagerly
    (backend="eager") a backward with create_graph=True has grad mode on. AOTAutograd traces this backward with grad
    mode on for any backward and raises its own error on a double backward of the compiled graph."""
    if not torch.compiler.is_compiling() and not _tracing():
        refuse_second_order()


def _tracing() -> bool:
    from torch._guards import TracingContext

    return TracingContext.try_get() is not None


def _input_grads(ctx, needs, dh, dw, db) -> tuple:
    """The op's input gradients: hidden, weight, bias where needed, None for targets and options."""
    grads = tuple(g if need else None for g, need in zip((dh, dw, db), needs))
    return grads + (None,) * (1 + len(ctx.args))


def _ce_backward(ctx, g_loss, g_lse, g_residual, g_stats):
    del g_residual, g_stats  # not differentiable outputs of the API
    _refuse_second_order()
    hidden, weight, bias, targets, class_weight, lse, residual = ctx.saved_tensors
    needs = needed_input_grads(ctx, bias)
    g_loss = torch.zeros_like(lse) if g_loss is None else g_loss
    g_lse = torch.zeros_like(lse) if g_lse is None else g_lse
    dh, dw, db = torch.ops.cce_dist.ce_rows_backward(
        hidden, weight, bias, targets, class_weight, lse, residual, g_loss, g_lse, *ctx.args, *needs
    )
    return _input_grads(ctx, needs, dh, dw, db) + (None,)


# ----------------------------------------------------------------------------------------------
# logprob / entropy rows
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("cce_dist::logprob_rows", mutates_args=())
def _logprob_rows(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    compute_dtype: torch.dtype,
    ignore_index: int,
    softcap: float | None,
    temperature: float,
    return_entropy: bool,
    impl: str,
    chunk_size: int | None,
    row_outputs: str,
    filter_eps: float | None,
    deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    del filter_eps, deterministic  # backward-only options
    check_target_range(targets, ignore_index, weight.shape[0])  # eager's check, when the op runs (a host read)
    stats = _stats(
        hidden,
        weight,
        bias,
        targets,
        compute_dtype=compute_dtype,
        softcap=softcap,
        temperature=temperature,
        impl=impl,
        chunk_size=chunk_size,
        need_entropy=return_entropy,
        need_sum=False,
        row_outputs=row_outputs,
    )
    lp, ent = formulas.logprob_rows(stats, targets != ignore_index)
    return lp, ent, stats


@_logprob_rows.register_fake
def _(hidden, *rest):  # shapes only: the outputs depend on the number of rows alone
    n = hidden.shape[0]
    f32 = torch.float32
    return (hidden.new_empty(n, dtype=f32), hidden.new_empty(n, dtype=f32), hidden.new_empty(n, S.NUM_STATS, dtype=f32))


@torch.library.custom_op("cce_dist::logprob_rows_backward", mutates_args=())
def _logprob_rows_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    stats: Tensor,
    g_lp: Tensor,
    g_ent: Tensor,
    compute_dtype: torch.dtype,
    ignore_index: int,
    softcap: float | None,
    temperature: float,
    return_entropy: bool,
    impl: str,
    chunk_size: int | None,
    row_outputs: str,
    filter_eps: float | None,
    deterministic: bool,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    valid = targets != ignore_index
    coef = formulas.logprob_coef(stats, valid, g_lp, g_ent if return_entropy else None)
    return _grads(
        hidden,
        weight,
        bias,
        targets,
        S.lse(stats),
        coef,
        compute_dtype=compute_dtype,
        softcap=softcap,
        temperature=temperature,
        impl=impl,
        chunk_size=chunk_size,
        filter_eps=filter_eps,
        deterministic=deterministic,
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
    )


@_logprob_rows_backward.register_fake
def _(hidden, weight, bias, *rest):
    # shapes only; the op's last three arguments are need_hidden, need_weight, need_bias
    return _fake_grads(hidden, weight, bias, *rest[-3:])


def _lp_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets = inputs[:4]
    ctx.save_for_backward(hidden, weight, bias, targets, output[2])
    ctx.args = inputs[
        4:
    ]  # compute_dtype, ignore_index, softcap, temperature, return_entropy, impl, chunk, rows, fe, det


def _lp_backward(ctx, g_lp, g_ent, g_stats):
    _refuse_second_order()
    hidden, weight, bias, targets, stats = ctx.saved_tensors
    needs = needed_input_grads(ctx, bias)
    zeros = stats.new_zeros(stats.shape[0])
    dh, dw, db = torch.ops.cce_dist.logprob_rows_backward(
        hidden,
        weight,
        bias,
        targets,
        stats,
        zeros if g_lp is None else g_lp,
        zeros if g_ent is None else g_ent,
        *ctx.args,
        *needs,
    )
    return _input_grads(ctx, needs, dh, dw, db)


_ce_rows.register_autograd(_ce_backward, setup_context=_ce_setup_context)
_logprob_rows.register_autograd(_lp_backward, setup_context=_lp_setup_context)


# ----------------------------------------------------------------------------------------------
# the entry points api.py calls under torch.compile
# ----------------------------------------------------------------------------------------------


def check_compilable(hidden, weight, targets, bias, opts: CrossEntropyOptions | LogprobOptions) -> None:
    """What the compiled path does not support (one device only, no DTensor), refused before the driver runs: the
    rest of the validation is the eager path's own (:func:`cce_dist.driver.plan_call`, traced)."""
    if opts.shard is not None:
        raise NotImplementedError(
            "cce_dist under torch.compile supports one device only (shard=None); call the vocab-parallel loss "
            "outside the compiled region, e.g. wrap it in torch.compiler.disable"
        )
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias)):
        if t is not None and is_dtensor(t):
            raise NotImplementedError(
                f"cce_dist under torch.compile does not accept DTensor inputs ({name}); call it outside the "
                "compiled region (torch.compiler.disable) or pass local tensors with shard=VocabShard(...)"
            )


def _backward_options(rows: Prepared, opts: CrossEntropyOptions | LogprobOptions) -> tuple[float | None, bool]:
    """The backward-only op arguments: the resolved filtering threshold and the requested determinism."""
    fe = resolve_filter_eps(opts, rows.compute_dtype)
    return None if fe is None else float(fe), bool(opts.deterministic)


def compiled_cross_entropy(
    rows: Prepared,
    weight: Tensor,
    bias: Tensor | None,
    class_weight: Tensor | None,
    plan: Plan,
    opts: CrossEntropyOptions,
) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor]:
    """The cross-entropy (reduced, with the lse where asked) and the statistics, as traceable ops, from the rows and
    plan the driver made (called by the API under compile, after the eager path's validation)."""
    loss_rows, lse, _, stats = torch.ops.cce_dist.ce_rows(
        rows.hidden,
        weight,
        bias,
        rows.targets,
        class_weight,
        rows.compute_dtype,
        opts.ignore_index,
        float(opts.label_smoothing),
        float(opts.z_loss) if class_weight is None else 0.0,  # class weights: added from the lse (eager's rule)
        opts.softcap,
        plan.backend.NAME,
        opts.chunk_size,
        ",".join(opts.row_outputs),
        *_backward_options(rows, opts),
    )
    w_t = None
    if class_weight is not None:
        w_t = row_weights(class_weight.detach(), rows.targets, rows.targets != opts.ignore_index)
    return cross_entropy_result(loss_rows, lse, rows, opts, w_t), stats


def compiled_logprobs(
    rows: Prepared, weight: Tensor, bias: Tensor | None, plan: Plan, opts: LogprobOptions
) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor]:
    """The logprobs (and entropies where asked) and the statistics, as traceable ops (as
    :func:`compiled_cross_entropy`)."""
    lp, ent, stats = torch.ops.cce_dist.logprob_rows(
        rows.hidden,
        weight,
        bias,
        rows.targets,
        rows.compute_dtype,
        opts.ignore_index,
        opts.softcap,
        float(opts.temperature),
        bool(opts.return_entropy),
        plan.backend.NAME,
        opts.chunk_size,
        ",".join(opts.row_outputs),
        *_backward_options(rows, opts),
    )
    return logprob_result(lp, ent, rows, opts), stats
