"""torch.compile support: the backend's two primitives as ``torch.library`` custom ops.

Under ``torch.compiler.is_compiling()`` (and on the meta device) :func:`cce_dist.linear_cross_entropy` and
:func:`cce_dist.linear_logprobs` run their eager path, traced by Dynamo: the driver, the autograd Functions
(``CrossEntropyRows``, ``LogprobRows``), :mod:`cce_dist.core.formulas`, the reduction. Only the plan's backend
differs, an :class:`OpsBackend` whose :class:`~cce_dist.backend.Backend` primitives are opaque ops (fake
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

from typing import Any

import torch
from torch import Tensor

from ..core import stats as S
from ..core.backend import Backend
from ..core.options import CrossEntropyOptions, LogprobOptions
from ..impl import torch_cross_entropy as torch_impl
from .autograd import refuse_second_order
from .prepare import backend_kwargs, check_target_range, is_dtensor, resolve_backend

__all__ = ["OpsBackend", "check_compilable", "first_order", "implementation", "ops_backend"]


def implementation(name: str) -> Backend:
    """The implementation named ``name`` (its ``NAME``: ``"torch"`` or ``"triton"``), as resolved by the driver."""
    if name == torch_impl.NAME:
        return torch_impl
    from .. import kernels

    return kernels


@torch.compiler.assume_constant_result
def _resolved_name(impl: str, device: torch.device, hidden_dim: int) -> str:
    """The name of :func:`cce_dist.engine.prepare.resolve_backend`'s implementation, called, not traced, under
    torch.compile: it reads the Triton version (a regular expression, which Dynamo of torch 2.10 / 2.11 cannot
    trace) and the environment, constants of the process."""
    return resolve_backend(impl, device, hidden_dim).NAME


def ops_backend(impl: str, hidden: Tensor, ignore_index: int) -> OpsBackend:
    """The :class:`OpsBackend` of the implementation ``impl=`` resolves to for ``hidden`` (the driver's ``resolve``
    under torch.compile and on the meta device)."""
    # resolve_backend reads only whether the hidden size is 0 (a constant even under dynamic shapes)
    empty = bool(hidden.shape[-1] == 0)
    return OpsBackend(implementation(_resolved_name(impl, hidden.device, 0 if empty else 1)), ignore_index=ignore_index)


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
    chunk_size: int | None,
    need_entropy: bool,
    need_sum: bool,
    need_argmax: bool,
    need_sumsq: bool,
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
    return hidden.new_empty(hidden.shape[0], S.NUM_STATS, dtype=torch.float32)


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
    chunk_size: int | None,
    filter_eps: float | None,
    deterministic: bool,
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


class OpsBackend:
    """A :class:`~cce_dist.backend.Backend` whose ``row_stats`` / ``grads`` are the custom ops running ``backend``
    (whose capabilities it declares, so the driver builds the same keyword options). ``ignore_index``: the id
    ``row_stats`` does not check (every other id must be in the vocabulary)."""

    FUSED_CHUNKING = False  # the fused schedule is not a primitive: grad_in_forward is ignored under compile

    def __init__(self, backend: Backend, *, ignore_index: int):
        self.NAME = backend.NAME
        self.SUPPORTS_FILTERING = backend.SUPPORTS_FILTERING
        self.DETERMINISTIC_OPTION = backend.DETERMINISTIC_OPTION
        self.ROW_STATS_OPTIONS = backend.ROW_STATS_OPTIONS
        self.GRADS_OPTIONS = backend.GRADS_OPTIONS
        self.ignore_index = ignore_index

    def row_stats(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        *,
        vocab_start: int,
        softcap: float | None,
        temperature: float,
        chunk_size: int | None = None,
        need_entropy: bool = True,
        need_sum: bool = True,
        need_argmax: bool = False,
        need_sumsq: bool = False,
    ) -> Tensor:
        return torch.ops.cce_dist.row_stats(
            hidden,
            weight,
            bias,
            targets,
            vocab_start=vocab_start,
            softcap=softcap,
            temperature=temperature,
            impl=self.NAME,
            ignore_index=self.ignore_index,
            chunk_size=chunk_size,
            need_entropy=need_entropy,
            need_sum=need_sum,
            need_argmax=need_argmax,
            need_sumsq=need_sumsq,
        )

    def grads(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        lse: Tensor,
        coef: Tensor,
        *,
        vocab_start: int,
        softcap: float | None,
        temperature: float,
        need_hidden: bool,
        need_weight: bool,
        need_bias: bool,
        filter_eps: float | None = None,
        deterministic: bool = False,
        gamma_weights: Tensor | None = None,
        chunk_size: int | None = None,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        need_bias = need_bias and bias is not None
        dh, dw, db = torch.ops.cce_dist.grads(
            hidden,
            weight,
            bias,
            targets,
            lse,
            coef,
            gamma_weights,
            vocab_start=vocab_start,
            softcap=softcap,
            temperature=temperature,
            impl=self.NAME,
            need_hidden=need_hidden,
            need_weight=need_weight,
            need_bias=need_bias,
            chunk_size=chunk_size,
            filter_eps=filter_eps,
            deterministic=deterministic,
        )
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
