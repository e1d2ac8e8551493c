"""Per-row partial statistics over a slice of the vocabulary, and how they combine.

Everything cce_dist computes (loss, lse, label-smoothing term, logprob, entropy, and the row outputs: the predicted
token, whether the target is top-1, log sum p^2, the mean logit) is a function of seven per-row numbers gathered over
a slice of the vocabulary. Two slices combine associatively,
so the same code merges vocab chunks inside one program, chunks of the PyTorch path and ranks of
a tensor-parallel group.

A statistics tensor is ``float32 [N, NUM_STATS]`` with columns:

``MAX``      m = max_j z_j                                 (-inf for an empty slice)
``SUMEXP``   s = sum_j exp(z_j - m)                        (0 for an empty slice)
``TARGET``   x = z_t if the row's target t is in the slice, else 0
``SUM``      a = sum_j z_j * SUM_SCALE                     (label smoothing needs mean_j z_j)
``ENTROPY``  e = sum_j exp(z_j - m) * (z_j - m)            (entropy needs E_p[z])
``ARGMAX``   the lowest global id j with z_j = m, as float32  (+inf for an empty slice; exact below 2**24)
``SUMSQ``    q = sum_j exp(2 (z_j - m))                     (log sum_j p_j^2 = log q - 2 log s)

SUM, ENTROPY, ARGMAX and SUMSQ are formed only where an output needs them (0 otherwise). Combining two slices keeps
the larger max and, on a tie, the lower id: ``torch.argmax``'s rule, whatever the order the slices (chunks, splits,
ranks) come in. A NaN logit is the maximum, as for ``torch.argmax``: a slice holding one has MAX NaN and ARGMAX the
lowest id of a NaN (:func:`holds_max`).

``e`` is taken relative to the slice max (rather than ``sum exp(z - m) * z``) so it does not
cancel catastrophically when logits are large; it rescales like ``s`` plus a shift term.

``a`` is scaled by the exact power of two ``SUM_SCALE = 2**-32`` before summing, so it cannot
overflow float32 for any vocabulary below 2**32 entries, whatever the logits (an unscaled sum of
V logits of ~1e37 overflows, and ``lse - a / V`` became -inf). Scaling only loses logits below
~1e-29 to float32's subnormal range: an absolute error under 1e-35 in ``mean_j z_j``.
"""

from __future__ import annotations

import torch

MAX, SUMEXP, TARGET, SUM, ENTROPY, ARGMAX, SUMSQ = range(7)
NUM_STATS = 7
#: the columns that add up across slices once rescaled to a common max (every column but MAX and ARGMAX)
ADDITIVE = (SUMEXP, TARGET, SUM, ENTROPY, SUMSQ)
#: ids at or above this are not exact as float32 (the ARGMAX column)
MAX_EXACT_ID = 2**24
SUM_SCALE = 2.0**-32


