"""Single-device low precision: bf16 / fp16 heads no worse than the materialized program in the same dtype, mixed
hidden / weight / bias dtypes, autocast, bf16 activations with an fp32 head, the CPU upcast GEMM's roundings (logits
and ``dz`` to the compute dtype), and loss >= 0 / logprob <= 0 at large logits. The accuracy rule is
``assert_no_worse_than_materialized`` (tests/single_device.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import oracle_cross_entropy, oracle_logits, oracle_logprobs
from single_device import (
    CHUNK,
    GIF,
    V,
    assert_close32,
    assert_no_worse_than_materialized,
    grads,
    leaves,
    make_inputs,
    max_err,
    opts_id,
    upstream,
)

from cce_dist import linear_cross_entropy, linear_logprobs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tiny shapes: see tests/conftest.py


# ----------------------------------------------------------------------------------------------
# low precision, mixed dtypes, autocast
# ----------------------------------------------------------------------------------------------


def _run_all(fn, h, w, b, t, g_fn, **kw):
    """Forward + backward; returns [out..., dh, dw, db] and the grads' dtypes."""
    h1, w1, b1 = leaves(h, w, b)
    out = fn(h1, w1, t, b1, **kw)
    outs = list(out) if isinstance(out, tuple) else [out]
    gs = [g_fn(o, i) for i, o in enumerate(outs)]
    gr = grads(outs, (h1, w1, b1), gs)
    return [o.detach() for o in outs] + gr


def _cce_ce(h, w, t, b, **kw):
    return linear_cross_entropy(h, w, t, bias=b, chunk_size=CHUNK, **kw)


def _cce_lp(h, w, t, b, **kw):
    return linear_logprobs(h, w, t, bias=b, chunk_size=CHUNK, **kw)


