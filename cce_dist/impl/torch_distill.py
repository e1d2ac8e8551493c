"""Knowledge distillation from two heads in token chunks: pure PyTorch, any device.

Per token chunk both heads' logits are formed (transposed, ``[V_local, n]`` float32, as in
:mod:`cce_dist.impl.torch_cross_entropy`), never a ``[N, V]`` block. Two passes over the chunk's logits:

1. row statistics (:mod:`cce_dist.core.stats` layout, MAX / SUMEXP / TARGET) of the student's soft
   logits, the teacher's soft logits and, with a hard-label term, the student's logits at T=1,
   stacked ``[k * n, NUM_STATS]`` and combined over the group by ``reduce_stats``
   (:meth:`cce_dist.tp.collectives.Comm.reduce_stats`: MAX + SUM or one all-gather) -> global max and sum;
2. with the global statistics every element's ``log p`` is known, so the divergence's per-row sums
   (and the one auxiliary sum its gradient needs) are plain sums over vocab entries, combined by
   ``reduce_rows`` (:meth:`cce_dist.tp.collectives.Comm.reduce_sum`).

With ``ls = log p_s``, ``lt = log p_t`` (soft: logits / T) the per-row divergences and the
gradients w.r.t. the student's soft logits ``z_s`` are

- ``kl``          ``D = sum p_t (lt - ls)``;                       ``dD/dz_s = p_s - p_t``
- ``reverse_kl``  ``D = R = sum p_s (ls - lt)``;                   ``dD/dz_s = p_s (ls - lt - R)``
- ``jsd``         ``lm = log(beta p_t + (1-beta) p_s)``, ``K = sum p_s (ls - lm)``,
                  ``D = beta sum p_t (lt - lm) + (1-beta) K``;     ``dD/dz_s = (1-beta) p_s (ls - lm - K)``

A zero probability contributes 0 to every sum (``0 log 0 = 0``: selected, never ``0 * -inf``), so a
masked token (a ``-inf`` logit, e.g. from a ``-inf`` bias entry) adds nothing where the divergence is
finite: a teacher-masked token for ``kl`` and ``jsd``, a student-masked one for ``reverse_kl`` and ``jsd``
(its gradient is 0). Where the materialized program's divergence is infinite -- teacher mass on a
student-masked token for ``kl``, student mass on a teacher-masked one for ``reverse_kl`` -- the loss is
``+inf`` as there (its gradient is not finite).

(the forward KL's sum is taken before the reduce, from this shard's ``exp(z - m)``:
``sum p_t (lt - ls) = c_t sum e_t (zt - zs) + (l_t - l_s) c_t s_t``, which lets it run in three
blocks), and the hard term ``CE = (M1 - z1_target) + log S1`` (student logits at T=1) adds
``p1 - onehot``.

No log-probability is formed as ``z - lse``: ``lse = M + log S`` (global max M and sum S) is rounded
at ulp(|lse|), an absolute error in every ``log p`` and a relative one in every ``p``, which near
``p = 1`` with large logits (3.8e-6 at |lse| ~ 40) is 30-100x the materialized float32 program's
(``log_softmax`` forms ``(z - M) - log S``). With this shard's row max ``m``,
``log p = (z - m) + l`` and ``p = exp(z - m) * c`` with ``l = (m - M) - log S`` and
``c = exp(m - M) / S`` (:func:`_normalizers`; ``1 / S`` on the shard that holds the max). With a
hard-label term the student's soft logits are held relative to ``m1 / T`` (``m1`` its max at T=1),
and ``p1 = exp(z1 - m1) * c1`` is ``p_s`` at T=1; at any other T the gradient keeps ``exp(z1 - m1)`` of
the T=1 pass in one more block (``e_s**T`` would underflow in float32 where ``z1 - m1 < -87 T``,
e.g. -4.4 at T=0.05, while ``p1`` is still sizable there). The raw logits' gradient
is then chained through ``1/T`` and the softcap. Backward (per-row upstream gradients) recomputes
a chunk from the saved global statistics and rows: no collective but the caller's dH reduction.

No autograd and no torch.distributed here: :mod:`cce_dist.engine.distill_autograd` passes the callbacks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.options import DistillationOptions
from ..core.stats import MAX, NUM_STATS, SUMEXP, TARGET, normalizers, safe_max
from .torch_cross_entropy import (
    GradAccumulator,
    LogitsBlock,
    gemm_inputs,
    inactive_rows_zeroed,
    logits_t,
    target_cols,
    token_chunks,
)

Tensor = torch.Tensor


@dataclass
class Heads:
    """One call's tensors, already cast to each head's compute dtype and flattened.

    hs ``[N, D_s]``, ws ``[V_local, D_s]``, bs ``[V_local]`` or None: the student;
    ht ``[N, D_t]``, wt ``[V_local, D_t]``, bt: the teacher (same vocab rows as the student);
    targets ``int64 [N]`` global ids (only read with a hard-label term), valid ``bool [N]``.
    """

    hs: Tensor
    ws: Tensor
    bs: Tensor | None
    ht: Tensor
    wt: Tensor
    bt: Tensor | None
    targets: Tensor
    valid: Tensor
    vocab_start: int
    opts: DistillationOptions

    def __post_init__(self) -> None:
        self.hs, self.ws, self.bs, self.round_s = gemm_inputs(self.hs, self.ws, self.bs)
        self.ht, self.wt, self.bt, self.round_t = gemm_inputs(self.ht, self.wt, self.bt)

    @property
    def n_stats(self) -> int:
        """Statistics blocks per row: student soft, teacher soft (and student at T=1)."""
        return 3 if self.opts.hard_label_weight > 0 else 2

    @property
    def n_rows(self) -> int:
        """Per-row sums of pass 2: the divergence's (jsd: the teacher part and K)."""
        return 2 if self.opts.divergence == "jsd" else 1


