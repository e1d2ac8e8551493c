"""Property-based fuzzing of every public entry point against the materialized oracle.

Single process (hypothesis): ``linear_cross_entropy``, ``LinearCrossEntropy`` and
``linear_logprobs`` on random shapes (N = 0 and 1, V = 1, V smaller than a chunk, V and D not a
multiple of anything, batched ``[B, T]`` targets), dtypes (fp32 / bf16 / fp16 heads, mixed
hidden dtypes), every option (reduction, label smoothing, z-loss, softcap, temperature, shift,
ignore_index incl. an in-vocab one, all-ignored rows, chunk sizes down to one logit, the
grad-in-forward schedule, return_lse / return_entropy, filter_eps, deterministic), random
upstream gradients and random subsets of inputs requiring grad; for the torch implementation and
the Triton kernels in the interpreter (tiny shapes there: the interpreter is slow). Each example
checks outputs and gradients against ``tests/oracle.py`` (forward, backward, dtypes, shapes) and
that no input was written in place.

Sharded (gloo): one spawn of 3 ranks runs a fixed list of seeded random cases (hypothesis inside
spawned children is awkward): random uneven layouts (empty shards included), N (0 and 1
included), V, D, dtypes, options, sequence parallelism, ``reduce_hidden_grad``, both statistics
collectives, both implementations; every rank checks its loss / lse / logprobs / entropy and its
dW / db slice and dH against the oracle, and that all ranks got bitwise the same loss.

Budget. CI runs a fixed number of examples, derandomized (the same examples every run) and
without deadlines. Long mode: ``CCE_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py`` sets the
example count of every single-process property to that number (and scales the sharded cases with
it) and draws fresh random examples (``derandomize=False``; hypothesis prints a reproducer blob
for any failure).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from dist_utils import run_ranks
from fuzz_common import (
    CHECKED,
    DTYPES,
    EPS,
    LONG,
    backward_grads,
    exact_grads,
    fuzz_settings,
    grad_report,
    grad_tol,
    leaves,
    needs_triton,
    store_rounding_tol,
)
from helpers import TRITON, close_report
from oracle import oracle_cross_entropy, oracle_logits, oracle_logprobs, shift_targets

hyp = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cce_dist import ROW_OUTPUTS, LinearCrossEntropy, VocabShard, linear_cross_entropy, linear_logprobs  # noqa: E402

# examples per property in CI (the README's Reliability figures: python -m benchmarks.reliability_counts)
CI_TORCH_CE = 120
CI_TORCH_LP = 80
CI_TRITON_CE = 14
CI_TRITON_LP = 8
CI_TORCH_ROWS = 40
CI_TRITON_ROWS = 6
CI_SHARDED_TORCH = 70  # per spawn, every rank runs all of them
CI_SHARDED_TRITON = 4


# ----------------------------------------------------------------------------------------------
# case generation
# ----------------------------------------------------------------------------------------------


@st.composite
def problems(draw, *, max_n=40, max_d=24, max_v=70, low_precision=True, small=False):
    """(hidden, weight, bias, targets, meta) of a random problem (targets may hold ignore_index)."""
    if small:
        n = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 9]))
        d = draw(st.integers(1, max_d))
        v = draw(st.sampled_from([1, 2, 3, 7, 16, 31, 33, 40]))
    else:
        n = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(0, max_n)))
        d = draw(st.one_of(st.sampled_from([1, 2, 3]), st.integers(1, max_d)))
        v = draw(st.one_of(st.sampled_from([1, 2, 3]), st.integers(1, max_v)))
    batched = draw(st.booleans()) and n > 0 and n % 2 == 0
    shape = (2, n // 2) if batched else (n,)
    wdtype = draw(st.sampled_from(DTYPES)) if low_precision else torch.float32
    hdtype = draw(st.sampled_from([wdtype, torch.float32, torch.bfloat16])) if low_precision else torch.float32
    use_bias = draw(st.booleans())
    scale = draw(st.sampled_from([0.05, 0.5, 1.0, 3.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(*shape, d, generator=g) * scale).to(hdtype)
    w = (torch.randn(v, d, generator=g) / math.sqrt(d) * 2).to(wdtype)
    # A common offset of the logits (through the bias) leaves the softmax unchanged but makes |lse| large: the
    # float32 lse is then rounded at ulp(|lse|), which the library must not let into the loss or p.
    offset = draw(st.sampled_from([0.0, 0.0, 0.0, 40.0, -60.0])) if use_bias else 0.0
    b = (torch.randn(v, generator=g) * 0.5 + offset).to(wdtype) if use_bias else None
    ignore_index = draw(st.sampled_from([-100, -1, 0] if v > 1 else [-100, -1]))
    ignore_mode = draw(st.sampled_from(["none", "some", "some", "all"]))
    t = torch.randint(0, v, shape, generator=g)
    if ignore_mode == "some":
        t = torch.where(torch.rand(shape, generator=g) < 0.3, torch.full_like(t, ignore_index), t)
    elif ignore_mode == "all":
        t = torch.full_like(t, ignore_index)
    if draw(st.booleans()):
        t = t.to(torch.int32)
    need = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    return (
        h,
        w,
        b,
        t,
        dict(
            n=n, d=d, v=v, ignore_index=ignore_index, need=need, seed=seed, wdtype=wdtype, hdtype=hdtype, offset=offset
        ),
    )


def _compute_dtype(h, w):
    return w.dtype


def _logit_bound(h, w, b):
    """max |raw logit| (a cheap bound for tolerances), computed in fp32."""
    if h.numel() == 0 or w.numel() == 0:
        return 0.0
    z = h.reshape(-1, h.shape[-1]).float() @ w.float().t()
    if b is not None:
        z = z + b.float()
    return float(z.abs().max())


def fwd_tol(dtype, zmax, *, z_loss=0.0, v=1, n_sum=1):
    e = EPS[dtype] if dtype != torch.float32 else 2e-6
    lse_mag = zmax + math.log(max(v, 1)) + 1
    base = 4 * e * (1 + lse_mag) * (1 + 2 * z_loss * lse_mag)
    return base * n_sum, 4 * e


# ----------------------------------------------------------------------------------------------
# single-process properties
# ----------------------------------------------------------------------------------------------


def _class_weight(mode: str | None, v: int, m: dict) -> torch.Tensor | None:
    """class_weight= of a fuzz case: None, random in [0.25, 2.25), the same with a third of the classes at 0 (some
    targets may weigh nothing, or all of them), or all ones (the unweighted loss)."""
    if mode is None:
        return None
    if mode == "ones":
        return torch.ones(v)
    g = torch.Generator().manual_seed(m["seed"] + 7)
    w = torch.rand(v, generator=g) * 2 + 0.25
    if mode == "some zero":
        w = torch.where(torch.rand(v, generator=g) < 1 / 3, 0.0, w)
    return w


def check_cross_entropy(data, impl: str, small: bool):
    h, w, b, t, m = data.draw(problems(small=small, low_precision=True), label="problem")
    n, v = m["n"], m["v"]
    reduction = data.draw(st.sampled_from(["mean", "sum", "none"]), label="reduction")
    eps = data.draw(st.sampled_from([0.0, 0.0, 0.1, 1.0]) | st.floats(0, 1), label="label_smoothing")
    zl = data.draw(st.sampled_from([0.0, 0.0, 1e-4, 0.1]), label="z_loss")
    softcap = data.draw(st.sampled_from([None, None, 0.7, 5.0, 30.0]), label="softcap")
    shift = data.draw(st.sampled_from([False, True, 0, 2]), label="shift")
    chunk = data.draw(st.sampled_from([1, 3, max(v - 1, 1), 64, None]), label="chunk")
    gif = data.draw(st.sampled_from([None, False, True]), label="grad_in_forward")
    ret_lse = data.draw(st.booleans(), label="return_lse")
    module = data.draw(st.booleans(), label="module form")
    cw = _class_weight(
        data.draw(st.sampled_from([None, None, "rand", "some zero", "ones"]), label="class_weight"), v, m
    )
    extra = {}
    if impl == "triton":
        extra["filter_eps"] = data.draw(st.sampled_from([None, None, "auto"]), label="filter_eps")
        extra["deterministic"] = data.draw(st.booleans(), label="deterministic")
    kw = dict(
        ignore_index=m["ignore_index"],
        reduction=reduction,
        label_smoothing=eps,
        z_loss=zl,
        softcap=softcap,
        shift=shift,
        impl=impl,
        return_lse=ret_lse,
        chunk_size=chunk,
        grad_in_forward=gif,
        **extra,
    )
    h1, w1, b1 = leaves(h, w, b, need=m["need"])
    h2, w2, b2 = leaves(h, w, b, need=m["need"])
    before = [x.clone() for x in (h, w, t)] + ([b.clone()] if b is not None else [])
    if module:
        out = LinearCrossEntropy(**kw)(h1, w1, t, b1, class_weight=cw)
    else:
        out = linear_cross_entropy(h1, w1, t, bias=b1, class_weight=cw, **kw)
    cd = _compute_dtype(h, w)

    def oracle(h_, w_, b_, dtype, contract=None):
        return oracle_cross_entropy(
            h_,
            w_,
            t,
            b_,
            ignore_index=m["ignore_index"],
            reduction=reduction,
            label_smoothing=eps,
            z_loss=zl,
            softcap=softcap,
            shift=shift,
            dtype=dtype,
            return_lse=True,
            contract=contract,
            class_weight=cw,
        )

    ref = oracle(h2, w2, b2, cd)
    loss, lse = out if ret_lse else (out, None)
    rloss, rlse = ref
    fails = []
    tshape = tuple(t.shape)
    if loss.dtype != torch.float32:
        fails.append(f"loss dtype {loss.dtype}")
    if tuple(loss.shape) != (tshape if reduction == "none" else ()):
        fails.append(f"loss shape {tuple(loss.shape)}")
    zmax = _logit_bound(h, w.to(cd), None if b is None else b.to(cd))
    if softcap is not None:
        zmax = min(zmax, softcap)
    atol, rtol = fwd_tol(cd, zmax, z_loss=zl, v=v, n_sum=max(n, 1) if reduction == "sum" else 1)
    if cw is not None:  # the rows scale by weights up to 2.25 (and the mean divides by at least 0.25)
        atol *= 9.0
    r = close_report(loss, rloss, atol, rtol)
    if r:
        fails.append(f"loss: {r}")
    if ret_lse:
        if lse.dtype != torch.float32 or tuple(lse.shape) != tshape:
            fails.append(f"lse dtype/shape {lse.dtype} {tuple(lse.shape)}")
        elif r := close_report(lse, rlse, *fwd_tol(cd, zmax, v=v)):
            fails.append(f"lse: {r}")
    # upstream gradients: a random scalar / per-token tensor for the loss, per-token for the lse
    g = torch.Generator().manual_seed(m["seed"] + 1)
    gl = (
        torch.randn(rloss.shape, generator=g)
        if reduction == "none"
        else torch.tensor(float(torch.rand(1, generator=g)) + 0.5)
    )
    gs = torch.randn(rlse.shape, generator=g)
    outs = [loss] + ([lse] if ret_lse else [])
    refs = [rloss] + ([rlse] if ret_lse else [])
    ups = [gl] + ([gs] if ret_lse else [])
    if any(o.requires_grad for o in refs):
        got = backward_grads(outs, (h1, w1, b1), ups)
        want = backward_grads(refs, (h2, w2, b2), ups)
        exact = exact_grads(oracle, len(outs), (h, w, b), m["need"], ups)
        contract_exact = exact_grads(oracle, len(outs), (h, w, b), m["need"], ups, contract=cd)
        for i, (name, x, y, src) in enumerate(zip("hwb", got, want, (h, w, b))):
            if y is None:
                if x is not None:
                    fails.append(f"d{name} given but not wanted")
                continue
            if x is None:
                fails.append(f"d{name} missing")
                continue
            if x.dtype != src.dtype:
                fails.append(f"d{name} dtype {x.dtype} != {src.dtype}")
            lowp = cd if cd != torch.float32 else src.dtype
            tol = grad_tol(lowp, y) * (1 + 2 * zl * (zmax + math.log(max(v, 1)) + 1)) + store_rounding_tol(
                lowp, src.dtype, y
            )
            if r := grad_report(x, y, tol, lambda i=i: exact(i), lambda i=i: contract_exact(i)):
                fails.append(f"d{name}: {r}")
    after = [h, w, t] + ([b] if b is not None else [])
    if not all(torch.equal(a, c) for a, c in zip(before, after)):
        fails.append("an input was modified in place")
    assert not fails, (
        f"{impl} cross-entropy {kw} class_weight={cw} n={n} v={v} d={m['d']} dtypes={m['hdtype']}/{m['wdtype']}: "
        + "; ".join(fails)
    )
    CHECKED[f"{impl} cross-entropy"] += 1


def check_logprobs(data, impl: str, small: bool):
    h, w, b, t, m = data.draw(problems(small=small, low_precision=True), label="problem")
    n, v = m["n"], m["v"]
    softcap = data.draw(st.sampled_from([None, None, 0.7, 5.0]), label="softcap")
    temp = data.draw(st.sampled_from([1.0, 1.0, 0.3, 2.5]), label="temperature")
    shift = data.draw(st.sampled_from([False, True, 3]), label="shift")
    ret_ent = data.draw(st.booleans(), label="return_entropy")
    chunk = data.draw(st.sampled_from([1, 5, 64, None]), label="chunk")
    extra = {}
    if impl == "triton":
        extra["filter_eps"] = data.draw(st.sampled_from([None, None, "auto"]), label="filter_eps")
        extra["deterministic"] = data.draw(st.booleans(), label="deterministic")
    kw = dict(
        ignore_index=m["ignore_index"],
        softcap=softcap,
        temperature=temp,
        shift=shift,
        impl=impl,
        return_entropy=ret_ent,
        chunk_size=chunk,
        **extra,
    )
    h1, w1, b1 = leaves(h, w, b, need=m["need"])
    h2, w2, b2 = leaves(h, w, b, need=m["need"])
    out = linear_logprobs(h1, w1, t, bias=b1, **kw)
    cd = _compute_dtype(h, w)

    def oracle(h_, w_, b_, dtype, contract=None):
        return oracle_logprobs(
            h_,
            w_,
            t,
            b_,
            ignore_index=m["ignore_index"],
            softcap=softcap,
            temperature=temp,
            shift=shift,
            dtype=dtype,
            return_entropy=True,
            contract=contract,
        )

    rlp, rent = oracle(h2, w2, b2, cd)
    lp, ent = out if ret_ent else (out, None)
    fails = []
    zmax = _logit_bound(h, w.to(cd), None if b is None else b.to(cd))
    if softcap is not None:
        zmax = min(zmax, softcap)
    zmax /= temp
    atol, rtol = fwd_tol(cd, zmax, v=v)
    if lp.dtype != torch.float32 or tuple(lp.shape) != tuple(t.shape):
        fails.append(f"logprobs dtype/shape {lp.dtype} {tuple(lp.shape)}")
    elif r := close_report(lp, rlp, atol, rtol):
        fails.append(f"logprobs: {r}")
    if bool((lp > 0).any()):
        fails.append("a positive logprob")
    if ret_ent:
        if r := close_report(ent, rent, atol, rtol):
            fails.append(f"entropy: {r}")
    g = torch.Generator().manual_seed(m["seed"] + 2)
    g1, g2 = torch.randn(rlp.shape, generator=g), torch.randn(rlp.shape, generator=g)
    outs, refs, ups = [lp], [rlp], [g1]
    if ret_ent:
        outs, refs, ups = [lp, ent], [rlp, rent], [g1, g2]
    if any(o.requires_grad for o in refs):
        got = backward_grads(outs, (h1, w1, b1), ups)
        want = backward_grads(refs, (h2, w2, b2), ups)
        exact = exact_grads(oracle, len(outs), (h, w, b), m["need"], ups)
        contract_exact = exact_grads(oracle, len(outs), (h, w, b), m["need"], ups, contract=cd)
        for i, (name, x, y, src) in enumerate(zip("hwb", got, want, (h, w, b))):
            if y is None:
                continue
            if x is None:
                fails.append(f"d{name} missing")
                continue
            if x.dtype != src.dtype:
                fails.append(f"d{name} dtype {x.dtype} != {src.dtype}")
            lowp = cd if cd != torch.float32 else src.dtype
            # entropy gradients carry a factor |z|: scale the tolerance with the logit range
            tol = grad_tol(lowp, y) * (1 + (zmax if ret_ent else 0.0)) + store_rounding_tol(lowp, src.dtype, y)
            if r := grad_report(x, y, tol, lambda i=i: exact(i), lambda i=i: contract_exact(i)):
                fails.append(f"d{name}: {r}")
    assert not fails, f"{impl} logprobs {kw} n={n} v={v} d={m['d']} dtypes={m['hdtype']}/{m['wdtype']}: " + "; ".join(
        fails
    )
    CHECKED[f"{impl} logprobs"] += 1


def check_row_outputs(data, impl: str):
    """row_outputs against the oracle's logits (the contract's rounding): the predicted token holds the row's
    maximum (to the logits' rounding: two logits that close may legitimately swap), -1 where ignored; is_top1 is
    exactly ``valid & (predicted == target)``; log sum p^2 and the mean logit to forward tolerance; the logprobs the
    same as without row_outputs (bitwise)."""
    h, w, b, t, m = data.draw(problems(small=impl == "triton", low_precision=True), label="problem")
    softcap = data.draw(st.sampled_from([None, None, 0.7, 5.0]), label="softcap")
    temp = data.draw(st.sampled_from([1.0, 0.3, 2.5]), label="temperature")
    shift = data.draw(st.sampled_from([False, True]), label="shift")
    kw = dict(ignore_index=m["ignore_index"], softcap=softcap, temperature=temp, shift=shift, impl=impl)
    with torch.no_grad():
        lp, rows = linear_logprobs(h, w, t, bias=b, row_outputs=ROW_OUTPUTS, **kw)
        plain = linear_logprobs(h, w, t, bias=b, **kw)
        z = oracle_logits(h, w, b, softcap=softcap, temperature=temp, dtype=_compute_dtype(h, w)).double()
    assert torch.equal(lp, plain)
    tt = shift_targets(t.long(), shift, m["ignore_index"])
    valid = tt != m["ignore_index"]
    assert torch.equal(rows.is_top1, valid & (rows.predicted == tt))
    assert bool((rows.predicted[~valid] == -1).all())
    if z.numel() and bool(valid.any()):
        zmax = z.amax(-1)
        idx = rows.predicted.clamp(min=0).unsqueeze(-1)
        picked = z.gather(-1, idx).squeeze(-1)
        tol_z = 8 * EPS[_compute_dtype(h, w)] * (1 + zmax.abs()) / min(temp, 1.0)
        assert bool(((zmax - picked)[valid] <= tol_z[valid]).all()), "predicted is not a maximum"
        p = torch.softmax(z, -1)
        tol, rtol = fwd_tol(_compute_dtype(h, w), float(z.abs().max()), v=m["v"])
        want_sq = torch.where(valid, (p * p).sum(-1).log(), 0.0)
        want_mean = torch.where(valid, z.mean(-1), 0.0)
        for name, got, want in (
            ("log_sum_sq_probs", rows.log_sum_sq_probs, want_sq),
            ("mean_logit", rows.mean_logit, want_mean),
        ):
            report = close_report(got.double(), want, atol=tol, rtol=rtol)
            assert report is None, f"{name}: {report}"
    CHECKED[f"{impl} row outputs"] += 1


@fuzz_settings(CI_TORCH_ROWS)
@given(data=st.data())
def test_fuzz_row_outputs_torch(data):
    check_row_outputs(data, "torch")


@needs_triton
@fuzz_settings(CI_TRITON_ROWS)
@given(data=st.data())
def test_fuzz_row_outputs_triton_interpreter(data):
    check_row_outputs(data, "triton")


@fuzz_settings(CI_TORCH_CE)
@given(data=st.data())
def test_fuzz_cross_entropy_torch(data):
    check_cross_entropy(data, "torch", small=False)


@fuzz_settings(CI_TORCH_LP)
@given(data=st.data())
def test_fuzz_logprobs_torch(data):
    check_logprobs(data, "torch", small=False)


@needs_triton
@fuzz_settings(CI_TRITON_CE)
@given(data=st.data())
def test_fuzz_cross_entropy_triton_interpreter(data):
    check_cross_entropy(data, "triton", small=True)


@needs_triton
@fuzz_settings(CI_TRITON_LP)
@given(data=st.data())
def test_fuzz_logprobs_triton_interpreter(data):
    check_logprobs(data, "triton", small=True)


def test_cancelling_bias_gradient_is_judged_against_float64():
    """A case the long fuzz run found (bf16, mean over two rows, shift=2, chunk_size=1): each row's bias gradient is
    ``+-(1 - p)`` with ``p ~ 0.97-0.999``, so ``db`` is a sum of O(1) terms cancelling to O(0.02). The bf16 materialized
    program rounds every ``dz`` to bf16 (spacing 2**-8 near 1) before summing and is 0.0014 off the float64 value;
    cce_dist keeps dz in float32 and is 8x closer. The dtype-oracle tolerance alone would fail it; the contract
    (never worse than the same-dtype materialized program) passes it, and a wrong gradient still fails."""
    bf = torch.bfloat16
    h = torch.tensor([[4.625, -0.8789], [-6.5312, 1.7031], [-3.25, -4.1875], [1.2109, 2.5156], [-2.1562, -1.2109],
                      [-1.7891, 0.5469]], dtype=bf)  # fmt: skip
    w = torch.tensor([[-1.2109, 1.5547], [-1.5156, 0.1738]], dtype=bf)
    b0 = torch.tensor([-0.2832, 0.1865], dtype=bf)
    t = torch.tensor([0, -100, -100, -100, 0, 1])

    def db(fn, dtype=bf):
        b = b0.to(dtype, copy=True).requires_grad_()
        fn(b).backward()
        return b.grad

    kw = dict(reduction="mean", shift=2)
    got = db(lambda b: linear_cross_entropy(h, w, t, bias=b, chunk_size=1, impl="torch", **kw))
    want = db(lambda b: oracle_cross_entropy(h, w, t, b, dtype=bf, **kw))
    exact = db(lambda b: oracle_cross_entropy(h.double(), w.double(), t, b, dtype=torch.float64, **kw), torch.float64)
    tol = grad_tol(bf, want)
    assert close_report(got.float(), want.float(), tol, 0.0) is not None  # the dtype oracle alone rejects it
    assert (got.double() - exact).abs().max() < (want.double() - exact).abs().max() / 4  # yet cce_dist is closer
    assert grad_report(got, want, tol, lambda: exact) is None
    wrong = got.float() + 4 * tol
    assert grad_report(wrong, want, tol, lambda: exact) is not None


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_gradient_judged_against_the_contracts_float64_program(impl):
    """A case the long fuzz run found (logprobs, bf16 head over fp32 hidden states, V = 2, temperature 2.5): the
    bias gradient is a sum of ~0.1 terms cancelling to 8.5e-4. Rounding the logits to bf16 (the contract, and the
    materialized bf16 program's own first step) moves it to 9.68e-4, which cce_dist returns; the materialized
    program then rounds each ``dz`` to bf16 and lands, by chance, within 2e-6 of the unrounded float64 value. Judged
    against the float64 program of the contract (the same bf16 logits, everything after in float64) cce_dist is
    exact to its bf16 output rounding and the materialized program is 1.1e-4 off, so it passes; a wrong gradient
    still fails."""
    bf = torch.bfloat16
    h = torch.tensor([[[0.3511], [-0.3841], [-0.5073], [-0.3469]], [[-0.4711], [-0.4504], [-0.9849], [-0.1916]]])
    w = torch.tensor([[-0.7188], [1.8594]], dtype=bf)
    b0 = torch.tensor([0.0030, 0.3086], dtype=bf)
    t = torch.tensor([[1, 0, -100, 0], [1, -100, 0, 1]])
    g1 = torch.randn(2, 4, generator=torch.Generator().manual_seed(10799))
    kw = dict(temperature=2.5, shift=True)

    def db(fn, dtype=bf):
        b = b0.to(dtype, copy=True).requires_grad_()
        (fn(b) * g1.to(dtype if dtype == torch.float64 else torch.float32)).sum().backward()
        return b.grad

    got = db(lambda b: linear_logprobs(h, w, t, bias=b, chunk_size=1, impl=impl, **kw))
    want = db(lambda b: oracle_logprobs(h, w, t, b, dtype=bf, **kw))
    f64 = dict(dtype=torch.float64, **kw)
    exact = db(lambda b: oracle_logprobs(h.double(), w.double(), t, b, **f64), torch.float64)
    contract = db(lambda b: oracle_logprobs(h.double(), w.double(), t, b, contract=bf, **f64), torch.float64)
    tol = grad_tol(bf, want)
    assert close_report(got.float(), want.float(), tol, 0.0) is not None  # the dtype oracle alone rejects it
    assert grad_report(got, want, tol, lambda: exact) is not None  # and so does the unrounded float64 value
    assert (got.double() - contract).abs().max() <= 2**-8 * contract.abs().max()  # bf16 output rounding only
    assert grad_report(got, want, tol, lambda: exact, lambda: contract) is None
    wrong = got.float() + 4 * tol
    assert grad_report(wrong, want, tol, lambda: exact, lambda: contract) is not None


# ----------------------------------------------------------------------------------------------
# sharded: seeded random cases on 3 gloo ranks
# ----------------------------------------------------------------------------------------------

WORLD = 3


def random_layout(rng: random.Random, v: int, world: int) -> list[tuple[int, int]]:
    """Random uneven tiling of [0, v) into ``world`` contiguous shards (empty shards allowed)."""
    cuts = sorted(rng.randint(0, v) for _ in range(world - 1))
    pts = [0] + cuts + [v]
    return [(pts[i], pts[i + 1]) for i in range(world)]


def sharded_case(seed: int, world: int, impl: str) -> dict:
    """One random case; identical on every rank (derived from ``seed`` only)."""
    rng = random.Random(seed)
    small = impl == "triton"
    v = rng.choice([1, 2, 3, 5, 13, 29, 40]) if small else rng.choice([1, 2, 3, rng.randint(1, 60)])
    sp = rng.random() < 0.3
    if sp:
        n_per = rng.choice([0, 1, 2, 3])
        shape = (n_per * world, rng.choice([1, 2]))
    else:
        n = rng.choice([0, 1, 2, rng.randint(0, 9 if small else 30)])
        shape = (n,) if rng.random() < 0.6 or n % 2 else (2, n // 2)
    c = dict(
        seed=seed,
        impl=impl,
        v=v,
        layout=random_layout(rng, v, world),
        shape=shape,
        d=rng.choice([1, 3, 16]) if small else rng.choice([1, 2, 5, 16, 23]),
        dtype=rng.choice([torch.float32, torch.float32, torch.bfloat16]),
        bias=rng.random() < 0.5,
        form=rng.choice(["ce", "ce", "lp"]),
        sp=sp,
        reduce_hidden_grad=True if sp else rng.random() < 0.8,
        stats_collective=rng.choice(["auto", "allreduce", "allgather"]),
        ignore_index=rng.choice([-100, -1, 0]) if v > 1 else -100,
        ignore_frac=rng.choice([0.0, 0.3, 1.0]),
        scale=rng.choice([0.1, 1.0, 3.0]),
        reduction=rng.choice(["mean", "sum", "none"]),
        label_smoothing=rng.choice([0.0, 0.0, 0.2]),
        z_loss=rng.choice([0.0, 1e-3]),
        softcap=rng.choice([None, None, 2.0]),
        temperature=rng.choice([1.0, 0.7]),
        shift=rng.choice([0, 0, 1]) if not sp else 0,
        chunk=rng.choice([1, 7, None]),
        gif=rng.choice([None, False]),
        return_extra=rng.random() < 0.5,
    )
    # drawn last, so the other fields of a seed's case are those of earlier runs: a common logit offset
    # through the bias (the global statistics must normalize it away as on one device)
    c["offset"] = rng.choice([0.0, 0.0, 0.0, 40.0]) if c["bias"] else 0.0
    c["class_weight"] = rng.choice([None, None, "rand", "some zero"]) if c["form"] == "ce" else None  # drawn last too
    return c


def _allgather_scalar_bits(x: torch.Tensor, group) -> list:
    import torch.distributed as dist

    buf = x.detach().float().reshape(-1).contiguous()
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, buf, group=group)
    return [o.view(torch.int32).tolist() for o in out]


def _sum_over(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    y = x.detach().float().clone()
    dist.all_reduce(y, group=group)
    return y


def run_sharded_case(rank, world, group, c) -> list[str]:
    fails: list[str] = []
    g = torch.Generator().manual_seed(c["seed"])
    shape, d, v = c["shape"], c["d"], c["v"]
    H = (torch.randn(*shape, d, generator=g) * c["scale"]).to(c["dtype"])
    W = (torch.randn(v, d, generator=g) / math.sqrt(d) * 2).to(c["dtype"])
    B = (torch.randn(v, generator=g) * 0.5 + c["offset"]).to(c["dtype"]) if c["bias"] else None
    T = torch.randint(0, v, shape, generator=g)
    T = torch.where(torch.rand(shape, generator=g) < c["ignore_frac"], torch.full_like(T, c["ignore_index"]), T)
    g1, g2 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    gs = float(torch.rand(1, generator=g)) + 0.5
    start, stop = c["layout"][rank]
    sp = c["sp"]
    n_loc = shape[0] // world if sp else None
    h_loc = H[rank * n_loc : (rank + 1) * n_loc] if sp else H
    h1 = h_loc.detach().clone().requires_grad_(True)
    w1 = W[start:stop].detach().clone().requires_grad_(True)
    b1 = None if B is None else B[start:stop].detach().clone().requires_grad_(True)
    shard = VocabShard(
        group,
        start,
        stop,
        sequence_parallel=sp,
        reduce_hidden_grad=c["reduce_hidden_grad"],
        stats_collective=c["stats_collective"],
    )
    h2 = H.detach().clone().requires_grad_(True)
    w2 = W.detach().clone().requires_grad_(True)
    b2 = None if B is None else B.detach().clone().requires_grad_(True)
    common = dict(
        ignore_index=c["ignore_index"], softcap=c["softcap"], shift=c["shift"], impl=c["impl"], chunk_size=c["chunk"]
    )
    cd = c["dtype"]
    zmax = _logit_bound(H, W, B)
    if c["softcap"] is not None:
        zmax = min(zmax, c["softcap"])
    n_tok = T.numel()
    if c["form"] == "ce":
        cw = _class_weight(c["class_weight"], v, c)
        out = linear_cross_entropy(
            h1,
            w1,
            T,
            bias=b1,
            class_weight=cw,
            shard=shard,
            reduction=c["reduction"],
            label_smoothing=c["label_smoothing"],
            z_loss=c["z_loss"],
            return_lse=c["return_extra"],
            grad_in_forward=c["gif"],
            **common,
        )
        ref = oracle_cross_entropy(
            h2,
            w2,
            T,
            b2,
            ignore_index=c["ignore_index"],
            reduction=c["reduction"],
            label_smoothing=c["label_smoothing"],
            z_loss=c["z_loss"],
            softcap=c["softcap"],
            shift=c["shift"],
            dtype=cd,
            return_lse=True,
            class_weight=cw,
        )
        outs = list(out) if c["return_extra"] else [out]
        refs = list(ref) if c["return_extra"] else [ref[0]]
        ups = [g1 if c["reduction"] == "none" else torch.tensor(gs)] + ([g2] if c["return_extra"] else [])
        loss_tol = fwd_tol(cd, zmax, z_loss=c["z_loss"], v=v, n_sum=max(n_tok, 1) if c["reduction"] == "sum" else 1)
        if cw is not None:  # weights up to 2.25, a mean divided by at least 0.25
            loss_tol = (loss_tol[0] * 9.0, loss_tol[1])
        tols = [loss_tol, fwd_tol(cd, zmax, v=v)]
        zl = c["z_loss"]
    else:
        out = linear_logprobs(
            h1, w1, T, bias=b1, shard=shard, temperature=c["temperature"], return_entropy=c["return_extra"], **common
        )
        ref = oracle_logprobs(
            h2,
            w2,
            T,
            b2,
            ignore_index=c["ignore_index"],
            softcap=c["softcap"],
            temperature=c["temperature"],
            shift=c["shift"],
            dtype=cd,
            return_entropy=True,
        )
        outs = list(out) if c["return_extra"] else [out]
        refs = list(ref) if c["return_extra"] else [ref[0]]
        ups = [g1, g2][: len(outs)]
        zmax /= c["temperature"]
        tols = [fwd_tol(cd, zmax, v=v)] * 2
        zl = 0.0
    for k, (o, r_, tl) in enumerate(zip(outs, refs, tols)):
        if r := close_report(o, r_, *tl):
            fails.append(f"output {k}: {r}")
    # every rank must hold bitwise the same values (a TP group must not drift apart)
    for k, o in enumerate(outs):
        bits = _allgather_scalar_bits(o, group)
        if any(b_ != bits[0] for b_ in bits):
            fails.append(f"output {k} differs bitwise between ranks")
    got = backward_grads(outs, (h1, w1, b1), ups)
    want = backward_grads(refs, (h2, w2, b2), ups)
    factor = (1 + 2 * zl * (zmax + math.log(v) + 1)) * (1 + (zmax if c["form"] == "lp" else 0.0))
    # dH: full (all-reduced), this rank's sequence slice, or a partial whose group sum is the oracle's
    dh_ref = want[0]
    if sp:
        dh_ref = dh_ref[rank * n_loc : (rank + 1) * n_loc]
    dh = got[0]
    if dh is None or dh.dtype != cd:
        fails.append(f"dH missing or of dtype {None if dh is None else dh.dtype}")
    else:
        dh_full = dh.float() if c["reduce_hidden_grad"] else _sum_over(dh, group)
        if r := close_report(dh_full, dh_ref.float(), grad_tol(cd, dh_ref) * factor * world, 0.0):
            fails.append(f"dH: {r}")
    for name, x, y, sl in (("dW", got[1], want[1], slice(start, stop)), ("db", got[2], want[2], slice(start, stop))):
        if y is None:
            continue
        if x is None or x.dtype != cd:
            fails.append(f"{name} missing or wrong dtype")
            continue
        if r := close_report(x.float(), y[sl].float(), grad_tol(cd, y) * factor, 0.0):
            fails.append(f"{name}: {r}")
    return fails


def _sharded_body(rank, world, group, n_torch, n_triton, seed):
    results = {"cases": 0, "fails": [], "failed_cases": []}
    cases = [sharded_case(seed + i, world, "torch") for i in range(n_torch)]
    if n_triton:
        cases += [sharded_case(seed + 10_000 + i, world, "triton") for i in range(n_triton)]
    for c in cases:
        try:
            fails = run_sharded_case(rank, world, group, c)
        except Exception as e:  # noqa: BLE001 - one failing case must not desync the group
            fails = [f"raised {type(e).__name__}: {e}"]
            # a case that raised on some ranks only may have left the others mid-collective:
            # stop here rather than hang (the parent reports it)
            results["fails"].append(f"case {c}: {fails}")
            results["failed_cases"].append((c["impl"], c["seed"]))
            results["cases"] += 1
            return results
        results["cases"] += 1
        if fails:
            results["fails"].append(f"rank {rank} case {c}: " + "; ".join(fails))
            results["failed_cases"].append((c["impl"], c["seed"]))
    return results


def test_fuzz_sharded_gloo(tmp_path):
    n_torch = max(CI_SHARDED_TORCH, LONG // 4) if LONG else CI_SHARDED_TORCH
    n_triton = (max(CI_SHARDED_TRITON, LONG // 50) if LONG else CI_SHARDED_TRITON) if TRITON else 0
    res = run_ranks(
        _sharded_body,
        WORLD,
        tmp_path,
        timeout=200 + 2 * LONG,
        pg_timeout=60,
        kw=dict(n_torch=n_torch, n_triton=n_triton, seed=7000),
    )
    fails = [f for r in res.values() for f in r["fails"]]
    ran = min(r["cases"] for r in res.values())
    failed = {case for r in res.values() for case in r["failed_cases"]}
    # cases that ran and passed on every rank (counted before the assertions, so a long run that
    # finds a failing case still reports how many others it checked)
    n_torch_ok = min(ran, n_torch) - sum(impl == "torch" for impl, _ in failed)
    n_triton_ok = max(ran - n_torch, 0) - sum(impl == "triton" for impl, _ in failed)
    CHECKED[f"sharded torch ({WORLD} ranks)"] += n_torch_ok
    CHECKED[f"sharded triton ({WORLD} ranks)"] += n_triton_ok
    assert not fails, f"{len(failed)} of {ran} cases failed:\n" + "\n".join(fails[:20])
    assert all(r["cases"] == n_torch + n_triton for r in res.values()), res
