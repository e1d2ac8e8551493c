"""Single-device cross-entropy and logprobs in fp32 against the materialized oracle (tests/oracle.py).

Forward and backward (hidden, weight, bias) for every option and combinations of them, both schedules of the
torch implementation (gradients formed in forward, and the recompute-in-backward path), reductions, per-token
upstream gradients, ``return_lse`` with a gradient through it, entropy, any chunk size, a subset of the inputs
requiring grad, no_grad, determinism, int32 targets and non-contiguous inputs. Shapes and helpers:
tests/single_device.py (N = 37 tokens, V = 53, D = 19, 5 tokens per chunk).
"""

from __future__ import annotations

import pytest
import torch
from helpers import leaf
from oracle import oracle_cross_entropy, oracle_logprobs
from single_device import (
    CHUNK,
    GIF,
    IGN,
    REDUCTIONS,
    N,
    V,
    assert_close32,
    assert_unchanged,
    grads,
    leaves,
    make_inputs,
    opts_id,
    snapshot,
    upstream,
)

from cce_dist import linear_cross_entropy, linear_logprobs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tiny shapes: see tests/conftest.py

CE_OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"label_smoothing": 1.0},
    {"z_loss": 1e-2},
    {"softcap": 3.0},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0},
    {"label_smoothing": 0.1, "ignore_index": 7},  # an ignore_index inside [0, V)
    {"z_loss": 1e-3, "softcap": 2.0, "ignore_index": -1},
]
LP_OPTIONS = [
    {},
    {"softcap": 3.0},
    {"temperature": 0.7},
    {"temperature": 1.9, "softcap": 4.0},
    {"temperature": 0.5, "ignore_index": 7},
]


# ----------------------------------------------------------------------------------------------
# fp32: forward and backward against the oracle, every option, both schedules
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opts", CE_OPTIONS, ids=opts_id)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_cross_entropy_fp32_matches_oracle(opts, reduction, gif, bias):
    ign = opts.get("ignore_index", IGN)
    h, w, b, t = make_inputs(bias=bias, ignore_index=ign, seed=len(opts_id(opts)))
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    before = snapshot(h, w, b, t)
    loss = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, chunk_size=CHUNK, grad_in_forward=gif, impl="torch", **opts
    )
    ref = oracle_cross_entropy(h2, w2, t, b2, reduction=reduction, **opts)
    assert loss.dtype == torch.float32
    assert loss.shape == ref.shape == ((N,) if reduction == "none" else ())
    assert_close32(loss, ref, what="loss")
    g = upstream(ref)
    got, want = grads(loss, (h1, w1, b1), g), grads(ref, (h2, w2, b2), g)
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        if y is not None:
            assert_close32(x, y, what=f"d{name}")
    assert_unchanged(before, h, w, b, t)


@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.3, "z_loss": 1e-2, "softcap": 4.0}], ids=opts_id)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", [None, False], ids=lambda g: f"gif={g}")
def test_return_lse_with_gradient_through_lse(opts, reduction, gif):
    h, w, b, t = make_inputs(seed=3)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    loss, lse = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, return_lse=True, chunk_size=CHUNK, grad_in_forward=gif, **opts
    )
    rloss, rlse = oracle_cross_entropy(h2, w2, t, b2, reduction=reduction, return_lse=True, **opts)
    assert lse.dtype == torch.float32 and lse.shape == t.shape
    assert_close32(loss, rloss, what="loss")
    assert_close32(lse, rlse, what="lse")
    g_loss, g_lse = upstream(rloss, seed=5), upstream(rlse, seed=6)
    got = grads((loss, lse), (h1, w1, b1), (g_loss, g_lse))
    want = grads((rloss, rlse), (h2, w2, b2), (g_loss, g_lse))
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        assert_close32(x, y, what=f"d{name}")
    # a gradient through lse alone (the loss unused)
    got = grads(lse, (h1, w1, b1), g_lse)
    want = grads(rlse, (h2, w2, b2), g_lse)
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        assert_close32(x, y, what=f"lse-only d{name}")


