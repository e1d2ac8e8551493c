"""What every call does before and after the loss itself, shared by the eager and the compiled path.

Before: validate the tensors (local checks only: no collective here), convert the targets to int64 ids and shift
them, flatten to rows, choose the compute dtype, resolve the implementation and build its keyword options.
After: reduce the per-row loss (``mean`` / ``sum`` / ``none``) and reshape the per-token outputs.

Shapes: ``hidden [..., D]``, ``weight [V_local, D]``, ``targets [...]`` (integer global ids). Under
``shard.sequence_parallel`` hidden holds this rank's slice of the first dimension:
``hidden.shape[0] * P == targets.shape[0]``.

Nothing here touches autograd or process groups: :mod:`cce_dist.api` runs the handshake and the autograd
Functions, :mod:`cce_dist.engine.compile` the backend's primitives as custom ops.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from ..core.backend import Backend
from ..core.options import CommonOptions, CrossEntropyOptions, DistillationOptions, LogprobOptions, Reduction
from ..impl import backends

if TYPE_CHECKING:  # pragma: no cover
    from ..core.shard import VocabShard

__all__ = [
    "Prepared",
    "as_rows",
    "backend_kwargs",
    "check_head",
    "check_row_stats_support",
    "check_target_range",
    "check_targets",
    "check_tensors",
    "compute_dtype",
    "cross_entropy_result",
    "distill_kwargs",
    "grad_needs",
    "is_dtensor",
    "known_vocab",
    "logprob_result",
    "prepare_distill_rows",
    "prepare_rows",
    "reduce_loss",
    "resolve_backend",
    "resolve_deterministic",
    "resolve_filter_eps",
    "row_mask",
    "shift_targets",
    "to_dtype",
    "token_shape",
    "valid_id_range",
]


# ----------------------------------------------------------------------------------------------
# validation (local: runs on every rank before any collective)
# ----------------------------------------------------------------------------------------------


def _functorch_wrapped(t: Any) -> bool:
    """Whether ``t`` is a ``torch.func`` transform's wrapper (``vmap``'s batched tensor, ``grad``'s tracking one)."""
    if torch.compiler.is_compiling():  # Dynamo cannot trace the query; a traced call holds fake tensors, not wrappers
        return False
    wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return isinstance(t, torch.Tensor) and wrapped is not None and bool(wrapped(t))


def check_plain_tensors(*named: tuple[str, Any]) -> None:
    """Refuse ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``, ...) with the alternative, naming the argument:
    the loss's autograd Functions read ids and schedules on the host, which a transform's wrapper has no storage for."""
    for name, t in named:
        if _functorch_wrapped(t):
            raise NotImplementedError(
                f"cce_dist does not run under torch.func transforms (vmap, grad, jacrev, ...): {name} is a "
                "transform's wrapped tensor. Flatten the batch into the token dimension instead (hidden [B*N, D], "
                "targets [B*N], reduction='none', then reshape the per-token results to [B, N]); for gradients "
                "call backward() or torch.autograd.grad outside the transform"
            )


