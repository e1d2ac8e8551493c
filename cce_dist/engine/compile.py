"""torch.compile support: the backend's two primitives as ``torch.library`` custom ops.

Under ``torch.compiler.is_compiling()`` (and on the meta device) :func:`cce_dist.linear_cross_entropy` and
:func:`cce_dist.linear_logprobs` run their eager path, traced by Dynamo: the driver, the autograd Functions
(``CrossEntropyRows``, ``LogprobRows``), :mod:`cce_dist.core.formulas`, the reduction. Only the plan's backend
differs, :func:`ops_backend`'s :class:`~cce_dist.core.backend.Backend`, whose primitives are opaque ops (fake
implementations give the shapes) running the implementation the driver resolved (its name is an op argument):

``cce_dist::row_stats(hidden, weight, bias, targets, *, ...) -> stats float32 [N, NUM_STATS]``
``cce_dist::grads(hidden, weight, bias, targets, lse, coef, gamma_weights, *, ...) -> (d_hidden, d_weight, d_bias)``

No formula lives here. Under compile:

- ``shard`` and DTensor inputs raise ``NotImplementedError`` (one device only): call the vocab-parallel loss outside
  the compiled region (``torch.compiler.disable``).
- ``grad_in_forward`` is ignored (the fused schedule is no primitive).
- the target ids are checked (eager's :func:`~cce_dist.engine.prepare.check_target_range`) inside ``row_stats`` when it
  runs: reading them at trace time would break the graph.
- ``create_graph=True`` raises: Dynamo traces the Functions' backward without grad mode, so ``cce_dist::first_order``
  (an identity on their outputs) applies their rule at run time (``backend="eager"``); behind AOTAutograd torch
  raises "torch.compile with aot_autograd does not currently support double backward".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import Tensor

from ..core.backend import Backend
from ..core.options import CrossEntropyOptions, LogprobOptions
from ..core.runtime import constant_result
from ..core.stats import NUM_STATS
from ..impl import backends
from .autograd import refuse_second_order
from .prepare import backend_kwargs, check_target_range, is_dtensor, resolve_backend

__all__ = ["check_compilable", "first_order", "implementation", "ops_backend"]


def implementation(name: str) -> Backend:
    """The implementation named ``name`` (its ``name``: ``"torch"`` or ``"triton"``), as resolved by the driver."""
    return backends.by_name(name)


@constant_result
def _resolved_name(impl: str, device: torch.device, hidden_dim: int) -> str:
    """The name of :func:`cce_dist.engine.prepare.resolve_backend`'s implementation, called, not traced, under
    torch.compile: it reads the Triton version (a regular expression, which Dynamo of torch 2.10 / 2.11 cannot
    trace) and the environment, constants of the process."""
    return resolve_backend(impl, device, hidden_dim).name


def ops_backend(impl: str, hidden: Tensor, ignore_index: int) -> Backend:
    """The implementation ``impl=`` resolves to for ``hidden``, its primitives replaced by the custom ops running it
    (the driver's backend under torch.compile and on the meta device). Its capabilities are the implementation's,
    so the driver builds the same keyword options; it has no fused schedule (``grad_in_forward`` is ignored under
    compile) and no distillation pass. ``ignore_index``: the id ``row_stats`` does not check (every other id must be
    in the vocabulary)."""
    # resolve_backend reads only whether the hidden size is 0 (a constant even under dynamic shapes)
    empty = bool(hidden.shape[-1] == 0)
    base = implementation(_resolved_name(impl, hidden.device, 0 if empty else 1))
    return dataclasses.replace(
        base,
        row_stats=functools.partial(_ops_row_stats, impl=base.name, ignore_index=ignore_index),
        grads=functools.partial(_ops_grads, impl=base.name),
        fused_cross_entropy=None,
        distill=None,
    )


# ----------------------------------------------------------------------------------------------
# the two primitives
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("cce_dist::row_stats", mutates_args=())
def _row_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    vocab_start: int,
    softcap: float | None,
    temperature: float,
    impl: str,
    ignore_index: int,
    # the implementations' declared options, defaulted as in their functions (an implementation that does not declare
    # one is not passed it)
    chunk_size: int | None = None,
    need_entropy: bool = True,
    need_sum: bool = True,
    need_argmax: bool = False,
    need_sumsq: bool = False,
) -> Tensor:
    """``impl``'s ``row_stats``, after eager's check of the target ids (a host read) against the vocabulary: the
    head's rows, on the one device the compiled path supports (:func:`check_compilable`)."""
    check_target_range(targets, ignore_index, vocab_start + weight.shape[0])
    backend = implementation(impl)
    kw = backend_kwargs(
        backend,
        chunk_size=chunk_size,
        need_entropy=need_entropy,
        need_sum=need_sum,
        need_argmax=need_argmax,
        need_sumsq=need_sumsq,
        filter_eps=None,
        deterministic=False,
    )
    return backend.row_stats(
        hidden,
        weight,
        bias,
        targets,
        vocab_start=vocab_start,
        softcap=softcap,
        temperature=temperature,
        **kw["row_stats"],
    )


@_row_stats.register_fake
def _(hidden, *args, **kwargs):  # shapes only
    return hidden.new_empty(hidden.shape[0], NUM_STATS, dtype=torch.float32)


@torch.library.custom_op("cce_dist::grads", mutates_args=())
def _grads(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    lse: Tensor,
    coef: Tensor,
    gamma_weights: Tensor | None,
    *,
    vocab_start: int,
    softcap: float | None,
    temperature: float,
    impl: str,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    chunk_size: int | None = None,
    filter_eps: float | None = None,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``impl``'s ``grads`` in float32; a gradient not needed (``d_bias`` without a bias) comes back empty (an op
    returns no None)."""
    need_bias = need_bias and bias is not None
    backend = implementation(impl)
    kw = backend_kwargs(
        backend,
        chunk_size=chunk_size,
        need_entropy=False,
        need_sum=False,
        filter_eps=filter_eps,
        deterministic=deterministic,
    )
    grads = backend.grads(
        hidden,
        weight,
        bias,
        targets,
        lse,
        coef,
        vocab_start=vocab_start,
        softcap=softcap,
        temperature=temperature,
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
        gamma_weights=gamma_weights,
        **kw["grads"],
    )
    # distinct empty tensors for the unused ones: the outputs of a custom op must not alias
    return tuple(hidden.new_empty(0, dtype=torch.float32) if g is None else g.float() for g in grads)  # type: ignore[return-value]


@_grads.register_fake
def _(hidden, weight, bias, *args, need_hidden, need_weight, need_bias, **kwargs):  # shapes only
    f32 = torch.float32
    return (
        torch.empty_like(hidden, dtype=f32) if need_hidden else hidden.new_empty(0, dtype=f32),
        torch.empty_like(weight, dtype=f32) if need_weight else hidden.new_empty(0, dtype=f32),
        torch.empty_like(bias, dtype=f32) if (need_bias and bias is not None) else hidden.new_empty(0, dtype=f32),
    )


# ----------------------------------------------------------------------------------------------
# second-order gradients
# ----------------------------------------------------------------------------------------------


@torch.library.custom_op("cce_dist::first_order", mutates_args=())
def _first_order(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The identity on a Function's two differentiable outputs, whose backward runs outside Dynamo's graphs."""
    return a.clone(), b.clone()


@_first_order.register_fake
def _(a, b):
    return torch.empty_like(a), torch.empty_like(b)


def _first_order_backward(ctx, ga, gb):
    """The Functions' rule (:func:`cce_dist.engine.autograd.refuse_second_order`) at run time: Dynamo traces their
    backward without grad mode, so there it cannot see ``create_graph=True``. AOTAutograd traces this backward with
    grad mode on for any backward (and raises its own error on a double backward of the compiled graph)."""
    if not torch.compiler.is_compiling() and not _tracing():
        refuse_second_order()
    return ga, gb


def _tracing() -> bool:
    from torch._guards import TracingContext

    return TracingContext.try_get() is not None


_first_order.register_autograd(_first_order_backward)


def first_order(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(a, b)`` (a Function's differentiable outputs) whose backward refuses ``create_graph=True``."""
    return torch.ops.cce_dist.first_order(a, b)


def _ops_row_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, **options: Any) -> Tensor:
    """``row_stats`` of :func:`ops_backend`: the op, given the contract's keywords, the options the driver built from
    the implementation's declared ones, and ``impl`` / ``ignore_index`` bound by :func:`ops_backend` (the op's schema
    names them all: tests/test_signatures.py)."""
    return torch.ops.cce_dist.row_stats(hidden, weight, bias, targets, **options)


def _ops_grads(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    lse: Tensor,
    coef: Tensor,
    *,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    gamma_weights: Tensor | None = None,
    **options: Any,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``grads`` of :func:`ops_backend`: the op (which returns empty tensors for the gradients not needed, an op
    returning no None) with ``gamma_weights`` passed positionally, as its schema has it."""
    need_bias = need_bias and bias is not None
    need = dict(need_hidden=need_hidden, need_weight=need_weight, need_bias=need_bias)
    dh, dw, db = torch.ops.cce_dist.grads(hidden, weight, bias, targets, lse, coef, gamma_weights, **need, **options)
    return (dh if need_hidden else None, dw if need_weight else None, db if need_bias else None)


def check_compilable(hidden: Any, weight: Any, targets: Any, bias: Any, opts: CrossEntropyOptions | LogprobOptions):
    """What the compiled path does not support (one device only, no DTensor), refused before the driver runs: the
    rest of the validation is the eager path's own (:func:`cce_dist.engine.driver.plan_call`, traced)."""
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