class _Buffers:
    """The reusable ``[V_local, n]`` float32 blocks of one call (see :class:`torch_cross_entropy.LogitsBlock`),
    made on first use: the forward KL needs three (``zs``, ``zt``, ``pt``), the others four; a gradient with a
    hard-label term at T != 1 one more (``p1``)."""

    def __init__(self, v_local: int, step: int, device: torch.device):
        self._args = (v_local, step, device)
        self._blocks: dict[str, LogitsBlock] = {}

    def __getattr__(self, name: str) -> LogitsBlock:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._blocks:
            self._blocks[name] = LogitsBlock(*self._args)
        return self._blocks[name]


def _head_stats(z: Tensor, e: Tensor, out: Tensor) -> Tensor:
    """MAX and SUMEXP of ``z [V, n]`` into ``out [n, NUM_STATS]``; ``z -= max`` in place (0 for a row max of -inf:
    :func:`cce_dist.core.stats.safe_max`), ``e = exp(z)``.

    Returns the row max (subtracted from ``z``)."""
    m = z.amax(0)
    z.sub_(safe_max(m))  # a row with no finite logit here (a masked shard): z stays -inf, e = 0, not NaN
    torch.exp(z, out=e)
    out[:, MAX] = m
    out[:, SUMEXP] = e.sum(0)
    return m


