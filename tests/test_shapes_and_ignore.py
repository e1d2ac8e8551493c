"""Single-device shapes and ignored tokens against the materialized oracle (tests/oracle.py): ``shift``, edge shapes
(N = 1, D = 1, V = 1 or 2, duplicate and chunk-shared targets), empty batches, one unbatched token, every target
ignored, ignored rows without gradient (also when their hidden states are not finite). Shapes and helpers:
tests/single_device.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import leaf
from oracle import oracle_cross_entropy, oracle_logprobs, shift_targets
from single_device import (
    CHUNK,
    GIF,
    IGN,
    REDUCTIONS,
    D,
    N,
    V,
    assert_close32,
    assert_unchanged,
    grads,
    leaves,
    make_inputs,
    snapshot,
    upstream,
)

from cce_dist import linear_cross_entropy, linear_logprobs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tiny shapes: see tests/conftest.py


# ----------------------------------------------------------------------------------------------
# shift, edge shapes, ignore handling
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [True, 2, 20], ids=lambda s: f"shift={s}")
@pytest.mark.parametrize("shape", [(3, 11), (11,)], ids=["BSD", "SD"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", [None, False], ids=lambda g: f"gif={g}")
def test_shift(shift, shape, reduction, gif):
    h, w, b, t = make_inputs(shape=shape, seed=12, ignore_frac=0.1)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    before = snapshot(t)
    loss = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, shift=shift, chunk_size=2 * V, grad_in_forward=gif, label_smoothing=0.1
    )
    ref = oracle_cross_entropy(h2, w2, t, b2, reduction=reduction, shift=shift, label_smoothing=0.1)
    assert loss.shape == ref.shape
    assert_close32(loss, ref)
    if reduction == "none":  # the last `shift` positions are ignored
        assert bool((loss[..., -int(shift) :] == 0).all())
    g = upstream(ref)
    for x, y in zip(grads(loss, (h1, w1, b1), g), grads(ref, (h2, w2, b2), g)):
        assert_close32(x, y)
    # the oracle's shift agrees with an explicit shift of the targets, and cce_dist does too
    st = shift_targets(t, shift, IGN)
    assert torch.equal(st[..., : max(shape[-1] - int(shift), 0)], t[..., int(shift) :])
    explicit = linear_cross_entropy(h, w, st, bias=b, reduction=reduction, chunk_size=2 * V, label_smoothing=0.1)
    assert_close32(loss, explicit)
    lp = linear_logprobs(h1, w1, t, bias=b1, shift=shift, chunk_size=2 * V, temperature=0.9)
    rlp = oracle_logprobs(h2, w2, t, b2, shift=shift, temperature=0.9)
    assert lp.shape == t.shape
    assert_close32(lp, rlp)
    assert_unchanged(before, t)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
@pytest.mark.parametrize("case", ["N=1", "D=1", "V=1", "V=2", "duplicate_targets", "shared_target_in_chunk"])
def test_edge_shapes_and_targets(case, reduction, gif):
    n, v, d = N, V, D
    if case == "N=1":
        n = 1
    elif case == "D=1":
        d = 1
    elif case == "V=1":
        v = 1
    elif case == "V=2":
        v = 2
    h, w, b, t = make_inputs(n, v, d, seed=13, ignore_frac=0.0 if case == "N=1" else 0.2)
    if case == "duplicate_targets":
        t[t != IGN] = 5  # every valid token has the same target
    elif case == "shared_target_in_chunk":
        t[:] = torch.arange(n) // 3 % v  # consecutive tokens (same chunk) share targets
    opts = {"label_smoothing": 0.1, "z_loss": 1e-3}
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    loss = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, chunk_size=3 * v + 1, grad_in_forward=gif, **opts
    )
    ref = oracle_cross_entropy(h2, w2, t, b2, reduction=reduction, **opts)
    assert_close32(loss, ref)
    g = upstream(ref)
    for x, y in zip(grads(loss, (h1, w1, b1), g), grads(ref, (h2, w2, b2), g)):
        assert_close32(x, y)
    lp, ent = linear_logprobs(h1, w1, t, bias=b1, chunk_size=3 * v + 1, return_entropy=True)
    rlp, rent = oracle_logprobs(h2, w2, t, b2, return_entropy=True)
    assert_close32(lp, rlp)
    assert_close32(ent, rent)


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 5)], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
def test_empty_batch(shape, reduction, gif):
    h, w, b, t = make_inputs(shape=shape, seed=14)
    h1, w1, b1 = leaves(h, w, b)
    loss = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, chunk_size=CHUNK, grad_in_forward=gif, label_smoothing=0.1, z_loss=1e-3
    )
    ref = oracle_cross_entropy(h, w, t, b, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    assert loss.dtype == torch.float32
    if reduction == "none":
        assert loss.shape == shape
    else:
        assert loss.shape == () and float(loss.detach()) == 0.0 == float(ref)
    gh, gw, gb = grads(loss, (h1, w1, b1), upstream(loss) if loss.numel() else torch.zeros(shape))
    assert gh.shape == h.shape and gw.shape == w.shape and gb.shape == b.shape
    assert not gw.any() and not gb.any() and not gh.any()
    lp, ent = linear_logprobs(h1, w1, t, bias=b1, return_entropy=True, chunk_size=CHUNK)
    assert lp.shape == ent.shape == shape
    gh, gw, gb = grads((lp, ent), (h1, w1, b1), (torch.zeros(shape), torch.zeros(shape)))
    assert not gw.any() and not gb.any()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
@pytest.mark.parametrize("ignore_index", [IGN, 0], ids=lambda i: f"ignore={i}")
def test_all_targets_ignored(reduction, gif, ignore_index):
    h, w, b, t = make_inputs(seed=15)
    t[:] = ignore_index
    h1, w1, b1 = leaves(h, w, b)
    loss = linear_cross_entropy(
        h1,
        w1,
        t,
        bias=b1,
        reduction=reduction,
        chunk_size=CHUNK,
        grad_in_forward=gif,
        ignore_index=ignore_index,
        label_smoothing=0.2,
        z_loss=1e-2,
        softcap=3.0,
    )
    assert torch.isfinite(loss).all()
    assert not loss.any(), "all-ignored loss must be exactly 0 (mean: 0, not NaN)"
    ref = oracle_cross_entropy(
        h, w, t, b, reduction=reduction, ignore_index=ignore_index, label_smoothing=0.2, z_loss=1e-2, softcap=3.0
    )
    assert torch.equal(loss.detach(), ref)
    for g in grads(loss, (h1, w1, b1), upstream(loss)):
        assert torch.isfinite(g).all() and not g.any()
    lp, ent = linear_logprobs(h1, w1, t, bias=b1, return_entropy=True, chunk_size=CHUNK, ignore_index=ignore_index)
    assert not lp.any() and not ent.any()
    for g in grads((lp, ent), (h1, w1, b1), (upstream(lp, 1), upstream(ent, 2))):
        assert torch.isfinite(g).all() and not g.any()


def test_ignored_rows_have_no_gradient():
    """Gradient rows of ignored tokens are exactly zero, whatever their upstream gradient."""
    h, w, b, t = make_inputs(seed=16, ignore_frac=0.4)
    ignored = t == IGN
    assert ignored.any() and (~ignored).any()
    for gif in GIF:
        h1 = leaf(h)
        loss = linear_cross_entropy(
            h1, w, t, bias=b, chunk_size=CHUNK, grad_in_forward=gif, reduction="sum", label_smoothing=0.3
        )
        (gh,) = torch.autograd.grad(loss, h1)
        assert not gh[ignored].any() and gh[~ignored].abs().sum(1).gt(0).all()
    h1 = leaf(h)
    lp, ent = linear_logprobs(h1, w, t, bias=b, chunk_size=CHUNK, return_entropy=True)
    (gh,) = torch.autograd.grad((lp, ent), h1, (torch.ones(N), torch.ones(N)))
    assert not gh[ignored].any()


@pytest.mark.parametrize("form", ["fused", "recompute", "logprobs"])
@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_nonfinite_hidden_in_ignored_row_gives_finite_grads(form, bad):
    """Ignored tokens contribute no gradient, even if their (padding) hidden states are garbage."""
    h, w, b, t = make_inputs(seed=32, ignore_frac=0.0)
    t[0] = IGN
    clean = h.clone()
    clean[0] = 0.0
    dirty = h.clone()
    dirty[0] = bad

    def run(x):
        x1, w1, b1 = leaves(x, w, b)
        if form == "logprobs":
            lp, ent = linear_logprobs(x1, w1, t, bias=b1, return_entropy=True, chunk_size=CHUNK)
            outs, gs = (lp, ent), (torch.ones(N), torch.ones(N))
        else:
            outs = (linear_cross_entropy(x1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=form == "fused"),)
            gs = (torch.tensor(1.0),)
        return [o.detach() for o in outs] + grads(outs, (x1, w1, b1), gs)

    for got, want in zip(run(dirty), run(clean)):
        assert torch.isfinite(got).all()
        assert_close32(got, want)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_single_unbatched_token(reduction):
    """hidden [D] with a 0-dim target: one token, loss of targets' shape ()."""
    h, w, b, t = make_inputs(n=1, seed=31, ignore_frac=0.0)
    h1, h2 = leaf(h[0]), leaf(h[0])
    loss = linear_cross_entropy(h1, w, t[0], bias=b, reduction=reduction, label_smoothing=0.1)
    ref = oracle_cross_entropy(h2, w, t[0], b, reduction=reduction, label_smoothing=0.1)
    assert loss.shape == ref.shape == ()
    assert_close32(loss, ref)
    assert_close32(torch.autograd.grad(loss, h1)[0], torch.autograd.grad(ref, h2)[0])
    lp = linear_logprobs(h[0], w, t[0], bias=b)
    assert lp.shape == () and float(lp) <= 0
    assert_close32(lp, oracle_logprobs(h[0], w, t[0], b))
