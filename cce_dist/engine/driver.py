"""The one driver every loss runs through, eager and compiled: validate -> handshake -> plan.

:func:`cce_dist.linear_cross_entropy`, :func:`cce_dist.linear_logprobs` (:mod:`cce_dist.api`) and
:func:`cce_dist.linear_distillation` (:mod:`cce_dist.distill`) describe their call as a :class:`Call`, a value (the
loss's name, its options, its tensors, the statistics its outputs read, its own handshake values), and get back the
rows and the :class:`~cce_dist.engine.autograd.Plan` their autograd Function runs. So a precaution taken here holds for
every loss:

1. validate locally on every rank (:func:`cce_dist.engine.prepare.prepare_rows` /
   :func:`~cce_dist.engine.prepare.prepare_distill_rows`: types, shapes, devices, target ids, class weights), and
   resolve the implementation (:func:`~cce_dist.engine.prepare.resolve_backend`, or under torch.compile its custom ops,
   :func:`cce_dist.engine.compile.ops_backend`), catching the error instead of raising it yet;
2. with a group of more than one rank, the handshake (:func:`cce_dist.tp.collectives.handshake`): one all-gather of
   every value that decides which collectives run and with what sizes, each named (the options by their dataclass
   fields), so a rank-local error or a disagreement raises on every rank, naming what differs;
3. the plan: the communicator, the vocabulary offset, the implementation's keyword options
   (:func:`cce_dist.engine.prepare.backend_kwargs`, from its declared capabilities) and the token chunk size every rank
   agrees on; then what the outputs need of the vocabulary every rank agreed on.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeVar, cast

import torch

from ..core import stats
from ..core.backend import Backend
from ..core.options import CommonOptions, CrossEntropyOptions, DistillationOptions, LossOptions, handshake_options
from ..core.shard import VocabShard
from ..impl import backends, torch_cross_entropy
from ..tp.collectives import Comm, Layout, data_parallel_layout, handshake, released, values_checksum
from .autograd import Plan
from .prepare import (
    Prepared,
    backend_kwargs,
    check_class_weight,
    check_row_stats_support,
    check_target_range,
    distill_kwargs,
    grad_needs,
    prepare_distill_rows,
    prepare_rows,
    resolve_backend,
    resolve_filter_eps,
)

__all__ = ["Call", "StatsNeeds", "options_for", "plan_call", "refuse_on_group"]

Named = tuple[tuple[str, object], ...]
LossForm = Literal["cross-entropy", "logprobs", "distillation"]


@dataclass(frozen=True)
class StatsNeeds:
    """Which optional statistics a loss's outputs read (for the implementations that can skip them)."""

    entropy: bool = False
    sum: bool = False
    argmax: bool = False
    sumsq: bool = False


@dataclass(frozen=True)
class Call:
    """One call of a loss, as the driver needs it: values only.

    form          the loss's name in the handshake
    opts          its options (every loss's share the :class:`~cce_dist.core.options.LossOptions` fields)
    hidden, weight, targets, bias
                  the (student's) tensors as passed: ``hidden [..., D]`` (this rank's slice under sequence
                  parallelism), ``weight [V_local, D]``, ``targets [...]`` integer global ids (distillation: or None),
                  ``bias [V_local]`` or None
    needs         the optional statistics its outputs read
    teacher       distillation's ``(teacher_hidden, teacher_weight, teacher_bias)``; None for one head
    class_weight  cross-entropy's ``class_weight [V]`` or None (its values are fingerprinted in the handshake)
    extra         the loss's own handshake values, each named (e.g. whether the gradients are formed in forward)
    compiling     the backend is the custom ops (:mod:`cce_dist.engine.compile`): under torch.compile and on the meta
                  device, where the target ids are checked when the ops run (reading them here breaks the graph)
    """

    form: LossForm
    opts: LossOptions
    hidden: Any
    weight: Any
    targets: Any
    bias: Any
    needs: StatsNeeds
    teacher: tuple[Any, Any, Any] | None = None
    class_weight: Any = None
    extra: Named = ()
    compiling: bool = False

    @property
    def head(self) -> str:
        """The prefix of the (student's) argument names in messages."""
        return "" if self.teacher is None else "student_"


def _validate(call: Call) -> tuple[Prepared, Backend]:
    """This rank's checks (raising TypeError / ValueError / RuntimeError naming the argument), its rows and the
    implementation."""
    opts = call.opts
    if call.teacher is not None:
        assert isinstance(opts, DistillationOptions)
        th, tw, tb = call.teacher
        rows = prepare_distill_rows(call.hidden, call.weight, th, tw, call.targets, call.bias, tb, opts)
        # "auto" takes the torch implementation on every device: the distillation kernels have been checked in
        # Triton's interpreter and compiled for GPU targets, not yet timed on one. A zero hidden size (either head)
        # runs the torch implementation.
        impl = "triton" if opts.impl == "triton" else "torch"
        return rows, resolve_backend(impl, call.hidden.device, min(call.hidden.shape[-1], th.shape[-1]))
    assert isinstance(opts, CommonOptions)
    if isinstance(opts, CrossEntropyOptions):
        check_class_weight(call.class_weight, call.hidden, call.weight, opts)
    rows = prepare_rows(call.hidden, call.weight, call.targets, call.bias, opts, check_ids=not call.compiling)
    if call.compiling:
        from .compile import ops_backend

        backend = ops_backend(opts.impl, call.hidden, opts.ignore_index)
    else:
        backend = resolve_backend(opts.impl, call.hidden.device, call.hidden.shape[-1])
    check_row_stats_support(
        backend, {"need_argmax": call.needs.argmax, "need_sumsq": call.needs.sumsq}, opts.row_outputs
    )
    return rows, backend


