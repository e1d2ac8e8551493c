"""Gradients whose terms cancel, against the materialized program in float64: the error must stay
at the level of float32 rounding of the *result*, not of the cancelled terms.

- dW of a bf16 head is summed over tokens in float32: a token chunk's partial sum must not be
  rounded to bf16 before it joins the accumulation (with small chunks whose partials cancel, that
  rounding made dW ~16x worse than the materialized bf16 program).
- When ``p`` is ~1 at the target, ``p * ALPHA - g`` cancels: the z-loss, label-smoothing and
  entropy terms of the target's gradient must not be formed after that cancellation (the backend
  contract's BETA is the target's excess over ALPHA, and ``p - 1`` is exact near 1).
"""

from __future__ import annotations

import pytest
import torch
from helpers import TRITON

from cce_dist import linear_cross_entropy, linear_distillation, linear_logprobs
from cce_dist.impl import torch_cross_entropy

IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON, reason="no cce_dist.kernels"))]
U32 = 2.0**-24  # unit roundoff of float32


def _exact_cross_entropy(h, w, t, *, label_smoothing=0.0, z_loss=0.0, return_lse=False, reduction="mean"):
    """The materialized loss entirely in float64 (``oracle_cross_entropy`` forms its logits and
    softmax in float32, whose own rounding near p = 1 is what these tests look at)."""
    z = h @ w.T
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    rows = -(1 - label_smoothing) * logp.gather(1, t[:, None])[:, 0] - label_smoothing * logp.mean(-1)
    rows = rows + z_loss * lse * lse
    loss = rows.sum() if reduction == "sum" else rows.mean()
    return (loss, lse) if return_lse else loss


def _exact_logprobs(h, w, t, *, return_entropy=False):
    """Target logprob and entropy entirely in float64."""
    logp = torch.log_softmax(h @ w.T, -1)
    lp = logp.gather(1, t[:, None])[:, 0]
    return (lp, -(logp.exp() * logp).sum(-1)) if return_entropy else lp


def _grads(fn, h, w, t, ups, **kw):
    """(dH, dW) of ``sum(out_k * ups[k])`` for float32 (library) or float64 (oracle) leaves."""
    h1, w1 = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    out = fn(h1, w1, t, **kw)
    outs = list(out) if isinstance(out, tuple) else [out]
    torch.autograd.backward(outs, [u.to(o.dtype).expand_as(o) for o, u in zip(outs, ups)])
    return h1.grad, w1.grad