def check_head(
    hidden: Any, weight: Any, bias: Any, shard: VocabShard | None, *, prefix: str = "", ref: Any = None
) -> None:
    """One head's ``hidden [..., D]``, ``weight [V_local, D]`` and ``bias [V_local]`` (or None): types, dtypes, shapes,
    devices and the shard's size; raises TypeError / ValueError naming the argument (``prefix`` + ``hidden`` etc.).

    ``ref``: ``(name, tensor)`` whose device every tensor must share (default: this head's hidden)."""
    h, w, b = (prefix + name for name in ("hidden", "weight", "bias"))
    check_plain_tensors((h, hidden), (w, weight), (b, bias))
    for name, t in ((h, hidden), (w, weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{b} must be a torch.Tensor or None, got {type(bias).__name__}")
    for name, t in ((h, hidden), (w, weight), (b, bias)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{w} must be 2-D [V_local, D], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1:
        raise ValueError(f"{h} must have at least one dimension [..., D]")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{h}'s last dimension ({hidden.shape[-1]}) must equal {w}.shape[1] ({weight.shape[1]})")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"{b} must have shape [{weight.shape[0]}] ({w}.shape[0]), got {tuple(bias.shape)}")
    ref_name, ref_t = ref if ref is not None else (h, hidden)
    for name, t in ((h, hidden), (w, weight), (b, bias)):
        if t is not None and t.device != ref_t.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref_t.device}")
    if shard is not None and weight.shape[0] != shard.local_size:
        raise ValueError(
            f"{w}.shape[0] ({weight.shape[0]}) must equal the shard size stop - start = {shard.local_size}"
        )


def token_shape(hidden: Tensor, shard: VocabShard | None) -> tuple[int, ...]:
    """The shape of the targets and of every per-token output: ``hidden.shape[:-1]``, with the first dimension
    gathered (times the group size) under sequence parallelism."""
    shape = tuple(hidden.shape[:-1])
    if shard is not None and shard.sequence_parallel and shard.world_size > 1:
        shape = (shape[0] * shard.world_size,) + shape[1:]
    return shape


def check_targets(targets: Any, hidden: Tensor, shard: VocabShard | None, *, hidden_name: str = "hidden") -> None:
    """``targets [...]``: an integer tensor on ``hidden``'s device of :func:`token_shape`; raises naming it."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
    check_plain_tensors(("targets", targets))
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor of class ids, got dtype {targets.dtype}")
    if targets.device != hidden.device:
        raise ValueError(f"targets is on {targets.device} but {hidden_name} is on {hidden.device}")
    sp = shard is not None and shard.sequence_parallel and shard.world_size > 1
    if sp and hidden.dim() < 2:
        raise ValueError(f"sequence_parallel needs {hidden_name} [n/P, ..., D] and targets [n, ...]")
    want = token_shape(hidden, shard)
    if tuple(targets.shape) != want:
        where = f"{hidden_name}.shape[:-1]" + (", times tp_size along dim 0 under sequence parallelism" if sp else "")
        raise ValueError(f"targets must have shape {want} ({where}), got {tuple(targets.shape)}")


def check_tensors(hidden: Any, weight: Any, targets: Any, bias: Any, opts: CommonOptions) -> None:
    """Types, dtypes, shapes and devices of the arguments; raises TypeError / ValueError naming the argument."""
    check_head(hidden, weight, bias, opts.shard)
    check_targets(targets, hidden, opts.shard)


def valid_id_range(targets: Tensor, ignore_index: int) -> tuple[int, int] | None:
    """``(min, max)`` of the ids that are not ``ignore_index``, or None when there are none (reads to the host).

    Compared as int64 whatever the targets' integer dtype: ``uint8`` targets compared with ``ignore_index=-100``
    directly would wrap it to 156 and skip that id here while the loss reads it as a class."""
    if targets.numel() == 0:
        return None
    t = targets.to(torch.int64).reshape(-1)
    valid = t != ignore_index
    big = torch.iinfo(torch.int64)
    # One read-back of three numbers (no boolean indexing, which is a read-back of its own, and one per min / max).
    lo, hi, count = torch.stack(
        [torch.where(valid, t, big.max).min(), torch.where(valid, t, big.min).max(), valid.sum()]
    ).tolist()
    if count == 0:
        return None
    return int(lo), int(hi)


def check_target_range(targets: Tensor, ignore_index: int, vocab_size: int | None) -> None:
    """Targets must be ignore_index or in [0, vocab_size) (upper bound checked only if known)."""
    ids = valid_id_range(targets, ignore_index)
    if ids is None:
        return
    lo, hi = ids
    if lo < 0:
        raise ValueError(f"targets contain id {lo}: ids must be in [0, V) or equal ignore_index ({ignore_index})")
    if vocab_size is not None and hi >= vocab_size:
        raise ValueError(f"targets contain id {hi}, outside the vocabulary [0, {vocab_size})")


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    # Only look if DTensor was imported already (importing it costs seconds): a DTensor exists only then.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def grad_needs(hidden: Any, weight: Any, bias: Any) -> tuple[bool, bool, bool]:
    """Which of hidden, weight, bias will receive a gradient (grad mode on and ``requires_grad``; False for None
    or for a non-tensor argument that validation is about to reject)."""
    on = torch.is_grad_enabled()
    return (
        on and bool(getattr(hidden, "requires_grad", False)),
        on and bool(getattr(weight, "requires_grad", False)),
        on and bool(getattr(bias, "requires_grad", False)),
    )


# ----------------------------------------------------------------------------------------------
# targets, rows, dtype
# ----------------------------------------------------------------------------------------------


def shift_targets(targets: Tensor, shift: int, ignore_index: int) -> Tensor:
    """Position i predicts target i + shift: a shifted copy of the (small) targets, never of hidden."""
    if shift == 0:
        return targets
    out = torch.full_like(targets, ignore_index)
    if targets.dim() and targets.shape[-1] > shift:
        out[..., :-shift] = targets[..., shift:]
    return out


def autocast_available(device_type: str) -> bool:
    """Whether ``device_type`` has autocast ("meta" has none: ``torch.is_autocast_enabled("meta")`` raises).

    Dynamo of torch 2.10 / 2.11 cannot trace ``torch.amp.is_autocast_available`` (a C builtin), and a compiled call
    never runs on meta: under torch.compile the device is asked by name (tests/test_compile_old_dynamo.py)."""
    if torch.compiler.is_compiling():
        return device_type != "meta"
    return torch.amp.is_autocast_available(device_type)


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype of the logits GEMM: autocast's when autocast is on for hidden's device, else the weight's."""
    dev = hidden.device.type
    if autocast_available(dev) and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def to_dtype(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t.to(dtype)``, passing None (an absent bias) through."""
    return None if t is None else t.to(dtype)


class Prepared(NamedTuple):
    """A call's inputs as rows: what the driver, the autograd Functions and the compiled path hand on.

    ``valid`` is None where it is ``targets != ignore_index`` (formed where it is needed); distillation without
    targets passes all-True (every row counts, and its targets are never read). ``teacher_hidden`` /
    ``teacher_dtype``: distillation's second head (None otherwise)."""

    hidden: Tensor  # [N_local, D]: a view of the caller's hidden (never copied)
    targets: Tensor  # int64 [N], shifted
    shape: tuple[int, ...]  # the targets' shape: the shape of every per-token output
    compute_dtype: torch.dtype
    valid: Tensor | None = None  # bool [N]
    teacher_hidden: Tensor | None = None  # [N_local, D_t], detached
    teacher_dtype: torch.dtype | None = None


def as_rows(hidden: Tensor) -> Tensor:
    """``hidden [..., D]`` as a ``[N, D]`` view (not ``reshape(-1, D)``: with ``D == 0`` the row count cannot be
    inferred from 0 elements)."""
    return hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])


def known_vocab(weight: Tensor, shard: VocabShard | None) -> int | None:
    """The vocabulary size this rank knows without a collective: the head's rows without a shard, ``shard.stop``
    for a one-rank group, None (unknown until the handshake) for a larger group."""
    if shard is None:
        return weight.shape[0]
    return shard.stop if shard.world_size == 1 else None


def check_class_weight(class_weight: Any, hidden: Any, weight: Any, opts: CrossEntropyOptions) -> None:
    """``class_weight``: None, or a floating ``[V]`` tensor of the full vocabulary's weights (every rank passes the
    whole vector) on hidden's device, not requiring grad; raises TypeError / ValueError naming it. Its length is
    checked against the vocabulary where this rank knows it; a larger group compares it in the handshake and checks
    it against the agreed vocabulary (:func:`check_class_weight_length`)."""
    if class_weight is None:
        return
    if is_dtensor(class_weight):
        raise TypeError(
            "class_weight must be a plain torch.Tensor [V] holding the whole vocabulary's weights, got a "
            "DTensor: pass class_weight.full_tensor()"
        )
    if not isinstance(class_weight, Tensor):
        raise TypeError(f"class_weight must be a torch.Tensor [V] or None, got {type(class_weight).__name__}")
    check_plain_tensors(("class_weight", class_weight))
    if not class_weight.is_floating_point():
        raise TypeError(f"class_weight must be a floating point tensor, got {class_weight.dtype}")
    if class_weight.dim() != 1:
        raise ValueError(f"class_weight must be 1-D [V], got shape {tuple(class_weight.shape)}")
    if isinstance(hidden, Tensor) and class_weight.device != hidden.device:
        raise ValueError(f"class_weight is on {class_weight.device}, hidden on {hidden.device}: put them on one device")
    if class_weight.requires_grad:
        raise ValueError(
            "class_weight must not require grad: cce_dist treats the class weights as constants (pass "
            "class_weight.detach())"
        )
    if opts.label_smoothing and "mean_logit" in opts.row_outputs:
        raise ValueError(
            "row_outputs 'mean_logit' cannot be combined with class_weight and label_smoothing > 0 (the statistic "
            "carries the weighted logit sum then): compute the mean logit in a second call without class_weight"
        )
    vocab = known_vocab(weight, opts.shard) if isinstance(weight, Tensor) else None
    if vocab is not None:
        check_class_weight_length(class_weight, vocab)
    elif opts.shard is not None and class_weight.shape[0] < opts.shard.stop:
        check_class_weight_length(class_weight, opts.shard.stop)


def check_class_weight_length(class_weight: Tensor | None, vocab_size: int) -> None:
    """``class_weight`` (when given) must hold one weight per id of the (global) vocabulary."""
    if class_weight is not None and class_weight.shape[0] != vocab_size:
        raise ValueError(
            f"class_weight must hold the whole vocabulary's weights, [V] = [{vocab_size}], on every rank; got "
            f"[{class_weight.shape[0]}]"
        )


def prepare_rows(
    hidden: Any, weight: Any, targets: Any, bias: Any, opts: CommonOptions, *, check_ids: bool
) -> Prepared:
    """Validate (locally), convert the targets to int64 ids, shift them, flatten to rows.

    ``check_ids``: also check the ids against the vocabulary this rank can know without a collective (the head's
    rows without a shard, ``shard.stop`` for a one-rank group, only ``>= 0`` for a larger group); this reads the
    ids to the host, so the compiled path checks them inside its op instead.
    """
    check_tensors(hidden, weight, targets, bias, opts)
    t = targets.to(torch.int64)  # any integer dtype -> int64 ids, before any comparison with ignore_index
    if check_ids:  # before the shift drops the first ids
        check_target_range(t, opts.ignore_index, known_vocab(weight, opts.shard))
    t = shift_targets(t, opts.shift, opts.ignore_index)
    return Prepared(as_rows(hidden), t.reshape(-1), tuple(targets.shape), compute_dtype(hidden, weight))


# ----------------------------------------------------------------------------------------------
# the implementation and its options
# ----------------------------------------------------------------------------------------------


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """One warning per distinct message and process (the loss runs every step)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def prepare_distill_rows(sh, sw, th, tw, targets, sb, tb, opts: DistillationOptions) -> Prepared:
    """Distillation's local checks (every rank, before any collective; errors name the argument) and the rows: the
    student's hidden ``[n, D_s]``, the teacher's (detached) ``[n, D_t]``, the target ids ``int64 [N]`` (``ignore_index``
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


def resolve_backend(impl: str, device: torch.device, hidden_dim: int | None = None) -> Backend:
    """The implementation for ``impl`` on ``device`` (:mod:`cce_dist.impl.backends`). A zero hidden size
    (``hidden_dim == 0``: the logits are the bias, or 0) always runs the torch implementation: its GEMMs handle the
    empty projection, the kernels do not (the check that ``impl='triton'`` can run still applies)."""
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return backends.TORCH
    if hidden_dim == 0:
        resolve_backend(impl, device)  # same errors as for a non-empty projection
        return backends.TORCH
    try:
        from .. import kernels
    except ImportError as e:  # triton missing
        if impl == "auto":
            return backends.TORCH
        raise RuntimeError(f"impl='triton' needs triton installed (pip install triton): {e}") from e
    reason = kernels.unsupported()
    if impl == "auto":
        if reason is not None:
            _warn_once(
                f"cce_dist: {reason}; impl='auto' uses the torch implementation (install a Triton in that range, "
                "or pass impl='torch' to silence this)"
            )
            return backends.TORCH
        return backends.triton() if kernels.available() else backends.TORCH
    if reason is not None:
        raise RuntimeError(f"impl='triton': {reason}; install a Triton in that range or use impl='torch'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "impl='triton' on CPU tensors runs only in Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is imported, or use impl='torch'"
        )
    return backends.triton()


def check_row_stats_support(backend: Backend, needs: dict[str, bool], row_outputs: tuple[str, ...]) -> None:
    """Raise RuntimeError (naming ``row_outputs`` and the remedy) where ``backend`` cannot form a statistics column
    the requested row outputs read (``need_argmax`` / ``need_sumsq`` missing from its ``row_stats_options``)."""
    missing = [k for k in ("need_argmax", "need_sumsq") if needs.get(k) and k not in backend.row_stats_options]
    if missing:
        raise RuntimeError(
            f"row_outputs={row_outputs} is not available with the {backend.name} implementation (it does not form "
            f"{', '.join(m[len('need_') :] for m in missing)}); pass impl='torch'"
        )


def resolve_deterministic(requested: bool) -> bool:
    """Deterministic when asked, or under torch.use_deterministic_algorithms (read when the loss is called)."""
    return bool(requested) or torch.are_deterministic_algorithms_enabled()


def resolve_filter_eps(opts: CommonOptions, dtype: torch.dtype) -> float | None:
    """The gradient filtering threshold for the compute dtype ``dtype`` (None = exact)."""
    if opts.filter_eps == "auto":
        # The CCE paper's choice for bf16 (2**-12), scaled to each dtype's resolution.
        return torch.finfo(dtype).eps * 2.0**-5
    return opts.filter_eps


def backend_kwargs(
    backend: Backend,
    *,
    chunk_size: int | None,
    need_entropy: bool,
    need_sum: bool,
    filter_eps: float | None,
    deterministic: bool,
    need_argmax: bool = False,
    need_sumsq: bool = False,
) -> dict[str, dict[str, Any]]:
    """``{"row_stats": {...}, "grads": {...}}``: the keyword options ``backend`` takes beyond the contract
    (:class:`~cce_dist.core.backend.Backend`'s ``row_stats_options`` / ``grads_options``), plus ``filter_eps`` and
    ``deterministic`` where it honours them (``supports_filtering`` / ``deterministic_option``).

    ``deterministic`` is the requested flag; torch.use_deterministic_algorithms is read here."""
    offered_row = {
        "chunk_size": chunk_size,
        "need_entropy": need_entropy,
        "need_sum": need_sum,
        "need_argmax": need_argmax,
        "need_sumsq": need_sumsq,
    }
    offered_grads: dict[str, Any] = {"chunk_size": chunk_size}
    grads = {k: v for k, v in offered_grads.items() if k in backend.grads_options}
    if backend.supports_filtering:
        grads["filter_eps"] = filter_eps
    if backend.deterministic_option:
        grads["deterministic"] = resolve_deterministic(deterministic)
    return {
        "row_stats": {k: v for k, v in offered_row.items() if k in backend.row_stats_options},
        "grads": grads,
    }


def distill_kwargs(backend: Backend, *, deterministic: bool) -> dict[str, dict[str, Any]]:
    """``{"grads": {...}}``: the keyword options ``backend``'s distillation pass takes (its ``grads_options``), for
    its ``grads`` and its fused ``forward(row_grad=...)``."""
    assert backend.distill is not None
    offered = {"deterministic": resolve_deterministic(deterministic)}
    return {"grads": {k: v for k, v in offered.items() if k in backend.distill.grads_options}}


# ----------------------------------------------------------------------------------------------
# after the loss: reduction and output shapes
# ----------------------------------------------------------------------------------------------


def reduce_loss(
    loss_rows: Tensor, valid: Tensor, reduction: Reduction, shape: tuple[int, ...], row_weights: Tensor | None = None
) -> Tensor:
    """The per-row loss ``float32 [N]`` reduced as every loss reduces it: ``mean`` over the counted rows (``valid``;
    0, not NaN, when none counts), ``sum``, or ``none`` (``shape``). ``row_weights`` (class weights, ``float32
    [N]``): the mean divides by their sum instead, as torch's weighted mean does (0 when that sum is 0)."""
    if reduction == "none":
        return loss_rows.reshape(shape)
    if reduction == "sum":
        return loss_rows.sum()
    if row_weights is not None:
        total = row_weights.sum()
        return torch.where(total != 0, loss_rows.sum() / torch.where(total != 0, total, 1.0), 0.0)
    return loss_rows.sum() / valid.sum().clamp(min=1)


def row_mask(rows: Prepared, ignore_index: int) -> Tensor:
    """``bool [N]``: which rows count (``rows.valid``, else the targets that are not ``ignore_index``)."""
    return rows.valid if rows.valid is not None else rows.targets != ignore_index


def cross_entropy_result(
    loss_rows: Tensor, lse: Tensor | None, rows: Prepared, opts: CrossEntropyOptions, row_weights: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """The reduced loss (:func:`reduce_loss`), and with ``return_lse`` the lse in the targets' shape.

    ``row_weights`` (class weights: the targets' weights, ``float32 [N]``): ``loss_rows`` are the weighted rows
    without the z-loss, which is added here from ``lse``: ``z_loss * lse**2`` per counted token, averaged over the
    counted tokens under ``mean`` while the cross-entropy is divided by the sum of the weights (torch's weighted mean
    for the cross-entropy, and Liger's for the z-loss)."""
    valid = row_mask(rows, opts.ignore_index)
    if row_weights is None:
        loss = reduce_loss(loss_rows, valid, opts.reduction, rows.shape)
    else:
        assert lse is not None, "class weights need the lse rows"
        z = None
        if opts.z_loss:
            lse_v = torch.where(valid, lse, 0.0)  # where(), first: an ignored row's lse may be NaN
            z = opts.z_loss * lse_v * lse_v
        if opts.reduction == "mean":
            loss = reduce_loss(loss_rows, valid, "mean", rows.shape, row_weights)
            if z is not None:
                loss = loss + reduce_loss(z, valid, "mean", rows.shape)
        else:
            loss = reduce_loss(loss_rows if z is None else loss_rows + z, valid, opts.reduction, rows.shape)
    if opts.return_lse:
        assert lse is not None, "return_lse needs the lse rows"
        return loss, lse.reshape(rows.shape)
    return loss


def logprob_result(lp: Tensor, ent: Tensor, rows: Prepared, opts: LogprobOptions) -> Tensor | tuple[Tensor, Tensor]:
    """Logprobs (and with ``return_entropy`` the entropies) in the targets' shape."""
    if opts.return_entropy:
        return lp.reshape(rows.shape), ent.reshape(rows.shape)
    return lp.reshape(rows.shape)
