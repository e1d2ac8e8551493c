"""Vocab-parallel (tensor-parallel) tests on gloo ranks spawned from pytest.

Every spawned rank builds the same full problem from one seed (hidden ``[.., D]``, head ``W [V, D]``,
bias ``b [V]``, targets, upstream gradients), keeps only its rows ``[start, stop)`` of ``W``/``b``
(and its slice of the tokens under sequence parallelism), calls cce_dist and compares with a
single-process oracle (tests/oracle.py: ``F.linear`` + softcap + ``F.cross_entropy`` / ``log_softmax``):
loss, lse, logprobs, entropy, dH (full, its sequence slice, or a partial whose sum over ranks is the
oracle's), and this rank's slice of dW and db. Each call also counts the collectives it issues.

A spawn costs ~10-15 s here, so the ranks are spawned once per world size (the ``rank_pool``
fixture, tests/dist_utils.py) and run one case per pytest item; each case is named by the options
that differ from the base case (``pytest tests/test_parallel.py -k "world4 and lp- and 0:2"`` selects
the logprobs cases of world 4, ``--collect-only -q`` lists them all). A rank collects the failing
checks of its case without raising, so it stays in step with its peers; the parent asserts there are
none.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from helpers import Failures, problem
from oracle import oracle_cross_entropy, oracle_logprobs

from cce_dist import InputError, LinearCrossEntropy, VocabShard, linear_cross_entropy, linear_logprobs
from cce_dist.impl.torch_cross_entropy import chunk_tokens
from cce_dist.testing import CollectiveLog
from cce_dist.tp.collectives import AUTO_ALLGATHER_MAX_ROWS_X_RANKS

D = 16  # hidden size; never equal to a statistics width (4, 5) so collectives can be told apart
V = 13  # global vocab (odd: shards are uneven)
SHAPE = (2, 12)  # tokens [B, T]; shift acts on T
SP_SHAPE = (12, 2)  # sequence-parallel tokens [S, B]; S is split over 2, 3 or 4 ranks
N = SHAPE[0] * SHAPE[1]
SMALL_CHUNK = 24  # logits per chunk: several token chunks (of >= 2 tokens) at every layout below

# uneven layouts (one with an empty shard) per world size
LAYOUTS = {
    2: [[(0, 5), (5, 13)], [(0, 12), (12, 13)]],
    3: [[(0, 6), (6, 6), (6, 13)], [(0, 3), (3, 10), (10, 13)]],
    4: [[(0, 2), (2, 7), (7, 8), (8, 13)]],
}

ATOL, RTOL = 3e-5, 1e-4


# ----------------------------------------------------------------------------------------------
# the oracle (tests/oracle.py: the materialized program, fp32 projection, fp32 after it)
# ----------------------------------------------------------------------------------------------


def ref_ce(h, w, b, t, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None, shift=0):
    """(loss, lse [targets' shape]) of the materialized program."""
    return oracle_cross_entropy(
        h,
        w,
        t,
        b,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        shift=shift,
        return_lse=True,
    )


def ref_logprobs(h, w, b, t, *, ignore_index=-100, softcap=None, temperature=1.0, shift=0):
    """(logprobs, entropy) of the materialized program, 0 at ignored positions."""
    return oracle_logprobs(
        h,
        w,
        t,
        b,
        ignore_index=ignore_index,
        softcap=softcap,
        temperature=temperature,
        shift=shift,
        return_entropy=True,
    )


# ----------------------------------------------------------------------------------------------
# helpers used inside the ranks
# ----------------------------------------------------------------------------------------------


def make_problem(seed=1234, shape=SHAPE, vocab=V, dim=D, ignore_frac=0.2):
    """helpers.problem (weight * 0.6, bias * 0.5, ~ignore_frac targets ignored) and, drawn next, two per-token
    upstream gradients g1, g2."""
    g = torch.Generator().manual_seed(seed)
    H, W, b, t = problem(shape, dim, vocab, w_scale=0.6, b_scale=0.5, ignore_frac=ignore_frac, seed=g)
    g1 = torch.randn(shape, generator=g)  # per-token upstream gradients
    g2 = torch.randn(shape, generator=g)
    return dict(H=H, W=W, b=b, t=t, g1=g1, g2=g2)


def _case_name(kind, c):
    """The case's options that differ from the base case (the base: see CE_BASE / LP_BASE)."""
    base = CE_BASE if kind.startswith("ce") else LP_BASE
    return kind + "(" + ", ".join(f"{k}={v}" for k, v in c.items() if base.get(k) != v) + ")"


def _sum_over_group(x, group):
    import torch.distributed as dist

    x = x.detach().clone().to(torch.float64)
    dist.all_reduce(x, group=group)
    return x


# ---- cross-entropy --------------------------------------------------------------------------

CE_BASE = dict(
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    bias=False,
    shift=0,
    ignore_index=-100,
    return_lse=False,
    gif=None,
    chunk=None,
    coll="allreduce",
    sp=False,
    rhg=True,
    needs="all",
    module=False,
    gscale=1.0,
    check=True,
    hdtype="float32",
)
CE_VALUES = dict(
    reduction=["mean", "sum", "none"],
    label_smoothing=[0.0, 0.1],
    z_loss=[0.0, 1e-2],
    softcap=[None, 2.5],
    bias=[False, True],
    shift=[0, 1],
    ignore_index=[-100, 0, V],
    return_lse=[False, True],
    gif=[None, False, True],
    chunk=[None, SMALL_CHUNK],
    coll=["allreduce", "allgather", "auto"],
    sp=[False, True],
    rhg=[True, False],
    needs=["all", "w_only", "h_only", "nograd"],
    module=[False, True],
    gscale=[1.0, 0.37],
    check=[True, False],
    hdtype=["float32", "bfloat16"],
)


def _ce_ok(c):
    return not (c["sp"] and not c["rhg"])  # rejected by VocabShard (tested in-process below)


def ce_cases(n_random, seed, one_at_a_time=True):
    """The base, every option varied alone from it, then ``n_random`` random combinations."""
    cases = [dict(CE_BASE)] if one_at_a_time else []
    if one_at_a_time:
        for k, vals in CE_VALUES.items():
            for v in vals:
                if v != CE_BASE[k]:
                    c = dict(CE_BASE, **{k: v})
                    if _ce_ok(c):
                        cases.append(c)
        cases.append(dict(CE_BASE, reduction="none", gif=True, chunk=SMALL_CHUNK))  # fused does not apply
        cases.append(dict(CE_BASE, sp=True, gif=True, chunk=SMALL_CHUNK, coll="allgather"))
        cases.append(
            dict(
                CE_BASE,
                label_smoothing=0.2,
                z_loss=1e-2,
                softcap=2.5,
                bias=True,
                shift=1,
                reduction="sum",
                gif=True,
                chunk=SMALL_CHUNK,
            )
        )
        cases.append(
            dict(
                CE_BASE,
                label_smoothing=0.2,
                z_loss=1e-2,
                softcap=2.5,
                bias=True,
                shift=1,
                reduction="none",
                return_lse=True,
                chunk=SMALL_CHUNK,
                sp=True,
            )
        )
    rng = random.Random(seed)
    while n_random > 0:
        c = {k: rng.choice(vals) for k, vals in CE_VALUES.items()}
        if _ce_ok(c):
            cases.append(c)
            n_random -= 1
    return cases


def _targets_for(t, ignore_index):
    return torch.where(t == -100, torch.full_like(t, ignore_index), t)


def run_ce_case(rank, world, group, bounds, c, fails, all_ignored=False):
    name = _case_name(f"ce world={world} bounds={bounds}" + (" all_ignored" if all_ignored else ""), c)
    fails.cases += 1
    start, stop = bounds[rank]
    P = make_problem(shape=SP_SHAPE if c["sp"] else SHAPE)
    ii = c["ignore_index"]
    t = _targets_for(P["t"], ii)
    if all_ignored:
        t = torch.full_like(t, ii)
    hdtype = getattr(torch, c["hdtype"])
    H = P["H"].to(hdtype)
    n_loc = H.shape[0] // world
    h_in = H[rank * n_loc : (rank + 1) * n_loc] if c["sp"] else H
    grad_h = c["needs"] in ("all", "h_only")
    grad_w = c["needs"] in ("all", "w_only")
    h = h_in.clone().requires_grad_(grad_h)
    w = P["W"][start:stop].clone().requires_grad_(grad_w)
    b = P["b"][start:stop].clone().requires_grad_(grad_w) if c["bias"] else None
    shard = VocabShard(
        group,
        start,
        stop,
        sequence_parallel=c["sp"],
        reduce_hidden_grad=c["rhg"],
        stats_collective=c["coll"],
        check=c["check"],
    )
    opts = dict(
        reduction=c["reduction"],
        label_smoothing=c["label_smoothing"],
        z_loss=c["z_loss"],
        softcap=c["softcap"],
        shift=c["shift"],
        ignore_index=ii,
        return_lse=c["return_lse"],
        grad_in_forward=c["gif"],
        impl="torch",
    )
    if c["chunk"] is not None:
        opts["chunk_size"] = c["chunk"]
    nograd = c["needs"] == "nograd"
    with CollectiveLog(hidden_size=D) as fwd, torch.set_grad_enabled(not nograd):
        if c["module"]:
            out = LinearCrossEntropy(shard=shard, **opts)(h, w, t, bias=b)
        else:
            out = linear_cross_entropy(h, w, t, bias=b, shard=shard, **opts)
    loss, lse = out if c["return_lse"] else (out, None)
    g1, g2 = P["g1"], P["g2"]

    def objective(loss, lse):
        obj = (loss * g1).sum() if c["reduction"] == "none" else loss * c["gscale"]
        if lse is not None:
            obj = obj + (lse * g2).sum()
        return obj

    bwd = CollectiveLog(hidden_size=D)
    if not nograd:
        with bwd:
            objective(loss, lse).backward()
    # oracle
    hr = H.detach().clone().requires_grad_(True)
    Wr = P["W"].detach().clone().requires_grad_(True)
    br = P["b"].detach().clone().requires_grad_(True) if c["bias"] else None
    rl, rlse = ref_ce(
        hr,
        Wr,
        br,
        t,
        ignore_index=ii,
        reduction=c["reduction"],
        label_smoothing=c["label_smoothing"],
        z_loss=c["z_loss"],
        softcap=c["softcap"],
        shift=c["shift"],
    )
    objective(rl, rlse if c["return_lse"] else None).backward()
    dh_sum = None
    if not nograd and grad_h and not c["rhg"]:
        dh_sum = _sum_over_group(h.grad, group)  # collective: before any assertion
    fails.check(loss.dtype == torch.float32, f"loss dtype {loss.dtype}", name)
    fails.close(loss, rl, "loss", name)
    if c["return_lse"]:
        fails.close(lse, rlse, "lse", name)
    if not nograd:
        tol = dict(atol=2e-2, rtol=2e-2) if hdtype == torch.bfloat16 else {}
        if grad_h:
            want = hr.grad[rank * n_loc : (rank + 1) * n_loc] if c["sp"] else hr.grad
            fails.check(h.grad is not None and h.grad.dtype == hdtype, "dH missing or wrong dtype", name)
            if c["rhg"]:
                fails.close(h.grad, want, "dH", name, **tol)
            else:
                fails.close(dh_sum, want, "sum over ranks of the partial dH", name, **tol)
        else:
            fails.check(h.grad is None, "dH formed though hidden does not require grad", name)
        if grad_w:
            fails.close(w.grad, Wr.grad[start:stop], "dW slice", name)
            if c["bias"]:
                fails.close(b.grad, br.grad[start:stop], "db slice", name)
    # collectives
    fused = c["reduction"] != "none" and not c["return_lse"] and c["gif"] is not False and not nograd
    _check_counts(
        fails,
        name,
        fwd,
        bwd,
        world,
        c,
        fused=fused,
        hidden_grad=grad_h and not nograd,
        max_local=max(b_ - a_ for a_, b_ in bounds),
        n_tokens=t.numel(),
    )


def _check_counts(fails, name, fwd, bwd, world, c, *, fused, hidden_grad, max_local, n_tokens):
    f, bk = fwd.classify(), bwd.classify()
    if world == 1:
        fails.check(not fwd.calls and not bwd.calls, f"collectives on a single device: {fwd.calls + bwd.calls}", name)
        return
    coll = c["coll"]
    if coll == "auto":  # documented: all-gather while rows * ranks <= the threshold (every chunk has <= N rows)
        assert n_tokens * world <= AUTO_ALLGATHER_MAX_ROWS_X_RANKS, "test shapes should stay in one regime"
        coll = "allgather"
    per = 2 if coll == "allreduce" else 1
    kind = "all_reduce" if coll == "allreduce" else "all_gather"
    fails.check(not f["other"] and not bk["other"], f"unexpected collectives {f['other'] + bk['other']}", name)
    if c["check"]:
        fails.check(
            len(f["handshake"]) == 1 and not f["layout"],
            f"forward handshake: {f['handshake'] + f['layout']} (want one int64 all_gather)",
            name,
        )
    else:
        fails.check(
            len(f["layout"]) == 1 and not f["handshake"],
            f"check=False layout exchange: {f['handshake'] + f['layout']} (want one int64 all_reduce)",
            name,
        )
    fails.check(len(f["gather_tokens"]) == (1 if c["sp"] else 0), f"token gathers {f['gather_tokens']}", name)
    fails.check(all(x.name == kind for x in f["stats"]), f"stats collectives {f['stats']} are not {kind}", name)
    if coll == "allreduce":  # per chunk one MAX (row maxima) then one SUM (rescaled sums)
        ops = [x.op for x in f["stats"]]
        fails.check(
            ops == ["MAX", "SUM"] * (len(ops) // 2), f"stats all-reduce ops {ops} (want MAX, SUM per chunk)", name
        )
    n_dh = len(f["dh"]) + len(bk["dh"])
    want_dh = 1 if (hidden_grad and c["rhg"]) else 0
    fails.check(n_dh == want_dh, f"{n_dh} dH reductions (want {want_dh}): fwd {f['dh']} bwd {bk['dh']}", name)
    fails.check(
        not bk["stats"] and not bk["handshake"] and not bk["gather_tokens"],
        f"backward issued {bk['stats'] + bk['handshake'] + bk['gather_tokens']}",
        name,
    )
    if fused:
        step = chunk_tokens(n_tokens, max_local, c["chunk"])
        n_chunks = math.ceil(n_tokens / step)
        fails.check(
            len(f["stats"]) == per * n_chunks,
            f"fused path: {len(f['stats'])} stats collectives for {n_chunks} token chunks (want {per} each)",
            name,
        )
        if c["chunk"] == SMALL_CHUNK:
            fails.check(n_chunks >= 2, f"small chunk_size gave only {n_chunks} chunk(s)", name)
        fails.check(not bk["dh"], "fused path reduced dH in backward", name)
    else:
        fails.check(len(f["stats"]) == per, f"2-pass forward: {len(f['stats'])} stats collectives (want {per})", name)
        fails.check(not f["dh"], "2-pass forward reduced dH", name)


# ---- logprobs -------------------------------------------------------------------------------

LP_BASE = dict(
    softcap=None,
    temperature=1.0,
    bias=False,
    shift=0,
    ignore_index=-100,
    entropy=False,
    gmode="lp",
    chunk=None,
    coll="allreduce",
    sp=False,
    rhg=True,
    needs="all",
    check=True,
)
LP_VALUES = dict(
    softcap=[None, 2.5],
    temperature=[1.0, 0.7],
    bias=[False, True],
    shift=[0, 1],
    ignore_index=[-100, 0, V],
    entropy=[False, True],
    gmode=["lp", "ent", "both", "nograd"],
    chunk=[None, SMALL_CHUNK],
    coll=["allreduce", "allgather", "auto"],
    sp=[False, True],
    rhg=[True, False],
    needs=["all", "w_only", "h_only"],
    check=[True, False],
)


def _lp_ok(c):
    return not (c["sp"] and not c["rhg"]) and not (c["gmode"] in ("ent", "both") and not c["entropy"])


def lp_cases(n_random, seed, one_at_a_time=True):
    cases = []
    if one_at_a_time:
        cases.append(dict(LP_BASE))
        for k, vals in LP_VALUES.items():
            for v in vals:
                if v != LP_BASE[k]:
                    c = dict(LP_BASE, **{k: v})
                    if k == "gmode" and v in ("ent", "both"):
                        c["entropy"] = True
                    if _lp_ok(c):
                        cases.append(c)
        # the entropy gradient alone, across ranks, with every transform on
        cases.append(
            dict(LP_BASE, entropy=True, gmode="ent", softcap=2.5, temperature=0.7, bias=True, chunk=SMALL_CHUNK)
        )
        cases.append(dict(LP_BASE, entropy=True, gmode="ent", rhg=False, softcap=2.5, temperature=0.7))
        cases.append(dict(LP_BASE, entropy=True, gmode="both", sp=True, coll="allgather", shift=1, bias=True))
    rng = random.Random(seed)
    while n_random > 0:
        c = {k: rng.choice(vals) for k, vals in LP_VALUES.items()}
        if _lp_ok(c):
            cases.append(c)
            n_random -= 1
    return cases


def run_lp_case(rank, world, group, bounds, c, fails):
    name = _case_name(f"logprobs world={world} bounds={bounds}", c)
    fails.cases += 1
    start, stop = bounds[rank]
    P = make_problem(shape=SP_SHAPE if c["sp"] else SHAPE)
    ii = c["ignore_index"]
    t = _targets_for(P["t"], ii)
    H = P["H"]
    n_loc = H.shape[0] // world
    nograd = c["gmode"] == "nograd"
    grad_h = c["needs"] in ("all", "h_only") and not nograd
    grad_w = c["needs"] in ("all", "w_only") and not nograd
    h = (H[rank * n_loc : (rank + 1) * n_loc] if c["sp"] else H).clone().requires_grad_(grad_h)
    w = P["W"][start:stop].clone().requires_grad_(grad_w)
    b = P["b"][start:stop].clone().requires_grad_(grad_w) if c["bias"] else None
    shard = VocabShard(
        group,
        start,
        stop,
        sequence_parallel=c["sp"],
        reduce_hidden_grad=c["rhg"],
        stats_collective=c["coll"],
        check=c["check"],
    )
    opts = dict(
        softcap=c["softcap"],
        temperature=c["temperature"],
        shift=c["shift"],
        ignore_index=ii,
        return_entropy=c["entropy"],
        impl="torch",
    )
    if c["chunk"] is not None:
        opts["chunk_size"] = c["chunk"]
    with CollectiveLog(hidden_size=D) as fwd:
        out = linear_logprobs(h, w, t, bias=b, shard=shard, **opts)
    lp, ent = out if c["entropy"] else (out, None)
    g1, g2 = P["g1"], P["g2"]

    def objective(lp, ent):
        if c["gmode"] == "lp":
            return (lp * g1).sum()
        if c["gmode"] == "ent":
            return (ent * g2).sum()
        return (lp * g1).sum() + (ent * g2).sum()

    bwd = CollectiveLog(hidden_size=D)
    if not nograd:
        with bwd:
            objective(lp, ent).backward()
    hr = H.detach().clone().requires_grad_(True)
    Wr = P["W"].detach().clone().requires_grad_(True)
    br = P["b"].detach().clone().requires_grad_(True) if c["bias"] else None
    rlp, rent = ref_logprobs(
        hr, Wr, br, t, ignore_index=ii, softcap=c["softcap"], temperature=c["temperature"], shift=c["shift"]
    )
    if not nograd:
        objective(rlp, rent).backward()
    dh_sum = _sum_over_group(h.grad, group) if (grad_h and not c["rhg"]) else None
    fails.close(lp, rlp, "logprobs", name)
    fails.check(bool((lp <= 0).all()), "a logprob is positive", name)
    if c["entropy"]:
        fails.close(ent, rent, "entropy", name)
    if grad_h:
        want = hr.grad[rank * n_loc : (rank + 1) * n_loc] if c["sp"] else hr.grad
        if c["rhg"]:
            fails.close(h.grad, want, "dH", name)
        else:
            fails.close(dh_sum, want, "sum over ranks of the partial dH", name)
    if grad_w:
        fails.close(w.grad, Wr.grad[start:stop], "dW slice", name)
        if c["bias"]:
            fails.close(b.grad, br.grad[start:stop], "db slice", name)
    _check_counts(fails, name, fwd, bwd, world, c, fused=False, hidden_grad=grad_h, max_local=0, n_tokens=t.numel())


def _one_row_statistics(rank, world, group, fails):
    """Statistics of a single row through the collectives: fused token chunks of one token
    (chunk_size // max_local == 1) and a batch of one token, on both paths and both collectives.
    (Regression: the MAX all-reduce once wrote into the local statistics through a view.)"""
    for coll in ("allreduce", "allgather"):
        run_ce_case(rank, world, group, [(0, 12), (12, 13)], dict(CE_BASE, chunk=16, coll=coll), fails)
        start, stop = LAYOUTS[2][0][rank]
        P = make_problem(shape=(1,))
        t = P["t"].clamp(min=0)
        for gif in (None, False):
            name = f"one token, {coll}, grad_in_forward={gif}"
            fails.cases += 1
            h = P["H"].clone().requires_grad_(True)
            w = P["W"][start:stop].clone().requires_grad_(True)
            loss = linear_cross_entropy(
                h, w, t, shard=VocabShard(group, start, stop, stats_collective=coll), grad_in_forward=gif, impl="torch"
            )
            loss.backward()
            hr, Wr = P["H"].clone().requires_grad_(True), P["W"].clone().requires_grad_(True)
            rl, _ = ref_ce(hr, Wr, None, t)
            rl.backward()
            fails.close(loss, rl, "loss", name)
            fails.close(h.grad, hr.grad, "dH", name)
            fails.close(w.grad, Wr.grad[start:stop], "dW slice", name)
        name = f"one token logprobs, {coll}"
        fails.cases += 1
        h = P["H"].clone().requires_grad_(True)
        lp, ent = linear_logprobs(
            h,
            P["W"][start:stop],
            t,
            shard=VocabShard(group, start, stop, stats_collective=coll),
            return_entropy=True,
            impl="torch",
        )
        (lp + ent).sum().backward()
        hr = P["H"].clone().requires_grad_(True)
        rlp, rent = ref_logprobs(hr, P["W"], None, t)
        (rlp + rent).sum().backward()
        fails.close(lp, rlp, "logprobs", name)
        fails.close(ent, rent, "entropy", name)
        fails.close(h.grad, hr.grad, "dH", name)


def _extras(rank, world, group, fails):
    """VocabShard.even, groups of size 1, shard=None: no collectives, same numbers as the oracle."""
    import torch.distributed as dist

    fails.cases += 1
    # VocabShard.even on the real group, and its error for an indivisible vocab
    ve = V + (world - V % world) % world
    s = VocabShard.even(ve, group)
    per = ve // world
    fails.check((s.start, s.stop) == (rank * per, (rank + 1) * per), f"VocabShard.even({ve}): {s}", "even")
    try:
        VocabShard.even(ve + 1, group)
        fails.check(False, "VocabShard.even accepted an indivisible vocab", "even")
    except ValueError as e:
        fails.check("not divisible" in str(e), f"VocabShard.even error: {e}", "even")
    # a full run on even shards of a padded vocab
    P = make_problem(vocab=ve)
    h = P["H"].clone().requires_grad_(True)
    w = P["W"][s.start : s.stop].clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, P["t"], shard=s, label_smoothing=0.1, impl="torch")
    loss.backward()
    hr, Wr = P["H"].detach().clone().requires_grad_(True), P["W"].detach().clone().requires_grad_(True)
    rl, _ = ref_ce(hr, Wr, None, P["t"], label_smoothing=0.1)
    rl.backward()
    fails.close(loss, rl, "loss on VocabShard.even", "even")
    fails.close(h.grad, hr.grad, "dH on VocabShard.even", "even")
    fails.close(w.grad, Wr.grad[s.start : s.stop], "dW on VocabShard.even", "even")

    # groups of size 1 (every rank creates every subgroup, in the same order)
    singles = [dist.new_group([r]) for r in range(world)]
    g1 = singles[rank]
    for label, shard in (
        ("shard=None", None),
        ("VocabShard(None, 0, V)", VocabShard(None, 0, V)),
        ("size-1 group", VocabShard(g1, 0, V)),
        ("even on size-1 group", VocabShard.even(V, g1)),
        ("size-1 group, allgather, sp", VocabShard(g1, 0, V, sequence_parallel=True, stats_collective="allgather")),
    ):
        for c in (
            dict(CE_BASE, label_smoothing=0.1, z_loss=1e-2, bias=True, reduction="sum"),
            dict(CE_BASE, reduction="none", return_lse=True, softcap=2.5),
            dict(CE_BASE, gif=True, chunk=SMALL_CHUNK, shift=1),
        ):
            _single_ce(shard, c, fails, f"{label} {c}")
        _single_lp(shard, fails, f"{label} logprobs")
    # rank-local errors on a size-1 group are raised directly (no handshake with anyone)
    P = make_problem()
    bad = P["t"].clone()
    bad[0, 0] = V
    for label, shard in (("size-1 group", VocabShard(g1, 0, V)), ("shard=None", None)):
        try:
            linear_cross_entropy(P["H"], P["W"], bad, shard=shard, impl="torch")
            fails.check(False, "out-of-range target accepted", label)
        except ValueError as e:
            fails.check("outside the vocabulary" in str(e), f"error text: {e}", label)
    try:
        linear_cross_entropy(P["H"], P["W"][2:], P["t"], shard=VocabShard(g1, 2, V), impl="torch")
        fails.check(False, "a size-1 group accepted start=2", "size-1 start")
    except ValueError as e:
        fails.check("start at 0" in str(e), f"error text: {e}", "size-1 start")
    for sg in singles:
        dist.destroy_process_group(sg)


def _single_ce(shard, c, fails, name):
    P = make_problem()
    h = P["H"].clone().requires_grad_(True)
    w = P["W"].clone().requires_grad_(True)
    b = P["b"].clone().requires_grad_(True) if c["bias"] else None
    opts = dict(
        reduction=c["reduction"],
        label_smoothing=c["label_smoothing"],
        z_loss=c["z_loss"],
        softcap=c["softcap"],
        shift=c["shift"],
        return_lse=c["return_lse"],
        grad_in_forward=c["gif"],
        impl="torch",
    )
    if c["chunk"]:
        opts["chunk_size"] = c["chunk"]
    with CollectiveLog(hidden_size=D) as cnt:
        out = linear_cross_entropy(h, w, P["t"], bias=b, shard=shard, **opts)
        loss, lse = out if c["return_lse"] else (out, None)
        obj = (loss * P["g1"]).sum() if c["reduction"] == "none" else loss
        if lse is not None:
            obj = obj + (lse * P["g2"]).sum()
        obj.backward()
    fails.check(not cnt.calls, f"collectives issued: {cnt.calls}", name)
    hr, Wr = P["H"].detach().clone().requires_grad_(True), P["W"].detach().clone().requires_grad_(True)
    br = P["b"].detach().clone().requires_grad_(True) if c["bias"] else None
    rl, rlse = ref_ce(
        hr,
        Wr,
        br,
        P["t"],
        reduction=c["reduction"],
        label_smoothing=c["label_smoothing"],
        z_loss=c["z_loss"],
        softcap=c["softcap"],
        shift=c["shift"],
    )
    robj = (rl * P["g1"]).sum() if c["reduction"] == "none" else rl
    if lse is not None:
        robj = robj + (rlse * P["g2"]).sum()
        fails.close(lse, rlse, "lse", name)
    robj.backward()
    fails.close(loss, rl, "loss", name)
    fails.close(h.grad, hr.grad, "dH", name)
    fails.close(w.grad, Wr.grad, "dW", name)
    if b is not None:
        fails.close(b.grad, br.grad, "db", name)


def _single_lp(shard, fails, name):
    P = make_problem()
    h = P["H"].clone().requires_grad_(True)
    w = P["W"].clone().requires_grad_(True)
    with CollectiveLog(hidden_size=D) as cnt:
        lp, ent = linear_logprobs(
            h, w, P["t"], shard=shard, softcap=2.5, temperature=0.7, return_entropy=True, impl="torch"
        )
        ((lp * P["g1"]).sum() + (ent * P["g2"]).sum()).backward()
    fails.check(not cnt.calls, f"collectives issued: {cnt.calls}", name)
    hr, Wr = P["H"].detach().clone().requires_grad_(True), P["W"].detach().clone().requires_grad_(True)
    rlp, rent = ref_logprobs(hr, Wr, None, P["t"], softcap=2.5, temperature=0.7)
    ((rlp * P["g1"]).sum() + (rent * P["g2"]).sum()).backward()
    fails.close(lp, rlp, "logprobs", name)
    fails.close(ent, rent, "entropy", name)
    fails.close(h.grad, hr.grad, "dH", name)
    fails.close(w.grad, Wr.grad, "dW", name)


# ----------------------------------------------------------------------------------------------
# one case on every rank of a pool (module level: pickled into the ranks)
# ----------------------------------------------------------------------------------------------


def _case_body(rank, world, group, kind, bounds=None, case=None, all_ignored=False):
    """Run one named case on this rank; returns ``Failures.result()`` (checks never raise mid-collective)."""
    torch.manual_seed(0)
    fails = Failures(ATOL, RTOL)
    if kind == "ce":
        run_ce_case(rank, world, group, bounds, case, fails, all_ignored=all_ignored)
    elif kind == "lp":
        run_lp_case(rank, world, group, bounds, case, fails)
    elif kind == "extras":
        _extras(rank, world, group, fails)
    elif kind == "one_row_statistics":
        _one_row_statistics(rank, world, group, fails)
    else:
        raise ValueError(f"unknown case kind {kind!r}")
    return fails.result()


def _id(c, base):
    """A pytest id: the options that differ from the base case."""
    return ",".join(f"{k}={v}" for k, v in c.items() if base.get(k) != v) or "base"


def _bounds_id(bounds):
    return "|".join(f"{a}:{b}" for a, b in bounds)


def matrix_cases(world, ce_random, lp_random, seed, extras):
    """The option matrix of ``world`` ranks as pytest params, in the order the ranks ran them."""
    out = []
    for bounds in LAYOUTS[world]:
        bid = _bounds_id(bounds)
        for i, c in enumerate(ce_cases(ce_random, seed)):
            out.append(pytest.param(dict(kind="ce", bounds=bounds, case=c), id=f"ce-{bid}-{i}-{_id(c, CE_BASE)}"))
        for red in ("mean", "sum", "none"):  # every target ignored: 0 (not NaN) and zero gradients
            for gif in (None, False):
                c = dict(CE_BASE, reduction=red, gif=gif)
                out.append(
                    pytest.param(
                        dict(kind="ce", bounds=bounds, case=c, all_ignored=True),
                        id=f"ce-{bid}-all_ignored-{_id(c, CE_BASE)}",
                    )
                )
        for i, c in enumerate(lp_cases(lp_random, seed + 1)):
            out.append(pytest.param(dict(kind="lp", bounds=bounds, case=c), id=f"lp-{bid}-{i}-{_id(c, LP_BASE)}"))
    if extras:
        out.append(pytest.param(dict(kind="extras"), id="extras"))
    if world == 2:
        out.append(pytest.param(dict(kind="one_row_statistics"), id="one_row_statistics"))
    return out


def _assert_clean(results):
    problems = []
    for r, res in sorted(results.items()):
        assert res["cases"] >= 1, f"rank {r} ran no case"
        problems += [f"rank {r}: {f}" for f in res["failures"]]
    assert not problems, f"{len(problems)} failing checks:\n" + "\n".join(problems[:40])


# ----------------------------------------------------------------------------------------------
# the matrix tests: one pytest item per case, run on a persistent pool of ranks
# ----------------------------------------------------------------------------------------------

# (world size, random CE combinations, random logprobs combinations, seed, extras) per layout;
# every option alone from the base case comes on top of the random ones
MATRICES = {2: (60, 30, 2, True), 4: (20, 10, 4, False), 3: (25, 15, 3, True)}


@pytest.mark.parametrize("spec", matrix_cases(2, *MATRICES[2]))
def test_world2_uneven(rank_pool, spec):
    """World 2, shards [0,5)+[5,13) and [0,12)+[12,13): every option alone, random combinations, the
    all-ignored batch; extras: VocabShard.even and its error, groups of size 1 and shard=None (no
    collective); single-row statistics (one-token batches and one-token fused chunks)."""
    _assert_clean(rank_pool(2).run(_case_body, **spec))


@pytest.mark.parametrize("spec", matrix_cases(4, *MATRICES[4]))
def test_world4_uneven(rank_pool, spec):
    """World 4, shards of 2, 5, 1 and 5 rows: every option alone and random combinations."""
    _assert_clean(rank_pool(4).run(_case_body, **spec))


@pytest.mark.parametrize("spec", matrix_cases(3, *MATRICES[3]))
def test_world3_uneven_empty_shard(rank_pool, spec):
    """World 3: the option matrix with an empty shard ([6,6) on rank 1) and with uneven shards."""
    _assert_clean(rank_pool(3).run(_case_body, **spec))


# ----------------------------------------------------------------------------------------------
# faults: every rank raises a clear error; none hangs; the group stays usable
# ----------------------------------------------------------------------------------------------

FAULT_BOUNDS = [(0, 4), (4, 9), (9, 13)]


class Call:
    """One rank's call of a fault case: fine inputs, which a fault then spoils (see FAULTS)."""

    def __init__(self, rank, world):
        P = make_problem()
        self.rank, self.world = rank, world
        self.H, self.W, self.t = P["H"], P["W"], P["t"]
        self.start, self.stop = FAULT_BOUNDS[rank]
        self.h, self.targets = self.H.clone().requires_grad_(True), self.t.clone()
        self.kw = dict(impl="torch")
        self.shard_kw = {}
        self.fn = "ce"
        self.no_grad = False
        self.extra_weight_rows = 0

    def __call__(self, group):
        w = self.W[self.start : self.stop + self.extra_weight_rows].clone().requires_grad_(not self.no_grad)
        shard = VocabShard(group, self.start, self.stop, **self.shard_kw)
        if self.fn == "lp":
            self.kw.pop("chunk_size", None)
            return linear_logprobs(self.h, w, self.targets, shard=shard, **self.kw)
        return linear_cross_entropy(self.h, w, self.targets, shard=shard, **self.kw)


def _set(**attrs):
    """A fault that sets attributes of the Call."""
    return lambda c: c.__dict__.update(attrs)


def _kw(**kw):
    """A fault that changes loss options."""
    return lambda c: c.kw.update(kw)


def _shard_kw(**kw):
    """A fault that changes VocabShard options."""
    return lambda c: c.shard_kw.update(kw)


def _target(i, j, value):
    def f(c):
        c.targets[i, j] = value(c.targets[i, j]) if callable(value) else value

    return f


def _hidden(h):
    return lambda c: setattr(c, "h", h(c).clone().requires_grad_(True))


def _every(*fs):
    def f(c):
        for g in fs:
            g(c)

    return f


def _no_ignored_targets(c):
    c.targets = torch.where(c.targets == -100, torch.ones_like(c.targets), c.targets)


def _n_disagree(c):
    c.h, c.targets = c.H[:, :11].clone().requires_grad_(True), c.t[:, :11].clone()  # locally consistent


def _d_disagree(c):
    c.h, c.W = c.H[..., :8].clone().requires_grad_(True), c.W[:, :8]


def _sequence_parallel(c):
    c.shard_kw["sequence_parallel"] = True
    P = make_problem(shape=SP_SHAPE)
    n = SP_SHAPE[0] // c.world
    c.targets = P["t"]
    c.h = P["H"][c.rank * n : (c.rank + 1) * n].clone().requires_grad_(True)


def _one_more_local_token(c):
    P = make_problem(shape=SP_SHAPE)
    n = SP_SHAPE[0] // c.world
    c.h = P["H"][c.rank * n : (c.rank + 1) * n + 1].clone().requires_grad_(True)


@dataclass(frozen=True)
class Fault:
    """A rank-local fault on 3 ranks: ``every`` is applied on every rank, then ``bad`` on rank 1.

    ``rank1`` / ``others``: (kind, regex) of the error each must raise, kind ``"own"`` (the rank's
    own local ValueError or TypeError) or ``"input"`` (cce_dist.InputError, from the handshake).
    """

    name: str
    bad: Callable | None = None
    every: Callable | None = None
    rank1: tuple = ()
    others: tuple = ()


OTHERS_REJECTED = ("input", r"rank\(s\) \[1\] of the tensor-parallel group rejected their inputs")
OPTS = ("input", r"disagree on the loss options")


def _own(pattern):
    """Rank 1 raises its own error; the others learn of it in the handshake."""
    return dict(rank1=("own", pattern), others=OTHERS_REJECTED)


def _all(pattern):
    """Every rank raises InputError matching ``pattern`` (a disagreement, seen by all)."""
    return dict(rank1=("input", pattern), others=("input", pattern))


FAULTS = [
    Fault("negative_target_one_rank", bad=_target(0, 0, -5), **_own(r"targets contain id -5")),
    Fault("oob_target_one_rank", bad=_target(0, 0, V), **_all(r"target")),
    Fault(
        "oob_target_all_ranks",
        every=_target(0, 0, V),
        **_all(r"targets contain id 13, outside the vocabulary \[0, 13\)"),
    ),
    Fault("targets_differ", bad=_target(0, 1, lambda x: (int(x) + 1) % V), **_all(r"disagree on the target ids")),
    Fault(
        "float_targets_one_rank",
        bad=lambda c: setattr(c, "targets", c.targets.float()),
        **_own(r"targets must be an integer tensor"),
    ),
    Fault(
        "hidden_tokens_one_rank",
        bad=_hidden(lambda c: c.H[:, :11]),  # 22 hidden rows for 24 targets
        **_own(r"targets must have shape \(2, 11\) \(hidden.shape\[:-1\]\), got \(2, 12\)"),
    ),
    Fault(
        "hidden_dim_one_rank",
        bad=_hidden(lambda c: torch.randn(*SHAPE, D + 1)),
        **_own(r"hidden's last dimension \(17\) must equal weight.shape\[1\] \(16\)"),
    ),
    Fault("n_disagree", bad=_n_disagree, **_all(r"disagree on the number of tokens.*\[24, 22, 24\]")),
    Fault("d_disagree", bad=_d_disagree, **_all(r"disagree on the hidden size.*\[16, 8, 16\]")),
    Fault(
        "weight_rows_one_rank",
        bad=_set(extra_weight_rows=1),  # one row more than the shard holds
        **_own(r"weight.shape\[0\] \(6\) must equal the shard size stop - start = 5"),
    ),
    Fault("layout_overlap", bad=_set(start=3), **_all(r"do not tile \[0, V\): overlap")),
    Fault("layout_gap", bad=_set(start=5), **_all(r"do not tile \[0, V\): gap")),
    Fault(
        "label_smoothing_differs",
        every=_kw(label_smoothing=0.0),
        bad=_kw(label_smoothing=0.1),
        rank1=OPTS,
        others=OPTS,
    ),
    Fault("reduction_differs", bad=_kw(reduction="sum"), rank1=OPTS, others=OPTS),
    Fault("z_loss_differs", bad=_kw(z_loss=1e-3), rank1=OPTS, others=OPTS),
    Fault("softcap_differs", bad=_kw(softcap=30.0), rank1=OPTS, others=OPTS),
    Fault("shift_differs", bad=_kw(shift=1), rank1=OPTS, others=OPTS),
    Fault("ignore_index_differs", every=_no_ignored_targets, bad=_kw(ignore_index=-1), rank1=OPTS, others=OPTS),
    Fault("stats_collective_differs", bad=_shard_kw(stats_collective="allgather"), rank1=OPTS, others=OPTS),
    Fault("chunk_size_differs", bad=_kw(chunk_size=64), rank1=OPTS, others=OPTS),
    # weight still requires grad everywhere: only the dH all-reduce would differ
    Fault("hidden_grad_need_differs", bad=lambda c: setattr(c, "h", c.h.detach()), rank1=OPTS, others=OPTS),
    Fault("no_grad_one_rank", bad=_set(no_grad=True), rank1=OPTS, others=OPTS),
    Fault("form_differs", bad=_set(fn="lp"), rank1=OPTS, others=OPTS),
    Fault("temperature_differs", every=_set(fn="lp"), bad=_kw(temperature=0.5), rank1=OPTS, others=OPTS),
    Fault("return_entropy_differs", every=_set(fn="lp"), bad=_kw(return_entropy=True), rank1=OPTS, others=OPTS),
    Fault(
        "sp_local_tokens_one_rank",
        every=_sequence_parallel,
        bad=_one_more_local_token,
        **_own(
            r"targets must have shape .* \(hidden.shape\[:-1\], times tp_size along dim 0 under sequence parallelism\)"
        ),
    ),
]
FAULT_BY_NAME = {f.name: f for f in FAULTS}
FINAL_FAULT = "hidden_tokens_one_rank"


def _fault_call(rank, world, group, name):
    """Run fault case ``name`` on this rank: inputs are fine except where the case says otherwise."""
    fault = FAULT_BY_NAME[name]
    call = Call(rank, world)
    if fault.every is not None:
        fault.every(call)
    if rank == 1 and fault.bad is not None:  # the odd rank out
        fault.bad(call)
    if call.no_grad:
        call.h = call.h.detach()
    return call(group)


def _healthy_call(rank, world, group):
    """A correct call after a fault: the group is still in step (no stray collective pending)."""
    P = make_problem()
    start, stop = FAULT_BOUNDS[rank]
    loss = linear_cross_entropy(
        P["H"], P["W"][start:stop], P["t"], shard=VocabShard(group, start, stop), label_smoothing=0.1, impl="torch"
    )
    rl, _ = ref_ce(P["H"], P["W"], None, P["t"], label_smoothing=0.1)
    return abs(float(loss) - float(rl))


def _fault_body(rank, world, group, name):
    """What fault ``name`` raised on this rank (caught), and how far off the next correct call is."""
    try:
        _fault_call(rank, world, group, name)
        rec = {"error": None}
    except Exception as e:  # noqa: BLE001 - recorded for the parent
        rec = {"type": type(e).__name__, "error": str(e), "is_input_error": isinstance(e, InputError)}
    rec["healthy_err"] = _healthy_call(rank, world, group)
    return rec


def _uncaught_fault_body(rank, world, group):
    _fault_call(rank, world, group, FINAL_FAULT)  # the pool reports each rank's error text
    return "no error raised"


def check_raised(fault, r, rec):
    """The problems with what rank ``r`` recorded for ``fault`` (an empty list when it is right)."""
    kind, want = fault.rank1 if r == 1 else fault.others
    if rec["error"] is None:
        return [f"{fault.name}: rank {r} raised nothing"]
    problems = []
    if not re.search(want, rec["error"]):
        problems.append(f"{fault.name}: rank {r} raised {rec['type']}: {rec['error']!r}; want /{want}/")
    # the odd rank out raises its own (local) ValueError/TypeError; the others learn of it in the
    # handshake (InputError); disagreements are InputError everywhere
    if kind == "own" and rec["type"] not in ("ValueError", "TypeError"):
        problems.append(f"{fault.name}: rank {r} raised {rec['type']}, not its own ValueError/TypeError")
    if kind == "input" and not rec["is_input_error"]:
        problems.append(f"{fault.name}: rank {r} raised {rec['type']}, not cce_dist.InputError")
    return problems


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_world3_rank_local_fault(rank_pool, fault):
    """Every rank raises a clear error (its own, or InputError from the handshake), none hangs, and
    the group stays usable: the next correct call matches the oracle."""
    records = rank_pool(3).run(_fault_body, name=fault.name)
    problems = []
    for r in range(3):
        problems += check_raised(fault, r, records[r])
        if records[r]["healthy_err"] > 1e-5:
            problems.append(f"{fault.name}: rank {r}: the next correct call is off by {records[r]['healthy_err']}")
    assert not problems, "\n".join(problems)


def test_world3_uncaught_fault_reaches_every_rank(rank_pool):
    """A rank-local fault left uncaught: each rank's own error text (ValueError on the bad rank,
    InputError on the others) is what leaves the rank."""
    got = rank_pool(3).run(_uncaught_fault_body, expect_errors=True)
    fault = FAULT_BY_NAME[FINAL_FAULT]
    for r in range(3):
        err = got[r][0]
        assert err is not None, f"rank {r} raised nothing for {FINAL_FAULT}"
        first = err.splitlines()[0]
        assert re.search((fault.rank1 if r == 1 else fault.others)[1], first), f"rank {r}: {err}"
        assert first.startswith("ValueError" if r == 1 else "InputError"), f"rank {r}: {err}"


# ----------------------------------------------------------------------------------------------
# in-process checks (no spawn)
# ----------------------------------------------------------------------------------------------


def test_vocabshard_validation_without_a_group():
    with pytest.raises(ValueError, match="start must be 0"):
        VocabShard(None, 2, 5)
    with pytest.raises(ValueError, match="start <= stop"):
        VocabShard(None, 5, 3)
    with pytest.raises(ValueError, match="non-negative int"):
        VocabShard(None, -1, 3)
    with pytest.raises(ValueError, match="stats_collective"):
        VocabShard(None, 0, 3, stats_collective="ring")
    with pytest.raises(ValueError, match="sequence_parallel=True requires reduce_hidden_grad=True"):
        VocabShard(None, 0, 3, sequence_parallel=True, reduce_hidden_grad=False)
    with pytest.raises(ValueError, match="positive int"):
        VocabShard.even(0, None)
    s = VocabShard.even(V, None)
    assert (s.start, s.stop, s.world_size, s.rank, s.local_size) == (0, V, 1, 0, V)


def test_single_device_paths_need_no_process_group():
    """shard=None and VocabShard(None, 0, V) run without torch.distributed initialised."""
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - a pytest process never initialises it
        pytest.skip("a process group is initialised in this process")
    fails = Failures(ATOL, RTOL)
    for shard in (None, VocabShard(None, 0, V)):
        _single_ce(shard, dict(CE_BASE, label_smoothing=0.1, z_loss=1e-2, bias=True), fails, f"{shard} ce")
        _single_lp(shard, fails, f"{shard} lp")
    assert not fails.items, "\n".join(fails.items)
    # a shard=VocabShard(None, ...) whose weight does not match the shard size is rejected
    P = make_problem()
    with pytest.raises(ValueError, match="must equal the shard size"):
        linear_cross_entropy(P["H"], P["W"][:5], P["t"], shard=VocabShard(None, 0, V), impl="torch")
