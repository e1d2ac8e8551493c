"""Per-class weights of the cross-entropy: torch's ``F.cross_entropy(weight=w)``, from the row statistics.

With ``w [V]`` (the full vocabulary's weights), ``t`` the target, ``eps`` the label smoothing and ``W = sum_j w_j``::

    loss_i = (1 - eps) * w_t * (lse_i - z_it) + (eps / V) * (W * lse_i - sum_j w_j z_ij)
    mean   = sum_i loss_i / sum_{valid i} w_t              (torch's normalizer; 0 here when it is 0)

Two pieces:

- the row weight ``w_t`` scales each row's loss and its gradient coefficients (:mod:`cce_dist.core.formulas`); every
  rank holds ``w`` whole, so it is read without a collective;
- the smoothing term's weighted logit sum ``sum_j w_j z_ij`` travels in the statistics' SUM column, which the
  exchange already sums over the ranks (:func:`weighted_logit_sum`: without a softcap it is linear in the hidden
  state, ``h_i . u + w . b`` with ``u = W_head^T w`` over this rank's vocabulary slice, two matrix-vector products;
  with one, the softcapped logits are recomputed in token chunks of at most ``SOFTCAP_CHUNK_ELEMENTS``, one more
  logit pass in forward). Its gradient, ``-(eps / V) g_i w_j`` on every logit, is the implementations' own uniform
  term weighed per vocab row (``gamma_weights`` of the backend's ``grads``), formed inside each logit tile beside the
  ``p`` terms it nearly cancels, as the materialized program forms it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .formulas import effective_smoothing
from .runtime import f32_out_gemm, matmul_f32
from .stats import SUM_SCALE

#: float32 copies of a chunk of rows made by the matrix-vector products: capped at ~8 MB
_CHUNK_BYTES = 8 << 20
#: float32 logits held at once where a softcap makes the smoothing term non-linear (64 MB)
SOFTCAP_CHUNK_ELEMENTS = 1 << 24


def _rows_per_chunk(cols: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * max(cols, 1)))


@dataclass(frozen=True)
class ClassWeights:
    """One call's class-weight terms, formed once by :meth:`of` (no gradient flows to them)."""

    rows: Tensor  # float32 [N]: the target's weight, 0 on ignored rows
    local: Tensor  # float32 [V_local]: this rank's slice
    mean: Tensor  # float32 []: W / V
    smoothing: bool  # label smoothing is on: the weighted logit sum and its gradient are needed

    @property
    def terms(self) -> tuple[Tensor, Tensor]:
        """``(w_t, W / V)`` as :func:`cce_dist.core.formulas.cross_entropy_rows` takes them."""
        return self.rows, self.mean

    @classmethod
    def of(
        cls,
        class_weight: Tensor,
        targets: Tensor,
        valid: Tensor,
        *,
        vocab_start: int,
        v_local: int,
        label_smoothing: float,
    ) -> ClassWeights:
        """The terms for ``class_weight [V]`` (every rank's whole vector), ``targets int64 [N]`` and ``valid bool
        [N]``, on the rank holding vocabulary rows ``[vocab_start, vocab_start + v_local)``."""
        cw = class_weight.detach()
        return cls(
            rows=row_weights(cw, targets, valid),
            local=local_slice(cw, vocab_start, v_local),
            mean=weight_mean(cw),
            smoothing=effective_smoothing(label_smoothing, cw.shape[0]) != 0,
        )


def row_weights(class_weight: Tensor, targets: Tensor, valid: Tensor) -> Tensor:
    """``float32 [N]``: ``class_weight[target]`` on the valid rows, 0 on ignored ones (whose ids are not read)."""
    ids = torch.where(valid, targets, torch.zeros_like(targets))
    w = class_weight.to(torch.float32)[ids]
    return torch.where(valid, w, torch.zeros_like(w))


