"""Regressions for the defects users reported against the driver (issue 21).

Each test failed on the code before its fix; numbers are compared with the plain materialized program
(``F.linear`` + ``F.cross_entropy`` / ``log_softmax``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cce_dist import VocabShard, linear_cross_entropy, linear_logprobs

N, D, V = 12, 16, 40


def _inputs(dtype=torch.float32, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    return h, w, b


def _grads(*ts):
    return [None if t is None else t.grad for t in ts]


def _plain_ce_sum(h, w, b, t):
    return F.cross_entropy(F.linear(h.float(), w.float(), None if b is None else b.float()), t, reduction="sum")


# ----------------------------------------------------------------------------------------------
# 1. all targets ignored + an infinite upstream gradient: zero gradients, never NaN
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("grad_in_forward", [None, False])
def test_all_ignored_infinite_upstream_gives_zero_grads(dtype, reduction, grad_in_forward):
    """HF Trainer on a micro-batch without labels: ``loss / num_items_in_batch`` with 0 items."""
    h, w, b = _inputs(dtype)
    t = torch.full((N,), -100)
    loss = linear_cross_entropy(h, w, t, bias=b, reduction=reduction, grad_in_forward=grad_in_forward)
    (loss / 0.0).backward()
    hr, wr, br = (x.detach().clone().requires_grad_() for x in (h, w, b))
    (_plain_ce_sum(hr, wr, br, t) / 0.0).backward()
    for got, want in zip(_grads(h, w, b), _grads(hr, wr, br)):
        assert torch.equal(want, torch.zeros_like(want))  # the plain program: exactly 0
        assert got.dtype == dtype and torch.equal(got, torch.zeros_like(got)), got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_partly_ignored_infinite_upstream_ignored_rows_stay_zero(dtype):
    """An ignored row's hidden gradient is 0 whatever the upstream value, as in the plain program."""
    h, w, b = _inputs(dtype)
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    t[::3] = -100
    (linear_cross_entropy(h, w, t, bias=b, reduction="sum") * math.inf).backward()
    hr = h.detach().clone().requires_grad_()
    (_plain_ce_sum(hr, w.detach(), b.detach(), t) * math.inf).backward()
    ignored = t == -100
    assert torch.equal(hr.grad[ignored], torch.zeros_like(hr.grad[ignored]))
    assert torch.equal(h.grad[ignored], torch.zeros_like(h.grad[ignored]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("g", [1.0, 2.0**16, -3.0, 1e-30])
def test_fused_finite_upstream_scales_as_before(dtype, g):
    """The fix leaves a finite upstream's scaling alone: the fused path against the two-pass one (its own
    algorithm, so to the dtype's tolerance), and exactly g times the gradients at g = 1 for a power of two."""
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
    t[1] = -100
    got = {}
    for key, upstream, gif in (("g", g, None), ("one", 1.0, None), ("two_pass", g, False)):
        h, w, b = _inputs(dtype)
        (linear_cross_entropy(h, w, t, bias=b, grad_in_forward=gif) * upstream).backward()
        got[key] = _grads(h, w, b)
    tol = dict(atol=1e-5 * abs(g), rtol=1.3e-6) if dtype == torch.float32 else dict(atol=1e-3 * abs(g), rtol=1e-2)
    for a, b in zip(got["g"], got["two_pass"]):
        torch.testing.assert_close(a, b, **tol)
    if math.frexp(abs(g))[0] == 0.5 and dtype != torch.float16:  # fp16 is held in float32: rounded after g
        for a, b in zip(got["g"], got["one"]):
            assert torch.equal(a, (b.float() * g).to(dtype))


def test_logprobs_all_ignored_infinite_upstream_gives_zero_grads():
    h, w, b = _inputs()
    t = torch.full((N,), -100)
    lp, ent = linear_logprobs(h, w, t, bias=b, return_entropy=True)
    ((lp.sum() + ent.sum()) / 0.0).backward()
    for got in _grads(h, w, b):
        assert torch.equal(got, torch.zeros_like(got)), got


def test_compiled_all_ignored_infinite_upstream_gives_zero_grads():
    h, w, b = _inputs()
    t = torch.full((N,), -100)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(h, w, b, t):
        return linear_cross_entropy(h, w, t, bias=b, reduction="sum") / 0.0

    f(h, w, b, t).backward()
    for got in _grads(h, w, b):
        assert torch.equal(got, torch.zeros_like(got)), got


def _tp_inf_body(rank, world, group, sequence_parallel, partly):
    """Fused TP cross-entropy times inf: the gradients of ignored rows (all, or every third) on this rank."""
    h, w, b = _inputs()
    t = torch.full((N,), -100)
    if partly:
        t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
        t[::3] = -100
    per = V // world
    shard = VocabShard(group, rank * per, (rank + 1) * per, sequence_parallel=sequence_parallel)
    rows = slice(rank * N // world, (rank + 1) * N // world) if sequence_parallel else slice(None)
    hl = h.detach()[rows].clone().requires_grad_()
    wl = w.detach()[rank * per : (rank + 1) * per].clone().requires_grad_()
    bl = b.detach()[rank * per : (rank + 1) * per].clone().requires_grad_()
    loss = linear_cross_entropy(hl, wl, t, bias=bl, reduction="sum", shard=shard)
    (loss * math.inf if partly else loss / 0.0).backward()
    ignored = (t == -100)[rows]
    if partly:
        return hl.grad[ignored]
    return hl.grad, wl.grad, bl.grad


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("partly", [False, True])
def test_tp_fused_infinite_upstream_ignored_rows_zero(rank_pool, sequence_parallel, partly):
    results = rank_pool(2).run(_tp_inf_body, sequence_parallel=sequence_parallel, partly=partly)
    for grads in results.values():
        for got in grads if isinstance(grads, tuple) else (grads,):
            assert torch.equal(got, torch.zeros_like(got)), got