def _normalizers(m: Tensor, glob: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`cce_dist.core.stats.normalizers` for this shard's row max ``m [n]`` and the global statistics ``glob [n,
    NUM_STATS]``: ``p = exp(z - m) * c``, ``log p = (z - m) + l`` (never through ``lse``: see the module docstring)."""
    return normalizers(m, glob)


def _rows_from(glob: Tensor, rows: Tensor, opts: DistillationOptions) -> Tensor:
    """The per-row divergence ``float32 [n]`` from the global pass-2 sums ``rows [n, n_rows]``."""
    if opts.divergence == "jsd":
        return opts.beta * rows[:, 0] + (1.0 - opts.beta) * rows[:, 1]
    return rows[:, 0]


@dataclass
class _Pass:
    """One chunk's blocks after the statistics pass (this shard's, before the group's statistics are known).

    ``zs`` / ``zt``: each head's soft logits relative to this shard's row max (``m_s`` / ``m_t``; ``m_s`` in soft
    units, offset by ``m1 / T`` with a hard-label term); ``ps`` / ``pt``: their ``exp`` (forward KL: ``zs`` itself
    becomes ``ps``); ``th``: the student's ``tanh`` of the softcap, or None; ``e1`` / ``m1``: ``exp(z1 - m1)`` and
    the max of the student's logits at T=1 (hard-label term); ``t_rows`` / ``t_cols``: this shard's targets;
    ``cross``: the forward KL's sum ``e_t (zt - zs)``; ``s_t``: the teacher's local sum; ``local``: the
    ``[k, n, NUM_STATS]`` statistics to reduce."""

    zs: Tensor
    zt: Tensor
    ps: Tensor
    pt: Tensor
    th: Tensor | None
    m_s: Tensor
    m_t: Tensor
    local: Tensor
    s_t: Tensor
    m1: Tensor | None = None
    e1: Tensor | None = None
    t_rows: Tensor | None = None
    t_cols: Tensor | None = None
    cross: Tensor | None = None


def _statistics_pass(heads: Heads, buf: _Buffers, sl: slice, local: Tensor, grad: bool) -> _Pass:
    """Both heads' logits of the chunk and this shard's statistics (into ``local``); ``grad``: a gradient follows
    (with a hard-label term at T != 1, ``exp(z1 - m1)`` is kept in one more block)."""
    o = heads.opts
    temp, n, v = o.temperature, sl.stop - sl.start, heads.ws.shape[0]
    zs, th = logits_t(heads.hs[sl], heads.ws, heads.bs, o.student_softcap, 1.0, buf.zs, heads.round_s)
    zt = logits_t(heads.ht[sl], heads.wt, heads.bt, o.teacher_softcap, temp, buf.zt, heads.round_t)[0]
    pt = buf.pt.view(n)
    t_rows = t_cols = m1 = e1 = None
    if o.hard_label_weight > 0:  # the student's logits at T=1: their statistics and the target logit
        t_rows, t_cols = target_cols(heads.targets[sl], heads.vocab_start, v)
        local[2, t_cols, TARGET] = zs[t_rows, t_cols]
        # exp(z1 - m1): kept for p1 where T != 1 and a gradient is asked for (formed from the soft logits as
        # exp(z1/T - m)**T it would underflow in float32 wherever z1 - m1 < -87 T while p1 is still sizable)
        e1 = buf.p1.view(n) if (grad and temp != 1.0) else pt
        m1 = _head_stats(zs, e1, local[2])  # zs = z1 - m1: the soft logits below are taken relative to m1 / T
    if temp != 1.0:
        zs.div_(temp)
    cross = None
    if o.divergence == "kl":  # three blocks: zs, zt, pt
        m_s = zs.amax(0)
        zs.sub_(safe_max(m_s))
        m_t = _head_stats(zt, pt, local[1])  # zt = z_t - m_t, pt = exp(zt)
        # sum e_t (zt - zs), this shard's, relative to its maxima; e_t = 0 (a teacher-masked token) adds 0, not
        # 0 * -inf (selected, not multiplied)
        cross = zt.sub_(zs).masked_fill_(pt == 0, 0.0).mul_(pt).sum(0)
        ps = zs.exp_()  # e_s, in place
        local[0, :, SUMEXP] = ps.sum(0)
    else:
        ps = buf.ps.view(n)
        m_s = _head_stats(zs, ps, local[0])  # zs = z_s - m_s, ps = exp(zs)
        m_t = _head_stats(zt, pt, local[1])
    if m1 is not None:
        m_s = m_s + m1 / temp
    local[0, :, MAX] = m_s
    s_t = local[1, :, SUMEXP].clone()
    return _Pass(zs, zt, ps, pt, th, m_s, m_t, local, s_t, m1, e1, t_rows, t_cols, cross)


def chunk(
    heads: Heads,
    buf: _Buffers,
    sl: slice,
    reduce_stats: Callable[[Tensor], Tensor],
    reduce_rows: Callable[[Tensor], Tensor],
    g: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One token chunk: ``(global stats [n, k, NUM_STATS], global rows [n, n_rows], d raw logits)``.

    ``g float32 [n]`` (0 on rows without gradient) asks for the gradient of ``sum_i g_i * loss_i``
    w.r.t. the student's raw logits, returned as ``float32 [V_local, n]`` (a view of a buffer);
    None: no gradient. ``reduce_stats`` / ``reduce_rows`` turn this shard's partial statistics
    and sums into the group's (or return saved ones when recomputing).
    """
    o = heads.opts
    n, k = sl.stop - sl.start, heads.n_stats
    local = torch.zeros(k, n, NUM_STATS, dtype=torch.float32, device=heads.hs.device)
    local[:, :, MAX] = float("-inf")
    if heads.ws.shape[0] == 0:  # an empty shard still joins every collective
        glob = reduce_stats(local.view(k * n, NUM_STATS)).view(k, n, NUM_STATS)
        rows = reduce_rows(torch.zeros(n, heads.n_rows, dtype=torch.float32, device=local.device))
        return glob.transpose(0, 1), rows, None
    st = _statistics_pass(heads, buf, sl, local, g is not None)
    glob = reduce_stats(local.view(k * n, NUM_STATS)).view(k, n, NUM_STATS)
    norms = (_normalizers(st.m_s, glob[0]), _normalizers(st.m_t, glob[1]))
    # the per-row factors of the gradient: the soft term's (its scale, JSD's 1 - beta, 1/T for the chain to the raw
    # logits) and the hard-label term's, with p1 = exp(z1 - m1) * c1 from the T=1 logits at T != 1 (T=1: p_s)
    gs = wg = p1 = None
    if g is not None:
        gs = g * (o.soft_scale * ((1.0 - o.beta) if o.divergence == "jsd" else 1.0) / o.temperature)
        if o.hard_label_weight > 0:
            wg = g * o.hard_label_weight
            if o.temperature != 1.0:
                assert st.m1 is not None and st.e1 is not None  # formed by the pass with a hard-label term
                p1 = st.e1.mul_(_normalizers(st.m1, glob[2])[0])
    if o.divergence == "kl":
        rows, dz, t_val = _forward_kl(st, norms, reduce_rows, gs, wg, exact_target=p1 is None)
    else:
        rows, dz = _log_space(heads, st, norms, reduce_rows, gs)
        t_val = None
        if wg is not None and p1 is None:
            p1 = st.ps
    if dz is None:
        return glob.transpose(0, 1), rows, None
    if p1 is not None:  # wg * (p1 - onehot): at the target (p1 - 1) * wg, exact near p1 = 1 (no cancellation)
        assert wg is not None  # p1 is formed for the hard-label term only
        t_val = dz[st.t_rows, st.t_cols] + wg[st.t_cols] * (p1[st.t_rows, st.t_cols] - 1.0)
        dz.addcmul_(p1, wg)
    if wg is not None:
        dz[st.t_rows, st.t_cols] = t_val
    if st.th is not None:
        dz.mul_(st.th.square_().neg_().add_(1.0))
    return glob.transpose(0, 1), rows, dz


