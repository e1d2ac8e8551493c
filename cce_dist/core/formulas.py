"""Per-row outputs and gradient coefficients, as functions of the (global) row statistics.

Pure elementwise torch on ``[N]`` vectors: shared by every implementation and by the
single-device and vocab-parallel paths. See :mod:`cce_dist.core.backend` for the coefficient layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import ALPHA, BETA, DELTA, GAMMA, NUM_COEFS
from .stats import MAX, SUMEXP, TARGET, entropy, mean_logit
from .stats import lse as log_sum_exp


def effective_smoothing(label_smoothing: float, vocab_size: int) -> float:
    """``label_smoothing``, or 0 for a one-entry vocabulary, where the smoothing term ``lse - mean_j z_j`` is 0
    identically: its gradient terms (``eps`` at the target, ``-eps/V`` everywhere) cancel exactly in the math, and
    forming them would leave their rounding (an ulp of ``eps * g``) in place of the z-loss term they swamp."""
    return 0.0 if vocab_size <= 1 else label_smoothing


def lse_residual(stats: torch.Tensor) -> torch.Tensor:
    """``float32 [N]``: what the float32 ``lse = m + log(s)`` of :func:`cce_dist.core.stats.lse` rounds away, i.e.
    ``(m + log(s)) - lse`` (0 where ``lse`` is not finite), exact by Knuth's two-sum.

    ``lse`` is rounded at ulp(|lse|) (3.8e-6 at |lse| ~ 40): ``exp(z - lse)`` then carries that absolute error, and
    the target's ``1 - p`` of a confident row (p ~ 0.999) would be ~1e-3 relatively wrong, where the materialized
    program's ``(z - m) - log(s)`` is exact to a float32 rounding. :func:`fold_lse_residual` puts it back."""
    m, log_s = stats[:, MAX], torch.log(stats[:, SUMEXP])
    lse = m + log_s
    b_virtual = lse - m
    residual = (m - (lse - b_virtual)) + (log_s - b_virtual)
    return torch.where(torch.isfinite(residual), residual, torch.zeros_like(residual))


