"""row_outputs=: the predicted token, is_top1, log sum p^2 and the mean logit, against the materialized program.

Each output is checked against the oracle's logits (tests/oracle.py: the same rounding to the compute dtype) for
cross-entropy and logprobs, with softcap, temperature, ignored rows, a -inf bias entry and exact ties (integer
logits, so that a tie is a tie whatever the summation order): the predicted token must be the lowest id among the
maxima, as torch.argmax. The loss, the other outputs and every gradient must be exactly those of the same call
without row_outputs. Tensor parallelism (both statistics collectives, ties across shards, sequence parallelism) is
checked against one process in tests/test_row_outputs_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TRITON, integer_problem
from oracle import oracle_logits

from cce_dist import ROW_OUTPUTS, RowOutputs, linear_cross_entropy, linear_logprobs
from cce_dist.core import stats as S
from cce_dist.tp.collectives import from_max_id_key, max_id_key

ALL = ROW_OUTPUTS


def _oracle(h, w, t, b=None, *, softcap=None, temperature=1.0, ignore_index=-100):
    z = oracle_logits(h, w, b, softcap=softcap, temperature=temperature, dtype=w.dtype).double()
    valid = t != ignore_index
    pred = torch.where(valid, z.argmax(-1), -1)
    p = torch.softmax(z, -1)
    zero = torch.zeros((), dtype=torch.float64)
    return z, RowOutputs(
        predicted=pred,
        is_top1=valid & (pred == t),
        log_sum_sq_probs=torch.where(valid, (p * p).sum(-1).log(), zero),
        mean_logit=torch.where(valid, z.mean(-1), zero),
    )


def _check(got: RowOutputs, want: RowOutputs, z: torch.Tensor, names=ALL):
    for name in ALL:
        if name not in names:
            assert getattr(got, name) is None, name
    if "predicted" in names:
        assert got.predicted.dtype == torch.int64
        assert torch.equal(got.predicted, want.predicted), (got.predicted, want.predicted)
    if "is_top1" in names:
        assert got.is_top1.dtype == torch.bool
        assert torch.equal(got.is_top1, want.is_top1)
    # float32 statistics of float32 logits: a few float32 ulps of log V / |z|
    if "log_sum_sq_probs" in names:
        torch.testing.assert_close(got.log_sum_sq_probs.double(), want.log_sum_sq_probs, rtol=1e-5, atol=1e-5)
    if "mean_logit" in names:
        torch.testing.assert_close(got.mean_logit.double(), want.mean_logit, rtol=1e-5, atol=1e-5 * z.abs().max())


IMPLS = ["torch"] + (["triton"] if TRITON else [])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_cross_entropy_row_outputs_match_the_materialized_program(impl, softcap):
    h, w, t = integer_problem()
    b = torch.zeros(w.shape[0])
    b[7] = float("-inf")  # a masked token
    h = h.requires_grad_()
    loss, got = linear_cross_entropy(h, w, t, bias=b, softcap=softcap, impl=impl, reduction="sum", row_outputs=ALL)
    z, want = _oracle(h.detach(), w, t, b, softcap=softcap)
    _check(got, want, z)
    assert bool(got.predicted[:4].eq(3).all())  # the tie resolves to the lower id
    assert bool(got.is_top1[0]) and not bool(got.is_top1[1])
    (gh,) = torch.autograd.grad(loss, [h])
    h2 = h.detach().clone().requires_grad_()
    plain = linear_cross_entropy(h2, w, t, bias=b, softcap=softcap, impl=impl, reduction="sum")
    (gh2,) = torch.autograd.grad(plain, [h2])
    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=0)  # the same loss, scheduled without grads in forward
    torch.testing.assert_close(gh, gh2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("names", [ALL, ("is_top1",), ("log_sum_sq_probs", "mean_logit"), "predicted"])
def test_logprob_row_outputs_of_the_tempered_distribution(impl, names):
    h, w, t = integer_problem(seed=1)
    (lp, ent), got = linear_logprobs(
        h, w, t, temperature=0.7, softcap=6.0, return_entropy=True, impl=impl, row_outputs=names
    )
    z, want = _oracle(h, w, t, softcap=6.0, temperature=0.7)
    _check(got, want, z, (names,) if isinstance(names, str) else names)
    lp2, ent2 = linear_logprobs(h, w, t, temperature=0.7, softcap=6.0, return_entropy=True, impl=impl)
    assert torch.equal(lp, lp2) and torch.equal(ent, ent2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_outputs_in_low_precision_use_the_rounded_logits(dtype):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(20, 16, generator=g).to(dtype)
    w = torch.randn(40, 16, generator=g).to(dtype)
    t = torch.randint(0, 40, (20,), generator=g)
    lp, got = linear_logprobs(h, w, t, row_outputs=ALL)
    z, want = _oracle(h, w, t)
    top = z.max(-1).values
    # the predicted token is a maximum of the rounded logits (ties among rounded values: the lowest of them)
    assert torch.equal(z.gather(1, got.predicted[:, None])[:, 0], top)
    assert torch.equal(got.predicted, want.predicted)
    torch.testing.assert_close(got.log_sum_sq_probs.double(), want.log_sum_sq_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.mean_logit.double(), want.mean_logit, rtol=1e-5, atol=1e-5)


def test_row_outputs_are_not_differentiable_and_keep_the_shape():
    h, w, t = integer_problem()
    h = h.reshape(4, 6, -1).requires_grad_()
    t = t.reshape(4, 6)
    loss, got = linear_cross_entropy(h, w, t, reduction="none", row_outputs=ALL)
    for name in ALL:
        out = getattr(got, name)
        assert out.shape == (4, 6) and not out.requires_grad, name
    loss.sum().backward()  # the outputs add nothing to the graph


def test_module_form_and_options_take_row_outputs():
    from cce_dist import CrossEntropyOptions, LinearCrossEntropy

    assert CrossEntropyOptions(row_outputs=["mean_logit", "predicted", "predicted"]).row_outputs == (
        "predicted",
        "mean_logit",
    )
    h, w, t = integer_problem()
    loss, got = LinearCrossEntropy(row_outputs="is_top1")(h, w, t)
    assert got.is_top1 is not None and got.predicted is None


@pytest.mark.parametrize("bad", ["accuracy", ("predicted", "top5"), 3])
def test_unknown_row_outputs_are_refused_naming_the_option(bad):
    h, w, t = integer_problem()
    with pytest.raises((TypeError, ValueError), match="row_outputs"):
        linear_cross_entropy(h, w, t, row_outputs=bad)
    with pytest.raises((TypeError, ValueError), match="row_outputs"):
        linear_logprobs(h, w, t, row_outputs=bad)


@pytest.mark.parametrize("kind", ["ce", "logprobs"])
def test_row_outputs_under_torch_compile_equal_eager(kind):
    h, w, t = integer_problem(seed=2)
    h = h.requires_grad_()

    def f(h, w, t):
        if kind == "ce":
            return linear_cross_entropy(h, w, t, softcap=5.0, row_outputs=ALL)
        return linear_logprobs(h, w, t, temperature=0.5, row_outputs=ALL)

    (a, got), (b, want) = torch.compile(f, backend="aot_eager", fullgraph=True)(h, w, t), f(h, w, t)
    torch.testing.assert_close(a, b)
    for name in ALL:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    (ga,) = torch.autograd.grad(a.sum(), [h])
    (gb,) = torch.autograd.grad(b.sum(), [h])
    torch.testing.assert_close(ga, gb)


# ----------------------------------------------------------------------------------------------
# the statistics: combining slices keeps the larger max and, on a tie, the lower id
# ----------------------------------------------------------------------------------------------


def test_combine_keeps_the_lowest_id_of_the_max_in_any_order():
    a, b, c = (S.empty_stats(3) for _ in range(3))
    for st, m, i in (
        (a, [1.0, 2.0, 5.0], [4, 0, 9]),
        (b, [1.0, 3.0, 5.0], [2, 7, 12]),
        (c, [0.5, 3.0, 5.0], [1, 6, 3]),
    ):
        st[:, S.MAX] = torch.tensor(m)
        st[:, S.ARGMAX] = torch.tensor(i, dtype=torch.float32)
        st[:, S.SUMEXP] = 1.0
    want = torch.tensor([2.0, 6.0, 3.0])
    for order in ((a, b, c), (c, b, a), (b, a, c)):
        assert torch.equal(S.combine_stack(torch.stack(order))[:, S.ARGMAX], want)
        assert torch.equal(S.combine(S.combine(order[0], order[1]), order[2])[:, S.ARGMAX], want)


def test_max_id_key_orders_by_max_then_lower_id_and_round_trips():
    m = torch.tensor([-2.0, -1.0, 0.0, -0.0, 3.5, float("-inf"), float("inf"), 1e-30, -1e30, 7.0, 7.0])
    ids = torch.tensor([5.0, 7.0, 0.0, 1.0, 2**24 - 1, float("inf"), 3.0, 4.0, 9.0, 8.0, 2.0])
    key = max_id_key(m, ids)
    back_m, back_ids = from_max_id_key(key)
    assert torch.equal(back_m, m) and torch.equal(back_ids, ids)
    order = torch.argsort(key)
    assert torch.equal(m[order], torch.sort(m, stable=True).values)
    assert int(ids[9 + int(key[9:].argmax())]) == 2  # 7.0 twice: the lower id has the larger key
    assert int(from_max_id_key(torch.maximum(max_id_key(m[3:4], ids[3:4]), max_id_key(m[2:3], ids[2:3])))[1]) == 0
