"""Regression tests for the ``linear_distillation`` defects of issue 21.

Each test compares against the plain materialized program (``F.linear`` logits, the divergence
formed with torch ops; :func:`oracle.oracle_distill` (tests/oracle.py) in float64 unless said) on both
implementations (``impl="triton"`` runs in Triton's interpreter without a GPU; shapes stay tiny).
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import distill_problem
from oracle import oracle_distill

from cce_dist import linear_distillation

IMPLS = ["torch", "triton"]
DIVS = ["kl", "reverse_kl", "jsd"]
N, DS, DT, V = 10, 8, 12, 11  # V = 11: a ragged vocab tile in the kernels


# float64 draws: hidden states * 1, both heads * 0.5, biases * 1; the student's tensors are leaves that require grad
_problem = functools.partial(
    distill_problem, n=N, ds=DS, dt=DT, v=V, weight_scale=0.5, draw_dtype=torch.float64, requires_grad=True
)


def _ins(sh, sw, sb):
    return [x for x in (sh, sw, sb) if x is not None]


# ------------------------------------------------------------------------------------------------
# 1. every row ignored + an infinite upstream gradient: zero gradients, not NaN
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("div", DIVS)
@pytest.mark.parametrize("path", ["fused", "rows"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_with_infinite_upstream_gives_zero_gradients(impl, div, path, reduction):
    """``loss / num_items_in_batch`` with ``num_items_in_batch = 0``: upstream inf. The plain program's
    ignored rows get exactly zero gradient whatever the upstream value (``torch.where`` selects them out)."""
    sh, sw, sb, th, tw, tb, t = _problem()
    t[:] = -100
    kw = dict(divergence=div, reduction=reduction, hard_label_weight=0.3, impl=impl)
    kw["grad_in_forward"] = path == "fused"
    loss = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, **kw)
    ref = oracle_distill(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, divergence=div, reduction=reduction,
                         hard_label_weight=0.3)  # fmt: skip
    up = torch.tensor(math.inf)
    got = torch.autograd.grad(loss, _ins(sh, sw, sb), grad_outputs=up)
    want = torch.autograd.grad(ref, _ins(sh, sw, sb), grad_outputs=up.double())
    for a, b in zip(got, want):
        assert torch.equal(b, torch.zeros_like(b))  # the plain program
        assert torch.equal(a, torch.zeros_like(a))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("upstream", [math.inf, math.nan])
def test_ignored_rows_stay_zero_under_a_non_finite_upstream(impl, upstream):
    """Some rows counted: the ignored rows' hidden gradient is still exactly 0 (the plain program's)."""
    sh, sw, sb, th, tw, tb, t = _problem()
    t[[1, 4, 7]] = -100
    loss = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, impl=impl)
    (dh,) = torch.autograd.grad(loss, [sh], grad_outputs=torch.tensor(upstream))
    assert torch.equal(dh[[1, 4, 7]], torch.zeros(3, DS))
    assert not torch.isfinite(dh[0]).all()  # the counted rows do take the non-finite factor


# ------------------------------------------------------------------------------------------------
# 2. hard-label gradient at a small temperature (torch path: p1 formed from exp(z/T - m) ** T)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperature", [0.05, 0.1])
@pytest.mark.parametrize("div", ["kl", "reverse_kl"])
def test_hard_label_gradient_at_small_temperature(impl, temperature, div):
    """w=1: the loss is the cross-entropy at T=1 whatever T; its gradient ``p1 - onehot`` must not
    depend on T. exp(z/T - m) underflows in float32 at z - max < -87 T (-4.4 at T=0.05), where p1 is
    still ~1e-2 of the max's: the T=1 probabilities are formed from the T=1 logits. Large V: that mass
    is most of the row's. float32 against float64: logits of |z| ~ 10 rounded at 2**-24 relative (1e-6
    relative in each p1) and 32000-term float32 sums: 1e-4 per entry, 1e-5 of the largest entry absolute
    (the old torch path was off by 6% at T=0.05)."""
    v = 2000 if impl == "triton" else 32000  # the interpreter: smaller, still most of the mass underflows
    sh, sw, sb, th, tw, tb, t = _problem(seed=1, n=4, v=v, hidden_scale=2.0)
    kw = dict(divergence=div, temperature=temperature, hard_label_weight=1.0, reduction="sum")
    loss = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, impl=impl, **kw)
    ref = oracle_distill(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, **kw)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=0)
    got = torch.autograd.grad(loss, _ins(sh, sw, sb))
    want = torch.autograd.grad(ref, _ins(sh, sw, sb))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5 * b.abs().max().item())


# ------------------------------------------------------------------------------------------------
# 3. create_graph=True: refused clearly on every path (never a gradient without its graph)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(grad_in_forward=False), dict(reduction="none"), dict(reduction="sum")],
    ids=["default", "no_fused", "none", "sum"],
)
def test_create_graph_is_refused(impl, kw):
    sh, sw, sb, th, tw, tb, t = _problem()
    loss = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, impl=impl, **kw)
    if loss.dim():
        loss = loss.sum()
    with pytest.raises(RuntimeError, match="second-order gradients"):
        torch.autograd.grad(loss, [sh, sw], create_graph=True)


# ------------------------------------------------------------------------------------------------
# 4. fp16 student under loss scaling
# ------------------------------------------------------------------------------------------------


def _plain_fp16(sh, sw, sb, th, tw, tb, t, scale):
    """The plain fp16 program: fp16 logits (F.linear), the divergence in float32, GradScaler's scaled backward."""
    zs = F.linear(sh, sw, sb).float()
    zt = F.linear(th, tw, tb).float()
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    loss = (lt.exp() * (lt - ls)).sum(-1).mean()
    return torch.autograd.grad(loss * scale, [sh, sw, sb])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("log2_scale", [10, 16])