def fold_lse_residual(coef: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The coefficients (layout: :mod:`cce_dist.core.backend`) that give, from the float32 ``lse``, the gradient of the
    exact ``lse + residual`` (``residual`` from :func:`lse_residual`); ``coef`` is not modified.

    With ``p = exp(z - lse)``, the exact probability is ``c * p`` (``c = exp(-residual)``) and the exact
    ``z - lse`` is ``(z - lse) - residual``, so ``dz = (p - [t]) * A + p * D * (z - lse) + [t] * B + GAMMA`` with
    ``A = c * (ALPHA - residual * DELTA)``, ``D = c * DELTA`` and ``B = BETA + (A - ALPHA)``, the last formed from
    ``expm1`` so that the target's ``(p - 1) * A + B`` keeps every bit of a confident row's ``1 - p``.
    Rows with a zero residual keep their coefficients bit for bit."""
    alpha, beta, delta = coef[:, ALPHA], coef[:, BETA], coef[:, DELTA]
    c = torch.exp(-residual)
    shift = alpha * torch.expm1(-residual) - c * residual * delta  # A - ALPHA
    out = coef.clone()
    out[:, ALPHA] = alpha + shift
    out[:, DELTA] = c * delta
    out[:, BETA] = beta + shift
    # A zero residual changes nothing, not even an infinite coefficient into inf * expm1(0) = NaN.
    return torch.where(residual[:, None] != 0, out, coef)


def cross_entropy_rows(
    stats: torch.Tensor,
    valid: torch.Tensor,
    *,
    label_smoothing: float,
    z_loss: float,
    vocab_size: int,
    class_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and lse, ``float32 [N]`` each; the loss is 0 where ``valid`` is False.

    ``loss = (1-eps)*(lse - z_t) + eps*(lse - mean_j z_j) + z_loss*lse**2``, its first term formed as
    ``(m - z_t) + log(s)``: a confident row's loss (~1 - p) is then exact to a float32 rounding, as in the
    materialized ``log_softmax``, instead of carrying an ulp of the logits' magnitude.

    ``class_weights``: ``(w_t float32 [N], W / V float32 [])`` (:mod:`cce_dist.core.class_weight`), with the SUM column
    holding ``sum_j w_j z_j``: ``loss = (1-eps)*w_t*(lse - z_t) + eps*((W/V)*lse - mean_j w_j z_j) + z_loss*lse**2``.
    """
    lse = log_sum_exp(stats)
    loss = (stats[:, MAX] - stats[:, TARGET]) + torch.log(stats[:, SUMEXP])
    if class_weights is not None:
        loss = class_weights[0] * loss
    label_smoothing = effective_smoothing(label_smoothing, vocab_size)
    if label_smoothing:
        smooth = (lse if class_weights is None else class_weights[1] * lse) - mean_logit(stats, vocab_size)
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    if z_loss:
        loss = loss + z_loss * lse * lse
    # where(), not multiply: an ignored row with a non-finite lse must still give exactly 0.
    return torch.where(valid, loss, torch.zeros_like(loss)), lse


def cross_entropy_coef(
    lse: torch.Tensor,
    valid: torch.Tensor,
    g_loss: torch.Tensor,
    g_lse: torch.Tensor | None,
    *,
    label_smoothing: float,
    z_loss: float,
    vocab_size: int,
    residual: torch.Tensor | None,
    class_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Coefficients ``float32 [N, NUM_COEFS]`` of d(loss, lse)/dz for upstream ``g_loss``, ``g_lse``, for a
    backward that forms ``p = exp(z - lse)``. ``residual``: :func:`lse_residual` of the row statistics (folded in
    by :func:`fold_lse_residual`), or None where ``p`` is formed exactly otherwise (the fused torch path's
    ``exp(z - m) / s``). ``class_weights``: as in :func:`cross_entropy_rows`; GAMMA is then the factor of ``w_j``
    (``-eps/V * g``, applied by :func:`cce_dist.core.class_weight.add_smoothing_grads`), and
    ``ALPHA = g*((1-eps)*w_t + eps*W/V + 2*zl*lse)``, ``BETA = g*(eps*W/V + 2*zl*lse)``."""
    g = torch.where(valid, g_loss.float(), torch.zeros_like(lse))
    coef = lse.new_zeros(lse.shape[0], NUM_COEFS)
    label_smoothing = effective_smoothing(label_smoothing, vocab_size)
    alpha = g
    if class_weights is not None:
        w_t, mean_w = class_weights
        alpha = g * ((1.0 - label_smoothing) * w_t + label_smoothing * mean_w)
    if z_loss:  # where(): an ignored row has g = 0 but may have lse = NaN, and 0 * NaN is NaN
        z_term = g * (1.0 + 2.0 * z_loss * lse) if class_weights is None else alpha + g * (2.0 * z_loss * lse)
        alpha = torch.where(valid, z_term, torch.zeros_like(g))
    if g_lse is not None:  # the returned lse is differentiable on every row, ignored or not
        alpha = alpha + g_lse.float()
    coef[:, ALPHA] = alpha
    # BETA is the target's excess over ALPHA, formed without the cancellation of ALPHA - g*(1-eps)
    beta = label_smoothing * g if class_weights is None else label_smoothing * class_weights[1] * g
    if z_loss:
        beta = beta + torch.where(valid, g * (2.0 * z_loss * lse), torch.zeros_like(g))
    if g_lse is not None:
        beta = beta + g_lse.float()
    coef[:, BETA] = beta
    if label_smoothing:
        coef[:, GAMMA] = -label_smoothing / vocab_size * g
    return coef if residual is None else fold_lse_residual(coef, residual)


def logprob_rows(stats: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row logprob of the target and entropy, ``float32 [N]``; 0 where ``valid`` is False."""
    lp = (stats[:, TARGET] - stats[:, MAX]) - torch.log(stats[:, SUMEXP])  # exact near 0 (lse_residual)
    ent = entropy(stats)
    zero = torch.zeros_like(lp)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def logprob_coef(
    stats: torch.Tensor, valid: torch.Tensor, g_logprob: torch.Tensor | None, g_entropy: torch.Tensor | None
) -> torch.Tensor:
    """Coefficients of d(logprob, entropy)/dz for a backward that forms ``p = exp(z - log_sum_exp(stats))``, the
    float32 lse's rounding folded in (:func:`fold_lse_residual`) (layout: :mod:`cce_dist.core.backend`; at the target
    the logprob terms ``g*(1 - p)`` are formed as ``(p - 1)*ALPHA``, exact near p = 1).

    Centred on lse (d H/d z_j = -p_j (z_j - lse + H)), no term is of the logits' magnitude: with
    absolute logits, ``g*E_p[z] - g*z`` cancelled and lost the logprob term at |z| ~ 1e37."""
    n = stats.shape[0]
    coef = stats.new_zeros(n, NUM_COEFS)
    zero = stats.new_zeros(n)
    g_lp = torch.where(valid, g_logprob.float(), zero) if g_logprob is not None else zero
    ent_term = zero  # -g_ent * H: the part of ALPHA the target's term keeps (BETA = ALPHA + g_lp, formed exactly)
    if g_entropy is not None:
        g_ent = torch.where(valid, g_entropy.float(), zero)
        ent_term = -torch.where(g_ent != 0, g_ent * entropy(stats), zero)
        coef[:, DELTA] = -g_ent
    coef[:, ALPHA] = ent_term - g_lp
    coef[:, BETA] = ent_term
    return fold_lse_residual(coef, lse_residual(stats))


@dataclass(frozen=True)
class CrossEntropyTerms:
    """Cross-entropy's formulas over chunks of rows, as a value: what a fused schedule
    (:attr:`cce_dist.core.backend.Backend.fused_cross_entropy`) applies to each chunk's global statistics.

    valid           ``bool [N]``: the rows that count
    label_smoothing, z_loss, vocab_size
                    as in :func:`cross_entropy_rows` (``vocab_size``: global, all shards)
    class_weights   :mod:`cce_dist.core.class_weight`'s terms ``(w_t float32 [N], W / V float32 [])``, or None
    """

    valid: torch.Tensor
    label_smoothing: float
    z_loss: float
    vocab_size: int
    class_weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def _chunk(self, rows: slice | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        cw = self.class_weights
        if rows is None:  # (no slice constant: the Dynamo of torch 2.10 / 2.11 cannot build one)
            return self.valid, cw
        return self.valid[rows], None if cw is None else (cw[0][rows], cw[1])

    def rows(self, stats: torch.Tensor, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, lse)`` ``float32 [n]`` of the rows ``rows`` (a slice of the N rows; None: all) from their
        global ``stats``: :func:`cross_entropy_rows`."""
        valid, cw = self._chunk(rows)
        return cross_entropy_rows(
            stats,
            valid,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            vocab_size=self.vocab_size,
            class_weights=cw,
        )

    def coef(
        self,
        lse: torch.Tensor,
        rows: slice | None = None,
        g_loss: torch.Tensor | None = None,
        g_lse: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Coefficients ``float32 [n, NUM_COEFS]`` of the rows ``rows`` (:func:`cross_entropy_coef`) for the upstream
        gradients ``g_loss`` (default: 1 per counted row) and ``g_lse``; ``residual`` None for a schedule that forms
        ``p`` exactly (no lse residual to fold in)."""
        valid, cw = self._chunk(rows)
        return cross_entropy_coef(
            lse,
            valid,
            torch.ones_like(lse) if g_loss is None else g_loss,
            g_lse,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
            vocab_size=self.vocab_size,
            residual=residual,
            class_weights=cw,
        )