@pytest.mark.parametrize("opts", LP_OPTIONS, ids=opts_id)
@pytest.mark.parametrize("which", ["logprob", "entropy", "both", "no_entropy"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_logprobs_entropy_fp32_matches_oracle(opts, which, bias):
    ign = opts.get("ignore_index", IGN)
    h, w, b, t = make_inputs(bias=bias, ignore_index=ign, seed=11)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    before = snapshot(h, w, b, t)
    ret_ent = which != "no_entropy"
    out = linear_logprobs(h1, w1, t, bias=b1, return_entropy=ret_ent, chunk_size=CHUNK, **opts)
    ref = oracle_logprobs(h2, w2, t, b2, return_entropy=ret_ent, **opts)
    if not ret_ent:
        out, ref = (out,), (ref,)
    for x, y, name in zip(out, ref, ("logprob", "entropy")):
        assert x.dtype == torch.float32 and x.shape == t.shape
        assert_close32(x, y, what=name)
    valid = t != ign
    assert bool((out[0][~valid] == 0).all())
    if which == "logprob":
        sel = [0]
    elif which == "entropy":
        sel = [1]
    else:
        sel = list(range(len(out)))
    gs = [upstream(ref[i], seed=20 + i) for i in sel]
    got = grads([out[i] for i in sel], (h1, w1, b1), gs)
    want = grads([ref[i] for i in sel], (h2, w2, b2), gs)
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        if y is not None:
            assert_close32(x, y, what=f"d{name}")
    assert_unchanged(before, h, w, b, t)


@pytest.mark.parametrize("chunk_size", [1, V - 1, V, V + 1, 3 * V + 1, N * V - 1, N * V, 1 << 30, None])
@pytest.mark.parametrize("gif", [None, False], ids=lambda g: f"gif={g}")
def test_chunk_sizes(chunk_size, gif):
    """Any chunk_size (smaller than a row, not a multiple of V, larger than everything) is exact."""
    opts = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}
    h, w, b, t = make_inputs(seed=4)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=chunk_size, grad_in_forward=gif, **opts)
    ref = oracle_cross_entropy(h2, w2, t, b2, **opts)
    assert_close32(loss, ref)
    for x, y in zip(grads(loss, (h1, w1, b1), None), grads(ref, (h2, w2, b2), None)):
        assert_close32(x, y)
    lp, ent = linear_logprobs(h1, w1, t, bias=b1, chunk_size=chunk_size, return_entropy=True, temperature=0.8)
    rlp, rent = oracle_logprobs(h2, w2, t, b2, return_entropy=True, temperature=0.8)
    assert_close32(lp, rlp)
    assert_close32(ent, rent)
    g = (upstream(rlp, 2), upstream(rent, 3))
    for x, y in zip(grads((lp, ent), (h1, w1, b1), g), grads((rlp, rent), (h2, w2, b2), g)):
        assert_close32(x, y)


@pytest.mark.parametrize("needs", ["hidden", "weight", "bias", "hidden+bias", "weight+bias"])
@pytest.mark.parametrize("gif", [None, False], ids=lambda g: f"gif={g}")
def test_subset_of_inputs_requires_grad(needs, gif):
    h, w, b, t = make_inputs(seed=5)
    want_h, want_w, want_b = ("hidden" in needs), ("weight" in needs), ("bias" in needs)
    h1, w1, b1 = (leaf(x) if f else x.clone() for x, f in ((h, want_h), (w, want_w), (b, want_b)))
    h2, w2, b2 = (leaf(x) if f else x.clone() for x, f in ((h, want_h), (w, want_w), (b, want_b)))
    loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=gif, label_smoothing=0.1)
    ref = oracle_cross_entropy(h2, w2, t, b2, label_smoothing=0.1)
    loss.backward()
    ref.backward()
    for x, y in ((h1, h2), (w1, w2), (b1, b2)):
        if y.requires_grad:
            assert_close32(x.grad, y.grad)
        else:
            assert x.grad is None


def test_no_grad_and_no_requires_grad():
    h, w, b, t = make_inputs(seed=6)
    ref = oracle_cross_entropy(h, w, t, b, z_loss=1e-3)
    plain = linear_cross_entropy(h, w, t, bias=b, chunk_size=CHUNK, z_loss=1e-3)
    assert plain.grad_fn is None and not plain.requires_grad
    assert_close32(plain, ref)
    h1, w1, b1 = leaves(h, w, b)
    with torch.no_grad():
        out = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, z_loss=1e-3)
        lp = linear_logprobs(h1, w1, t, bias=b1, chunk_size=CHUNK)
    assert not out.requires_grad and not lp.requires_grad
    assert torch.equal(out, plain)
    assert_close32(lp, oracle_logprobs(h, w, t, b))


def test_impl_auto_equals_torch_on_cpu():
    h, w, b, t = make_inputs(seed=7)
    a = linear_cross_entropy(h, w, t, bias=b, impl="auto", chunk_size=CHUNK, reduction="none")
    c = linear_cross_entropy(h, w, t, bias=b, impl="torch", chunk_size=CHUNK, reduction="none")
    assert torch.equal(a, c)


def test_deterministic_repeat():
    h, w, b, t = make_inputs(seed=8)
    outs = []
    for _ in range(2):
        h1, w1, b1 = leaves(h, w, b)
        loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, label_smoothing=0.1)
        loss.backward()
        outs.append((loss.detach(), h1.grad, w1.grad, b1.grad))
    for x, y in zip(*outs):
        assert torch.equal(x, y)


@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
def test_int32_targets_and_noncontiguous_inputs(gif):
    h, w, b, t = make_inputs(seed=9)
    # hidden and weight as transposed views of column-major storage, targets as int32
    h_nc = leaf(h.t().contiguous()).t()
    w_nc_leaf = leaf(w.t().contiguous())
    w_nc = w_nc_leaf.t()
    assert not h_nc.is_contiguous() and not w_nc.is_contiguous()
    h_leaf = h_nc._base if h_nc._base is not None else h_nc
    loss = linear_cross_entropy(
        h_nc, w_nc, t.to(torch.int32), bias=b, chunk_size=CHUNK, grad_in_forward=gif, label_smoothing=0.1
    )
    h2, w2 = leaf(h), leaf(w)
    ref = oracle_cross_entropy(h2, w2, t, b, label_smoothing=0.1)
    assert_close32(loss, ref)
    loss.backward()
    ref.backward()
    assert_close32(h_leaf.grad.t(), h2.grad)
    assert_close32(w_nc_leaf.grad.t(), w2.grad)
