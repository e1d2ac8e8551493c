"""The loss under ``torch.func`` transforms and on the meta device.

``vmap`` / ``grad`` / ``jacrev`` wrap their inputs in tensors without storage, which the loss's autograd Functions
cannot read (target ids and schedules are decided on the host): every entry point refuses them with a
NotImplementedError naming the transform family, the argument and the alternative (flatten the batch into the
token dimension), instead of torch's "Cannot access data pointer of Tensor that doesn't have storage". The
alternative the message gives is checked to equal the per-slice losses the user wanted from ``vmap``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import distill_problem, problem
from oracle import oracle_cross_entropy

from cce_dist import linear_cross_entropy, linear_distillation, linear_logprobs

B, N, D, V = 3, 4, 8, 11


def _batch():
    p = problem(B * N, D, V, seed=3)
    return p.hidden.reshape(B, N, D), p.weight, p.targets.reshape(B, N)


def _ce(h, w, t):
    return linear_cross_entropy(h, w, t)


def _ce_class_weight(h, w, t):
    return linear_cross_entropy(h, w, t, class_weight=torch.linspace(0.5, 1.5, V))


def _ce_row_outputs(h, w, t):
    return linear_cross_entropy(h, w, t, row_outputs=("predicted", "is_top1"))[0]


def _logprobs(h, w, t):
    return linear_logprobs(h, w, t, return_entropy=True)[0]


LOSSES = [_ce, _ce_class_weight, _ce_row_outputs, _logprobs]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("batched", ["hidden", "targets"])
def test_vmap_is_refused_naming_the_argument(loss, batched):
    h, w, t = _batch()
    if batched == "hidden":
        fn = torch.func.vmap(lambda hb: loss(hb, w, t[0]))
        args: tuple = (h,)
    else:
        fn = torch.func.vmap(lambda tb: loss(h[0], w, tb))
        args = (t,)
    with pytest.raises(NotImplementedError, match=rf"torch\.func transforms \(vmap.*{batched} is a transform"):
        fn(*args)


@pytest.mark.parametrize("transform", [torch.func.grad, torch.func.jacrev])
def test_grad_transforms_are_refused(transform):
    h, w, t = _batch()
    with pytest.raises(NotImplementedError, match="is a transform.s wrapped tensor"):
        transform(lambda wb: linear_cross_entropy(h[0], wb, t[0]))(w)


def test_distillation_under_vmap_is_refused():
    p = distill_problem(B * N, D, D + 2, V, seed=4)
    sh = p.student_hidden.reshape(B, N, D)
    fn = torch.func.vmap(
        lambda s: linear_distillation(s, p.student_weight, p.teacher_hidden[:N], p.teacher_weight, None)
    )
    with pytest.raises(NotImplementedError, match="student_hidden is a transform's wrapped tensor"):
        fn(sh)


def test_the_suggested_alternative_gives_the_per_slice_losses():
    """What vmap over the batch would have returned (one mean per slice) is the flattened call's reshaped rows."""
    h, w, t = _batch()
    rows = linear_cross_entropy(h.reshape(B * N, D), w, t.reshape(B * N), reduction="none").reshape(B, N)
    want = torch.stack([oracle_cross_entropy(h[i].double(), w.double(), t[i], dtype=None) for i in range(B)])
    torch.testing.assert_close(rows.mean(dim=1).double(), want, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the meta device: the custom ops' fake implementations give the shapes (FSDP-style deferred init, shape checks)
# ---------------------------------------------------------------------------------------------------------------


def _meta(*shape, dtype=torch.float32, grad=False):
    return torch.empty(*shape, device="meta", dtype=dtype).requires_grad_(grad)


@pytest.mark.parametrize("reduction, shape", [("mean", ()), ("sum", ()), ("none", (B, N))])
def test_cross_entropy_on_meta_gives_shapes_and_gradients(reduction, shape):
    h, w = _meta(B, N, D, grad=True), _meta(V, D, grad=True)
    t = torch.empty(B, N, device="meta", dtype=torch.long)
    loss = linear_cross_entropy(h, w, t, reduction=reduction)
    assert loss.device.type == "meta" and tuple(loss.shape) == shape and loss.dtype == torch.float32
    loss.sum().backward()
    assert h.grad is not None and h.grad.shape == h.shape and h.grad.device.type == "meta"
    assert w.grad is not None and w.grad.shape == w.shape


def test_logprobs_and_row_outputs_on_meta():
    h, w = _meta(B * N, D, dtype=torch.bfloat16), _meta(V, D, dtype=torch.bfloat16)
    t = torch.empty(B * N, device="meta", dtype=torch.int32)
    lp, ent = linear_logprobs(h, w, t, return_entropy=True)
    assert lp.shape == ent.shape == (B * N,) and lp.dtype == torch.float32 and lp.device.type == "meta"
    loss, ro = linear_cross_entropy(h, w, t, reduction="none", row_outputs=("predicted", "is_top1"))
    assert loss.shape == (B * N,) and ro.predicted.shape == (B * N,) and ro.predicted.dtype == torch.int64


def test_meta_inputs_are_validated_as_eager():
    """The one validation runs on meta inputs too: a shape error names the argument."""
    with pytest.raises(ValueError, match="targets must have shape"):
        linear_cross_entropy(_meta(6, D), _meta(V, D), torch.empty(5, device="meta", dtype=torch.long))


def test_distillation_on_meta_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="no meta-device implementation"):
        linear_distillation(_meta(6, D), _meta(V, D), _meta(6, D + 2), _meta(V, D + 2), None)