def _forward_kl(st: _Pass, norms, reduce_rows, gs: Tensor | None, wg: Tensor | None, exact_target: bool):
    """``(rows, dz w.r.t. the soft logits, the target entries or None)`` of ``KL(p_t || p_s)`` from the three
    blocks of its statistics pass. ``exact_target`` (T = 1): the hard-label term ``wg * (p_s - onehot)`` is folded
    in here, its target entries formed exactly near ``p_s = 1``."""
    (c_s, l_s), (c_t, l_t) = norms
    local_rows = torch.empty(st.zs.shape[1], 1, dtype=torch.float32, device=st.zs.device)
    assert st.cross is not None  # the cross sum of the forward KL's statistics pass
    # sum p_t (log p_t - log p_s) = c_t * sum e_t (zt - zs) + (l_t - l_s) * c_t * s_t
    # a shard without teacher mass (c_t = 0: e.g. every token masked, l_t = -inf) adds 0, never 0 * (-inf - l_s)
    local_rows[:, 0] = torch.where(c_t == 0, 0.0, c_t * st.cross + (l_t - l_s) * (c_t * st.s_t))
    rows = reduce_rows(local_rows)
    if gs is None:
        return rows, None, None
    # dz = gs * (p_s - p_t) (+ wg * p_s at T = 1): two passes over the held exp(z - m)
    a_s, t_val = c_s * gs, None
    if wg is not None and exact_target:  # the target's value, with wg*(p_s - 1) formed exactly near p_s = 1
        a_s = c_s * (gs + wg)
        tr, tc = st.t_rows, st.t_cols
        p_st = st.ps[tr, tc] * c_s[tc]
        t_val = gs[tc] * (p_st - st.pt[tr, tc] * c_t[tc]) + wg[tc] * (p_st - 1.0)
    return rows, st.ps.mul_(a_s).addcmul_(st.pt, -(c_t * gs)), t_val


