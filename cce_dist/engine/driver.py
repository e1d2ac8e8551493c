"""The one eager driver every loss runs through: validate -> handshake -> plan.

:func:`cce_dist.linear_cross_entropy`, :func:`cce_dist.linear_logprobs` (:mod:`cce_dist.api`) and
:func:`cce_dist.linear_distillation` (:mod:`cce_dist.distill`) describe their call as a :class:`Call` (the loss's name,
its options, how to validate and flatten its tensors, which implementation to resolve) and get back the rows and the
:class:`~cce_dist.engine.autograd.Plan` their autograd Function runs. So a precaution taken here holds for every loss:

1. validate locally on every rank (``Call.prepare``: types, shapes, devices, target ids), and resolve the
   implementation (``Call.resolve``: a :class:`~cce_dist.core.backend.Backend` or
   :class:`~cce_dist.core.backend.DistillBackend`), catching the error instead of raising it yet;
2. with a group of more than one rank, the handshake (:func:`cce_dist.tp.collectives.handshake`): one all-gather of
   every value that decides which collectives run and with what sizes, each named (the options by their dataclass
   fields), so a rank-local error or a disagreement raises on every rank, naming what differs;
3. the plan: the communicator, the vocabulary offset, the implementation's keyword options
   (:func:`cce_dist.engine.prepare.backend_kwargs`, from its declared capabilities) and the token chunk size every rank
   agrees on.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from ..core.backend import Capabilities
from ..core.options import CommonOptions, LossOptions, handshake_options
from ..core.shard import VocabShard
from ..impl import torch_cross_entropy
from ..tp.collectives import Comm, Layout, data_parallel_layout, handshake, released
from .autograd import Plan
from .prepare import Prepared, backend_kwargs, check_target_range, grad_needs, resolve_filter_eps

__all__ = ["Call", "plan_call"]

B = TypeVar("B", bound=Capabilities)
Named = tuple[tuple[str, object], ...]


def _no_extra(rows: Prepared | None) -> Named:
    return ()


@dataclass(frozen=True)
class Call(Generic[B]):
    """One call of a loss, as the driver needs it.

    form        the loss's name in the handshake ("cross-entropy", "logprobs", "distillation")
    opts        its options (every loss's share the :class:`~cce_dist.core.options.LossOptions` fields)
    hidden      the (student's) hidden as passed: its device, hidden size and sequence-parallel slice
    weight      the (student's) head ``[V_local, D]`` as passed
    bias        the (student's) bias or None (which of hidden/weight/bias require grad is compared)
    prepare     local validation (raises TypeError / ValueError / RuntimeError naming the argument) and the rows
    resolve     the implementation for the prepared rows (raises RuntimeError naming ``impl``)
    extra       the loss's own handshake values, from the rows (None on a rank whose validation failed)
    head        the prefix of the (student's) argument names in messages ("" or "student_")
    need_entropy, need_sum, need_argmax, need_sumsq
                which optional statistics the outputs read (for the implementations that can skip them)
    """

    form: str
    opts: LossOptions
    hidden: Any
    weight: Any
    bias: Any
    prepare: Callable[[], Prepared]
    resolve: Callable[[Prepared], B]
    extra: Callable[[Prepared | None], Named] = field(default=_no_extra)
    head: str = ""
    need_entropy: bool = False
    need_sum: bool = False
    need_argmax: bool = False
    need_sumsq: bool = False


def plan_call(call: Call[B]) -> tuple[Prepared, Plan[B]]:
    """Validate (locally, then with the group), flatten and plan: the rows and the :class:`Plan` of one call."""
    opts, shard = call.opts, call.opts.shard
    error: BaseException | None = None
    rows: Prepared | None = None
    backend: Any = torch_cross_entropy  # what a failed rank names in the handshake
    try:
        rows = call.prepare()
        backend = call.resolve(rows)
    except (TypeError, ValueError, RuntimeError) as e:
        error, rows = e, None

    if shard is None or shard.world_size == 1:
        if error is not None:
            raise error
        assert rows is not None
        if shard is not None and shard.start != 0:
            raise ValueError(f"a single-rank VocabShard must start at 0, got start={shard.start}")
        # an int under torch.compile too: Dynamo cannot lift a symbolic size only a Function's backward reads
        v_local = operator.index(call.weight.shape[0])
        layout = Layout(
            vocab_size=v_local if shard is None else shard.stop, n_tokens=rows.targets.numel(), max_local=v_local
        )
    else:
        layout = _exchange(call, shard, error, rows, backend.NAME)
        assert rows is not None  # the exchange raised this rank's error, if any, on every rank

    filter_eps = resolve_filter_eps(opts, rows.compute_dtype) if isinstance(opts, CommonOptions) else None
    plan = Plan(
        backend=backend,
        compute_dtype=rows.compute_dtype,
        teacher_dtype=rows.teacher_dtype,
        vocab_start=0 if shard is None else shard.start,
        vocab_size=layout.vocab_size,
        comm=Comm(shard, layout),
        backend_kwargs=backend_kwargs(
            backend,
            chunk_size=opts.chunk_size,
            need_entropy=call.need_entropy,
            need_sum=call.need_sum,
            need_argmax=call.need_argmax,
            need_sumsq=call.need_sumsq,
            filter_eps=filter_eps,
            deterministic=opts.deterministic,
        ),
        # from values every rank agreed on, so the per-chunk collectives line up
        chunk_tokens=torch_cross_entropy.chunk_tokens(layout.n_tokens, layout.max_local, opts.chunk_size),
    )
    return rows, plan


def _exchange(
    call: Call, shard: VocabShard, error: BaseException | None, rows: Prepared | None, backend_name: str
) -> Layout:
    """A group of more than one rank: the handshake (or, with ``check=False``, the vocab size alone).

    Raises this rank's ``error`` after telling the others, so none is left waiting in a collective."""
    opts, hidden, p = call.opts, call.hidden, call.head
    sp = shard.sequence_parallel
    n_local = hidden.shape[0] if (rows is not None and sp) else 0
    n_tokens = rows.targets.numel() if rows is not None else 0
    # Everything that decides which collectives run, and with what sizes, must agree; each is named, so a
    # disagreement names what differs. The resolved implementation too: the torch one forms scalar-loss gradients in
    # forward with one statistics collective per token chunk, the triton one issues a single one.
    dtype_name = "the student's compute dtype" if p else "the compute dtype"
    named = (
        (("the loss", call.form),)
        + handshake_options(opts)
        + call.extra(rows)
        + (
            ("sequence_parallel", sp),
            ("reduce_hidden_grad", shard.reduce_hidden_grad),
            ("stats_collective", shard.stats_collective),
            (dtype_name, str(None if rows is None else rows.compute_dtype)),
            (f"which of {p}hidden/{p}weight/{p}bias require grad", grad_needs(hidden, call.weight, call.bias)),
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
        return layout
    return handshake(
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


def _cheap_layout(shard: VocabShard, n_tokens: int, device: torch.device) -> Layout:
    """check=False: learn only the global vocab and the largest shard (one tiny all-reduce; data_parallel: the
    token counts too, one tiny all-gather)."""
    import torch.distributed as dist

    if shard.data_parallel:
        return data_parallel_layout(shard, n_tokens, device)

    buf = torch.tensor([shard.stop, shard.local_size], dtype=torch.int64, device=device)
    with released([buf]):  # see tp.collectives.released: the worker thread must not outlive the call with it
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=shard.group)
    v, max_local = (int(x) for x in buf.tolist())
    return Layout(vocab_size=v, n_tokens=n_tokens, max_local=max_local)
