"""Every loss runs one stack: the same options base, validation, driver, gradient holding, reduction and -inf-safe
normalization. Each test here checks that a precaution taken once holds for cross-entropy, logprobs and
distillation alike (tests/test_signatures.py checks that each reaches the handshake through cce_dist.engine.driver)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import problem

from cce_dist import linear_cross_entropy, linear_distillation, linear_logprobs
from cce_dist.core import stats as S
from cce_dist.core.options import CrossEntropyOptions, DistillationOptions, LogprobOptions, LossOptions
from cce_dist.engine.autograd import HeldGradients

LOSSES = {
    "cross-entropy": lambda h, w, t, **kw: linear_cross_entropy(h, w, t, **kw),
    "logprobs": lambda h, w, t, **kw: linear_logprobs(h, w, t, **kw).sum(),
    "distillation": lambda h, w, t, **kw: linear_distillation(h, w, h.detach(), w.detach(), t, **kw),
}


@pytest.mark.parametrize("options", [CrossEntropyOptions, LogprobOptions, DistillationOptions])
def test_every_options_class_shares_the_loss_options(options):
    assert issubclass(options, LossOptions)
    shared = {f for f in LossOptions.__dataclass_fields__}
    assert shared <= set(options.__dataclass_fields__)


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize(
    "option,value",
    [("deterministic", "yes"), ("chunk_size", 0), ("impl", "cuda"), ("ignore_index", 1.5), ("shard", "tp")],
)
def test_a_shared_option_is_checked_for_every_loss(loss, option, value):
    """The checks of the shared fields live once (LossOptions): cross-entropy and logprobs took deterministic='yes'
    silently (only distillation checked it)."""
    h, w, _, t = problem(6, 4, 7, bias=False, requires_grad=True)
    with pytest.raises((TypeError, ValueError), match=option):
        LOSSES[loss](h, w, t, **{option: value})


@pytest.mark.parametrize("loss", ["cross-entropy", "distillation"])
def test_grad_in_forward_must_be_a_bool_or_none_for_every_loss(loss):
    h, w, _, t = problem(6, 4, 7, bias=False, requires_grad=True)
    with pytest.raises(TypeError, match="grad_in_forward"):
        LOSSES[loss](h, w, t, grad_in_forward="always")


@pytest.mark.parametrize("loss", ["cross-entropy", "distillation"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_both_fused_losses_hold_their_gradients_in_one_place(loss, reduction):
    """Cross-entropy's and distillation's gradients formed in forward are held by the one HeldGradients, in float32
    for float32 tensors, and released once: a second backward raises naming the remedy."""
    h, w, _, t = problem(6, 4, 7, bias=False, requires_grad=True)
    t[1] = -100
    out = LOSSES[loss](h, w, t, reduction=reduction, impl="torch")
    held = out.grad_fn.held
    assert isinstance(held, HeldGradients)
    assert [g.dtype for g in held.grads if g is not None] == [torch.float32, torch.float32]
    out.backward(retain_graph=True)
    assert h.grad is not None and bool((h.grad[1] == 0).all())  # the ignored row
    with pytest.raises(RuntimeError, match="grad_in_forward=False"):
        out.backward()


def test_held_gradients_zero_when_no_row_counts_device_flag():
    """any_valid given as a device tensor (distillation: no read-back) selects 0 for an infinite upstream."""
    grads = (torch.ones(2, 3), torch.ones(4, 3), None)
    tensors = (torch.zeros(2, 3, dtype=torch.float16), torch.zeros(4, 3, dtype=torch.bfloat16), None)
    held = HeldGradients(
        grads,
        tensors,
        scale=torch.tensor(0.5),
        valid_rows=torch.tensor([False, False]),
        any_valid=torch.tensor(False),
        what="test",
    )
    dh, dw, db = held.release(torch.tensor(math.inf))
    assert dh.dtype == torch.float16 and dw.dtype == torch.bfloat16 and db is None
    assert bool((dh == 0).all()) and bool((dw == 0).all())


def test_held_gradients_scale_in_float32_before_rounding():
    """A float16 tensor's gradient scaled by 2**16 is applied in float32, then rounded once: finite."""
    g16 = torch.full((2, 3), 1e-3)
    held = HeldGradients(
        (g16, None, None),
        (torch.zeros(2, 3, dtype=torch.float16), None, None),
        scale=2.0**-16,
        valid_rows=torch.tensor([True, False]),
        any_valid=True,
        what="test",
    )
    (dh, _, _) = held.release(torch.tensor(2.0**16))  # GradScaler's scale (float32; inf as an fp16 number)
    assert dh.dtype == torch.float16
    torch.testing.assert_close(dh[0].float(), torch.full((3,), 1e-3), rtol=1e-3, atol=0)
    assert bool((dh[1] == 0).all())


def test_normalizers_are_minus_inf_safe():
    """A slice with no finite logit (a masked shard or split) adds exactly 0; elsewhere p and log p match."""
    z = torch.tensor([[0.5, -1.0, 2.0], [float("-inf"), float("-inf"), 1.0]])
    glob = torch.stack([S.empty_stats(1)[0]] * 2)  # filled below: the global max and sum of each row
    glob[:, S.MAX] = z.amax(1)
    glob[:, S.SUMEXP] = torch.exp(z - glob[:, S.MAX, None]).sum(1)
    masked_slice = z[:, :2]  # row 1: every entry -inf
    m = masked_slice.amax(1)
    c, lg = S.normalizers(m, glob)
    assert c[1] == 0 and lg[1] == float("-inf")
    torch.testing.assert_close(torch.exp(masked_slice[0] - m[0]) * c[0], torch.softmax(z[0], 0)[:2])
    torch.testing.assert_close((masked_slice[0] - m[0]) + lg[0], torch.log_softmax(z[0], 0)[:2])


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_loss_names_a_bad_target_id_the_same_way(loss):
    h, w, _, t = problem(6, 4, 7, bias=False, requires_grad=True)
    t[0] = 7  # = V
    with pytest.raises(ValueError, match=r"targets contain id 7, outside the vocabulary \[0, 7\)"):
        LOSSES[loss](h, w, t)