LOWP_CASES = [
    ("ce", {"reduction": "mean"}),
    ("ce", {"reduction": "sum", "grad_in_forward": False}),
    ("ce", {"reduction": "none", "label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}),
    ("ce", {"reduction": "mean", "label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}),
    ("ce", {"reduction": "sum", "return_lse": True}),
    ("lp", {"return_entropy": True}),
    ("lp", {"return_entropy": True, "softcap": 4.0, "temperature": 0.7}),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("form,opts", LOWP_CASES, ids=lambda x: x if isinstance(x, str) else opts_id(x))
def test_low_precision_no_worse_than_materialized(dtype, form, opts):
    h, w, b, t = make_inputs(n=64, dtype=dtype, seed=17)
    g_fn = lambda o, i: upstream(o, seed=30 + i)  # noqa: E731
    oracle = oracle_cross_entropy if form == "ce" else oracle_logprobs
    cce = _cce_ce if form == "ce" else _cce_lp
    oracle_kw = {k: v for k, v in opts.items() if k != "grad_in_forward"}
    ref = _run_all(
        lambda *a, **k: oracle(*a, dtype=torch.float32, **k), h.float(), w.float(), b.float(), t, g_fn, **oracle_kw
    )
    mat = _run_all(lambda *a, **k: oracle(*a, dtype=dtype, **k), h, w, b, t, g_fn, **oracle_kw)
    got = _run_all(cce, h, w, b, t, g_fn, **opts)
    for i, (x, m, r) in enumerate(zip(got, mat, ref)):
        assert x.shape == r.shape
        assert_no_worse_than_materialized(x, m, r, dtype, what=f"output {i}")
    dh, dw, db = got[-3:]
    assert (dh.dtype, dw.dtype, db.dtype) == (dtype, dtype, dtype)


HDT = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("hdtype", HDT, ids=str)
@pytest.mark.parametrize("wdtype", HDT, ids=str)
@pytest.mark.parametrize("bdtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gif", [None, False], ids=lambda g: f"gif={g}")
def test_mixed_dtypes(hdtype, wdtype, bdtype, gif):
    """Compute dtype = the weight's; hidden and bias are cast to it; grads in each tensor's dtype."""
    h, w, b, t = make_inputs(dtype=hdtype, wdtype=wdtype, bdtype=bdtype, seed=18)
    h1, w1, b1 = leaves(h, w, b)
    loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=gif, label_smoothing=0.1)
    assert loss.dtype == torch.float32
    dh, dw, db = grads(loss, (h1, w1, b1), None)
    assert (dh.dtype, dw.dtype, db.dtype) == (hdtype, wdtype, bdtype)
    # the materialized program in the compute dtype (the weight's), on the same input values
    h2, w2, b2 = leaves(h, w, b)
    mat = oracle_cross_entropy(h2, w2, t, b2, dtype=wdtype, label_smoothing=0.1)
    mdh, mdw, mdb = grads(mat, (h2, w2, b2), None)
    assert (mdh.dtype, mdw.dtype, mdb.dtype) == (hdtype, wdtype, bdtype)
    h3, w3, b3 = leaves(h.float(), w.float(), b.float())
    ref = oracle_cross_entropy(h3, w3, t, b3, label_smoothing=0.1)
    rgrads = grads(ref, (h3, w3, b3), None)
    if wdtype == torch.float32:
        # fp32 compute: the result is the fp32 oracle's, gradients rounded once to their dtype
        assert_close32(loss, ref)
        for x, r in zip((dh, dw, db), rgrads):
            tol = torch.finfo(x.dtype).eps if x.dtype != torch.float32 else 2e-4
            assert_close32(x, r.to(x.dtype), rtol=tol, atol=tol * 1e-2)
    else:
        for x, m, r in zip((loss, dh, dw, db), (mat, mdh, mdw, mdb), [ref] + rgrads):
            assert_no_worse_than_materialized(x, m, r, wdtype, what=str(x.dtype))


@pytest.mark.parametrize("form", ["ce-mean", "ce-mean-recompute", "ce-none", "ce-lse", "lp"])
def test_autocast_bf16_with_fp32_weights(form):
    h, w, b, t = make_inputs(n=64, seed=19)
    g_fn = lambda o, i: upstream(o, seed=40 + i)  # noqa: E731
    if form.startswith("ce"):
        kw = {"label_smoothing": 0.1, "z_loss": 1e-3}
        if form == "ce-none":
            kw["reduction"] = "none"
        if form == "ce-lse":
            kw["return_lse"] = True
        oracle, cce = oracle_cross_entropy, _cce_ce
        cce_kw = dict(kw, grad_in_forward=False) if form == "ce-mean-recompute" else kw
    else:
        kw = {"return_entropy": True, "temperature": 0.8, "softcap": 5.0}
        oracle, cce, cce_kw = oracle_logprobs, _cce_lp, kw
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run_all(cce, h, w, b, t, g_fn, **cce_kw)
        # the materialized program under the same autocast: F.linear runs in bf16
        mat = _run_all(lambda *a, **k: oracle(*a, dtype=None, **k), h, w, b, t, g_fn, **kw)
    ref = _run_all(oracle, h, w, b, t, g_fn, **kw)
    for i, (x, m, r) in enumerate(zip(got, mat, ref)):
        assert x.dtype == torch.float32, f"output {i}: fp32 tensors get fp32 outputs/grads under autocast"
        assert_no_worse_than_materialized(x, m, r, torch.bfloat16, what=f"output {i}")
    # it really computed in bf16: it matches the autocast program far better than the fp32 one
    # for the forward output (the logits' bf16 rounding is visible at this logit scale)
    assert max_err(got[0], mat[0]) < max_err(got[0], ref[0]) or max_err(mat[0], ref[0]) == 0.0


def test_bf16_activations_with_fp32_head():
    """bf16 hidden states with an fp32 head compute in fp32 and give a bf16 hidden gradient."""
    h, w, b, t = make_inputs(seed=20)
    hb = h.to(torch.bfloat16)
    for gif in GIF:
        h1, w1, b1 = leaves(hb, w, b)
        loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=gif, z_loss=1e-3)
        h2, w2, b2 = leaves(hb.float(), w, b)
        ref = oracle_cross_entropy(h2, w2, t, b2, z_loss=1e-3)
        assert_close32(loss, ref)
        dh, dw, db = grads(loss, (h1, w1, b1), None)
        rdh, rdw, rdb = grads(ref, (h2, w2, b2), None)
        assert dh.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32
        assert_close32(dw, rdw)
        assert_close32(db, rdb)
        torch.testing.assert_close(dh.float(), rdh.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_cpu_upcast_gemm_rounds_logits_to_compute_dtype(dtype, bias, monkeypatch):
    """On a CPU without native bf16/fp16 GEMMs the torch path runs float32 GEMMs on upcast operands
    and must round the logits to the compute dtype, as a native GEMM would: the row maxima and
    target logits are then values of that dtype, and both paths give the same statistics."""
    from cce_dist.core import stats as S
    from cce_dist.impl import torch_cross_entropy

    h, w, b, t = make_inputs(n=48, dtype=dtype, seed=41, bias=bias, ignore_frac=0.0)
    got = {}
    for native in (False, True):
        monkeypatch.setattr(torch_cross_entropy, "_native_low_precision_gemm", lambda dt, native=native: native)
        got[native] = torch_cross_entropy.row_stats(
            h, w, b, t, vocab_start=0, softcap=None, temperature=1.0, chunk_size=7 * V
        )
    up = got[False]
    for col in (S.MAX, S.TARGET):
        vals = up[:, col]
        assert torch.equal(vals, vals.to(dtype).float()), f"stat {col}: logits were not rounded to {dtype}"
    # native (emulated) low-precision GEMM vs float32 GEMM + rounding: equal up to one rounding step
    # of the logits (different summation orders can land on neighbouring values)
    ulp = torch.finfo(dtype).eps * got[True][:, S.MAX].abs().clamp_min(1.0)
    assert ((up[:, S.MAX] - got[True][:, S.MAX]).abs() <= ulp).all()
    torch.testing.assert_close(up[:, S.SUMEXP], got[True][:, S.SUMEXP], rtol=4 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("softcap", [None, 0.7])
def test_cpu_upcast_gemm_rounds_dz_to_compute_dtype(dtype, softcap, monkeypatch):
    """The gradient GEMMs of the upcast path must be given ``dz`` rounded to the compute dtype, as a native
    bf16/fp16 GEMM (and the Triton kernels, and the materialized program) is: its float32 dH / dW then equal the
    native path's up to float32 summation order (~1e-6 relative), where unrounded dz differed by the compute
    dtype's resolution (found by the long fuzz run: an fp16 dW at 2.05x the materialized program's error, which
    rounds dz). db sums the unrounded dz on both paths."""
    from cce_dist.core import formulas
    from cce_dist.core import stats as S
    from cce_dist.impl import torch_cross_entropy

    h, w, b, t = make_inputs(n=48, dtype=dtype, seed=43, bias=True, ignore_frac=0.0)
    kw = dict(vocab_start=0, softcap=softcap, temperature=1.0)
    got = {}
    for native in (False, True):
        monkeypatch.setattr(torch_cross_entropy, "_native_low_precision_gemm", lambda dt, native=native: native)
        stats = torch_cross_entropy.row_stats(h, w, b, t, **kw, chunk_size=7 * V)
        coef = formulas.logprob_coef(
            stats, t >= 0, torch.randn(t.shape[0], generator=torch.Generator().manual_seed(1)), None
        )
        got[native] = torch_cross_entropy.grads(
            h, w, b, t, S.lse(stats), coef, **kw, need_hidden=True, need_weight=True, need_bias=True, chunk_size=5 * V
        )
    (dh_up, *rest_up), (dh_nat, *rest_nat) = got[False], got[True]
    # dH rows are one GEMM's output in the compute dtype on both paths (the same rounding as materialized): values
    # of that dtype, equal up to a rounding flip where the float32 sums differ in their last bits
    assert torch.equal(dh_up, dh_up.to(dtype).float()), "upcast dH was not rounded to the compute dtype"
    ulp = torch.finfo(dtype).eps * dh_nat.abs()
    assert ((dh_up - dh_nat).abs() <= ulp).all(), float((dh_up - dh_nat).abs().max())
    for name, up, nat in zip(("dW", "db"), rest_up, rest_nat):
        assert up.dtype == nat.dtype == torch.float32
        scale = float(nat.abs().max())
        err = float((up - nat).abs().max())
        assert err <= 1e-5 * scale, f"{name}: upcast vs native {err:.3g} (max |grad| {scale:.3g})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1}, {"z_loss": 1e-4}, {"softcap": 30.0}], ids=opts_id)
def test_loss_nonnegative_logprob_nonpositive_large_logits(dtype, opts):
    """Target logit and normalizer come from the same rounded logits: loss >= 0, logprob <= 0."""
    h, w, b, t = make_inputs(n=64, v=97, dtype=dtype, seed=21, scale=60.0, ignore_frac=0.0)
    # hardest case: each target is its row's argmax (true loss ~ 0, where rounding could go < 0);
    # and a few rows whose logits tie at a large value
    logits = oracle_logits(h, w, b, dtype=dtype)
    t = logits.argmax(-1)
    h = h.clone()
    h[:4] = 0
    assert bool(logits.abs().max() > 100)
    for gif in GIF:
        loss = linear_cross_entropy(
            h, w, t, bias=b, reduction="none", chunk_size=3 * 97 + 5, grad_in_forward=gif, **opts
        )
        assert torch.isfinite(loss).all()
        assert bool((loss >= 0).all()), f"negative loss {float(loss.min())}"
    lp, ent = linear_logprobs(h, w, t, bias=b, chunk_size=3 * 97 + 5, return_entropy=True, softcap=opts.get("softcap"))
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert bool((lp <= 0).all()), f"positive logprob {float(lp.max())}"
    assert bool((ent >= 0).all()) and bool((ent <= math.log(97) + 1e-4).all())
