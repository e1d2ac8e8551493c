"""The contract every implementation (``torch``, ``triton``) fulfils for one vocab shard.

An implementation is one :class:`Backend` value (:data:`cce_dist.impl.backends.TORCH`,
:func:`cce_dist.impl.backends.triton`): its primitives, free of autograd and of torch.distributed, and the
capabilities it declares, so callers ask what a backend can do instead of which one it is. Every loss runs on the
same shape: row statistics and gradients (cross-entropy, logprobs, row outputs, class weights), an optional fused
schedule (cross-entropy's scalar loss with the gradients formed in forward) and distillation's rows pass
(:class:`DistillPass`, two heads at once).

``row_stats(hidden, weight, bias, targets, *, vocab_start, softcap, temperature) -> stats``
    hidden  ``[N, D]``  compute dtype (already cast)
    weight  ``[V_local, D]`` compute dtype; local row ``j`` is global vocab id ``vocab_start + j``
    bias    ``[V_local]`` compute dtype, or None
    targets ``[N]`` int64 *global* ids; ids outside ``[vocab_start, vocab_start + V_local)``
            (ignore_index included) contribute TARGET = 0
    returns ``float32 [N, NUM_STATS]`` statistics (see :mod:`cce_dist.core.stats`) of the logits

        raw = round_to_compute_dtype(hidden @ weight.T + bias)     # then float32
        c   = softcap * tanh(raw / softcap)   if softcap else raw
        z   = c / temperature

``grads(hidden, weight, bias, targets, lse, coef, *, vocab_start, softcap, temperature,
        need_hidden, need_weight, need_bias, filter_eps=None, deterministic=False, gamma_weights=None)
        -> (d_hidden, d_weight, d_bias)``
    lse     ``float32 [N]`` the *global* log-sum-exp of each row (all shards), as float32 rounds it
    coef    ``float32 [N, NUM_COEFS]`` per-row coefficients (below); an all-zero row contributes 0
    returns float32 tensors ``[N, D]``, ``[V_local, D]``, ``[V_local]`` (None where not needed);
    ``d_hidden`` is this shard's *partial* sum over its vocab rows.

    With ``p = exp(z - lse)`` and ``onehot`` the target indicator, the gradient w.r.t. ``z`` is

        dz = (p - onehot) * ALPHA + p * DELTA * (z - lse) + BETA * onehot + GAMMA

    (with ``gamma_weights [V_local]``, float32 class weights, the last term is ``GAMMA * gamma_weights[j]``),
    i.e. ``p * (ALPHA + DELTA * (z - lse)) + GAMMA`` off the target, and BETA is the target's
    excess over ALPHA: the target's ``(p - 1) * ALPHA`` is formed with ``p - 1`` exact near p = 1,
    so no term of the target's gradient cancels against ALPHA (each formula forms BETA directly).
    (``z - lse = log p`` keeps the DELTA term small where ``p`` matters, however large the logits;
    a zero ``p`` contributes exactly 0 to the p-terms, even where ``z - lse`` is -inf.)

    then chained through temperature and softcap: ``d raw = dz / temperature * (1 - (c/softcap)^2)``
    (the softcap factor only with a softcap), and ``d_hidden = d raw @ weight``,
    ``d_weight = d raw.T @ hidden``, ``d_bias = d raw.sum(0)``, all accumulated in float32.
    ``filter_eps``: a kernel may skip a tile whose softmax terms are all small *relative to the
    row's coefficients*, ``|p * (ALPHA + DELTA*(z - lse))| <= filter_eps * max(|ALPHA|, |BETA - ALPHA|, |DELTA|)``
    (for cross-entropy: ``p <= filter_eps``, the CCE paper's rule, whatever the upstream scale);
    the BETA (target) and GAMMA (uniform smoothing) terms must stay exact. None = exact.
    ``deterministic``: no float atomics, bitwise repeatable (the torch implementation always is).

The coefficients for each output form (``g`` = upstream gradient of that output per row):

- cross-entropy ``(1-eps)*(lse - z_t) + eps*(lse - mean z) + zl*lse^2``:
  ALPHA = g*(1 + 2*zl*lse), BETA = g*(2*zl*lse + eps), GAMMA = -g*eps/V_total, DELTA = 0
- returned lse: ALPHA += g_lse, BETA += g_lse
- logprob ``z_t - lse``: ALPHA = -g, BETA = 0
- entropy ``H = lse - E_p[z]``: ALPHA -= g_ent * H, BETA -= g_ent * H, DELTA = -g_ent
  (d H / d z_j = -p_j * (z_j - lse + H))

The float32 ``lse`` is rounded at ulp(|lse|), which at large logits is far above a confident row's ``1 - p``; the
formulas therefore fold that rounding back into the coefficients (``formulas.fold_lse_residual``), so a backend
forms ``p = exp(z - lse)`` from the lse it is given and still gets the exact gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

ALPHA, BETA, GAMMA, DELTA = range(4)
NUM_COEFS = 4


class RowStats(Protocol):
    """The parameters every ``row_stats`` starts with (module docstring); the backend's declared
    ``row_stats_options`` follow, each keyword-only with a default (tests/test_signatures.py)."""

    def __call__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        *,
        vocab_start: int,
        softcap: float | None,
        temperature: float,
    ) -> Tensor: ...


class Grads(Protocol):
    """The parameters every ``grads`` starts with (module docstring); the backend's declared ``grads_options``
    follow, each keyword-only with a default."""

    def __call__(
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
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]: ...


class DistillForward(Protocol):
    """The parameters of every :attr:`DistillPass.forward`."""

    def __call__(
        self,
        heads: Any,
        step: int,
        reduce_stats: Callable[[Tensor], Tensor],
        reduce_rows: Callable[[Tensor], Tensor],
        row_grad: float | Tensor | None = None,
        need: tuple[bool, bool, bool] = (False, False, False),
        deterministic: bool = False,
    ) -> tuple[Any, ...]: ...


class DistillGrads(Protocol):
    """The parameters of every :attr:`DistillPass.grads`."""

    def __call__(
        self,
        heads: Any,
        step: int,
        stats: Tensor,
        rows: Tensor,
        g: Tensor,
        need: tuple[bool, bool, bool],
        deterministic: bool = False,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]: ...


@dataclass(frozen=True)
class DistillPass:
    """Distillation's rows pass for one vocab shard of two heads (:mod:`cce_dist.impl.torch_distill`,
    :mod:`cce_dist.impl.triton_distill`), free of autograd and of torch.distributed (the caller passes the
    collectives as callbacks).

    ``Heads(hs, ws, bs, ht, wt, bt, targets, valid, vocab_start, opts)``: one call's tensors in each head's compute
    dtype, flattened to rows (``hs [N, D_s]``, ``ws [V_local, D_s]``, ``ht [N, D_t]``, ``wt [V_local, D_t]``,
    biases ``[V_local]`` or None, ``targets int64 [N]``, ``valid bool [N]``).

    ``forward(heads, step, reduce_stats, reduce_rows, row_grad=None, need=(False,) * 3, **grads_options)
    -> (loss_rows [N], stats [N, k, NUM_STATS], rows [N, n_rows], dh, dw, db)``: the per-row loss (0 where not
    valid), the global statistics and per-row sums its gradient needs, and with ``row_grad`` (the pass's fused
    schedule) the student's float32 gradients of ``row_grad * sum_i loss_i`` over the valid rows (``dh`` this shard's
    partial sum; None where not in ``need`` = hidden, weight, bias). ``step``: tokens per chunk, identical on every
    rank of a group.

    ``grads(heads, step, stats, rows, g, need, **grads_options) -> (dh, dw, db)``: float32 gradients of
    ``sum_i g_i * loss_i`` recomputed from the saved ``stats`` / ``rows``, no collective.

    ``grads_options``: the keyword options ``forward`` (with ``row_grad``) and ``grads`` accept (``deterministic``
    where the pass uses float atomics by default)."""

    Heads: type
    forward: DistillForward
    grads: DistillGrads
    grads_options: frozenset[str]


@dataclass(frozen=True)
class Backend:
    """One implementation: what :mod:`cce_dist.engine` may rely on, for every loss.

    name                 "torch" | "triton": which implementation ``impl=`` resolved to (the TP handshake compares
                         it: the two issue different statistics collectives for a scalar loss)
    row_stats, grads     the two primitives of the module docstring (:class:`RowStats`, :class:`Grads`: the
                         contract's parameters, then the declared options)
    fused_cross_entropy  the scalar-loss schedule that forms the gradients in forward, or None (then
                         ``grad_in_forward`` runs ``row_stats`` + ``grads``): see
                         :func:`cce_dist.impl.torch_cross_entropy.fused_cross_entropy`, with per-token-chunk
                         statistics collectives
    distill              distillation's rows pass (:class:`DistillPass`), or None where this backend has none (the
                         compiled path's: distillation does not compile)
    supports_filtering   ``grads`` honours ``filter_eps`` (else it is not passed: always exact)
    deterministic_option ``grads`` honours ``deterministic`` (else it is not passed: always deterministic)
    row_stats_options    the extra keyword options ``row_stats`` accepts (e.g. ``chunk_size``)
    grads_options        the extra keyword options ``grads`` accepts besides ``filter_eps`` / ``deterministic``
    """

    name: str
    row_stats: RowStats
    grads: Grads
    fused_cross_entropy: Callable[..., tuple[Any, ...]] | None
    distill: DistillPass | None
    supports_filtering: bool
    deterministic_option: bool
    row_stats_options: frozenset[str]
    grads_options: frozenset[str]
