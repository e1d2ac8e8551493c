"""The module form and autograd behaviour on one device: ``LinearCrossEntropy`` equals the function, no input (or
upstream gradient) is written in place, double backward (refused after the fused schedule, right after the recompute
one), and gradients that accumulate over losses sharing inputs. Shapes and helpers: tests/single_device.py.
"""

from __future__ import annotations

import pytest
import torch
from oracle import oracle_cross_entropy
from single_device import (
    CHUNK,
    GIF,
    IGN,
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

import cce_dist
from cce_dist import LinearCrossEntropy, linear_cross_entropy, linear_logprobs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tiny shapes: see tests/conftest.py


# ----------------------------------------------------------------------------------------------
# module form, in-place safety, autograd behaviour
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"reduction": "none", "label_smoothing": 0.1},
        {"reduction": "sum", "z_loss": 1e-3, "softcap": 5.0, "shift": True},
        {"return_lse": True, "ignore_index": 3},
        {"grad_in_forward": False, "chunk_size": 2 * V},
    ],
    ids=opts_id,
)
def test_module_equals_function(opts):
    h, w, b, t = make_inputs(seed=22, ignore_index=opts.get("ignore_index", IGN))
    kw = dict({"chunk_size": CHUNK}, **opts)
    mod = LinearCrossEntropy(**kw)
    assert isinstance(mod, torch.nn.Module)
    assert mod.options == cce_dist.CrossEntropyOptions(**kw)
    for k, v in opts.items():
        if k != "shift":
            assert f"{k}={v!r}" in repr(mod)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    a = mod(h1, w1, t, b1)
    c = linear_cross_entropy(h2, w2, t, bias=b2, **kw)
    a, c = (a if isinstance(a, tuple) else (a,)), (c if isinstance(c, tuple) else (c,))
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    gs = [upstream(x, seed=i) for i, x in enumerate(a)]
    for x, y in zip(grads(a, (h1, w1, b1), gs), grads(c, (h2, w2, b2), gs)):
        assert torch.equal(x, y)
    with pytest.raises((AttributeError, TypeError)):
        mod.options.reduction = "sum"  # frozen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", ["fused", "recompute", "none", "lse", "logprobs"])
def test_inputs_not_modified_in_place(dtype, form):
    h, w, b, t = make_inputs(dtype=dtype, seed=23)
    h1, w1, b1 = leaves(h, w, b)
    before = snapshot(h1, w1, b1, t)
    opts = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}
    if form == "logprobs":
        out = linear_logprobs(h1, w1, t, bias=b1, chunk_size=CHUNK, softcap=3.0, temperature=0.7, return_entropy=True)
    elif form == "lse":
        out = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, return_lse=True, **opts)
    else:
        out = linear_cross_entropy(
            h1,
            w1,
            t,
            bias=b1,
            chunk_size=CHUNK,
            reduction="none" if form == "none" else "mean",
            grad_in_forward=form == "fused",
            **opts,
        )
    outs = out if isinstance(out, tuple) else (out,)
    assert_unchanged(before, h1, w1, b1, t)
    gs = [upstream(o, seed=i) for i, o in enumerate(outs)]
    gs_before = snapshot(*gs)
    torch.autograd.backward(outs, gs)
    assert_unchanged(before, h1, w1, b1, t)
    assert_unchanged(gs_before, *gs)


@pytest.mark.parametrize("gif", [None, True])
def test_double_backward_through_fused_loss_raises(gif):
    h, w, b, t = make_inputs(seed=24)
    h1, w1, b1 = leaves(h, w, b)
    loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=gif)
    loss.backward(retain_graph=True)
    first = h1.grad.clone()
    assert first.any()
    with pytest.raises(RuntimeError, match="grad_in_forward"):
        loss.backward()
    assert torch.equal(h1.grad, first)  # the failed second backward added nothing


def test_double_backward_recompute_path_works():
    h, w, b, t = make_inputs(seed=25)
    h1, w1, b1 = leaves(h, w, b)
    loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=False, label_smoothing=0.1)
    loss.backward(retain_graph=True)
    once = [x.grad.clone() for x in (h1, w1, b1)]
    loss.backward()
    for x, g in zip((h1, w1, b1), once):
        assert_close32(x.grad, 2 * g)


@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
def test_grad_accumulation_and_graph_composition(gif):
    """Two losses sharing inputs (and combined with other terms) accumulate gradients correctly."""
    h, w, b, t = make_inputs(seed=26)
    t2 = torch.roll(t, 1)
    h1, w1, b1 = leaves(h, w, b)
    x1 = h1 * 1.5  # non-leaf hidden
    total = (
        linear_cross_entropy(x1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=gif)
        + 0.5
        * linear_cross_entropy(x1, w1, t2, bias=b1, chunk_size=CHUNK, grad_in_forward=gif, reduction="sum", z_loss=1e-3)
        + (w1**2).sum() * 1e-3
    )
    total.backward()
    h2, w2, b2 = leaves(h, w, b)
    x2 = h2 * 1.5
    ref = (
        oracle_cross_entropy(x2, w2, t, b2)
        + 0.5 * oracle_cross_entropy(x2, w2, t2, b2, reduction="sum", z_loss=1e-3)
        + (w2**2).sum() * 1e-3
    )
    ref.backward()
    assert_close32(total, ref)
    for x, y in ((h1, h2), (w1, w2), (b1, b2)):
        assert_close32(x.grad, y.grad)
