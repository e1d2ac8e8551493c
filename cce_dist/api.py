"""Public entry points: validation, shifting, flattening, dispatch, reduction.

Shapes: ``hidden [..., D]``, ``weight [V_local, D]``, ``targets [...]`` (integer global ids).
Under ``shard.sequence_parallel`` hidden holds this rank's slice of the first dimension:
``hidden.shape[0] * P == targets.shape[0]``.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Optional, Union

import torch
from torch import nn

from . import torch_impl
from .autograd import CrossEntropyRows, FusedCrossEntropy, LogprobRows, Plan
from .options import CrossEntropyOptions, LogprobOptions, _CommonOptions
from .parallel import Comm, Layout, VocabShard, fingerprint, handshake

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------
# validation (local: runs on every rank before any collective)
# ----------------------------------------------------------------------------------------------


def _check_tensors(hidden, weight, targets, bias, opts: _CommonOptions) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating-point tensor, got dtype {hidden.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got dtype {weight.dtype}")
    if bias is not None and not bias.is_floating_point():
        raise TypeError(f"bias must be a floating-point tensor, got dtype {bias.dtype}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor of class ids, got dtype {targets.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V_local, D], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension [..., D]")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden's last dimension ({hidden.shape[-1]}) must equal weight.shape[1] ({weight.shape[1]})"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must have shape [{weight.shape[0]}] (weight.shape[0]), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("targets", targets), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    shard = opts.shard
    if shard is not None and weight.shape[0] != shard.local_size:
        raise ValueError(
            f"weight.shape[0] ({weight.shape[0]}) must equal the shard size stop - start = {shard.local_size}"
        )
    sp = shard is not None and shard.sequence_parallel and shard.world_size > 1
    if sp:
        if hidden.dim() < 2 or targets.dim() < 1:
            raise ValueError("sequence_parallel needs hidden [n/P, ..., D] and targets [n, ...]")
        want = (hidden.shape[0] * shard.world_size,) + tuple(hidden.shape[1:-1])
        if tuple(targets.shape) != want:
            raise ValueError(
                f"under sequence parallelism targets must have shape {want} (hidden.shape[0] * tp_size, "
                f"...), got {tuple(targets.shape)}"
            )
    elif tuple(hidden.shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"hidden.shape[:-1] {tuple(hidden.shape[:-1])} must equal targets.shape {tuple(targets.shape)}"
        )


def _check_target_range(targets: Tensor, ignore_index: int, vocab_size: Optional[int]) -> None:
    """Targets must be ignore_index or in [0, vocab_size) (upper bound checked only if known).

    Compared as int64 whatever the targets' integer dtype: ``uint8`` targets compared with ``ignore_index=-100``
    directly would wrap it to 156 and skip that id here while the loss reads it as a class."""
    if targets.numel() == 0:
        return
    targets = targets.to(torch.int64)
    t = targets[targets != ignore_index]
    if t.numel() == 0:
        return
    lo, hi = int(t.min().item()), int(t.max().item())
    if lo < 0:
        raise ValueError(f"targets contain id {lo}: ids must be in [0, V) or equal ignore_index ({ignore_index})")
    if vocab_size is not None and hi >= vocab_size:
        raise ValueError(f"targets contain id {hi}, outside the vocabulary [0, {vocab_size})")


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def _shift_targets(targets: Tensor, shift: int, ignore_index: int) -> Tensor:
    """Position i predicts target i + shift: a shifted copy of the (small) targets, never of hidden."""
    if shift == 0:
        return targets
    out = torch.full_like(targets, ignore_index)
    if targets.dim() and targets.shape[-1] > shift:
        out[..., :-shift] = targets[..., shift:]
    return out


def _resolve_backend(impl: str, device: torch.device, hidden_dim: Optional[int] = None):
    """The implementation module for ``impl`` on ``device``. A zero hidden size (``hidden_dim == 0``: the logits are
    the bias, or 0) always runs the torch implementation: its GEMMs handle the empty projection, the kernels do not
    (the check that ``impl='triton'`` can run still applies)."""
    if impl == "torch" or (impl == "auto" and device.type != "cuda"):
        return torch_impl
    if hidden_dim == 0:
        _resolve_backend(impl, device)  # same errors as for a non-empty projection
        return torch_impl
    try:
        from . import kernels
    except ImportError as e:  # triton missing
        if impl == "auto":
            return torch_impl
        raise RuntimeError(f"impl='triton' needs triton installed (pip install triton): {e}") from e
    if impl == "auto":
        return kernels if kernels.available() else torch_impl
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "impl='triton' on CPU tensors runs only in Triton's interpreter: set TRITON_INTERPRET=1 before "
            "triton is imported, or use impl='torch'"
        )
    return kernels


def _backend_name(backend) -> str:
    return "torch" if backend is torch_impl else "triton"


def _deterministic(requested: bool) -> bool:
    """The triton backward avoids float atomics when asked, or under torch.use_deterministic_algorithms."""
    return bool(requested) or torch.are_deterministic_algorithms_enabled()


def _filter_eps(opts: _CommonOptions, dtype: torch.dtype) -> Optional[float]:
    if opts.filter_eps == "auto":
        # The CCE paper's choice for bf16 (2**-12), scaled to each dtype's resolution.
        return torch.finfo(dtype).eps * 2.0**-5
    return opts.filter_eps


# ----------------------------------------------------------------------------------------------
# the shared driver
# ----------------------------------------------------------------------------------------------


def _prepare(hidden, weight, targets, bias, opts: _CommonOptions, form: str, extra_fp: tuple):
    """Validate (locally, then with the group), flatten and plan. Returns (h2, t1, plan, out_shape)."""
    shard = opts.shard
    error: Optional[BaseException] = None
    backend = torch_impl
    t = targets
    try:
        _check_tensors(hidden, weight, targets, bias, opts)
        local_vocab = None
        if shard is None:
            local_vocab = weight.shape[0]
        elif shard.world_size == 1:
            local_vocab = shard.stop
        t = targets.to(torch.int64)  # any integer dtype -> int64 ids, before any comparison with ignore_index
        _check_target_range(t, opts.ignore_index, local_vocab)
        backend = _resolve_backend(opts.impl, hidden.device, hidden.shape[-1])
        t = _shift_targets(t, opts.shift, opts.ignore_index)
    except (TypeError, ValueError, RuntimeError) as e:
        error = e

    compute_dtype = _compute_dtype(hidden, weight) if error is None else None
    comm_needed = shard is not None and shard.world_size > 1
    if not comm_needed:
        if error is not None:
            raise error
        v_total = weight.shape[0] if shard is None else shard.stop
        if shard is not None and shard.start != 0:
            raise ValueError(f"a single-rank VocabShard must start at 0, got start={shard.start}")
        layout = Layout(vocab_size=v_total, n_tokens=t.numel(), max_local=weight.shape[0])
    else:
        sp = shard.sequence_parallel
        n_local = hidden.shape[0] if (error is None and sp) else 0
        n_tokens = t.numel() if error is None else 0
        # Everything that decides which collectives run, and with what sizes, must agree.
        # The resolved implementation too: the torch one forms scalar-loss gradients in forward with one statistics
        # collective per token chunk, the triton one issues a single one.
        fp = fingerprint(form, extra_fp, opts.ignore_index, opts.softcap, opts.shift, opts.chunk_size,
                         sp, shard.reduce_hidden_grad, shard.stats_collective, str(compute_dtype),
                         _grad_needs(hidden, weight, bias), _backend_name(backend))
        device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
        if not shard.check and error is not None:
            raise error  # documented: without the handshake a rank-local error can strand the others
        if shard.check:
            layout = handshake(shard, error, n_tokens=n_tokens, n_local_tokens=n_local,
                               hidden_dim=hidden.shape[-1] if error is None else 0, options_fp=fp,
                               targets=t, ignore_index=opts.ignore_index, device=device)
        else:
            layout = _cheap_layout(shard, n_tokens, device)
            # No handshake, but the global vocab is known now: an id >= V still raises (on this rank), as a
            # single-device call would, instead of contributing no target logit (loss = lse).
            _check_target_range(t, opts.ignore_index, layout.vocab_size)

    if backend is torch_impl:
        kw = {"row_stats": {"chunk_size": opts.chunk_size}, "grads": {"chunk_size": opts.chunk_size}}
    else:
        kw = {"grads": {"filter_eps": _filter_eps(opts, compute_dtype),
                        "deterministic": _deterministic(opts.deterministic)}}
    d = hidden.shape[-1]
    plan = Plan(
        backend=backend, compute_dtype=compute_dtype, vocab_start=0 if shard is None else shard.start,
        vocab_size=layout.vocab_size, comm=Comm(shard, layout), backend_kwargs=kw,
        # from values every rank agreed on, so the fused schedule's per-chunk collectives line up
        fused_chunk_tokens=torch_impl.chunk_tokens(layout.n_tokens, layout.max_local, opts.chunk_size),
    )
    # not reshape(-1, d): with d == 0 the row count cannot be inferred from 0 elements
    return hidden.reshape(math.prod(hidden.shape[:-1]), d), t.reshape(-1), plan, tuple(targets.shape)


def _cheap_layout(shard: VocabShard, n_tokens: int, device) -> Layout:
    """check=False: learn only the global vocab and the largest shard (one tiny all-reduce)."""
    import torch.distributed as dist

    buf = torch.tensor([shard.stop, shard.local_size], dtype=torch.int64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=shard.group)
    v, max_local = (int(x) for x in buf.tolist())
    return Layout(vocab_size=v, n_tokens=n_tokens, max_local=max_local)


def _grad_needs(*tensors) -> tuple[bool, ...]:
    """Which inputs will receive a gradient (decides whether backward reduces dH)."""
    on = torch.is_grad_enabled()
    return tuple(on and bool(getattr(t, "requires_grad", False)) for t in tensors)


def _wants_grad(*tensors) -> bool:
    return any(_grad_needs(*tensors))


def _integrations(hidden, weight, targets, bias, opts):
    """Hooks for inputs that need translating first: DTensor heads (cce_dist.dtensor)."""
    if _is_dtensor(weight) or _is_dtensor(hidden):
        from .dtensor import from_dtensor

        hidden, weight, targets, bias, opts = from_dtensor(hidden, weight, targets, bias, opts)
    return hidden, weight, targets, bias, opts


def _is_dtensor(t) -> bool:
    # Only look if DTensor was imported already (importing it costs seconds): a DTensor exists only then.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _cross_entropy(hidden, weight, targets, bias, opts: CrossEntropyOptions):
    if torch.compiler.is_compiling():
        from .compile import compiled_cross_entropy

        return compiled_cross_entropy(hidden, weight, targets, bias, opts)
    hidden, weight, targets, bias, opts = _integrations(hidden, weight, targets, bias, opts)
    wants_grad = _wants_grad(hidden, weight, bias)
    fused = (
        opts.reduction != "none"
        and not opts.return_lse
        and opts.grad_in_forward is not False
        and wants_grad
    )
    extra = (opts.reduction, opts.label_smoothing, opts.z_loss, opts.return_lse, wants_grad, fused)
    h2, t1, plan, shape = _prepare(hidden, weight, targets, bias, opts, "ce", extra)
    if fused and plan.backend is torch_impl:
        return FusedCrossEntropy.apply(h2, weight, bias, t1, plan, opts)
    if plan.backend is torch_impl:
        plan.backend_kwargs["row_stats"].update(need_entropy=False, need_sum=bool(opts.label_smoothing))
    loss_rows, lse = CrossEntropyRows.apply(h2, weight, bias, t1, plan, opts)
    if opts.reduction == "none":
        loss = loss_rows.reshape(shape)
    elif opts.reduction == "sum":
        loss = loss_rows.sum()
    else:
        loss = loss_rows.sum() / (t1 != opts.ignore_index).sum().clamp(min=1)
    return (loss, lse.reshape(shape)) if opts.return_lse else loss


def _logprobs(hidden, weight, targets, bias, opts: LogprobOptions):
    if torch.compiler.is_compiling():
        from .compile import compiled_logprobs

        return compiled_logprobs(hidden, weight, targets, bias, opts)
    hidden, weight, targets, bias, opts = _integrations(hidden, weight, targets, bias, opts)
    extra = (opts.temperature, opts.return_entropy, _wants_grad(hidden, weight, bias))
    h2, t1, plan, shape = _prepare(hidden, weight, targets, bias, opts, "logprob", extra)
    if plan.backend is torch_impl:
        plan.backend_kwargs["row_stats"].update(need_entropy=opts.return_entropy, need_sum=False)
    lp, ent = LogprobRows.apply(h2, weight, bias, t1, plan, opts)
    return (lp.reshape(shape), ent.reshape(shape)) if opts.return_entropy else lp.reshape(shape)


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    shift: Union[bool, int] = False,
    shard: Optional[VocabShard] = None,
    impl: str = "auto",
    return_lse: bool = False,
    chunk_size: Optional[int] = None,
    grad_in_forward: Optional[bool] = None,
    filter_eps: Optional[Union[float, str]] = None,
    deterministic: bool = False,
):
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
            forward (3 GEMMs instead of 4; a single backward; the float32 gradients are held until
            backward, which applies the upstream gradient, e.g. a loss scale, before rounding them
            to each tensor's dtype). None = whenever it applies.
        filter_eps: triton impl: gradient filtering threshold (None = exact, "auto").
        deterministic: triton impl: bitwise reproducible backward (no float atomics).

    Returns:
        float32 loss: a scalar for ``mean``/``sum``, targets' shape for ``none``; with
        ``return_lse``: ``(loss, lse)``. Differentiable (once) w.r.t. hidden, weight and bias;
        gradients come back in each tensor's dtype. Second-order gradients (``create_graph=True``)
        raise a RuntimeError: compute a gradient penalty from the materialized loss instead.
    """
    opts = CrossEntropyOptions(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
        softcap=softcap, shift=shift, shard=shard, impl=impl, return_lse=return_lse, chunk_size=chunk_size,
        grad_in_forward=grad_in_forward, filter_eps=filter_eps, deterministic=deterministic,
    )
    return _cross_entropy(hidden, weight, targets, bias, opts)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    shift: Union[bool, int] = False,
    shard: Optional[VocabShard] = None,
    impl: str = "auto",
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
    filter_eps: Optional[Union[float, str]] = None,
    deterministic: bool = False,
):
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
        ignore_index=ignore_index, softcap=softcap, shift=shift, shard=shard, impl=impl, chunk_size=chunk_size,
        filter_eps=filter_eps, deterministic=deterministic, temperature=temperature, return_entropy=return_entropy,
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

    def forward(self, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor] = None):
        return _cross_entropy(hidden, weight, targets, bias, self.options)

    def extra_repr(self) -> str:
        defaults = CrossEntropyOptions()
        changed = [f"{k}={getattr(self.options, k)!r}" for k in self.options.__dataclass_fields__
                   if getattr(self.options, k) != getattr(defaults, k)]
        return ", ".join(changed)
