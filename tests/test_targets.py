"""Target ids of every integer dtype: range checks and losses compare them as int64 on every path.

``uint8`` targets compared with ``ignore_index=-100`` directly wrap it to 156, so an out-of-range id 156 slipped past
the range check and was scored as a class (loss = lse); under ``torch.compile`` int8/int16 ids indexed out of range
and uint8 ids indexed as a boolean mask. The eager result, the compiled result and the oracle (tests/oracle.py,
int64 targets) must agree for every integer dtype, and every path must reject the same ids.
"""

from __future__ import annotations

import pytest
import torch
from helpers import problem
from oracle import oracle_cross_entropy, oracle_logprobs

from cce_dist import linear_cross_entropy, linear_logprobs

N, D, V = 8, 6, 100
INT_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
IMPLS = ["torch", "triton"]


def _problem(dtype, ignore_index=-100):
    """The problem with targets of ``dtype``: the third one ignored, except in uint8 (which cannot hold -100)."""
    ignore = (2,) if dtype.is_signed else ()
    h, w, b, t = problem(N, D, V, w_scale=D**-0.5, b_scale=0.1, ignore=ignore, ignore_index=ignore_index, seed=11)
    return h, w, b, t.to(dtype)


def _loss_and_grads(fn, h, w, b, t):
    h, w, b = (x.detach().clone().requires_grad_(True) for x in (h, w, b))
    rows, (lp, ent) = fn(h, w, b, t)
    out = (rows * torch.linspace(0.5, 1.5, N)).sum() + lp.sum() - 0.3 * ent.sum()
    out.backward()
    return rows.detach(), lp.detach(), ent.detach(), h.grad, w.grad, b.grad


def _library(impl="torch"):
    def fn(h, w, b, t):
        rows = linear_cross_entropy(h, w, t, bias=b, reduction="none", shift=1, impl=impl)
        return rows, linear_logprobs(h, w, t, bias=b, return_entropy=True, impl=impl)

    return fn


def _oracle(h, w, b, t):
    t = t.long()
    return (
        oracle_cross_entropy(h, w, t, b, reduction="none", shift=1),
        oracle_logprobs(h, w, t, b, return_entropy=True),
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_every_integer_dtype_matches_the_oracle(dtype, impl):
    h, w, b, t = _problem(dtype)
    got = _loss_and_grads(_library(impl), h, w, b, t)
    ref = _loss_and_grads(_oracle, h, w, b, t)
    for name, x, y in zip(("loss", "logprob", "entropy", "d_hidden", "d_weight", "d_bias"), got, ref):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")  # fp32 both


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_compiled_equals_eager_for_every_integer_dtype(dtype):
    """torch.compile gave IndexError for int8/int16 and a silently wrong loss for uint8 (ids used as a mask)."""
    torch._dynamo.reset()
    h, w, b, t = _problem(dtype)
    eager = _loss_and_grads(_library(), h, w, b, t)
    compiled = _loss_and_grads(torch.compile(_library(), fullgraph=True, backend="aot_eager"), h, w, b, t)
    for name, x, y in zip(("loss", "logprob", "entropy", "d_hidden", "d_weight", "d_bias"), compiled, eager):
        # the same float32 computation in both (the compiled ops run the eager implementation)
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def _uint8_out_of_range():
    """uint8 targets holding id 156 (= -100 wrapped to uint8) with a vocabulary of 100."""
    h, w, b, t = _problem(torch.uint8)
    t[3] = 156
    return h, w, b, t


@pytest.mark.parametrize("impl", IMPLS)
def test_uint8_id_equal_to_wrapped_ignore_index_is_rejected(impl):
    h, w, b, t = _uint8_out_of_range()
    with pytest.raises(ValueError, match=r"targets contain id 156, outside the vocabulary \[0, 100\)"):
        linear_cross_entropy(h, w, t, bias=b, impl=impl)
    with pytest.raises(ValueError, match=r"targets contain id 156, outside the vocabulary \[0, 100\)"):
        linear_logprobs(h, w, t, bias=b, impl=impl)


def test_uint8_id_equal_to_wrapped_ignore_index_is_rejected_under_compile():
    torch._dynamo.reset()
    h, w, b, t = _uint8_out_of_range()
    fn = torch.compile(_library(), fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match=r"targets contain id 156, outside the vocabulary \[0, 100\)"):
        fn(h, w, b, t)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16], ids=str)
def test_ignore_index_representable_in_the_dtype_is_ignored(dtype):
    """ignore_index=99 in a uint8/int16 tensor: those rows are ignored (compared as int64, equal values match)."""
    h, w, b, t = _problem(dtype, ignore_index=99)
    t[4] = 99
    got = linear_cross_entropy(h, w, t, bias=b, ignore_index=99, reduction="none")
    ref = oracle_cross_entropy(h, w, t.long(), b, ignore_index=99, reduction="none")
    assert float(got[4]) == 0.0
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