def _log_space(heads: Heads, st: _Pass, norms, reduce_rows, gs: Tensor | None):
    """``(rows, dz w.r.t. the soft logits)`` of the reverse KL or the JSD, from both heads' log-probabilities
    (``zs``, ``zt`` become them in place; ``ps``, ``pt`` the probabilities)."""
    o = heads.opts
    (c_s, l_s), (c_t, l_t) = norms
    zs, zt, ps, pt = st.zs, st.zt, st.ps, st.pt
    local_rows = torch.empty(zs.shape[1], heads.n_rows, dtype=torch.float32, device=zs.device)
    zs.add_(l_s)  # log p_s
    ps.mul_(c_s)  # p_s
    zt.add_(l_t)
    pt.mul_(c_t)
    if o.divergence == "reverse_kl":
        zs.sub_(zt).masked_fill_(ps == 0, 0.0)  # log p_s - log p_t; 0 where p_s = 0 (0 log 0 = 0)
        local_rows[:, 0] = torch.mul(ps, zs, out=zt).sum(0)
        rows = reduce_rows(local_rows)
        # p_s (d - R) as p_s d - p_s R with the very p_s d that R sums: where the heads disagree confidently,
        # d - R cancels at the student's max, and there so does the rounding of p_s d (not of d alone)
        dz = zt.addcmul_(ps, rows[:, 0], value=-1.0) if gs is not None else None
    else:
        lb, l1b = math.log(o.beta), math.log1p(-o.beta)
        lm = torch.logaddexp(zt.add_(lb), zs.add_(l1b))  # log M
        zs.sub_(lm).sub_(l1b).masked_fill_(ps == 0, 0.0)  # log p_s - log M; 0 where p_s = 0 (0 log 0 = 0)
        zt.sub_(lm).sub_(lb).masked_fill_(pt == 0, 0.0)  # log p_t - log M; likewise
        local_rows[:, 1] = torch.mul(ps, zs, out=lm).sum(0)  # K
        local_rows[:, 0] = torch.mul(pt, zt, out=lm).sum(0)
        del lm
        rows = reduce_rows(local_rows)
        dz = zs.sub_(rows[:, 1]).mul_(ps) if gs is not None else None
    if dz is None:
        return rows, None
    assert gs is not None
    return rows, dz.mul_(gs)


def loss_rows(heads: Heads, glob: Tensor, rows: Tensor, sl: slice) -> Tensor:
    """Per-row loss ``float32 [n]`` (0 where not valid) from a chunk's global stats and rows."""
    o = heads.opts
    loss = o.soft_scale * _rows_from(glob, rows, o)
    if o.hard_label_weight > 0:  # lse1 - z1_target = (M1 - z1_target) + log S1: not rounded at ulp(|lse1|)
        h = glob[:, 2]
        loss = loss + o.hard_label_weight * ((h[:, MAX] - h[:, TARGET]) + torch.log(h[:, SUMEXP]))
    return torch.where(heads.valid[sl], loss, torch.zeros_like(loss))


