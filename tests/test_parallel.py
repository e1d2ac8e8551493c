"""Vocab-parallel (tensor-parallel) tests on gloo ranks spawned from pytest.

Every spawned rank builds the same full problem from one seed (hidden ``[.., D]``, head ``W [V, D]``,
bias ``b [V]``, targets, upstream gradients), keeps only its rows ``[start, stop)`` of ``W``/``b``
(and its slice of the tokens under sequence parallelism), calls cce_dist and compares with a
single-process oracle (tests/oracle.py: ``F.linear`` + softcap + ``F.cross_entropy`` / ``log_softmax``):
loss, lse, logprobs, entropy, dH (full, its sequence slice, or a partial whose sum over ranks is the
oracle's), and this rank's slice of dW and db. Each call also counts the collectives it issues.

A spawn costs ~10-15 s here, so each test runs many cases inside one spawn; a body collects every
failing case (named by its options) and the parent asserts there are none.
"""

from __future__ import annotations

import json
import math
import os
import random
import re

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks
from oracle import oracle_cross_entropy, oracle_logprobs

from cce_dist import InputError, LinearCrossEntropy, VocabShard, linear_cross_entropy, linear_logprobs
from cce_dist.torch_impl import chunk_tokens
from cce_dist.parallel import AUTO_ALLGATHER_MAX_ROWS_X_RANKS

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


def ref_ce(h, w, b, t, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
           softcap=None, shift=0):
    """(loss, lse [targets' shape]) of the materialized program."""
    return oracle_cross_entropy(h, w, t, b, ignore_index=ignore_index, reduction=reduction,
                                label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, shift=shift,
                                return_lse=True)


def ref_logprobs(h, w, b, t, *, ignore_index=-100, softcap=None, temperature=1.0, shift=0):
    """(logprobs, entropy) of the materialized program, 0 at ignored positions."""
    return oracle_logprobs(h, w, t, b, ignore_index=ignore_index, softcap=softcap, temperature=temperature,
                           shift=shift, return_entropy=True)


# ----------------------------------------------------------------------------------------------
# helpers used inside the ranks
# ----------------------------------------------------------------------------------------------


def make_problem(seed=1234, shape=SHAPE, vocab=V, dim=D, ignore_frac=0.2):
    g = torch.Generator().manual_seed(seed)
    H = torch.randn(*shape, dim, generator=g)
    W = torch.randn(vocab, dim, generator=g) * 0.6
    b = torch.randn(vocab, generator=g) * 0.5
    t = torch.randint(0, vocab, shape, generator=g)
    t = torch.where(torch.rand(shape, generator=g) < ignore_frac, torch.full_like(t, -100), t)
    g1 = torch.randn(shape, generator=g)  # per-token upstream gradients
    g2 = torch.randn(shape, generator=g)
    return dict(H=H, W=W, b=b, t=t, g1=g1, g2=g2)


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "reduce", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter",
                "all_gather_object", "broadcast_object_list", "send", "recv", "isend", "irecv")