def empty_stats(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Statistics of an empty vocab slice for ``n`` rows: the identity of :func:`combine`."""
    out = torch.zeros(n, NUM_STATS, dtype=torch.float32, device=device)
    out[:, MAX] = float("-inf")
    out[:, ARGMAX] = float("inf")
    return out


def safe_max(m: torch.Tensor) -> torch.Tensor:
    """A slice's row max ``m``, or 0 where ``m = -inf`` (no finite logit: empty, or every token masked by a ``-inf``
    bias): what its exponents are taken relative to, so that ``exp(z - safe_max(m))`` is ``exp(-inf) = 0`` there,
    never ``exp(-inf - -inf) = NaN`` (flash attention's guard). The MAX column keeps ``-inf``."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def _safe_scale(m: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """exp(m - new_max), with exp(-inf - -inf) taken as 0 (both slices empty)."""
    d = m - new_max
    return torch.where(torch.isneginf(m), torch.zeros_like(d), torch.exp(d))


def rescale(stats: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """Re-express ``stats`` relative to ``new_max`` (>= the slice max) so slices can be summed.

    Returns ``[N, NUM_STATS]`` whose ``MAX`` column is ``new_max`` and whose SUMEXP/ENTROPY columns
    are additive across slices that share ``new_max``. TARGET and SUM are already additive; ARGMAX is kept.
    """
    m, s, e = stats[:, MAX], stats[:, SUMEXP], stats[:, ENTROPY]
    scale = _safe_scale(m, new_max)
    shift = torch.where(torch.isneginf(m), torch.zeros_like(m), m - new_max)
    out = stats.clone()
    out[:, MAX] = new_max
    out[:, SUMEXP] = s * scale
    # a slice whose weight exp(m - new_max) is 0 adds 0; its shift may have overflowed to -inf (maxes near -3e38 and
    # +3e38), and -inf * 0 would be NaN. A NaN max gives a NaN scale, which still propagates.
    out[:, ENTROPY] = torch.where(scale == 0, torch.zeros_like(e), (e + s * shift) * scale)
    out[:, SUMSQ] = stats[:, SUMSQ] * scale * scale
    return out


def holds_max(m: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """Where a slice whose MAX is ``m`` holds the combined max ``new_max`` (broadcast): equal, or both NaN.

    The argmax rule is ``torch.argmax``'s: a NaN logit counts as the maximum (the first NaN wins), otherwise the
    largest value (the lowest id on a tie). A slice holding a NaN logit has MAX NaN and ARGMAX the lowest id of a
    NaN; a combined max is NaN where any slice's is (``amax`` propagates it), and then only the NaN slices hold it.
    """
    return (m == new_max) | (torch.isnan(m) & torch.isnan(new_max))


def argmax_of(stack: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """The ARGMAX of ``[P, N, NUM_STATS]`` slices whose combined max is ``new_max [N]``: the lowest id among the
    slices that hold the max (:func:`holds_max`: a NaN max is held by the slices with a NaN)."""
    holds = holds_max(stack[..., MAX], new_max)
    return torch.where(holds, stack[..., ARGMAX], torch.full_like(stack[..., ARGMAX], float("inf"))).amin(0)


def predicted(stats: torch.Tensor) -> torch.Tensor:
    """The ARGMAX column as ``int64 [N]`` global ids; -1 where it holds no id (+inf: no slice had a logit), never
    the ``INT64_MIN`` a cast of a non-finite float gives."""
    ids = stats[:, ARGMAX]
    return torch.where(torch.isfinite(ids), ids, -1.0).to(torch.int64)


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Merge the statistics of two disjoint vocab slices (associative, commutative)."""
    return combine_stack(torch.stack([a, b]))


def combine_stack(stack: torch.Tensor) -> torch.Tensor:
    """Merge ``[P, N, NUM_STATS]`` statistics of P disjoint slices into ``[N, NUM_STATS]``."""
    if stack.shape[0] == 1:
        return stack[0]
    new_max = stack[..., MAX].amax(0)
    out = torch.stack([rescale(s, new_max) for s in stack.unbind(0)]).sum(0)
    out[..., MAX] = new_max
    out[..., ARGMAX] = argmax_of(stack, new_max)
    return out


def lse(stats: torch.Tensor) -> torch.Tensor:
    """log-sum-exp per row, ``float32 [N]``."""
    return stats[:, MAX] + torch.log(stats[:, SUMEXP])


def normalizers(local_max: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(c, l)`` ``float32 [..., N]``: how a slice whose row max is ``local_max [..., N]`` turns its
    ``exp(z - local_max)`` into probabilities, ``p = exp(z - local_max) * c``, and its ``z - local_max`` into
    log-probabilities, ``log p = (z - local_max) + l``, given the row's global statistics ``stats [N, NUM_STATS]``
    (max ``M``, sum ``S``): ``c = exp(local_max - M) / S`` and ``l = (local_max - M) - log S``.

    Never through ``lse = M + log S``, which float32 rounds at ulp(|lse|): an absolute error in every ``log p`` and a
    relative one in every ``p``. ``-inf``-safe: a slice with no finite logit (``local_max = -inf``: empty, or every
    token masked by a ``-inf`` bias) gets ``c = 0`` and ``l = -inf``, so it adds exactly 0 to every sum over ``p``
    (``-inf - M`` is NaN where the whole row is masked: there is no distribution)."""
    d = local_max - stats[:, MAX]
    empty = torch.isneginf(local_max)
    c = torch.where(empty, torch.zeros_like(d), torch.exp(d) / stats[:, SUMEXP])
    return c, torch.where(empty, float("-inf"), d - torch.log(stats[:, SUMEXP]))


def log_sum_sq_probs(stats: torch.Tensor) -> torch.Tensor:
    """``log sum_j p_j^2`` per row, ``float32 [N]``: ``log q - 2 log s`` (no lse rounding)."""
    return torch.log(stats[:, SUMSQ]) - 2.0 * torch.log(stats[:, SUMEXP])


def mean_logit(stats: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """mean_j z_j over a vocabulary of ``vocab_size`` entries, ``float32 [N]`` (never overflows)."""
    return (stats[:, SUM] / vocab_size) / SUM_SCALE


def entropy(stats: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per row: lse - E_p[z] = log s - e / s, ``float32 [N]``."""
    s = stats[:, SUMEXP]
    return torch.log(s) - stats[:, ENTROPY] / s
