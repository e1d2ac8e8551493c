"""torch.compile support: the loss as ``torch.library`` custom ops with an autograd formula.

:func:`cce_dist.linear_cross_entropy` / :func:`cce_dist.linear_logprobs` call into this module
when ``torch.compiler.is_compiling()``. Dynamo then sees, instead of the chunked Python loops of
the eager path (data-dependent control flow, ``.item()``), four opaque ops:

``cce_dist::ce_rows(hidden, weight, bias, targets, ...) -> (loss_rows, lse)``
``cce_dist::ce_rows_backward(...) -> (d_hidden, d_weight, d_bias)``
``cce_dist::logprob_rows(...) -> (logprob, entropy, stats)``
``cce_dist::logprob_rows_backward(...) -> (d_hidden, d_weight, d_bias)``

Each has a fake (meta) implementation, so shapes propagate without running it, and the forward
ops carry their backward through ``torch.library.register_autograd``. The options are passed as
scalar op arguments. Shifting the targets, flattening and the ``mean``/``sum`` reductions are
plain torch ops around them, so ``torch.compile(fullgraph=True)`` of a model that calls the loss
traces without a graph break and gives the eager numbers.

Inside the ops the eager implementations run (the torch implementation on CPU, the Triton one for
CUDA tensors with ``impl="auto"``/``"triton"``), on one device. Under compile:

- ``shard`` (tensor parallelism) and DTensor inputs raise ``NotImplementedError``: run the
  vocab-parallel loss outside the compiled region (``torch.compiler.disable``) instead.
- ``grad_in_forward`` is ignored (the backward recomputes the logits from the saved lse).
- targets of any integer dtype are converted to int64 ids before the ops (as eager does); ids out
  of range raise when the op runs, not at trace time.
- second-order gradients are not supported: run eagerly (``backend="eager"``) the backward raises
  the library's error for ``create_graph=True``; behind AOTAutograd (``aot_eager``, ``inductor``)
  torch raises "torch.compile with aot_autograd does not currently support double backward" when
  the second-order graph is differentiated.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import formulas as F
from . import stats as S
from .options import CrossEntropyOptions, LogprobOptions

__all__ = ["compiled_cross_entropy", "compiled_logprobs"]


# ----------------------------------------------------------------------------------------------
# eager bodies of the ops (run on real tensors; free to use Python control flow)
# ----------------------------------------------------------------------------------------------


def _backend(impl: str, hidden: Tensor):
    from .api import _resolve_backend

    return _resolve_backend(impl, hidden.device, hidden.shape[-1])


def _kwargs(backend, chunk_size: Optional[int], need_entropy: bool, filter_eps: Optional[float], deterministic: bool):
    from . import torch_impl
    from .api import _deterministic

    if backend is torch_impl:
        return ({"chunk_size": chunk_size, "need_entropy": need_entropy}, {"chunk_size": chunk_size})
    # read when the op runs, as eager reads it when the loss is called
    return ({}, {"filter_eps": filter_eps, "deterministic": _deterministic(deterministic)})


def _check_targets(targets: Tensor, ignore_index: int, vocab_size: int) -> None:
    t = targets[targets != ignore_index]
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise ValueError(
            f"targets must be in [0, {vocab_size}) or equal ignore_index ({ignore_index}); got ids in "
            f"[{int(t.min())}, {int(t.max())}]"
        )


def _cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return None if t is None else t.to(dtype)


def _stats(hidden, weight, bias, targets, compute_dtype, softcap, temperature, impl, chunk_size, need_entropy):
    backend = _backend(impl, hidden)
    kw, _ = _kwargs(backend, chunk_size, need_entropy, None, False)
    with torch.autocast(hidden.device.type, enabled=False):
        return backend.row_stats(
            hidden.to(compute_dtype), weight.to(compute_dtype), _cast(bias, compute_dtype), targets,
            vocab_start=0, softcap=softcap, temperature=temperature, **kw,
        )


def _grads(hidden, weight, bias, targets, lse, coef, compute_dtype, softcap, temperature, impl, chunk_size,
           filter_eps, deterministic, need_hidden, need_weight, need_bias):
    backend = _backend(impl, hidden)
    _, kw = _kwargs(backend, chunk_size, False, filter_eps, deterministic)
    need_bias = need_bias and bias is not None
    with torch.autocast(hidden.device.type, enabled=False):
        dh, dw, db = backend.grads(
            hidden.to(compute_dtype), weight.to(compute_dtype), _cast(bias, compute_dtype), targets, lse, coef,
            vocab_start=0, softcap=softcap, temperature=temperature, need_hidden=need_hidden,
            need_weight=need_weight, need_bias=need_bias, **kw,
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


@torch.library.custom_op("cce_dist::ce_rows", mutates_args=())
def _ce_rows(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, compute_dtype: torch.dtype,
    ignore_index: int, label_smoothing: float, z_loss: float, softcap: Optional[float], impl: str,
    chunk_size: Optional[int], filter_eps: Optional[float], deterministic: bool,
) -> tuple[Tensor, Tensor]:
    del filter_eps, deterministic  # backward-only options
    vocab = weight.shape[0]
    _check_targets(targets, ignore_index, vocab)
    stats = _stats(hidden, weight, bias, targets, compute_dtype, softcap, 1.0, impl, chunk_size, False)
    valid = targets != ignore_index
    return F.cross_entropy_rows(stats, valid, label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab)


@_ce_rows.register_fake
def _(hidden, weight, bias, targets, compute_dtype, ignore_index, label_smoothing, z_loss, softcap, impl,
      chunk_size, filter_eps, deterministic):
    n = hidden.shape[0]
    return hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("cce_dist::ce_rows_backward", mutates_args=())
def _ce_rows_backward(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, lse: Tensor, g_loss: Tensor,
    g_lse: Tensor, compute_dtype: torch.dtype, ignore_index: int, label_smoothing: float, z_loss: float,
    softcap: Optional[float], impl: str, chunk_size: Optional[int], filter_eps: Optional[float], deterministic: bool,
    need_hidden: bool, need_weight: bool, need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    valid = targets != ignore_index
    coef = F.cross_entropy_coef(lse, valid, g_loss, g_lse, label_smoothing=label_smoothing, z_loss=z_loss,
                                vocab_size=weight.shape[0])
    return _grads(hidden, weight, bias, targets, lse, coef, compute_dtype, softcap, 1.0, impl, chunk_size,
                  filter_eps, deterministic, need_hidden, need_weight, need_bias)


def _fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias):
    return (
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        torch.empty_like(bias) if (need_bias and bias is not None) else hidden.new_empty(0),
    )


@_ce_rows_backward.register_fake
def _(hidden, weight, bias, targets, lse, g_loss, g_lse, compute_dtype, ignore_index, label_smoothing, z_loss,
      softcap, impl, chunk_size, filter_eps, deterministic, need_hidden, need_weight, need_bias):
    return _fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _ce_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets = inputs[:4]
    ctx.save_for_backward(hidden, weight, bias, targets, output[1])
    ctx.args = inputs[4:]  # compute_dtype, ignore_index, label_smoothing, z_loss, softcap, impl, chunk, fe, det


def _refuse_second_order() -> None:
    """The eager autograd Functions' rule (cce_dist.autograd.refuse_second_order), where it can be told: run eagerly
    (backend="eager") a backward with create_graph=True has grad mode on. AOTAutograd traces this backward with grad
    mode on for any backward and raises its own error on a double backward of the compiled graph."""
    from .autograd import refuse_second_order

    if not torch.compiler.is_compiling() and not _tracing():
        refuse_second_order()


def _tracing() -> bool:
    from torch._guards import TracingContext

    return TracingContext.try_get() is not None


def _needed_input_grads(ctx, bias) -> tuple[bool, bool, bool]:
    """Whether hidden, weight and bias (when there is one) need a gradient."""
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    return bool(need_h), bool(need_w), bool(need_b and bias is not None)


def _input_grads(ctx, needs, dh, dw, db) -> tuple:
    """The op's input gradients: hidden, weight, bias where needed, None for targets and options."""
    grads = tuple(g if need else None for g, need in zip((dh, dw, db), needs))
    return grads + (None,) * (1 + len(ctx.args))


