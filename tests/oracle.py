"""The materialized references that every cce_dist implementation is tested against (the one oracle module:
test modules import these, never a reference from another test module).

This is the program of docs/design.md ("What it computes") written plainly in PyTorch: the full
``[N, V]`` logits are formed with ``F.linear``, then softcap, temperature, ``F.cross_entropy``
(with PyTorch's own ``label_smoothing`` and ``ignore_index``), z-loss, ``log_softmax`` + gather
for logprobs and the softmax entropy. It is deliberately simple and slow; it is differentiable
with ordinary autograd, so the same call gives the reference gradients.

Precision model (matches the library's contract):

- ``dtype`` is the *projection* dtype: ``hidden``, ``weight`` and ``bias`` are cast to it and
  ``F.linear`` runs in it, so the logits are rounded once to ``dtype`` (``torch.float32`` gives
  the exact fp32 reference; ``torch.bfloat16`` gives "the materialized loss computed in bf16",
  the baseline a low-precision implementation must not be worse than). ``dtype=None`` leaves the
  tensors as they are, so under ``torch.autocast`` the projection runs in the autocast dtype.
- Everything after the projection (softcap, temperature, softmax, reductions) runs in float32,
  on the rounded logits; with ``dtype=torch.float64`` it runs in float64 (the exact reference,
  outputs float64).
- Gradients flow back through the casts, so they arrive in each input tensor's own dtype.
- ``contract`` (with ``dtype=torch.float64``): the float64 program *of the precision contract* for
  compute dtype ``contract``: the inputs and the raw logits take the values the library rounds them
  to (``hidden``/``bias`` cast to it, ``F.linear``'s result rounded to it), everything else is
  float64, and gradients pass straight through those roundings (they are values the contract
  fixes, not functions of the inputs). The materialized program in ``contract`` makes the same
  roundings, so the errors of the two against this reference are the ones each adds beyond them.

Public functions::

    oracle_logits(hidden, weight, bias=None, *, softcap=None, temperature=1.0, dtype=float32,
                  contract=None)
    shift_targets(targets, shift, ignore_index)
    oracle_cross_entropy(hidden, weight, targets, bias=None, *, ignore_index=-100,
                         reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                         shift=False, dtype=torch.float32, return_lse=False, contract=None)
    oracle_logprobs(hidden, weight, targets, bias=None, *, ignore_index=-100, softcap=None,
                    temperature=1.0, shift=False, dtype=torch.float32, return_entropy=False,
                    contract=None)
    oracle_distill(student_hidden, student_weight, teacher_hidden, teacher_weight, targets=None, *,
                   divergence="kl", beta=0.5, temperature=1.0, scale_by_temperature_squared=True,
                   hard_label_weight=0.0, ignore_index=-100, reduction="mean", student_bias=None,
                   teacher_bias=None, softcap=None, student_dtype=torch.float64,
                   teacher_dtype=torch.float64, student_contract=None)

``oracle_distill`` is the reference of ``cce_dist.linear_distillation``: it forms both heads' full
``[N, V]`` logits with ``F.linear`` in each head's projection dtype (float64 by default: the exact
formula; ``torch.bfloat16`` gives the logits a bf16 materialized program would round to), then
everything in float64: softcap, temperature, ``log_softmax``, the divergence, ``T**2``, the
hard-label ``F.cross_entropy``, ``ignore_index``, the reduction. The teacher's tensors are detached,
so the same call gives the reference gradients of the student's hidden, weight and bias. Its checks
against independent formulas (PyTorch's ``kl_div``, JSD's limits) are tests/test_distill_oracle.py.

Shapes follow cce_dist: ``hidden [..., D]``, ``weight [V, D]``, ``bias [V]``,
``targets [...] == hidden.shape[:-1]`` (integer ids in ``[0, V)`` or ``ignore_index``).
Outputs are float32 and have targets' shape (or are scalars for ``mean``/``sum``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

__all__ = ["oracle_logits", "shift_targets", "oracle_cross_entropy", "oracle_logprobs", "oracle_distill"]


def _cast(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    if t is None or dtype is None:
        return t
    return t.to(dtype)


def _rounded(t: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """``t`` with the values of its rounding to ``dtype``, its gradient passed straight through."""
    if t is None or dtype is None:
        return t
    return t + (t.to(dtype).to(t.dtype) - t).detach()


def oracle_logits(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    softcap: float | None = None,
    temperature: float = 1.0,
    dtype: torch.dtype | None = torch.float32,
    contract: torch.dtype | None = None,
) -> Tensor:
    """Materialized logits ``[..., V]``: ``softcap(linear(h, W, b) rounded to dtype) / T``, float32 (float64 for
    ``dtype=torch.float64``; ``contract``: see the module docstring)."""
    hidden, weight, bias = (_rounded(_cast(x, dtype), contract) for x in (hidden, weight, bias))
    z = _rounded(F.linear(hidden, weight, bias), contract)
    z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if temperature != 1.0:
        z = z / temperature
    return z


def shift_targets(targets: Tensor, shift: bool | int, ignore_index: int) -> Tensor:
    """Position ``i`` predicts ``targets[..., i + shift]``; the last ``shift`` positions are ignored."""
    shift = int(shift)
    if shift == 0:
        return targets
    out = torch.full_like(targets, ignore_index)
    if targets.dim() > 0 and targets.shape[-1] > shift:
        out[..., :-shift] = targets[..., shift:]
    return out


def _reduce(rows: Tensor, valid: Tensor, reduction: str) -> Tensor:
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    if reduction == "mean":
        # mean over non-ignored tokens; 0 (not NaN) when every token is ignored
        return rows.sum() / valid.sum().clamp(min=1)
    raise ValueError(f"unknown reduction {reduction!r}")


def oracle_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    shift: bool | int = False,
    dtype: torch.dtype | None = torch.float32,
    return_lse: bool = False,
    contract: torch.dtype | None = None,
    class_weight: Tensor | None = None,
):
    """Reference of ``cce_dist.linear_cross_entropy`` (same keywords; see the module docstring).

    ``loss_i = F.cross_entropy(z_i, t_i, label_smoothing=eps) + z_loss * logsumexp(z_i)**2``
    for valid tokens, 0 for ignored ones; then reduced. With ``return_lse`` also returns the
    float32 per-token ``logsumexp(z_i)`` (targets' shape, computed for every token).

    ``class_weight [V]``: ``F.cross_entropy(..., weight=class_weight)``'s rows; ``mean`` divides their sum by the
    counted targets' weights (0 when that is 0) and the z-loss's by the counted tokens (Liger's reference,
    ``CrossEntropyWithZLoss`` in its tests).
    """
    t = shift_targets(targets, shift, ignore_index).long()
    z = oracle_logits(hidden, weight, bias, softcap=softcap, dtype=dtype, contract=contract)  # [..., V] float32
    v = z.shape[-1]
    z2 = z.reshape(-1, v)
    t1 = t.reshape(-1)
    valid = t1 != ignore_index
    cw = None if class_weight is None else class_weight.to(z2.dtype)
    rows = F.cross_entropy(
        z2, t1, weight=cw, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    lse = torch.logsumexp(z2, dim=-1)
    z_rows = torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse)) if z_loss else torch.zeros_like(lse)
    if cw is not None and reduction == "mean":
        w_t = torch.where(valid, cw[torch.where(valid, t1, 0)], torch.zeros_like(lse))
        total = w_t.sum()
        ce = torch.where(total != 0, rows.sum() / torch.where(total != 0, total, 1.0), 0.0)
        out = ce + _reduce(z_rows, valid, "mean")
    else:
        out = _reduce((rows + z_rows).reshape(t.shape), valid, reduction)
    if return_lse:
        return out, lse.reshape(t.shape)
    return out


def oracle_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    temperature: float = 1.0,
    shift: bool | int = False,
    dtype: torch.dtype | None = torch.float32,
    return_entropy: bool = False,
    contract: torch.dtype | None = None,
):
    """Reference of ``cce_dist.linear_logprobs``: ``log_softmax(z)[t]`` and ``-sum p log p``.

    Both are float32 with targets' shape and 0 at ignored positions.
    """
    t = shift_targets(targets, shift, ignore_index).long()
    z = oracle_logits(hidden, weight, bias, softcap=softcap, temperature=temperature, dtype=dtype, contract=contract)
    v = z.shape[-1]
    logp = torch.log_softmax(z.reshape(-1, v), dim=-1)
    t1 = t.reshape(-1)
    valid = t1 != ignore_index
    safe_t = torch.where(valid, t1, torch.zeros_like(t1))
    lp = logp.gather(1, safe_t.unsqueeze(1)).squeeze(1)
    zero = torch.zeros_like(lp)
    lp = torch.where(valid, lp, zero).reshape(t.shape)
    if not return_entropy:
        return lp
    ent = -(logp.exp() * logp).sum(-1)
    ent = torch.where(valid, ent, zero).reshape(t.shape)
    return lp, ent


def _distill_logits(h, w, b, cap, temperature, dtype, contract=None):
    """One head's raw (softcapped) logits and soft logits ``/ temperature``, float64."""
    if contract is None:
        z = F.linear(h.to(dtype), w.to(dtype), None if b is None else b.to(dtype)).double()
    else:  # the module docstring's contract: the values rounded to ``contract``, gradients straight through
        z = _rounded(F.linear(*(_rounded(x, contract) for x in (h, w, b))), contract)
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z, z / temperature


def oracle_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor | None = None,
    *,
    divergence: str = "kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    scale_by_temperature_squared: bool = True,
    hard_label_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    softcap=None,
    student_dtype: torch.dtype = torch.float64,
    teacher_dtype: torch.dtype = torch.float64,
    student_contract: torch.dtype | None = None,
) -> Tensor:
    """float64 loss of the materialized two-head program (keywords as in ``linear_distillation``).

    ``student_contract`` (with float64 student tensors and ``student_dtype=torch.float64``): the student's
    inputs and raw logits take the values of their rounding to that dtype, gradients passed straight through
    (``contract`` of the module docstring)."""
    caps = softcap if isinstance(softcap, tuple) else (softcap, softcap)
    d = student_hidden.shape[-1]
    z1, zs = _distill_logits(
        student_hidden.reshape(-1, d),
        student_weight,
        student_bias,
        caps[0],
        temperature,
        student_dtype,
        student_contract,
    )
    tb = None if teacher_bias is None else teacher_bias.detach()
    _, zt = _distill_logits(
        teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]),
        teacher_weight.detach(),
        tb,
        caps[1],
        temperature,
        teacher_dtype,
    )
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    if divergence == "kl":
        div = (lt.exp() * (lt - ls)).sum(-1)
    elif divergence == "reverse_kl":
        div = (ls.exp() * (ls - lt)).sum(-1)
    elif divergence == "jsd":
        lm = torch.logaddexp(lt + math.log(beta), ls + math.log1p(-beta))  # log(beta p_t + (1-beta) p_s)
        div = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    else:
        raise ValueError(divergence)
    t2 = temperature**2 if scale_by_temperature_squared else 1.0
    rows = (1.0 - hard_label_weight) * t2 * div
    n = rows.shape[0]
    if targets is None:
        valid = torch.ones(n, dtype=torch.bool)
    else:
        t = targets.reshape(-1).long()
        valid = t != ignore_index
        if hard_label_weight:
            rows = rows + hard_label_weight * F.cross_entropy(z1, t, ignore_index=ignore_index, reduction="none")
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    if reduction == "none":
        return rows.reshape(student_hidden.shape[:-1])
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / valid.sum().clamp(min=1)
