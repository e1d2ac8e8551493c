"""The kernels form no invalid value in lanes they then discard.

A masked token (a ``-inf`` bias entry) has ``p = 0`` and ``log p = -inf``; a kernel that forms ``p * log p`` or
``delta * log p`` there and selects the lane away afterwards gives the right result on a GPU, but the interpreter
(numpy) reports the ``0 * -inf`` as an invalid value, and under ``-W error`` that is an error (the distillation
kernels had the same defect, fixed with the one-stack change). Every cross-entropy / logprob schedule, forward and
backward, with a masked token, under ``warnings.simplefilter("error")``, must run and match the torch
implementation.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TRITON

from cce_dist import linear_cross_entropy, linear_logprobs

pytestmark = pytest.mark.skipif(not TRITON, reason="cce_dist.kernels unavailable (triton missing / no interpreter)")


def _problem():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 8, generator=g)
    w = torch.randn(19, 8, generator=g)
    b = torch.randn(19, generator=g)
    b[4] = float("-inf")  # a masked token
    t = torch.randint(0, 19, (12,), generator=g)
    t[t == 4] = 5
    t[3] = -100
    return h, w, b, t


def _first(out):
    """The logprobs of ``(logprobs, RowOutputs)``, summed."""
    return out[0].sum()


CASES = {
    "ce-sum": lambda h, w, b, t, **kw: linear_cross_entropy(h, w, t, bias=b, reduction="sum", **kw),
    # (label smoothing is left out: with a -inf logit its loss is +inf, as materialized)
    "ce-zloss": lambda h, w, b, t, **kw: linear_cross_entropy(h, w, t, bias=b, reduction="sum", z_loss=1e-3, **kw),
    "logprobs-entropy": lambda h, w, b, t, **kw: sum(
        x.sum() for x in linear_logprobs(h, w, t, bias=b, return_entropy=True, temperature=0.7, **kw)
    ),
    "row-outputs": lambda h, w, b, t, **kw: _first(
        linear_logprobs(h, w, t, bias=b, row_outputs=("log_sum_sq_probs",), **kw)
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("options", [{}, {"deterministic": True}, {"filter_eps": "auto"}, {"softcap": 3.0}])
def test_no_invalid_value_with_a_masked_token(case, options):
    h, w, b, t = _problem()

    def run(impl, strict):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with warnings.catch_warnings():
            if strict:
                warnings.simplefilter("error")
            loss = CASES[case](hh, ww, b, t, impl=impl, **options)
            loss.backward()
        return loss.detach(), hh.grad, ww.grad

    got = run("triton", strict=True)
    want = run("torch", strict=False)
    for a, e in zip(got, want):
        assert bool(torch.isfinite(a).all())
        # filter_eps="auto" skips tiles whose softmax terms are below float32's resolution: a few ulps of the row
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-5)