def _validated_values(call: Call, rows: Prepared | None) -> Named:
    """The handshake values only a rank whose inputs validated can form (None on one that failed, whose error the
    handshake raises instead): class weights' checksum, the teacher head's geometry."""
    out: Named = ()
    if call.class_weight is not None:
        out += (("class_weight's values (checksum)", None if rows is None else values_checksum(call.class_weight)),)
    if call.teacher is not None:
        out += (
            ("the teacher's compute dtype", str(None if rows is None else rows.teacher_dtype)),
            (
                "the teacher's hidden size (teacher_hidden.shape[-1] = teacher_weight.shape[1])",
                None if rows is None else call.teacher[0].shape[-1],
            ),
        )
    return out


def plan_call(call: Call) -> tuple[Prepared, Plan]:
    """Validate (locally, then with the group), flatten and plan: the rows and the :class:`Plan` of one call."""
    opts, shard = call.opts, call.opts.shard
    error: BaseException | None = None
    rows: Prepared | None = None
    backend: Backend = backends.TORCH  # what a failed rank names in the handshake
    try:
        rows, backend = _validate(call)
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
        layout = _exchange(call, shard, error, rows, backend.name)
        assert rows is not None  # the exchange raised this rank's error, if any, on every rank

    if call.needs.argmax and layout.vocab_size > stats.MAX_EXACT_ID:
        raise ValueError(
            f"row_outputs 'predicted' / 'is_top1' need a vocabulary below 2**24 ids (float32 statistics), got "
            f"{layout.vocab_size}"
        )
    if call.teacher is not None:
        kwargs = distill_kwargs(backend, deterministic=opts.deterministic)
    else:
        assert isinstance(opts, CommonOptions)
        kwargs = backend_kwargs(
            backend,
            chunk_size=opts.chunk_size,
            need_entropy=call.needs.entropy,
            need_sum=call.needs.sum,
            need_argmax=call.needs.argmax,
            need_sumsq=call.needs.sumsq,
            filter_eps=resolve_filter_eps(opts, rows.compute_dtype),
            deterministic=opts.deterministic,
        )
    plan = Plan(
        backend=backend,
        compute_dtype=rows.compute_dtype,
        teacher_dtype=rows.teacher_dtype,
        vocab_start=0 if shard is None else shard.start,
        vocab_size=layout.vocab_size,
        comm=Comm(shard, layout),
        backend_kwargs=kwargs,
        # from values every rank agreed on, so the per-chunk collectives line up
        chunk_tokens=torch_cross_entropy.chunk_tokens(layout.n_tokens, layout.max_local, opts.chunk_size),
    )
    return rows, plan


def _collective_device(hidden: object) -> torch.device:
    """Where a call's handshake runs: its hidden states' device (CPU for a non-tensor, which validation refuses)."""
    return hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")


def refuse_on_group(shard: VocabShard | None, error: BaseException, hidden: object) -> NoReturn:
    """Raise ``error``, a check of this rank's own inputs that a wrapper makes before its loss call (an integration's
    labels, a weight it was handed), the way :func:`plan_call` raises its own: the group is told first (the
    handshake's one all-gather, this rank marked as failed), so the other ranks, in the handshake of the same call,
    raise :class:`cce_dist.InputError` naming this rank instead of waiting in a collective. Alone, or without the
    handshake (``shard.check=False``, documented to strand the others), it raises at once. ``hidden``: the loss's
    hidden states (the handshake's collective runs on their device)."""
    if shard is not None and shard.world_size > 1 and shard.check:
        handshake(
            shard,
            error,
            n_tokens=0,
            n_local_tokens=0,
            hidden_dim=0,
            options=(),
            targets=None,
            ignore_index=0,
            device=_collective_device(hidden),
        )
    raise error


_Options = TypeVar("_Options", bound=LossOptions)


def options_for(cls: type[_Options], shard: object, hidden: object) -> type[_Options]:
    """What an entry point builds its options with: ``cls`` (an options dataclass), or, for a call with a ``shard``
    outside torch.compile, a stand-in whose ``from_keywords`` raises an invalid option through the group
    (:func:`refuse_on_group`): options are checked when built, before :func:`plan_call` can hand the error to the
    handshake, so one rank's bad ``label_smoothing`` had left the others waiting in it. Under torch.compile (which
    refuses a shard anyway) and without a shard, ``cls`` itself, traced as before."""
    if shard is None or not isinstance(shard, VocabShard) or torch.compiler.is_compiling():
        return cls
    return cast("type[_Options]", _OptionsRefusedOnGroup(cls, shard, hidden))


@dataclass(frozen=True)
class _OptionsRefusedOnGroup:
    """:func:`options_for`'s stand-in: ``cls.from_keywords``, its TypeError / ValueError raised on every rank."""

    cls: Any
    shard: VocabShard
    hidden: object

    def from_keywords(self, **keywords: Any) -> Any:
        try:
            return self.cls.from_keywords(**keywords)
        except (TypeError, ValueError) as e:
            refuse_on_group(self.shard, e, self.hidden)


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
        + call.extra
        + _validated_values(call, rows)
        + (
            ("sequence_parallel", sp),
            ("reduce_hidden_grad", shard.reduce_hidden_grad),
            ("stats_collective", shard.stats_collective),
            (dtype_name, str(None if rows is None else rows.compute_dtype)),
            (f"which of {p}hidden/{p}weight/{p}bias require grad", grad_needs(hidden, call.weight, call.bias)),
            ("the implementation (torch/triton) that impl= resolved to", backend_name),
        )
    )
    device = _collective_device(hidden)
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