def test_fp16_student_under_loss_scaling(impl, log2_scale):
    """GradScaler's ``(loss * 2**k).backward()`` of the mean over 2048 rows: the gradients held from forward must
    not be formed at the mean's 1/N scale in fp16 (subnormal: flushed entries) nor multiplied in fp16 (inf at
    2**16). Against float64: no less accurate than the plain fp16 program (fp16 logits, float32 divergence,
    fp16 gradients), and within one fp16 rounding of the recomputing backward's (``grad_in_forward=False``:
    its per-row upstream gradient 2**k / N is a power of two, so only the logit gradients' rounding to fp16
    before the products differs, where they are subnormal at one of the two scales)."""
    n = 2048
    sh, sw, sb, th, tw, tb, t = _problem(seed=2, n=n, student_dtype=torch.float16, hidden_scale=0.5)
    scale = 2.0**log2_scale
    got, rows = (
        torch.autograd.grad(
            linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, impl=impl, grad_in_forward=f)
            * scale,
            [sh, sw, sb],
        )
        for f in (True, False)
    )
    exact = [x.detach().double().requires_grad_() for x in (sh, sw, sb)]  # the fp16 values, float64 program
    ref = oracle_distill(*exact[:2], th, tw, t, student_bias=exact[2], teacher_bias=tb)
    want = torch.autograd.grad(ref * scale, exact)
    plain = _plain_fp16(sh, sw, sb, th, tw, tb, t, scale)
    for name, a, r, b, p in zip(("dh", "dw", "db"), got, rows, want, plain):
        assert a.dtype == torch.float16
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, r, rtol=2**-9, atol=2**-24, msg=name)  # one fp16 rounding apart at most
        err, plain_err = ((x.double() - b).norm().item() for x in (a, p))
        assert err <= 1.5 * plain_err, (name, err, plain_err)


# ------------------------------------------------------------------------------------------------
# 5. a -inf bias entry (a masked token)
# ------------------------------------------------------------------------------------------------