def _ce_backward(ctx, g_loss, g_lse):
    _refuse_second_order()
    hidden, weight, bias, targets, lse = ctx.saved_tensors
    needs = _needed_input_grads(ctx, bias)
    g_loss = torch.zeros_like(lse) if g_loss is None else g_loss
    g_lse = torch.zeros_like(lse) if g_lse is None else g_lse
    dh, dw, db = torch.ops.cce_dist.ce_rows_backward(hidden, weight, bias, targets, lse, g_loss, g_lse, *ctx.args,
                                                     *needs)
    return _input_grads(ctx, needs, dh, dw, db)


# ----------------------------------------------------------------------------------------------
# logprob / entropy rows
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("cce_dist::logprob_rows", mutates_args=())
def _logprob_rows(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, compute_dtype: torch.dtype,
    ignore_index: int, softcap: Optional[float], temperature: float, return_entropy: bool, impl: str,
    chunk_size: Optional[int], filter_eps: Optional[float], deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    del filter_eps, deterministic  # backward-only options
    _check_targets(targets, ignore_index, weight.shape[0])
    stats = _stats(hidden, weight, bias, targets, compute_dtype, softcap, temperature, impl, chunk_size,
                   return_entropy)
    lp, ent = F.logprob_rows(stats, targets != ignore_index)
    return lp, ent, stats


@_logprob_rows.register_fake
def _(hidden, weight, bias, targets, compute_dtype, ignore_index, softcap, temperature, return_entropy, impl,
      chunk_size, filter_eps, deterministic):
    n = hidden.shape[0]
    f32 = torch.float32
    return (hidden.new_empty(n, dtype=f32), hidden.new_empty(n, dtype=f32),
            hidden.new_empty(n, S.NUM_STATS, dtype=f32))


@torch.library.custom_op("cce_dist::logprob_rows_backward", mutates_args=())
def _logprob_rows_backward(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, stats: Tensor, g_lp: Tensor,
    g_ent: Tensor, compute_dtype: torch.dtype, ignore_index: int, softcap: Optional[float], temperature: float,
    return_entropy: bool, impl: str, chunk_size: Optional[int], filter_eps: Optional[float], deterministic: bool,
    need_hidden: bool, need_weight: bool, need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    valid = targets != ignore_index
    coef = F.logprob_coef(stats, valid, g_lp, g_ent if return_entropy else None)
    return _grads(hidden, weight, bias, targets, S.lse(stats), coef, compute_dtype, softcap, temperature, impl,
                  chunk_size, filter_eps, deterministic, need_hidden, need_weight, need_bias)


@_logprob_rows_backward.register_fake
def _(hidden, weight, bias, targets, stats, g_lp, g_ent, compute_dtype, ignore_index, softcap, temperature,
      return_entropy, impl, chunk_size, filter_eps, deterministic, need_hidden, need_weight, need_bias):
    return _fake_grads(hidden, weight, bias, need_hidden, need_weight, need_bias)


def _lp_setup_context(ctx, inputs, output):
    hidden, weight, bias, targets = inputs[:4]
    ctx.save_for_backward(hidden, weight, bias, targets, output[2])
    ctx.args = inputs[4:]  # compute_dtype, ignore_index, softcap, temperature, return_entropy, impl, chunk, fe, det


def _lp_backward(ctx, g_lp, g_ent, g_stats):
    _refuse_second_order()
    hidden, weight, bias, targets, stats = ctx.saved_tensors
    needs = _needed_input_grads(ctx, bias)
    zeros = stats.new_zeros(stats.shape[0])
    dh, dw, db = torch.ops.cce_dist.logprob_rows_backward(
        hidden, weight, bias, targets, stats, zeros if g_lp is None else g_lp, zeros if g_ent is None else g_ent,
        *ctx.args, *needs,
    )
    return _input_grads(ctx, needs, dh, dw, db)


_ce_rows.register_autograd(_ce_backward, setup_context=_ce_setup_context)
_logprob_rows.register_autograd(_lp_backward, setup_context=_lp_setup_context)


# ----------------------------------------------------------------------------------------------
# the entry points api.py calls under torch.compile
# ----------------------------------------------------------------------------------------------


def _unsupported(hidden, weight, targets, bias, opts) -> None:
    if opts.shard is not None:
        raise NotImplementedError(
            "cce_dist under torch.compile supports one device only (shard=None); call the vocab-parallel loss "
            "outside the compiled region, e.g. wrap it in torch.compiler.disable"
        )
    from .api import _is_dtensor

    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets), ("bias", bias)):
        if t is not None and _is_dtensor(t):
            raise NotImplementedError(
                f"cce_dist under torch.compile does not accept DTensor inputs ({name}); call it outside the "
                "compiled region (torch.compiler.disable) or pass local tensors with shard=VocabShard(...)"
            )


