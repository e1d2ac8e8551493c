"""Data-parallel vocab-sharded heads (``VocabShard.data_parallel``, FSDP2): each rank's own rows around the Functions.

Under ``data_parallel`` every rank passes its own tokens, ``n_r`` of them (any number, 0 too), and holds a vocab shard
of the head. The loss Functions of :mod:`cce_dist.engine.autograd` / :mod:`cce_dist.engine.distill_autograd` then run
as under sequence parallelism, on all ``N = sum_r n_r`` tokens of the group in rank order: they all-gather the hidden
states (:meth:`cce_dist.tp.collectives.Comm.gather_tokens`), combine the row statistics over the group, and in
backward reduce-scatter dH back to the owners and divide dW / db by the shard's factor (``Comm.param_grad``). What
this module adds around them:

- :func:`all_targets`: the group's target ids (and distillation's row mask), gathered in the same order, since every
  rank scores every row on its own vocab rows;
- :func:`own_rows`: the Function's per-row outputs ``[N]`` narrowed to this rank's rows ``[n_r]`` by
  :class:`OwnRows`, whose backward all-gathers every rank's upstream gradient: each rank's loss is its own, so the
  gradient the Functions' backward forms (the same on every rank) is that of the sum of the ranks' losses. Every
  rank must therefore run backward through its loss when any does (as FSDP2 requires for its own reduce-scatter).
- :class:`GatheredWeight`: a Shard(0) head's rows all-gathered for a plain ``F.linear`` (generation, eval logits),
  with FSDP2's gradient (the sum over ranks, divided by the factor, reduce-scattered back): the fallback of
  :func:`cce_dist.fsdp.shard_lm_head` when the head module itself is called. It moves ``V x D``, as FSDP does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..tp.collectives import Comm, gather_rows, reduce_scatter_rows
from .autograd import Plan, refuse_second_order

__all__ = ["GatheredWeight", "OwnRows", "all_targets", "own_rows"]


def all_targets(plan: Plan, targets: torch.Tensor, valid: torch.Tensor | None = None):
    """``(targets int64 [N], valid bool [N] or None)`` of every rank in rank order under ``data_parallel`` (one
    all-gather of ``[max n_r, 1 or 2]`` int64), else the arguments unchanged."""
    comm = plan.comm
    if comm.counts is None:
        return targets, valid
    if valid is None:
        return comm.gather_rows(targets.reshape(-1, 1)).reshape(-1), None
    both = comm.gather_rows(torch.stack([targets.reshape(-1), valid.reshape(-1).to(torch.int64)], 1))
    return both[:, 0].contiguous(), both[:, 1].to(torch.bool)


class OwnRows(torch.autograd.Function):
    """``(comm, *rows float [N])`` -> this rank's rows of each, ``[n_r]``; backward all-gathers the ranks' upstream
    gradients (one all-gather for all of them) into ``[N]`` each."""

    @staticmethod
    def forward(ctx, comm: Comm, *rows: torch.Tensor):
        ctx.comm = comm
        ctx.dtypes = [r.dtype for r in rows]
        return tuple(comm.own_rows(r).clone() for r in rows)

    @staticmethod
    def backward(ctx, *upstream: torch.Tensor):
        refuse_second_order()
        comm: Comm = ctx.comm
        stacked = torch.stack([g.reshape(-1).to(torch.float32) for g in upstream], 1)
        full = comm.gather_rows(stacked)
        return (None,) + tuple(full[:, i].to(dt) for i, dt in enumerate(ctx.dtypes))


def own_rows(plan: Plan, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's rows of the Function's differentiable per-row outputs under ``data_parallel`` (:class:`OwnRows`),
    else ``rows``. A non-differentiable per-row tensor (statistics, class weights) is narrowed with
    ``plan.comm.own_rows`` instead."""
    comm = plan.comm
    if comm.counts is None:
        return rows
    return tuple(OwnRows.apply(comm, *rows))


class GatheredWeight(torch.autograd.Function):
    """``(local [V_r, ...], sizes, rank, group, divide_factor)`` -> the full ``[V, ...]`` rows of every rank
    (:func:`cce_dist.tp.collectives.gather_rows`); backward: the full gradient summed over the ranks, this rank's
    rows of it divided by ``divide_factor`` (FSDP2's reduce-scatter of a ``Shard(0)`` parameter)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, sizes: Sequence[int], rank: int, group, divide_factor: float):
        ctx.sizes, ctx.rank, ctx.group, ctx.factor = tuple(sizes), rank, group, divide_factor
        return gather_rows(local.detach(), ctx.sizes, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        refuse_second_order()
        dtype = g.dtype
        mine = reduce_scatter_rows(g.to(torch.float32, copy=True), ctx.sizes, ctx.rank, ctx.group)
        if ctx.factor != 1.0:
            mine = mine / ctx.factor
        return mine.to(dtype), None, None, None, None