def _accumulate(acc: GradAccumulator, heads: Heads, dz: Tensor, g: Tensor, sl: slice) -> None:
    inactive = torch.nonzero(g == 0, as_tuple=True)[0]
    if inactive.numel():  # exactly zero, even where a row's logits are not finite
        dz.index_fill_(1, inactive, 0.0)
    acc.add(dz, inactive_rows_zeroed(heads.hs[sl], inactive), heads.ws, sl)


def forward(
    heads: Heads,
    step: int,
    reduce_stats: Callable[[Tensor], Tensor],
    reduce_rows: Callable[[Tensor], Tensor],
    row_grad: float | Tensor | None = None,
    need: tuple[bool, bool, bool] = (False, False, False),
    deterministic: bool = False,
):
    """All chunks: ``(loss_rows [N], stats [N, k, NUM_STATS], rows [N, n_rows], dh, dw, db)``.

    ``row_grad`` (the scalar-loss schedule): also the student's gradients (float32, ``need`` =
    hidden, weight, bias) of ``row_grad * sum_i loss_i`` over valid rows, formed from the held
    logits. ``step`` tokens per chunk must be the same on every rank of a group. Always deterministic (the
    flag is the protocol's, not read).
    """
    n = heads.hs.shape[0]
    dev = heads.hs.device
    loss = torch.zeros(n, dtype=torch.float32, device=dev)
    stats = torch.empty(n, heads.n_stats, NUM_STATS, dtype=torch.float32, device=dev)
    rows = torch.empty(n, heads.n_rows, dtype=torch.float32, device=dev)
    grads = row_grad is not None and any(need)
    acc = GradAccumulator(heads.hs, heads.ws, *need, heads.round_s) if grads else None
    buf = _Buffers(heads.ws.shape[0], min(step, max(n, 1)), dev)
    for sl in token_chunks(n, step):
        g = None
        if grads:
            assert row_grad is not None  # grads needs it
            g = torch.where(heads.valid[sl], row_grad, 0.0).float()
        glob, r, dz = chunk(heads, buf, sl, reduce_stats, reduce_rows, g)
        stats[sl], rows[sl] = glob, r
        loss[sl] = loss_rows(heads, glob, r, sl)
        if dz is not None and g is not None and acc is not None and bool(g.any()):
            _accumulate(acc, heads, dz, g, sl)
    out = acc.result() if acc is not None else (None, None, None)
    return (loss, stats, rows) + tuple(out)


def grads(
    heads: Heads,
    step: int,
    stats: Tensor,
    rows: Tensor,
    g: Tensor,
    need: tuple[bool, bool, bool],
    deterministic: bool = False,
):
    """The student's float32 gradients ``(dh partial, dw, db)`` of ``sum_i g_i * loss_i`` (no collective):
    each chunk is recomputed from the saved global ``stats`` and ``rows`` of :func:`forward`."""
    acc = GradAccumulator(heads.hs, heads.ws, *need, heads.round_s)
    n = heads.hs.shape[0]
    if n == 0 or heads.ws.shape[0] == 0:
        return acc.result()
    g = torch.where(heads.valid, g.float(), torch.zeros_like(g, dtype=torch.float32))
    buf = _Buffers(heads.ws.shape[0], min(step, n), heads.hs.device)
    for sl in token_chunks(n, step):
        gc = g[sl]
        if not bool(gc.any()):
            continue
        saved_stats = stats[sl].transpose(0, 1).reshape(-1, NUM_STATS)  # the [k * n, NUM_STATS] of forward

        def saved(_, s=saved_stats):
            return s

        def saved_rows(_, r=rows[sl]):
            return r

        _, _, dz = chunk(heads, buf, sl, saved, saved_rows, gc)
        assert dz is not None  # asked for with gc
        _accumulate(acc, heads, dz, gc, sl)
    return acc.result()