def local_slice(class_weight: Tensor, vocab_start: int, v_local: int) -> Tensor:
    """``float32 [V_local]``: the weights of this rank's vocabulary rows."""
    return class_weight[vocab_start : vocab_start + v_local].to(torch.float32)


def weight_mean(class_weight: Tensor) -> Tensor:
    """``float32 []``: ``W / V``, the factor of ``lse`` in the smoothing term (1 for all-ones weights)."""
    return class_weight.to(torch.float32).mean()


def head_direction(weight: Tensor, w_local: Tensor) -> Tensor:
    """``float32 [D]``: ``sum_j w_j W_head[j]`` over the local rows, in float32 (chunks of the head upcast, so no
    float32 copy of the whole head; rows with a zero weight are left out)."""
    u = torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device)
    step = _rows_per_chunk(weight.shape[1])
    for j in range(0, weight.shape[0], step):
        wj = w_local[j : j + step]
        # a zero weight keeps its row out even where the head holds inf (0 * inf would be NaN)
        rows = torch.where((wj != 0)[:, None], weight[j : j + step].float(), 0.0)
        u.add_(wj @ rows)
    return u


def _gemm_head(weight: Tensor) -> Tensor:
    """The head as the chunks' GEMMs read it: itself where it is float32 or its dtype has a float32-output GEMM on
    its device, else a float32 copy, made once per call (a CPU's bf16 / fp16)."""
    native = weight.dtype == torch.float32 or (weight.is_cuda and f32_out_gemm(weight.device, weight.dtype))
    return weight if native else weight.float()


def _softcapped_logits(hidden: Tensor, head: Tensor, bias: Tensor | None, softcap: float):
    """``(rows, c)`` per token chunk: the softcapped logits ``c = softcap * tanh(raw / softcap)``, float32 (``raw``
    rounded to the compute dtype ``hidden.dtype``, as every implementation rounds it). ``head``: :func:`_gemm_head`
    of the weight."""
    step = max(1, SOFTCAP_CHUNK_ELEMENTS // max(head.shape[0], 1))
    for i in range(0, hidden.shape[0], step):
        raw = matmul_f32(hidden[i : i + step].to(head.dtype), head.T)
        if bias is not None:
            raw += bias.float()
        yield slice(i, i + step), softcap * torch.tanh(raw.to(hidden.dtype).float() / softcap)


def weighted_logit_sum(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, w_local: Tensor, softcap: float | None = None
) -> Tensor:
    """``float32 [N]``: ``sum_j w_j z_ij`` over this rank's rows, scaled by ``stats.SUM_SCALE`` as the SUM column
    holds it. ``hidden [N, D]``, ``weight [V_local, D]``, ``bias [V_local]`` in the compute dtype."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    if softcap:
        for rows, c in _softcapped_logits(hidden, _gemm_head(weight), bias, softcap):
            out[rows] = torch.where(w_local != 0, c * w_local, 0.0).sum(1)
        return out * SUM_SCALE
    u = head_direction(weight, w_local)
    step = _rows_per_chunk(hidden.shape[1])
    for i in range(0, hidden.shape[0], step):
        out[i : i + step] = hidden[i : i + step].float() @ u
    if bias is not None:
        out += torch.where(w_local != 0, w_local * bias.float(), 0.0).sum()
    return out * SUM_SCALE


def gamma_weights(cw: ClassWeights | None) -> Tensor | None:
    """The backends' ``gamma_weights`` for ``cw`` (its local slice where the smoothing term is on), else None."""
    return cw.local if cw is not None and cw.smoothing else None


def sum_column(
    cw: ClassWeights | None, hidden: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None
) -> Tensor | None:
    """The SUM column this rank's statistics carry for ``cw`` (:func:`weighted_logit_sum`), or None where the
    implementation's own (unweighted or unneeded) SUM stands."""
    w = gamma_weights(cw)
    return None if w is None else weighted_logit_sum(hidden, weight, bias, w, softcap)