def _prepare(hidden, weight, targets, bias, opts):
    from .api import _check_tensors, _compute_dtype, _filter_eps, _shift_targets

    _unsupported(hidden, weight, targets, bias, opts)
    _check_tensors(hidden, weight, targets, bias, opts)
    compute_dtype = _compute_dtype(hidden, weight)
    # int64 ids before anything compares them with ignore_index or indexes with them (as eager does): int8/int16
    # ids index out of range and uint8 ids index as a boolean mask
    t = _shift_targets(targets.to(torch.int64), opts.shift, opts.ignore_index)
    fe = _filter_eps(opts, compute_dtype)
    extra = (None if fe is None else float(fe), bool(opts.deterministic))
    h2 = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])  # -1 cannot be inferred when D == 0
    return h2, t.reshape(-1), compute_dtype, extra


def compiled_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor],
                           opts: CrossEntropyOptions):
    """:func:`cce_dist.linear_cross_entropy` as traceable ops (called by the API under compile)."""
    h2, t1, compute_dtype, extra = _prepare(hidden, weight, targets, bias, opts)
    loss_rows, lse = torch.ops.cce_dist.ce_rows(
        h2, weight, bias, t1, compute_dtype, opts.ignore_index, float(opts.label_smoothing), float(opts.z_loss),
        opts.softcap, opts.impl, opts.chunk_size, *extra,
    )
    if opts.reduction == "none":
        loss = loss_rows.reshape(targets.shape)
    elif opts.reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = loss_rows.sum() / (t1 != opts.ignore_index).sum().clamp(min=1)
    return (loss, lse.reshape(targets.shape)) if opts.return_lse else loss


def compiled_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor],
                      opts: LogprobOptions):
    """:func:`cce_dist.linear_logprobs` as traceable ops (called by the API under compile)."""
    h2, t1, compute_dtype, extra = _prepare(hidden, weight, targets, bias, opts)
    lp, ent, _ = torch.ops.cce_dist.logprob_rows(
        h2, weight, bias, t1, compute_dtype, opts.ignore_index, opts.softcap, float(opts.temperature),
        bool(opts.return_entropy), opts.impl, opts.chunk_size, *extra,
    )
    shape = targets.shape
    return (lp.reshape(shape), ent.reshape(shape)) if opts.return_entropy else lp.reshape(shape)