def test_dw_token_chunk_partials_accumulate_in_float32():
    """bf16 head, V = 1, 3 tokens per chunk, chunk partials of magnitude ~3 that cancel across
    chunks: every product dz_i * h_i is exact in float32 (dz = +-1, h_i with 8 significant bits),
    so float32 accumulation of N terms is within N * u32 * sum |dz_i h_i| of the exact sum, while a
    bf16 rounding of a chunk's partial errs by up to 2^-7 (half a bf16 ulp at 3)."""
    n, d = 24, 8
    i = torch.arange(n)[:, None]
    j = torch.arange(d)[None, :]
    h = (1.0 + ((3 * i + j) % 7 + 1) * 2.0**-7).to(torch.bfloat16)  # exact in bf16
    w = torch.full((1, d), 0.125, dtype=torch.bfloat16)
    targets = torch.full((n,), -100)  # no target in the shard: dz = p * ALPHA, and p = 1 (V = 1)
    z = (h.float() @ w.float().T)[:, 0].to(torch.bfloat16).float()
    coef = torch.zeros(n, 4)
    sign = torch.where((torch.arange(n) // 3) % 2 == 0, 1.0, -1.0)  # alternate sign per chunk
    coef[:, 0] = sign  # ALPHA
    _, dw, _ = torch_cross_entropy.grads(
        h,
        w,
        None,
        targets,
        z,
        coef,
        vocab_start=0,
        softcap=None,
        temperature=1.0,
        need_hidden=False,
        need_weight=True,
        need_bias=False,
        chunk_size=3,
    )
    exact = (sign.double()[:, None] * h.double()).sum(0)
    bound = n * U32 * h.double().abs().sum(0)
    assert ((dw[0].double() - exact).abs() <= bound).all(), (dw[0] - exact).abs().max()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grad_in_forward", [None, False])  # torch: the fused-in-forward and the two-pass paths
def test_z_loss_gradient_of_a_certain_token(impl, grad_in_forward):
    """V = 1 (p = 1 exactly): the gradient is the z-loss term alone, 2*zl*lse*w. Formed from the
    coefficients without a cancellation it is float32-accurate (a few roundings: 1e-6 relative);
    formed as p*g*(1 + 2*zl*lse) - g it lost ~6e-8 absolutely (5.7e-4 relative)."""
    h = torch.tensor([[0.2352]])
    w = torch.tensor([[1.6]])
    t = torch.tensor([0])
    dh, dw = _grads(
        linear_cross_entropy, h, w, t, [torch.tensor(1.0)], z_loss=1e-4, impl=impl, grad_in_forward=grad_in_forward
    )
    rh, rw = _grads(_exact_cross_entropy, h.double(), w.double(), t, [torch.tensor(1.0)], z_loss=1e-4)
    for got, ref in ((dh, rh), (dw, rw)):
        assert ((got.double() - ref).abs() <= 1e-6 * ref.abs()).all(), (got, ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("eps", [0.2, 1e-6])
@pytest.mark.parametrize("grad_in_forward", [None, False])  # torch: the fused-in-forward and the two-pass paths
def test_label_smoothing_gradient_of_a_certain_token(impl, eps, grad_in_forward):
    """V = 1: the exact gradient is 0 (the smoothing's pull to the target and its uniform term
    cancel). The target's excess g*eps and the uniform term -g*eps/V are each one float32
    rounding of ~g*eps: half an ulp of g*eps is the most fp32 can be off. Formed after p*g - g*(1-eps),
    the error was an ulp of g (2.4e-8 * |w| at eps = 0.2), which does not shrink with eps."""
    h = torch.tensor([[0.2352]])
    w = torch.tensor([[1.6]])
    t = torch.tensor([0])
    dh, dw = _grads(
        linear_cross_entropy,
        h,
        w,
        t,
        [torch.tensor(1.0)],
        label_smoothing=eps,
        impl=impl,
        grad_in_forward=grad_in_forward,
    )
    rh, rw = _grads(_exact_cross_entropy, h.double(), w.double(), t, [torch.tensor(1.0)], label_smoothing=eps)
    for got, ref, other in ((dh, rh, w), (dw, rw, h)):
        assert ((got.double() - ref).abs() <= U32 * eps * other.double().abs()).all(), (got, ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_z_loss_smoothing_and_lse_gradient_of_a_confident_token(impl):
    """V = 3 with the other logits 30 and 35 below the target's: p_target rounds to 1 in float32
    (1 - p ~ 1e-13, far below the tolerance), so dz_target = g*(2*zl*lse + eps - eps/V) + g_lse
    (~3e-3) must be float32-accurate (1e-6 relative), as in the materialized program where each
    loss term has its own gradient; formed after p*ALPHA - g it lost ~6e-8 (2e-5 relative)."""
    h = torch.tensor([[1.0], [2.0]])
    w = torch.tensor([[0.75], [-29.25], [-34.25]])
    t = torch.tensor([0, 0])
    ups = [torch.tensor(1.0), torch.tensor([3e-4, 2e-4])]  # small g_lse: the result is the small terms
    kw = dict(z_loss=1e-3, label_smoothing=1e-3, return_lse=True, reduction="sum")
    dh, dw = _grads(linear_cross_entropy, h, w, t, ups, impl=impl, **kw)
    rh, rw = _grads(_exact_cross_entropy, h.double(), w.double(), t, ups, **kw)
    for got, ref in ((dh, rh), (dw, rw)):
        assert ((got.double() - ref).abs() <= 1e-6 * ref.abs().max()).all(), (got, ref)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("v", [1, 3])
def test_logprob_and_entropy_gradient_of_a_confident_token(impl, v):
    """Logprob + entropy with p ~ 1 at the target (V = 1: exactly; V = 3: 1 - p ~ 1e-13): the
    target's g_lp*(1 - p) is (p - 1)*ALPHA, exact, and the entropy terms are ~H ~ 1e-12; the
    remaining error is float32 rounding of the result (1e-6 relative) plus p's own rounding
    near 1 (u32 * |g|), as in the materialized float32 program."""
    h = torch.tensor([[1.0], [2.0]])
    w = torch.tensor([[0.75], [-29.25], [-34.25]])[:v]
    t = torch.tensor([0, 0])
    ups = [torch.tensor([0.7, -0.3]), torch.tensor([0.4, 0.9])]
    dh, dw = _grads(linear_logprobs, h, w, t, ups, return_entropy=True, impl=impl)
    rh, rw = _grads(_exact_logprobs, h.double(), w.double(), t, ups, return_entropy=True)
    g = 1.0  # the largest upstream gradient
    for got, ref, other in ((dh, rh, w), (dw, rw, h)):
        tol = 1e-6 * ref.abs().max() + U32 * g * other.double().abs().max() * v
        assert ((got.double() - ref).abs() <= tol).all(), (got, ref)


def _offset_problem(offset: float):
    """Float32 logits ``offset + k/64`` that every summation order computes exactly (entries of H and W are
    multiples of 1/8 below 1, the bias ``offset`` plus a multiple of 1/64), so the materialized fp32 program and the
    library see the same logits and differ only in how they normalize them. Rows 0-5 target vocab entry 0, which a
    bias of +8 makes the row's confident maximum (p ~ 0.995); rows 6-7 target an unlikely entry."""
    g = torch.Generator().manual_seed(5)
    n, v, d = 8, 16, 6
    h = torch.randint(-7, 8, (n, d), generator=g) / 8.0
    w = torch.randint(-7, 8, (v, d), generator=g) / 8.0
    b = offset + torch.randint(-32, 33, (v,), generator=g) / 64.0
    b[0] += 8.0
    t = torch.tensor([0, 0, 0, 0, 0, 0, 3, 11])
    ups = torch.randint(1, 9, (n,), generator=g) / 8.0
    return h, w, b, t, ups


def _materialized_rows(h, w, b, t, kind):
    """Per-row loss (``"ce"``) or logprob (``"lp"``) of the materialized program, in the leaves' dtype."""
    logp = torch.log_softmax(torch.nn.functional.linear(h, w, b), -1).gather(1, t[:, None])[:, 0]
    return -logp if kind == "ce" else logp


def _rows_and_grads(fn, h, w, b, t, ups):
    """``(rows, (dH, dW, db))`` of ``sum(ups * fn(h, w, b, t))`` for fresh leaves of ``h, w, b``."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (h, w, b)]
    rows = fn(*leaves, t)
    (rows * ups.to(rows.dtype)).sum().backward()
    return rows.detach(), tuple(x.grad for x in leaves)


def _assert_rows_within_2x(got, mat, exact, what) -> None:
    """Rows no farther from float64 than 2x the materialized fp32 rows, plus a floor of a few float32 roundings of
    ``log(s)``'s argument (s ~ 1 here): the two programs sum ``s`` in different orders, an ulp apart."""
    err, err_mat = float((got.double() - exact).abs().max()), float((mat.double() - exact).abs().max())
    floor = 4 * U32 * max(1.0, float(exact.abs().max()))
    assert err <= 2 * err_mat + floor, f"{what}: error {err:.3g} vs materialized fp32 {err_mat:.3g}"


def _library_rows(kind, **kw):
    if kind == "ce":
        return lambda h, w, b, t: linear_cross_entropy(h, w, t, bias=b, reduction="none", **kw)
    return lambda h, w, b, t: linear_logprobs(h, w, t, bias=b, **kw)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["ce", "lp"])
@pytest.mark.parametrize("offset", [40.0, 200.0])
@pytest.mark.parametrize("path", ["grad_in_forward", "two_pass", "compiled"])
def test_large_logits_confident_rows_keep_float32_accuracy(impl, kind, offset, path):
    """Logits ~40 and ~200 with p ~ 0.995 at the target: the float32 ``lse = m + log(s)`` is rounded at ulp(|lse|)
    (3.8e-6 / 1.5e-5), so a loss formed as ``lse - z_t`` or a gradient from ``exp(z - lse)`` carried that absolute
    error into a ~5e-3 loss and the target's ``1 - p``: the loss 20-60x and dW / db 30-85x less accurate than the
    materialized fp32 program, which normalizes as ``(z - m) - log(s)``. Loss rows and every gradient must stay
    within 2x of that program's error against float64, on every path: cross-entropy's gradient formed in forward
    (torch) or in backward, and the torch.compile custom ops."""
    if kind == "lp" and path == "grad_in_forward":
        pytest.skip("logprobs have no gradient-in-forward path")
    h, w, b, t, ups = _offset_problem(offset)
    exact_rows, exact = _rows_and_grads(
        lambda *a: _materialized_rows(*a, kind), h.double(), w.double(), b.double(), t, ups
    )
    mat_rows, mat = _rows_and_grads(lambda *a: _materialized_rows(*a, kind), h, w, b, t, ups)
    kw = dict(impl=impl)
    if kind == "ce":
        kw["grad_in_forward"] = None if path == "grad_in_forward" else False
    fn = _library_rows(kind, **kw)
    if path == "compiled":
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="eager", fullgraph=True)
    got_rows, got = _rows_and_grads(fn, h, w, b, t, ups)
    _assert_rows_within_2x(got_rows, mat_rows, exact_rows, kind)
    _assert_within_2x_of_materialized(got, mat, exact)


def _tensor_parallel_offset_body(rank, world, group, offset):
    """Each rank holds a vocab slice of :func:`_offset_problem`; the loss / logprob rows, dH and this rank's slices of
    dW and db are judged as in the single-device test. Returns the failed checks (raising between collectives would
    leave the peer waiting)."""
    from cce_dist import VocabShard

    h, w, b, t, ups = _offset_problem(offset)
    v = w.shape[0]
    start, stop = (0, v // 2 + 1) if rank == 0 else (v // 2 + 1, v)  # the confident entry 0 on rank 0 only
    failures = []
    for kind, gif in (("ce", None), ("ce", False), ("lp", None)):
        exact_rows, exact = _rows_and_grads(
            lambda *a, k=kind: _materialized_rows(*a, k), h.double(), w.double(), b.double(), t, ups
        )
        mat_rows, mat = _rows_and_grads(lambda *a, k=kind: _materialized_rows(*a, k), h, w, b, t, ups)
        kw = dict(impl="torch", shard=VocabShard(group, start, stop))
        if kind == "ce":
            kw["grad_in_forward"] = gif
        got_rows, (dh, dw, db) = _rows_and_grads(_library_rows(kind, **kw), h, w[start:stop], b[start:stop], t, ups)
        sliced = lambda g: (g[0], g[1][start:stop], g[2][start:stop])  # noqa: E731
        try:
            _assert_rows_within_2x(got_rows, mat_rows, exact_rows, kind)
            _assert_within_2x_of_materialized((dh, dw, db), sliced(mat), sliced(exact))
        except AssertionError as e:
            failures.append(f"rank {rank} {kind} grad_in_forward={gif}: {e}")
    return failures


def test_large_logits_confident_rows_keep_float32_accuracy_vocab_parallel(rank_pool):
    """The same on two ranks that each hold half the vocabulary: the global statistics are normalized the same way."""
    res = rank_pool(2).run(_tensor_parallel_offset_body, offset=40.0, timeout=300)
    assert res == {0: [], 1: []}, res


def _exact_distillation(hs, ws, ht, wt, t, *, temperature, hard_label_weight):
    """KL(p_t || p_s) at ``temperature`` (no T**2) mixed with the hard-label cross-entropy, in float64."""
    ls = torch.log_softmax(hs @ ws.T / temperature, -1)
    lt = torch.log_softmax(ht @ wt.T / temperature, -1)
    kl = (lt.exp() * (lt - ls)).sum(-1)
    ce = -torch.log_softmax(hs @ ws.T, -1).gather(1, t[:, None])[:, 0]
    return ((1 - hard_label_weight) * kl + hard_label_weight * ce).mean()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_distillation_hard_label_gradient_of_a_confident_token(temperature):
    """The student is certain of the target (p_s rounds to 1 in float32, 1 - p_s < 1e-6 at T = 2,
    < 1e-13 at T = 1), the teacher is not, and the hard label dominates (w = 0.9999): the target's
    gradient is the soft term (1 - w)*(p_s - p_t) ~ 1e-4/3; formed after (soft + w*p) - w it lost
    ~ulp(w/3) (4e-5 relative here), formed as soft + w*(p - 1) it is float32-accurate (1e-5
    relative of the largest gradient entry, which is that soft term times |h| or |w|)."""
    hs = torch.tensor([[1.0], [2.0], [1.5]])
    ws = torch.tensor([[0.75], [-29.25]])
    ht = hs.clone()
    wt = torch.tensor([[0.3], [0.1]])
    t = torch.tensor([0, 0, 0])
    kw = dict(temperature=temperature, hard_label_weight=0.9999)

    def lib(hs1, ws1, t1):
        return linear_distillation(hs1, ws1, ht, wt, t1, scale_by_temperature_squared=False, impl="torch", **kw)

    def exact(hs1, ws1, t1):
        return _exact_distillation(hs1, ws1, ht.double(), wt.double(), t1, **kw)

    dh, dw = _grads(lib, hs, ws, t, [torch.tensor(1.0)])
    rh, rw = _grads(exact, hs.double(), ws.double(), t, [torch.tensor(1.0)])
    for got, ref in ((dh, rh), (dw, rw)):
        assert ((got.double() - ref).abs() <= 1e-5 * ref.abs().max()).all(), (got, ref)


def _assert_within_2x_of_materialized(got, mat, exact, names=("dH", "dW", "db")) -> None:
    """Each of ``got`` (named by ``names``: by default dH, dW[, db]) no farther from the float64 ``exact`` than 2x the
    materialized fp32 ``mat``, plus a floor of a few float32 roundings of the largest entry (both can be exact to the
    last bit)."""
    for name, x, m, e in zip(names, got, mat, exact):
        err, err_mat = float((x.double() - e).abs().max()), float((m.double() - e).abs().max())
        floor = 4 * U32 * float(e.abs().max())
        assert err <= 2 * err_mat + floor, f"{name}: error {err:.3g} vs materialized fp32 {err_mat:.3g}"


def _softcap_logprobs(h, w, t, *, cap):
    """Target logprobs of softcapped logits, every step in the leaves' dtype (float64: exact)."""
    z = cap * torch.tanh((h @ w.T) / cap)
    return torch.log_softmax(z, -1).gather(1, t[:, None])[:, 0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cap", [0.7, 3.0])
def test_softcap_gradient_where_tanh_saturates(impl, cap):
    """Raw logits 3-9 softcaps deep: the softcap's slope ``1 - tanh^2`` is 1e-2 .. 1e-7 there, and
    formed as ``1 - t * t`` it keeps only the rounding of ``t`` (the interpreter's tanh has a few
    1e-8 of absolute error: gradients 7x less accurate than the materialized fp32 program's, found
    by the long fuzz run). Every path must stay within 2x of that program's error against float64."""
    g = torch.Generator().manual_seed(11)
    n, v, d = 6, 7, 12
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g)
    raw = h @ w.T
    h = h * (6.0 * cap / raw.abs().mean())  # raw logits ~ 6 caps on average
    t = torch.randint(0, v, (n,), generator=g)
    ups = [torch.randn(n, generator=g)]
    exact = _grads(_softcap_logprobs, h.double(), w.double(), t, ups, cap=cap)
    mat = _grads(_softcap_logprobs, h, w, t, ups, cap=cap)
    got = _grads(lambda h_, w_, t_: linear_logprobs(h_, w_, t_, softcap=cap, impl=impl), h, w, t, ups)
    _assert_within_2x_of_materialized(got, mat, exact)


def _softcap_kl(hs, ws, ht, wt, *, cap):
    """Forward KL(p_t || p_s) summed over rows, the student's logits softcapped; every step in the leaves' dtype."""
    ls = torch.log_softmax(cap * torch.tanh((hs @ ws.T) / cap), -1)
    lt = torch.log_softmax(ht @ wt.T, -1)
    return (lt.exp() * (lt - ls)).sum()


@pytest.mark.parametrize("impl", IMPLS)
def test_distillation_softcap_gradient_where_tanh_saturates(impl):
    """The distillation kernels' student softcap chain factor where the tanh saturates (raw logits ~4 caps deep):
    formed as ``1 - t * t`` it made dW 4.3x less accurate than the materialized fp32 program."""
    g = torch.Generator().manual_seed(11)
    n, v, d, cap = 6, 7, 12, 0.7
    hs, ws = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    hs = hs * (4.0 * cap / (hs @ ws.T).abs().mean())
    ht, wt = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)

    one = [torch.tensor(1.0)]  # a scalar loss: upstream gradient 1 (_grads takes targets; the KL has none)
    exact = _grads(
        lambda a, b, _: _softcap_kl(a, b, ht.double(), wt.double(), cap=cap), hs.double(), ws.double(), None, one
    )
    mat = _grads(lambda a, b, _: _softcap_kl(a, b, ht, wt, cap=cap), hs, ws, None, one)
    got = _grads(
        lambda a, b, _: linear_distillation(a, b, ht, wt, reduction="sum", softcap=(cap, None), impl=impl),
        hs,
        ws,
        None,
        one,
    )
    _assert_within_2x_of_materialized(got, mat, exact)


def _materialized_distillation(hs, ws, bs, ht, wt, bt, t, *, divergence, temperature, hard_label_weight):
    """Summed distillation loss (``T**2`` scaled, hard label mixed in, the JSD's beta = 1/2) with every step in the
    leaves' dtype: float64 is exact, float32 is the materialized program (``log_softmax`` forms ``(z - m) - log s``)."""
    z1 = hs @ ws.T + bs
    ls = torch.log_softmax(z1 / temperature, -1)
    lt = torch.log_softmax((ht @ wt.T + bt) / temperature, -1)
    if divergence == "kl":
        div = (lt.exp() * (lt - ls)).sum(-1)
    elif divergence == "reverse_kl":
        div = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logaddexp(lt, ls) - torch.log(torch.tensor(2.0, dtype=lt.dtype))  # log((p_t + p_s) / 2)
        div = 0.5 * (lt.exp() * (lt - lm)).sum(-1) + 0.5 * (ls.exp() * (ls - lm)).sum(-1)
    ce = -torch.log_softmax(z1, -1).gather(1, t[:, None])[:, 0]
    return ((1 - hard_label_weight) * temperature**2 * div + hard_label_weight * ce).sum()


def _confident_head(favourite, gaps, noise_h, noise_w, bias):
    """``(h [n, v + 1], w [v, v + 1], b [v])`` whose logits ``gap_i * [j = favourite_i] + noise_h_i * noise_w_j +
    bias_j`` are exact in float32 in any summation order (small integers and power-of-two fractions; the bias
    holds the large offset, so that no gradient is the sum of terms that large)."""
    n, v = len(favourite), len(noise_w)
    h = torch.zeros(n, v + 1)
    h[torch.arange(n), torch.tensor(favourite)] = torch.tensor(gaps)
    h[:, -1] = torch.tensor(noise_h)
    w = torch.cat([torch.eye(v), torch.tensor(noise_w)[:, None]], 1)
    return h, w, torch.tensor(bias)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("divergence", ["kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("offset", [40.0, 200.0])
# (0.75, 1.0): the hard label alone, its student logits at T = 1 held beside soft logits of a temperature
# that is not a power of two (the soft terms have weight 0, so the fp32 program's rounding of z / T does not enter)
@pytest.mark.parametrize("temperature, hard_label_weight", [(1.0, 0.0), (2.0, 0.5), (0.75, 1.0)])
def test_distillation_of_confident_heads_with_large_logits(impl, divergence, offset, temperature, hard_label_weight):
    """Every logit of both heads is ``offset`` (40 or 200) plus at most ~20, the student is confident in every
    row (p of its max entry 0.975 .. 0.9993 at the soft temperature) and the teacher in two of them, on the
    student's favourite (0.9996 and 0.995; elsewhere it leans to another entry, p 0.5 .. 0.7). The statistics round
    ``lse = m + log s`` to float32 at ulp(offset) (3.8e-6 at 40, 1.5e-5 at 200); a log-probability formed as
    ``z - lse`` (or ``exp(m - lse)``, ``lse - z_t``) carries that absolute error into p ~ 1, where the
    materialized float32 program (``(z - m) - log s``) is exact to ~1e-7. Loss and every student gradient must
    stay within 2x of that program's error against float64, plus a floor of a few float32 roundings of the
    result. (Where the heads disagree confidently, reverse KL's ``p_s (log p_s - log p_t - R)`` cancels terms
    of size R ~ 10 in every program: the teacher is not confident elsewhere, so that ulp(R) stays below the
    error looked at here.)"""
    gaps = [temperature * x for x in (5.5, 7.0, 8.5, 10.0)]  # soft gaps; exact in float32 at these T
    t_gaps = [temperature * x for x in (10.0, 2.0, 7.0, 2.5)]
    noise_w = [0.25, -0.5, 0.0, 0.75, -0.25, 0.5]
    small = [0.0, 0.125, -0.25, 0.5, -0.125, 0.25]
    hs, ws, bs = _confident_head([0, 3, 5, 1], gaps, [1.0, -2.0, 0.5, 3.0], noise_w, [offset + x for x in small])
    ht, wt, bt = _confident_head([0, 2, 5, 4], t_gaps, [-1.0, 0.5, 2.0, 1.0], noise_w[::-1], [offset] * 6)
    t = torch.tensor([0, 3, 2, 1])  # the student's favourite but in the third row
    kw = dict(divergence=divergence, temperature=temperature, hard_label_weight=hard_label_weight)

    def lib(hs1, ws1, bs1, targets):
        return linear_distillation(
            hs1, ws1, ht, wt, targets, student_bias=bs1, teacher_bias=bt, reduction="sum", impl=impl, **kw
        )

    def materialized(teacher):
        return lambda a, b, c, targets: _materialized_distillation(a, b, c, *teacher, targets, **kw)

    one = torch.tensor(1.0)  # the upstream gradient of the scalar loss
    exact = _rows_and_grads(
        materialized((ht.double(), wt.double(), bt.double())), hs.double(), ws.double(), bs.double(), t, one
    )
    mat = _rows_and_grads(materialized((ht, wt, bt)), hs, ws, bs, t, one)
    got = _rows_and_grads(lib, hs, ws, bs, t if hard_label_weight else None, one)
    _assert_within_2x_of_materialized(
        (got[0], *got[1]), (mat[0], *mat[1]), (exact[0], *exact[1]), names=("loss", "dH", "dW", "db")
    )