class CountCollectives:
    """Record every torch.distributed collective issued inside the block: (name, shape, dtype, op)."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        import torch.distributed as dist

        self.calls, self._orig = [], {}
        for name in _COLLECTIVES:
            f = getattr(dist, name, None)
            if f is not None:
                self._orig[name] = f
                setattr(dist, name, self._wrap(name, f))
        return self

    def _wrap(self, name, f):
        def wrapped(*a, **k):
            t = a[0] if a else k.get("tensor")
            if name == "all_gather" and len(a) > 1:
                t = a[1]
            op = k.get("op", a[1] if name == "all_reduce" and len(a) > 1 else None)
            if isinstance(t, torch.Tensor):
                self.calls.append((name, tuple(t.shape), t.dtype, str(op)))
            else:
                self.calls.append((name, None, None, str(op)))
            return f(*a, **k)

        return wrapped

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, f in self._orig.items():
            setattr(dist, name, f)
        return False

    def classify(self):
        """Split the calls into handshake / layout / token gather / dH reduction / statistics / other."""
        out = {k: [] for k in ("handshake", "layout", "gather_tokens", "dh", "stats", "other")}
        for c in self.calls:
            name, shape, dtype, _ = c
            if dtype == torch.int64 and name == "all_gather":
                out["handshake"].append(c)
            elif dtype == torch.int64 and name == "all_reduce":
                out["layout"].append(c)
            elif dtype is not None and dtype.is_floating_point and shape and shape[-1] == D:
                out["gather_tokens" if name in ("all_gather", "all_gather_into_tensor") else "dh"].append(c)
            elif dtype is not None and dtype.is_floating_point and name in ("all_reduce", "all_gather"):
                out["stats"].append(c)
            else:
                out["other"].append(c)
        return out


class Failures:
    def __init__(self):
        self.items = []
        self.cases = 0

    def close(self, got, want, what, case, atol=ATOL, rtol=RTOL):
        if got is None or want is None:
            if (got is None) != (want is None):
                self.items.append(f"[{case}] {what}: got {'None' if got is None else 'a tensor'}, "
                                  f"want {'None' if want is None else 'a tensor'}")
            return
        got64 = got.detach().to(torch.float64)
        want64 = want.detach().to(torch.float64)
        if got64.shape != want64.shape:
            self.items.append(f"[{case}] {what}: shape {tuple(got64.shape)} != {tuple(want64.shape)}")
            return
        if not torch.allclose(got64, want64, atol=atol, rtol=rtol):
            err = (got64 - want64).abs().max().item()
            self.items.append(f"[{case}] {what}: max abs err {err:.3g} (atol {atol}, rtol {rtol})")

    def check(self, cond, msg, case):
        if not cond:
            self.items.append(f"[{case}] {msg}")

    def result(self):
        return {"cases": self.cases, "failures": self.items}


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

CE_BASE = dict(reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None, bias=False, shift=0,
               ignore_index=-100, return_lse=False, gif=None, chunk=None, coll="allreduce", sp=False,
               rhg=True, needs="all", module=False, gscale=1.0, check=True, hdtype="float32")
CE_VALUES = dict(reduction=["mean", "sum", "none"], label_smoothing=[0.0, 0.1], z_loss=[0.0, 1e-2],
                 softcap=[None, 2.5], bias=[False, True], shift=[0, 1], ignore_index=[-100, 0, V],
                 return_lse=[False, True], gif=[None, False, True], chunk=[None, SMALL_CHUNK],
                 coll=["allreduce", "allgather", "auto"], sp=[False, True], rhg=[True, False],
                 needs=["all", "w_only", "h_only", "nograd"], module=[False, True], gscale=[1.0, 0.37],
                 check=[True, False], hdtype=["float32", "bfloat16"])


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
        cases.append(dict(CE_BASE, label_smoothing=0.2, z_loss=1e-2, softcap=2.5, bias=True, shift=1,
                          reduction="sum", gif=True, chunk=SMALL_CHUNK))
        cases.append(dict(CE_BASE, label_smoothing=0.2, z_loss=1e-2, softcap=2.5, bias=True, shift=1,
                          reduction="none", return_lse=True, chunk=SMALL_CHUNK, sp=True))
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
    h_in = H[rank * n_loc:(rank + 1) * n_loc] if c["sp"] else H
    grad_h = c["needs"] in ("all", "h_only")
    grad_w = c["needs"] in ("all", "w_only")
    h = h_in.clone().requires_grad_(grad_h)
    w = P["W"][start:stop].clone().requires_grad_(grad_w)
    b = P["b"][start:stop].clone().requires_grad_(grad_w) if c["bias"] else None
    shard = VocabShard(group, start, stop, sequence_parallel=c["sp"], reduce_hidden_grad=c["rhg"],
                       stats_collective=c["coll"], check=c["check"])
    opts = dict(reduction=c["reduction"], label_smoothing=c["label_smoothing"], z_loss=c["z_loss"],
                softcap=c["softcap"], shift=c["shift"], ignore_index=ii, return_lse=c["return_lse"],
                grad_in_forward=c["gif"], impl="torch")
    if c["chunk"] is not None:
        opts["chunk_size"] = c["chunk"]
    nograd = c["needs"] == "nograd"
    with CountCollectives() as fwd, torch.set_grad_enabled(not nograd):
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

    bwd = CountCollectives()
    if not nograd:
        with bwd:
            objective(loss, lse).backward()
    # oracle
    hr = H.detach().clone().requires_grad_(True)
    Wr = P["W"].detach().clone().requires_grad_(True)
    br = P["b"].detach().clone().requires_grad_(True) if c["bias"] else None
    rl, rlse = ref_ce(hr, Wr, br, t, ignore_index=ii, reduction=c["reduction"],
                      label_smoothing=c["label_smoothing"], z_loss=c["z_loss"], softcap=c["softcap"], shift=c["shift"])
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
            want = hr.grad[rank * n_loc:(rank + 1) * n_loc] if c["sp"] else hr.grad
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
    fused = (c["reduction"] != "none" and not c["return_lse"] and c["gif"] is not False and not nograd)
    _check_counts(fails, name, fwd, bwd, world, c, fused=fused, hidden_grad=grad_h and not nograd,
                  max_local=max(b_ - a_ for a_, b_ in bounds), n_tokens=t.numel())


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
        fails.check(len(f["handshake"]) == 1 and not f["layout"],
                    f"forward handshake: {f['handshake'] + f['layout']} (want one int64 all_gather)", name)
    else:
        fails.check(len(f["layout"]) == 1 and not f["handshake"],
                    f"check=False layout exchange: {f['handshake'] + f['layout']} (want one int64 all_reduce)", name)
    fails.check(len(f["gather_tokens"]) == (1 if c["sp"] else 0), f"token gathers {f['gather_tokens']}", name)
    fails.check(all(x[0] == kind for x in f["stats"]), f"stats collectives {f['stats']} are not {kind}", name)
    n_dh = len(f["dh"]) + len(bk["dh"])
    want_dh = 1 if (hidden_grad and c["rhg"]) else 0
    fails.check(n_dh == want_dh, f"{n_dh} dH reductions (want {want_dh}): fwd {f['dh']} bwd {bk['dh']}", name)
    fails.check(not bk["stats"] and not bk["handshake"] and not bk["gather_tokens"],
                f"backward issued {bk['stats'] + bk['handshake'] + bk['gather_tokens']}", name)
    if fused:
        step = chunk_tokens(n_tokens, max_local, c["chunk"])
        n_chunks = math.ceil(n_tokens / step)
        fails.check(len(f["stats"]) == per * n_chunks,
                    f"fused path: {len(f['stats'])} stats collectives for {n_chunks} token chunks (want {per} each)",
                    name)
        if c["chunk"] == SMALL_CHUNK:
            fails.check(n_chunks >= 2, f"small chunk_size gave only {n_chunks} chunk(s)", name)
        fails.check(not bk["dh"], "fused path reduced dH in backward", name)
    else:
        fails.check(len(f["stats"]) == per, f"2-pass forward: {len(f['stats'])} stats collectives (want {per})",
                    name)
        fails.check(not f["dh"], "2-pass forward reduced dH", name)


# ---- logprobs -------------------------------------------------------------------------------

LP_BASE = dict(softcap=None, temperature=1.0, bias=False, shift=0, ignore_index=-100, entropy=False,
               gmode="lp", chunk=None, coll="allreduce", sp=False, rhg=True, needs="all", check=True)
LP_VALUES = dict(softcap=[None, 2.5], temperature=[1.0, 0.7], bias=[False, True], shift=[0, 1],
                 ignore_index=[-100, 0, V], entropy=[False, True], gmode=["lp", "ent", "both", "nograd"],
                 chunk=[None, SMALL_CHUNK], coll=["allreduce", "allgather", "auto"], sp=[False, True], rhg=[True, False],
                 needs=["all", "w_only", "h_only"], check=[True, False])


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
        cases.append(dict(LP_BASE, entropy=True, gmode="ent", softcap=2.5, temperature=0.7, bias=True,
                          chunk=SMALL_CHUNK))
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
    h = (H[rank * n_loc:(rank + 1) * n_loc] if c["sp"] else H).clone().requires_grad_(grad_h)
    w = P["W"][start:stop].clone().requires_grad_(grad_w)
    b = P["b"][start:stop].clone().requires_grad_(grad_w) if c["bias"] else None
    shard = VocabShard(group, start, stop, sequence_parallel=c["sp"], reduce_hidden_grad=c["rhg"],
                       stats_collective=c["coll"], check=c["check"])
    opts = dict(softcap=c["softcap"], temperature=c["temperature"], shift=c["shift"], ignore_index=ii,
                return_entropy=c["entropy"], impl="torch")
    if c["chunk"] is not None:
        opts["chunk_size"] = c["chunk"]
    with CountCollectives() as fwd:
        out = linear_logprobs(h, w, t, bias=b, shard=shard, **opts)
    lp, ent = out if c["entropy"] else (out, None)
    g1, g2 = P["g1"], P["g2"]

    def objective(lp, ent):
        if c["gmode"] == "lp":
            return (lp * g1).sum()
        if c["gmode"] == "ent":
            return (ent * g2).sum()
        return (lp * g1).sum() + (ent * g2).sum()

    bwd = CountCollectives()
    if not nograd:
        with bwd:
            objective(lp, ent).backward()
    hr = H.detach().clone().requires_grad_(True)
    Wr = P["W"].detach().clone().requires_grad_(True)
    br = P["b"].detach().clone().requires_grad_(True) if c["bias"] else None
    rlp, rent = ref_logprobs(hr, Wr, br, t, ignore_index=ii, softcap=c["softcap"], temperature=c["temperature"],
                             shift=c["shift"])
    if not nograd:
        objective(rlp, rent).backward()
    dh_sum = _sum_over_group(h.grad, group) if (grad_h and not c["rhg"]) else None
    fails.close(lp, rlp, "logprobs", name)
    fails.check(bool((lp <= 0).all()), "a logprob is positive", name)
    if c["entropy"]:
        fails.close(ent, rent, "entropy", name)
    if grad_h:
        want = hr.grad[rank * n_loc:(rank + 1) * n_loc] if c["sp"] else hr.grad
        if c["rhg"]:
            fails.close(h.grad, want, "dH", name)
        else:
            fails.close(dh_sum, want, "sum over ranks of the partial dH", name)
    if grad_w:
        fails.close(w.grad, Wr.grad[start:stop], "dW slice", name)
        if c["bias"]:
            fails.close(b.grad, br.grad[start:stop], "db slice", name)
    _check_counts(fails, name, fwd, bwd, world, c, fused=False, hidden_grad=grad_h, max_local=0, n_tokens=t.numel())


# ----------------------------------------------------------------------------------------------
# bodies (module level: pickled into the ranks)
# ----------------------------------------------------------------------------------------------


def _matrix_body(rank, world, group, ce_random, lp_random, seed, one_at_a_time, extras):
    torch.manual_seed(0)
    fails = Failures()
    for bounds in LAYOUTS[world]:
        for c in ce_cases(ce_random, seed, one_at_a_time):
            run_ce_case(rank, world, group, bounds, c, fails)
        for red in ("mean", "sum", "none"):  # every target ignored: 0 (not NaN) and zero gradients
            for gif in (None, False):
                run_ce_case(rank, world, group, bounds, dict(CE_BASE, reduction=red, gif=gif), fails, all_ignored=True)
        for c in lp_cases(lp_random, seed + 1, one_at_a_time):
            run_lp_case(rank, world, group, bounds, c, fails)
    if extras:
        _extras(rank, world, group, fails)
    if world == 2:
        _one_row_statistics(rank, world, group, fails)
    return fails.result()


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
            loss = linear_cross_entropy(h, w, t, shard=VocabShard(group, start, stop, stats_collective=coll),
                                        grad_in_forward=gif, impl="torch")
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
        lp, ent = linear_logprobs(h, P["W"][start:stop], t, shard=VocabShard(group, start, stop, stats_collective=coll),
                                  return_entropy=True, impl="torch")
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
    w = P["W"][s.start:s.stop].clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, P["t"], shard=s, label_smoothing=0.1, impl="torch")
    loss.backward()
    hr, Wr = P["H"].detach().clone().requires_grad_(True), P["W"].detach().clone().requires_grad_(True)
    rl, _ = ref_ce(hr, Wr, None, P["t"], label_smoothing=0.1)
    rl.backward()
    fails.close(loss, rl, "loss on VocabShard.even", "even")
    fails.close(h.grad, hr.grad, "dH on VocabShard.even", "even")
    fails.close(w.grad, Wr.grad[s.start:s.stop], "dW on VocabShard.even", "even")

    # groups of size 1 (every rank creates every subgroup, in the same order)
    singles = [dist.new_group([r]) for r in range(world)]
    g1 = singles[rank]
    for label, shard in (("shard=None", None), ("VocabShard(None, 0, V)", VocabShard(None, 0, V)),
                         ("size-1 group", VocabShard(g1, 0, V)), ("even on size-1 group", VocabShard.even(V, g1)),
                         ("size-1 group, allgather, sp", VocabShard(g1, 0, V, sequence_parallel=True,
                                                                    stats_collective="allgather"))):
        for c in (dict(CE_BASE, label_smoothing=0.1, z_loss=1e-2, bias=True, reduction="sum"),
                  dict(CE_BASE, reduction="none", return_lse=True, softcap=2.5),
                  dict(CE_BASE, gif=True, chunk=SMALL_CHUNK, shift=1)):
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
    opts = dict(reduction=c["reduction"], label_smoothing=c["label_smoothing"], z_loss=c["z_loss"],
                softcap=c["softcap"], shift=c["shift"], return_lse=c["return_lse"], grad_in_forward=c["gif"],
                impl="torch")
    if c["chunk"]:
        opts["chunk_size"] = c["chunk"]
    with CountCollectives() as cnt:
        out = linear_cross_entropy(h, w, P["t"], bias=b, shard=shard, **opts)
        loss, lse = out if c["return_lse"] else (out, None)
        obj = (loss * P["g1"]).sum() if c["reduction"] == "none" else loss
        if lse is not None:
            obj = obj + (lse * P["g2"]).sum()
        obj.backward()
    fails.check(not cnt.calls, f"collectives issued: {cnt.calls}", name)
    hr, Wr = P["H"].detach().clone().requires_grad_(True), P["W"].detach().clone().requires_grad_(True)
    br = P["b"].detach().clone().requires_grad_(True) if c["bias"] else None
    rl, rlse = ref_ce(hr, Wr, br, P["t"], reduction=c["reduction"], label_smoothing=c["label_smoothing"],
                      z_loss=c["z_loss"], softcap=c["softcap"], shift=c["shift"])
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
    with CountCollectives() as cnt:
        lp, ent = linear_logprobs(h, w, P["t"], shard=shard, softcap=2.5, temperature=0.7, return_entropy=True,
                                  impl="torch")
        ((lp * P["g1"]).sum() + (ent * P["g2"]).sum()).backward()
    fails.check(not cnt.calls, f"collectives issued: {cnt.calls}", name)
    hr, Wr = P["H"].detach().clone().requires_grad_(True), P["W"].detach().clone().requires_grad_(True)
    rlp, rent = ref_logprobs(hr, Wr, None, P["t"], softcap=2.5, temperature=0.7)
    ((rlp * P["g1"]).sum() + (rent * P["g2"]).sum()).backward()
    fails.close(lp, rlp, "logprobs", name)
    fails.close(ent, rent, "entropy", name)
    fails.close(h.grad, hr.grad, "dH", name)
    fails.close(w.grad, Wr.grad, "dW", name)


def _assert_clean(results, min_cases):
    problems = []
    for r, res in sorted(results.items()):
        assert res["cases"] >= min_cases, f"rank {r} ran only {res['cases']} cases"
        problems += [f"rank {r}: {f}" for f in res["failures"]]
    assert not problems, f"{len(problems)} failing checks:\n" + "\n".join(problems[:40])


# ----------------------------------------------------------------------------------------------
# the matrix tests
# ----------------------------------------------------------------------------------------------


def test_world2_uneven_every_option(tmp_path):
    """World 2, shards [0,5)+[5,13) and [0,12)+[12,13): every option alone, random combinations, the
    all-ignored batch, VocabShard.even and its error, groups of size 1 and shard=None (no collective),
    single-row statistics (one-token batches and one-token fused chunks)."""
    res = run_ranks(_matrix_body, 2, tmp_path, timeout=300,
                    kw=dict(ce_random=60, lp_random=30, seed=2, one_at_a_time=True, extras=True))
    _assert_clean(res, 250)


def test_world4_uneven(tmp_path):
    """World 4, shards of 2, 5, 1 and 5 rows: every option alone and random combinations."""
    res = run_ranks(_matrix_body, 4, tmp_path, timeout=300,
                    kw=dict(ce_random=20, lp_random=10, seed=4, one_at_a_time=True, extras=False))
    _assert_clean(res, 80)


# ----------------------------------------------------------------------------------------------
# faults: every rank raises a clear error; none hangs; the group stays usable
# ----------------------------------------------------------------------------------------------

FAULT_BOUNDS = [(0, 4), (4, 9), (9, 13)]


def _fault_call(rank, world, group, case):
    """Run one fault case on this rank. Inputs are fine except where the case says otherwise."""
    P = make_problem()
    H, W, b, t = P["H"], P["W"], P["b"], P["t"]
    start, stop = FAULT_BOUNDS[rank]
    kw = dict(impl="torch")
    shard_kw = {}
    h, targets = H.clone().requires_grad_(True), t.clone()
    fn = "ce"
    no_grad = False
    bad = rank == 1  # the odd rank out
    if case == "negative_target_one_rank" and bad:
        targets[0, 0] = -5
    elif case == "oob_target_one_rank" and bad:
        targets[0, 0] = V
    elif case == "oob_target_all_ranks":
        targets[0, 0] = V
    elif case == "targets_differ" and bad:
        targets[0, 1] = (int(targets[0, 1]) + 1) % V
    elif case == "float_targets_one_rank" and bad:
        targets = targets.float()
    elif case == "hidden_tokens_one_rank" and bad:
        h = H[:, :11].clone().requires_grad_(True)  # 22 hidden rows for 24 targets
    elif case == "hidden_dim_one_rank" and bad:
        h = torch.randn(*SHAPE, D + 1, requires_grad=True)
    elif case == "n_disagree" and bad:
        h, targets = H[:, :11].clone().requires_grad_(True), t[:, :11].clone()  # locally consistent
    elif case == "d_disagree" and bad:
        h, W = H[..., :8].clone().requires_grad_(True), W[:, :8]
    elif case == "weight_rows_one_rank" and bad:
        w = W[start:stop + 1].clone().requires_grad_(True)  # one row more than the shard holds
        return linear_cross_entropy(h, w, targets, shard=VocabShard(group, start, stop), **kw)
    elif case == "layout_overlap" and bad:
        start = 3
    elif case == "layout_gap" and bad:
        start = 5
    elif case == "label_smoothing_differs":
        kw["label_smoothing"] = 0.1 if bad else 0.0
    elif case == "reduction_differs" and bad:
        kw["reduction"] = "sum"
    elif case == "z_loss_differs" and bad:
        kw["z_loss"] = 1e-3
    elif case == "softcap_differs" and bad:
        kw["softcap"] = 30.0
    elif case == "shift_differs" and bad:
        kw["shift"] = 1
    elif case == "ignore_index_differs":
        targets = torch.where(targets == -100, torch.ones_like(targets), targets)
        if bad:
            kw["ignore_index"] = -1
    elif case == "stats_collective_differs" and bad:
        shard_kw["stats_collective"] = "allgather"
    elif case == "chunk_size_differs" and bad:
        kw["chunk_size"] = 64
    elif case == "hidden_grad_need_differs" and bad:
        h = h.detach()  # weight still requires grad everywhere: only the dH all-reduce would differ
    elif case == "no_grad_one_rank" and bad:
        h, no_grad = h.detach(), True
    elif case == "form_differs" and bad:
        fn = "lp"
    elif case == "temperature_differs":
        fn = "lp"
        if bad:
            kw["temperature"] = 0.5
    elif case == "return_entropy_differs":
        fn = "lp"
        if bad:
            kw["return_entropy"] = True
    elif case == "sp_local_tokens_one_rank":
        shard_kw["sequence_parallel"] = True
        Hs = make_problem(shape=SP_SHAPE)["H"]
        targets = make_problem(shape=SP_SHAPE)["t"]
        n = SP_SHAPE[0] // world
        h = Hs[rank * n:(rank + 1) * n + (1 if bad else 0)].clone().requires_grad_(True)
    w = W[start:stop].clone().requires_grad_(not no_grad)
    shard = VocabShard(group, start, stop, **shard_kw)
    if fn == "lp":
        kw.pop("chunk_size", None)
        return linear_logprobs(h, w, targets, shard=shard, **kw)
    return linear_cross_entropy(h, w, targets, shard=shard, **kw)


# case -> (message on the bad rank 1, message on the others); "*" = the same on every rank
OTHERS_REJECTED = r"rank\(s\) \[1\] of the tensor-parallel group rejected their inputs"
OPTS = r"disagree on the loss options"
FAULTS = {
    "negative_target_one_rank": (r"targets contain id -5", OTHERS_REJECTED),
    "oob_target_one_rank": (r"target", r"target"),
    "oob_target_all_ranks": (r"targets contain id 13, outside the vocabulary \[0, 13\)", "*"),
    "targets_differ": (r"disagree on the target ids", "*"),
    "float_targets_one_rank": (r"targets must be an integer tensor", OTHERS_REJECTED),
    "hidden_tokens_one_rank": (r"hidden.shape\[:-1\] \(2, 11\) must equal targets.shape \(2, 12\)", OTHERS_REJECTED),
    "hidden_dim_one_rank": (r"hidden's last dimension \(17\) must equal weight.shape\[1\] \(16\)", OTHERS_REJECTED),
    "n_disagree": (r"disagree on the number of tokens.*\[24, 22, 24\]", "*"),
    "d_disagree": (r"disagree on the hidden size.*\[16, 8, 16\]", "*"),
    "weight_rows_one_rank": (r"weight.shape\[0\] \(6\) must equal the shard size stop - start = 5", OTHERS_REJECTED),
    "layout_overlap": (r"do not tile \[0, V\): overlap", "*"),
    "layout_gap": (r"do not tile \[0, V\): gap", "*"),
    "label_smoothing_differs": (OPTS, "*"),
    "reduction_differs": (OPTS, "*"),
    "z_loss_differs": (OPTS, "*"),
    "softcap_differs": (OPTS, "*"),
    "shift_differs": (OPTS, "*"),
    "ignore_index_differs": (OPTS, "*"),
    "stats_collective_differs": (OPTS, "*"),
    "chunk_size_differs": (OPTS, "*"),
    "no_grad_one_rank": (OPTS, "*"),
    "hidden_grad_need_differs": (OPTS, "*"),
    "form_differs": (OPTS, "*"),
    "temperature_differs": (OPTS, "*"),
    "return_entropy_differs": (OPTS, "*"),
    "sp_local_tokens_one_rank": (r"under sequence parallelism targets must have shape", OTHERS_REJECTED),
}
FINAL_FAULT = "hidden_tokens_one_rank"


def _healthy_call(rank, world, group):
    """A correct call after a fault: the group is still in step (no stray collective pending)."""
    P = make_problem()
    start, stop = FAULT_BOUNDS[rank]
    loss = linear_cross_entropy(P["H"], P["W"][start:stop], P["t"], shard=VocabShard(group, start, stop),
                                label_smoothing=0.1, impl="torch")
    rl, _ = ref_ce(P["H"], P["W"], None, P["t"], label_smoothing=0.1)
    return abs(float(loss) - float(rl))


def _world3_body(rank, world, group, out_dir):
    """The world-3 matrix (uneven shards, one empty), then every fault, then one uncaught fault."""
    res = _matrix_body(rank, world, group, ce_random=25, lp_random=15, seed=3, one_at_a_time=True, extras=True)
    with open(os.path.join(out_dir, f"matrix_rank{rank}.json"), "w") as f:
        json.dump(res, f)
    record = {}
    for case in FAULTS:
        try:
            _fault_call(rank, world, group, case)
            record[case] = {"error": None}
        except Exception as e:  # noqa: BLE001 - recorded for the parent
            record[case] = {"type": type(e).__name__, "error": str(e), "is_input_error": isinstance(e, InputError)}
        record[case]["healthy_err"] = _healthy_call(rank, world, group)
    with open(os.path.join(out_dir, f"faults_rank{rank}.json"), "w") as f:
        json.dump(record, f)
    _fault_call(rank, world, group, FINAL_FAULT)  # uncaught: the parent reads each rank's error text
    return "no error raised"


def _read_rank_json(tmp_path, stem, rank, errors):
    path = tmp_path / f"{stem}_rank{rank}.json"
    assert path.exists(), f"rank {rank} stopped before writing {path.name}:\n{errors[rank]}"
    with open(path) as f:
        return json.load(f)


def test_world3_uneven_empty_shard_and_faults(tmp_path):
    """World 3: the option matrix with an empty shard ([6,6) on rank 1) and with uneven shards; then
    faults: every rank raises a clear error, none hangs, and the group stays usable afterwards."""
    errors = run_ranks(_world3_body, 3, tmp_path, kw=dict(out_dir=str(tmp_path)), timeout=300, pg_timeout=60,
                       expect_errors=True)
    _assert_clean({r: _read_rank_json(tmp_path, "matrix", r, errors) for r in range(3)}, 150)
    records = {r: _read_rank_json(tmp_path, "faults", r, errors) for r in range(3)}
    # the final, uncaught rank-local fault: each rank's own error text
    bad_re, other_re = FAULTS[FINAL_FAULT]
    for r in range(3):
        assert errors[r] is not None, f"rank {r} raised nothing for {FINAL_FAULT}"
        first = errors[r].splitlines()[0]
        assert re.search(bad_re if r == 1 else other_re, first), f"rank {r}: {errors[r]}"
        assert first.startswith("ValueError" if r == 1 else "InputError"), f"rank {r}: {errors[r]}"
    problems = []
    for case, (bad_re, other_re) in FAULTS.items():
        for r in range(3):
            rec = records[r][case]
            want = bad_re if (r == 1 or other_re == "*") else other_re
            if rec["error"] is None:
                problems.append(f"{case}: rank {r} raised nothing")
                continue
            if not re.search(want, rec["error"]):
                problems.append(f"{case}: rank {r} raised {rec['type']}: {rec['error']!r}; want /{want}/")
            # the odd rank out raises its own (local) ValueError/TypeError; the others learn of it
            # in the handshake (InputError); disagreements are InputError everywhere
            own = r == 1 and other_re == OTHERS_REJECTED
            if own and rec["type"] not in ("ValueError", "TypeError"):
                problems.append(f"{case}: rank 1 raised {rec['type']}, not its own ValueError/TypeError")
            if not own and not rec["is_input_error"]:
                problems.append(f"{case}: rank {r} raised {rec['type']}, not cce_dist.InputError")
            if rec["healthy_err"] > 1e-5:
                problems.append(f"{case}: rank {r}: the next correct call is off by {rec['healthy_err']}")
    assert not problems, "\n".join(problems)


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
    fails = Failures()
    for shard in (None, VocabShard(None, 0, V)):
        _single_ce(shard, dict(CE_BASE, label_smoothing=0.1, z_loss=1e-2, bias=True), fails, f"{shard} ce")
        _single_lp(shard, fails, f"{shard} lp")
    assert not fails.items, "\n".join(fails.items)
    # a shard=VocabShard(None, ...) whose weight does not match the shard size is rejected
    P = make_problem()
    with pytest.raises(ValueError, match="must equal the shard size"):
        linear_cross_entropy(P["H"], P["W"][:5], P["t"], shard=VocabShard(None, 0, V), impl="torch")