def _masked(head, div, impl, reduction="none", hard=0.0):
    sh, sw, sb, th, tw, tb, t = _problem(seed=3)
    masked_b = (sb if head == "student" else tb).detach().clone()
    masked_b[[2, 7]] = -math.inf
    t[t == 2] = 0
    t[t == 7] = 0  # no target on a masked token (its cross-entropy would be inf, as in the plain program)
    if head == "student":
        sb = masked_b.requires_grad_()
    else:
        tb = masked_b
    kw = dict(divergence=div, reduction=reduction, hard_label_weight=hard)
    loss = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, impl=impl, **kw)
    # the plain program's limit: -1e4 for -inf (float64: exp(-1e4 - max) is 0, so p log p is 0 * finite)
    lim_s = None if sb is None else torch.where(torch.isinf(sb), -1e4, sb.double()).detach().requires_grad_()
    lim_t = torch.where(torch.isinf(tb), -1e4, tb.double())
    ref = oracle_distill(sh, sw, th, tw, t, student_bias=lim_s, teacher_bias=lim_t, **kw)
    return (sh, sw, sb, lim_s), loss, ref


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "head,div", [("teacher", "kl"), ("teacher", "jsd"), ("student", "reverse_kl"), ("student", "jsd")]
)
@pytest.mark.parametrize("hard", [0.0, 0.25])
def test_masked_token_gives_the_finite_divergence(impl, head, div, hard):
    """``p log p`` with ``p = 0`` is 0: the divergence of the masked token's column is 0 where it is finite."""
    (sh, sw, sb, lim_s), loss, ref = _masked(head, div, impl, hard=hard)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=2e-6)
    up = torch.randn(N, generator=torch.Generator().manual_seed(5))
    got = torch.autograd.grad(loss, [sh, sw, sb], grad_outputs=up)
    want = torch.autograd.grad(ref, [sh, sw, lim_s], grad_outputs=up.double())
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b.double(), rtol=2e-5, atol=2e-6)
    if head == "student":  # the masked logits' gradient is exactly 0
        assert torch.equal(got[2][[2, 7]], torch.zeros(2))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("head,div", [("student", "kl"), ("teacher", "reverse_kl")])
def test_masked_token_with_mass_on_the_other_side_is_inf(impl, head, div):
    """Teacher mass on a student-masked token (forward KL), student mass on a teacher-masked one (reverse KL):
    the plain program's divergence is +inf, and so is ours (not NaN)."""
    _, loss, _ = _masked(head, div, impl)
    assert torch.equal(loss, torch.full_like(loss, math.inf))


# ------------------------------------------------------------------------------------------------
# 9. no inf - inf in discarded lanes of the kernels (python -W error in the interpreter)
# ------------------------------------------------------------------------------------------------


#: masked tokens per divergence where its value stays finite: token 5 masked in both heads, and 2 (student) / 9
#: (teacher) where the other head's mass does not make the divergence infinite
FINITE_MASKS = {"kl": ([5], [5, 9]), "reverse_kl": ([2, 5], [5]), "jsd": ([2, 5], [5, 9])}


@pytest.mark.parametrize("div", DIVS)
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_triton_kernels_raise_no_floating_point_warning(div, temperature):
    """Masked (-inf bias) tokens (one in both heads) and a ragged vocab tile (V = 11): the interpreter's numpy
    warns on ``inf - inf`` / ``0 * inf`` in lanes the kernels discard (RuntimeWarning, an error under ``-W error``).
    The loss and gradients are finite and those of the materialized program's limit (-1e4 for -inf)."""
    sh, sw, sb, th, tw, tb, t = _problem(seed=4)
    s_mask, t_mask = FINITE_MASKS[div]
    with torch.no_grad():
        sb[s_mask] = -math.inf
    tb[t_mask] = -math.inf
    t[(t == 2) | (t == 5)] = 0
    kw = dict(divergence=div, temperature=temperature, hard_label_weight=0.25, reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, impl="triton", **kw)
        got = torch.autograd.grad(loss, [sh, sw, sb])
    lim_s = torch.where(torch.isinf(sb), -1e4, sb.double()).detach().requires_grad_()
    lim_t = torch.where(torch.isinf(tb), -1e4, tb.double())
    ref = oracle_distill(sh, sw, th, tw, t, student_bias=lim_s, teacher_bias=lim_t, **kw)
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=2e-6)
    for a, b in zip(got, torch.autograd.grad(ref, [sh, sw, lim_s])):
        torch.testing.assert_close(a.double(), b.double(), rtol=2e-5, atol=2e-6)
