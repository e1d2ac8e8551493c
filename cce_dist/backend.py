"""The contract every implementation (``torch``, ``triton``) fulfils for one vocab shard.

An implementation is a module with two functions, free of autograd and of torch.distributed:

``row_stats(hidden, weight, bias, targets, *, vocab_start, softcap, temperature) -> stats``
    hidden  ``[N, D]``  compute dtype (already cast)
    weight  ``[V_local, D]`` compute dtype; local row ``j`` is global vocab id ``vocab_start + j``
    bias    ``[V_local]`` compute dtype, or None
    targets ``[N]`` int64 *global* ids; ids outside ``[vocab_start, vocab_start + V_local)``
            (ignore_index included) contribute TARGET = 0
    returns ``float32 [N, NUM_STATS]`` statistics (see :mod:`cce_dist.stats`) of the logits

        raw = round_to_compute_dtype(hidden @ weight.T + bias)     # then float32
        c   = softcap * tanh(raw / softcap)   if softcap else raw
        z   = c / temperature

``grads(hidden, weight, bias, targets, lse, coef, *, vocab_start, softcap, temperature,
        need_hidden, need_weight, need_bias, filter_eps=None, deterministic=False)
        -> (d_hidden, d_weight, d_bias)``
    lse     ``float32 [N]`` the *global* log-sum-exp of each row (all shards)
    coef    ``float32 [N, NUM_COEFS]`` per-row coefficients (below); an all-zero row contributes 0
    returns float32 tensors ``[N, D]``, ``[V_local, D]``, ``[V_local]`` (None where not needed);
    ``d_hidden`` is this shard's *partial* sum over its vocab rows.

    With ``p = exp(z - lse)`` and ``onehot`` the target indicator, the gradient w.r.t. ``z`` is

        dz = (p - onehot) * ALPHA + p * DELTA * (z - lse) + BETA * onehot + GAMMA

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
"""

from __future__ import annotations

ALPHA, BETA, GAMMA, DELTA = range(4)
NUM_COEFS = 4
