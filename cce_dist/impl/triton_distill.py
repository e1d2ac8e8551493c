"""Knowledge distillation from two heads with the Triton kernels (:mod:`cce_dist.kernels.distill`).

The same contract as :mod:`cce_dist.impl.torch_distill` (``Heads``, ``forward``, ``grads``: the same
per-row statistics ``[N, k, NUM_STATS]``, per-row sums ``[N, n_rows]`` and float32 gradients),
over all tokens at once instead of token chunks: the kernels hold one logit tile per head per
program, never a ``[N, V]`` block, so there is nothing to chunk. A forward is one statistics
launch (for either KL it also forms the cross sum its divergence needs), one ``reduce_stats``,
for the JSD a second launch (its ``log M`` needs both heads' global statistics), and one ``reduce_rows``; the
gradients are one launch that recomputes both heads' tiles from the global statistics and adds the products
with float atomics, or with ``deterministic`` two launches without atomics (bitwise repeatable).

No autograd and no torch.distributed here: :mod:`cce_dist.engine.distill_autograd` passes the callbacks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.stats import NUM_STATS
from . import torch_distill

Tensor = torch.Tensor


class Heads(torch_distill.Heads):
    """:class:`cce_dist.impl.torch_distill.Heads` with the tensors left in their compute dtypes (the kernels
    round each head's logits to it themselves; no float32 copies for the CPU GEMMs)."""

    def __post_init__(self) -> None:
        self.round_s = self.round_t = None


def _kd():
    """:mod:`cce_dist.kernels.distill` (triton), imported where a kernel is launched: importing this module (the
    driver does, to resolve ``impl``) does not import triton."""
    from ..kernels import distill

    return distill


def _geometry(heads: Heads) -> dict:
    o = heads.opts
    return dict(softcap=(o.student_softcap, o.teacher_softcap), temperature=o.temperature)


def _tensors(heads: Heads) -> tuple:
    return heads.hs, heads.ws, heads.bs, heads.ht, heads.wt, heads.bt


def _grads(heads: Heads, stats: Tensor, rows: Tensor, g: Tensor, need: tuple[bool, bool, bool], deterministic: bool):
    o = heads.opts
    soft_coef = o.soft_scale * ((1.0 - o.beta) if o.divergence == "jsd" else 1.0) / o.temperature
    return _kd().grads(
        *_tensors(heads),
        heads.targets,
        _kd().norms(stats),  # each head's max and log S: log p = (z - M) - log S, never z - lse
        rows[:, -1],  # reverse_kl: R; jsd: K; kl: unused
        g,
        vocab_start=heads.vocab_start,
        divergence=o.divergence,
        beta=o.beta,
        soft_coef=soft_coef,
        hard_coef=o.hard_label_weight,
        need_hidden=need[0],
        need_weight=need[1],
        need_bias=need[2],
        deterministic=deterministic,
        **_geometry(heads),
    )


# forward and grads: the cce_dist.core.backend.DistillPass contract, as torch_distill (mypy checks both where
# cce_dist.impl.backends builds them).
def forward(
    heads: Heads,
    step: int,
    reduce_stats: Callable[[Tensor], Tensor],
    reduce_rows: Callable[[Tensor], Tensor],
    row_grad: float | Tensor | None = None,
    need: tuple[bool, bool, bool] = (False, False, False),
    deterministic: bool = False,
):
    """``(loss_rows [N], stats [N, k, NUM_STATS], rows [N, n_rows], dh, dw, db)`` as
    :func:`cce_dist.impl.torch_distill.forward` (``step`` is not used: one pass over all tokens, so one
    ``reduce_stats`` and one ``reduce_rows`` per call on every rank)."""
    o = heads.opts
    n, k = heads.hs.shape[0], heads.n_stats
    dev = heads.hs.device
    grads_wanted = row_grad is not None and any(need)
    if n == 0:  # the same on every rank of a group (the token count is global): no collective
        none = torch.zeros(0, dtype=torch.float32, device=dev)
        stats, rows = none.new_zeros(0, k, NUM_STATS), none.new_zeros(0, heads.n_rows)
        out = _grads(heads, stats, rows, none, need, deterministic) if grads_wanted else (None, None, None)
        return (none, stats, rows) + tuple(out)
    kd = _kd()
    cross = None if o.divergence == "jsd" else o.divergence  # a KL's sums come from the statistics pass
    local, slabs = kd.stats(
        *_tensors(heads), heads.targets, vocab_start=heads.vocab_start, hard=k == 3, cross=cross, **_geometry(heads)
    )  # [k, n, NUM_STATS]
    stats = reduce_stats(local.reshape(k * n, NUM_STATS)).view(k, n, NUM_STATS).transpose(0, 1)
    if cross is not None:
        local_rows = kd.cross_rows(slabs, stats, cross=cross)
    else:  # the JSD's log M needs both heads' global statistics: a second pass over the tiles
        local_rows = kd.rows(
            *_tensors(heads), kd.norms(stats), divergence=o.divergence, beta=o.beta, **_geometry(heads)
        )
    rows = reduce_rows(local_rows)
    loss = torch_distill.loss_rows(heads, stats, rows, slice(None))
    dh = dw = db = None
    if row_grad is not None and grads_wanted:
        g = torch.where(heads.valid, row_grad, 0.0).float()
        dh, dw, db = _grads(heads, stats, rows, g, need, deterministic)
    return loss, stats, rows, dh, dw, db


def grads(
    heads: Heads,
    step: int,
    stats: Tensor,
    rows: Tensor,
    g: Tensor,
    need: tuple[bool, bool, bool],
    deterministic: bool = False,
):
    """The student's float32 gradients ``(dh partial, dw, db)`` of ``sum_i g_i * loss_i`` (no
    collective), recomputed from the saved global ``stats`` and ``rows`` of :func:`forward`;
    ``deterministic``: without float atomics (bitwise repeatable)."""
    g = torch.where(heads.valid, g.float(), torch.zeros_like(g, dtype=torch.float32))
    return _grads(heads, stats, rows, g, need, deterministic)
