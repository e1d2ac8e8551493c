"""The autograd contract of every output path: what a training loop does with the loss besides one plain backward.

Every path is one way of calling the library whose gradients come from a different autograd Function or schedule:

``mean`` / ``sum``        scalar loss, gradients formed during forward (torch impl) or recomputed (triton)
``mean_recompute``        scalar loss with ``grad_in_forward=False`` (backward recomputes the logits)
``none``                  per-token losses with per-token upstream gradients
``return_lse``            scalar loss plus the differentiable lse
``logprobs`` / ``entropy``  the RL form, per-token upstream gradients on logprob (and entropy)

Each is run with the ``torch`` and the ``triton`` (interpreter) implementation, under ``torch.compile`` (the same
Functions, traced, with cce_dist/engine/compile.py's custom ops as their backend) and on a 2-rank gloo tensor-parallel
group, and checked against the materialized program (tests/oracle.py) computed in float64:

- second-order gradients (``create_graph=True``, e.g. a gradient penalty) raise a clear error naming the feature and
  the alternative, instead of returning a gradient that silently lacks its second-order term;
- activation checkpointing (``torch.utils.checkpoint``, reentrant and non-reentrant) gives the oracle's gradients;
- loss scaling as GradScaler does it (``(loss * 2**k).backward()``, k = 0..24) with fp16 / bf16 heads and fp16 hidden
  states under an fp32 head: the gradients are no less accurate than the materialized loss in the same dtype (relative
  error within 2x of its own against the float64 oracle) and finite wherever its are;
- a zero hidden size (D = 0) gives the oracle's value (the logits are the bias, or 0: loss log V) and empty gradients.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_utils import run_ranks
from helpers import problem
from oracle import oracle_cross_entropy, oracle_logprobs
from torch.utils.checkpoint import checkpoint

from cce_dist import VocabShard, linear_cross_entropy, linear_logprobs

PATHS = ["mean", "sum", "mean_recompute", "none", "return_lse", "logprobs", "entropy"]
IMPLS = ["torch", "triton"]
SECOND_ORDER = r"second-order gradients .*create_graph=True.* not supported"

N, D, V = 9, 6, 16  # tiny: the triton kernels run in the interpreter


def _row_weights(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed, distinct per-token upstream gradients (float32) for the per-token paths."""
    i = torch.arange(n, dtype=torch.float32)
    return 0.5 + 0.25 * torch.cos(i), 0.3 - 0.2 * torch.sin(i)


def objective(path, h, w, t, b=None, *, impl="torch", shard=None, oracle=False):
    """The scalar a training step differentiates, for one output path (library or materialized oracle)."""
    u1, u2 = _row_weights(t.numel())
    u1, u2 = u1.reshape(t.shape).to(h.device), u2.reshape(t.shape).to(h.device)
    if oracle:

        def ce(**kw):
            return oracle_cross_entropy(h, w, t, b, dtype=torch.float64, **kw)

        def lp(**kw):
            return oracle_logprobs(h, w, t, b, dtype=torch.float64, **kw)
    else:

        def ce(**kw):
            return linear_cross_entropy(h, w, t, bias=b, impl=impl, shard=shard, **kw)

        def lp(**kw):
            return linear_logprobs(h, w, t, bias=b, impl=impl, shard=shard, **kw)

    if path == "mean":
        return ce(z_loss=1e-2)
    if path == "sum":
        return ce(reduction="sum", label_smoothing=0.1)
    if path == "mean_recompute":
        return ce(**({} if oracle else {"grad_in_forward": False}))
    if path == "none":
        return (ce(reduction="none") * u1).sum()
    if path == "return_lse":
        loss, lse = ce(return_lse=True)
        return loss + 0.1 * lse.square().mean()
    if path == "logprobs":
        return (lp() * u1).sum()
    if path == "entropy":
        logp, ent = lp(return_entropy=True)
        return (logp * u1).sum() + (ent * u2).sum()
    raise AssertionError(path)


# N tokens (the second ignored), D, V; weight / sqrt(D), bias * 0.1; requires_grad=True gives leaves
_problem = functools.partial(problem, n=N, d=D, v=V, w_scale=D**-0.5, b_scale=0.1, ignore=(1,))


def _leaves(*ts):
    return [None if x is None else x.detach().clone().requires_grad_(True) for x in ts]


def oracle_grads(path, h, w, t, b):
    """Value and gradients of the float64 materialized program (gradients in float64)."""
    h64, w64, b64 = _leaves(h.double(), w.double(), None if b is None else b.double())
    out = objective(path, h64, w64, t, b64, oracle=True)
    out.backward()
    return out.detach(), h64.grad, w64.grad, None if b64 is None else b64.grad


# ----------------------------------------------------------------------------------------------
# second-order gradients
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("path", PATHS)
def test_second_order_gradients_raise(path, impl):
    """A gradient penalty needs d/dh of the gradient: every path refuses create_graph=True with a clear error (today
    the default path returned a gradient without requires_grad, silently dropping the penalty's second-order term)."""
    h, w, b, t = _problem(requires_grad=True)
    out = objective(path, h, w, t, b, impl=impl)
    with pytest.raises(RuntimeError, match=SECOND_ORDER):
        torch.autograd.grad(out, (h,), create_graph=True)
    # the first-order gradient of a fresh call is still right
    out = objective(path, h, w, t, b, impl=impl)
    (gh,) = torch.autograd.grad(out, (h,))
    ref = oracle_grads(path, h.detach(), w.detach(), t, b.detach())
    torch.testing.assert_close(gh.double(), ref[1], rtol=1e-4, atol=1e-5)  # fp32 vs float64: fp32 rounding


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_second_order_gradients_raise_under_compile(backend):
    """Compiled (cce_dist/engine/compile.py): run eagerly (backend="eager") the backward refuses create_graph=True with
    the library's error (cce_dist::first_order: Dynamo traces the Functions' backward without grad mode); behind
    AOTAutograd (aot_eager, inductor) the compiled backward runs without grad mode, and torch's own error ("does not
    currently support double backward") is raised as soon as the second-order graph is differentiated, so the
    penalty never silently loses its term either way."""
    torch._dynamo.reset()
    h, w, b, t = _problem(requires_grad=True)

    @torch.compile(fullgraph=True, backend=backend)
    def loss_fn(h, w, t, b):
        lp, ent = linear_logprobs(h, w, t, bias=b, impl="torch", return_entropy=True)
        return linear_cross_entropy(h, w, t, bias=b, impl="torch") - 0.1 * lp.sum() + 0.1 * ent.sum()

    out = loss_fn(h, w, t, b)
    with pytest.raises(RuntimeError, match=SECOND_ORDER if backend == "eager" else r"double backward"):
        (gh,) = torch.autograd.grad(out, (h,), create_graph=True)
        (out + gh.square().sum()).backward()


# ----------------------------------------------------------------------------------------------
# activation checkpointing
# ----------------------------------------------------------------------------------------------


def _checkpointed_grads(path, h, w, t, b, impl, reentrant, shard=None):
    h, w, b = _leaves(h, w, b)

    def region(h, w, b):
        return objective(path, torch.tanh(h), w, t, b, impl=impl, shard=shard)

    out = checkpoint(region, h, w, b, use_reentrant=reentrant)
    out.backward()
    return out.detach(), h.grad, w.grad, b.grad


def _oracle_tanh_grads(path, h, w, t, b):
    h64, w64, b64 = _leaves(h.double(), w.double(), b.double())
    out = objective(path, torch.tanh(h64), w64, t, b64, oracle=True)
    out.backward()
    return out.detach(), h64.grad, w64.grad, b64.grad


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("path", PATHS)
def test_activation_checkpointing(path, impl, reentrant):
    """Checkpointing the region that ends in the loss gives the oracle's value and gradients (non-reentrant
    checkpointing unpacks each saved tensor once: backward must read ctx.saved_tensors only once)."""
    h, w, b, t = _problem()
    got = _checkpointed_grads(path, h, w, t, b, impl, reentrant)
    ref = _oracle_tanh_grads(path, h, w, t, b)
    for name, x, y in zip(("value", "d_hidden", "d_weight", "d_bias"), got, ref):
        # float32 computation against float64: a few float32 roundings of O(1) quantities
        torch.testing.assert_close(
            x.double(), y.double(), rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


# ----------------------------------------------------------------------------------------------
# loss scaling (GradScaler) in low precision
# ----------------------------------------------------------------------------------------------

DTYPES = {  # name: (hidden dtype, weight dtype)
    "fp16": (torch.float16, torch.float16),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp32_head_fp16_hidden": (torch.float16, torch.float32),
}
SCALES = [2.0**k for k in range(25)]  # every scale GradScaler may use


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _scaled_grads(fn, h, w, t, scale):
    h, w = _leaves(h, w)
    (fn(h, w, t) * scale).backward()
    return h.grad, w.grad


def _assert_no_worse(name, got, mat, ref, scale):
    """``got`` (scaled gradient) is finite wherever the materialized ``mat`` is, and its relative error against the
    float64 oracle ``ref`` (unscaled) is within 2x of the materialized one's (plus a float32-level floor: both can be
    exact to the last bit of the dtype, where a ratio means nothing)."""
    fin = torch.isfinite(mat)
    assert bool(torch.isfinite(got)[fin].all()), f"{name}: non-finite gradient where the materialized one is finite"
    if not bool(fin.all()):
        return
    e_got, e_mat = _rel_err(got.double() / scale, ref), _rel_err(mat.double() / scale, ref)
    assert e_got <= 2 * e_mat + 1e-6, f"{name}: relative error {e_got:.3g} vs materialized {e_mat:.3g}"


def _loss_scaling_case(fn, dtype_name, n, d, v, scales):
    hdt, wdt = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(5)
    h = torch.randn(n, d, generator=g).to(hdt)
    w = (torch.randn(v, d, generator=g) / d**0.5).to(wdt)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    _, ref_h, ref_w, _ = oracle_grads("mean", h, w, t, None)
    mdt = None if wdt == torch.float32 else wdt  # the materialized program projects in the head's dtype

    def materialized(h, w, t):
        return oracle_cross_entropy(h, w, t, z_loss=1e-2, dtype=mdt if mdt is not None else torch.float32)

    for s in scales:
        mh, mw = _scaled_grads(materialized, h, w, t, s)
        gh, gw = _scaled_grads(fn, h, w, t, s)
        assert gh.dtype == hdt and gw.dtype == wdt
        _assert_no_worse(f"{dtype_name} scale 2**{int(s).bit_length() - 1} d_hidden", gh, mh, ref_h, s)
        _assert_no_worse(f"{dtype_name} scale 2**{int(s).bit_length() - 1} d_weight", gw, mw, ref_w, s)


@pytest.mark.parametrize("grad_in_forward", [None, False], ids=["fused", "recompute"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_loss_scaling_torch(dtype_name, grad_in_forward):
    """The GradScaler recipe at the issue's shape (N=4096, D=32, V=512), every scale 2**0..2**24: today the fused
    path cast the gradients to fp16 before applying the scale (and cast the scale to fp16): inf/NaN at 2**16 and
    66x less accurate than the materialized loss at 2**15."""

    def fn(h, w, t):
        return linear_cross_entropy(h, w, t, z_loss=1e-2, impl="torch", grad_in_forward=grad_in_forward)

    _loss_scaling_case(fn, dtype_name, 4096, 32, 512, SCALES)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_loss_scaling_torch_native_low_precision_gemm(dtype_name, monkeypatch):
    """Same, with the GEMMs run in the head's dtype (as on a GPU or a CPU with native bf16/fp16 GEMMs), where the
    fused path rounds each chunk's logit gradient to that dtype before the upstream scale is known."""
    import cce_dist.impl.torch_cross_entropy as ti

    monkeypatch.setattr(ti, "_native_low_precision_gemm", lambda dtype: True)

    def fn(h, w, t):
        return linear_cross_entropy(h, w, t, z_loss=1e-2, impl="torch")

    _loss_scaling_case(fn, dtype_name, 512, 16, 128, SCALES)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_loss_scaling_triton(dtype_name):
    """The triton kernels (interpreter, small shape) at every scale."""

    def fn(h, w, t):
        return linear_cross_entropy(h, w, t, z_loss=1e-2, impl="triton")

    _loss_scaling_case(fn, dtype_name, 48, 16, 32, SCALES)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_loss_scaling_compiled(dtype_name):
    """The compiled custom op at every scale."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fn(h, w, t):
        return linear_cross_entropy(h, w, t, z_loss=1e-2, impl="torch")

    _loss_scaling_case(fn, dtype_name, 512, 16, 128, SCALES)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_fused_holds_gradients_in_their_own_dtype_except_fp16(dtype_name):
    """grad_in_forward holds dH, dW, db from forward to backward: in float32 only for float16 tensors (a scaled fp16
    gradient can overflow or underflow), in the tensor's own dtype otherwise (a bf16 head holds bf16: half the bytes
    of float32). Counts the held bytes on the graph node, then checks the gradients against the float64 oracle."""
    hdt, wdt = DTYPES[dtype_name]
    h0, w0, b0, t = _problem(dtype=hdt, weight_dtype=wdt, ignore=(3,), seed=9)
    h, w, b = (x.clone().requires_grad_(True) for x in (h0, w0, b0))
    loss = objective("mean", h, w, t, b, impl="torch")  # a scalar loss: the gradients are formed in forward
    held = loss.grad_fn.held.grads  # the FusedCrossEntropy node holds the gradients formed in forward (HeldGradients)
    want = [torch.float32 if dt == torch.float16 else dt for dt in (hdt, wdt, wdt)]
    assert [x.dtype for x in held] == want
    held_bytes = sum(x.numel() * x.element_size() for x in held)
    want_bytes = sum(x.numel() * (4 if x.dtype == torch.float16 else x.element_size()) for x in (h0, w0, b0))
    assert held_bytes == want_bytes, (held_bytes, want_bytes)
    (loss * 2.0**10).backward()
    _, ref_h, ref_w, ref_b = oracle_grads("mean", h0, w0, t, b0)
    # one rounding to the dtype of a float32-accumulated gradient: 2 ulps of bf16 / fp16 (2**-7 / 2**-10 relative)
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
    for name, got, ref, dt in (
        ("hidden", h.grad, ref_h, hdt),
        ("weight", w.grad, ref_w, wdt),
        ("bias", b.grad, ref_b, wdt),
    ):
        assert got.dtype == dt, name
        torch.testing.assert_close(
            got.double() / 2.0**10,
            ref,
            rtol=tol[dt],
            atol=tol[dt] * float(ref.abs().max()),
            msg=lambda m, name=name: f"{name}: {m}",
        )


# ----------------------------------------------------------------------------------------------
# zero hidden size
# ----------------------------------------------------------------------------------------------


def _zero_dim_check(got, ref, h, w, b):
    value, gh, gw, gb = got
    torch.testing.assert_close(value.double(), ref[0].double(), rtol=1e-5, atol=1e-6)
    assert gh.shape == h.shape and gw.shape == w.shape
    if b is not None:
        # the logits are the bias: its gradient is softmax(b) - onehot, as in the oracle
        torch.testing.assert_close(gb.double(), ref[3], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("path", PATHS)
def test_zero_hidden_size(path, impl, bias):
    """D = 0: the logits are the bias (or 0), so the loss is the oracle's (log V without a bias); today a reshape of
    the empty hidden states raised 'cannot reshape tensor of 0 elements'."""
    h, w, b, t = _problem(d=0, bias=bias, requires_grad=True)
    out = objective(path, h, w, t, b, impl=impl)
    out.backward()
    ref = oracle_grads(path, h.detach(), w.detach(), t, None if b is None else b.detach())
    _zero_dim_check((out.detach(), h.grad, w.grad, None if b is None else b.grad), ref, h, w, b)


def test_zero_hidden_size_compiled():
    torch._dynamo.reset()
    h, w, b, t = _problem(d=0, requires_grad=True)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def fn(h, w, t, b):
        return objective("entropy", h, w, t, b) + objective("return_lse", h, w, t, b)

    out = fn(h, w, t, b)
    out.backward()
    h2, w2, b2 = _leaves(h, w, b)
    ref_out = objective("entropy", h2, w2, t, b2, oracle=True) + objective("return_lse", h2, w2, t, b2, oracle=True)
    ref_out.backward()
    _zero_dim_check(
        (out.detach(), h.grad, w.grad, b.grad), (ref_out.detach().double(), None, None, b2.grad.double()), h, w, b
    )


# ----------------------------------------------------------------------------------------------
# tensor parallel: the same contract on a 2-rank gloo group
# ----------------------------------------------------------------------------------------------


def _tp_body(rank, world, group, cases):
    import traceback

    fails = []
    for path, impl, what, arg in cases:
        name = f"{what}:{path}:{impl}:{arg}"
        try:
            d = 0 if what == "zero_dim" else D
            h, w, b, t = _problem(d=d)
            shard = VocabShard.even(V, group)
            sl = slice(shard.start, shard.stop)
            if what == "second_order":
                hh, ww, bb = _leaves(h, w[sl], b[sl])
                out = objective(path, hh, ww, t, bb, impl=impl, shard=shard)
                try:
                    torch.autograd.grad(out, (hh,), create_graph=True)
                    fails.append(f"{name}: no error")
                except RuntimeError as e:
                    import re

                    if not re.search(SECOND_ORDER, str(e)):
                        fails.append(f"{name}: unclear error {e}")
                continue
            if what == "loss_scale":  # fp16 head and hidden, the fused schedule with its per-chunk collectives
                g = torch.Generator().manual_seed(5)
                h = torch.randn(256, D, generator=g).half()
                w = (torch.randn(V, D, generator=g) / D**0.5).half()
                t = torch.randint(0, V, (256,), generator=g)
                ref = oracle_grads("mean", h, w, t, None)
                for s in (2.0**15, 2.0**16, 2.0**24):
                    mh, mw = _scaled_grads(
                        lambda a, b, t: oracle_cross_entropy(a, b, t, z_loss=1e-2, dtype=torch.float16), h, w, t, s
                    )
                    hh, ww = _leaves(h, w[sl])
                    out = linear_cross_entropy(hh, ww, t, z_loss=1e-2, shard=shard, impl=impl, chunk_size=64 * V)
                    (out * s).backward()
                    try:
                        _assert_no_worse(f"{name} scale {s} d_hidden", hh.grad, mh, ref[1], s)
                        _assert_no_worse(f"{name} scale {s} d_weight", ww.grad, mw[sl], ref[2][sl], s)
                    except AssertionError as e:
                        fails.append(str(e))
                continue
            if what == "checkpoint":
                got = _checkpointed_grads(path, h, w[sl], t, b[sl], impl, arg, shard=shard)
                ref = _oracle_tanh_grads(path, h, w, t, b)
            else:  # zero_dim
                hh, ww, bb = _leaves(h, w[sl], b[sl])
                out = objective(path, hh, ww, t, bb, impl=impl, shard=shard)
                out.backward()
                got = (out.detach(), hh.grad, ww.grad, bb.grad)
                ref = oracle_grads(path, h, w, t, b)
                if got[1].shape != h.shape or got[2].shape != ww.shape:
                    fails.append(f"{name}: gradient shapes {got[1].shape} {got[2].shape}")
                    continue
            ref = (ref[0], ref[1], ref[2][sl], ref[3][sl])
            for k, x, y in zip(("value", "d_hidden", "d_weight", "d_bias"), got, ref):
                if x.numel() == 0 and y.numel() == 0:
                    continue
                if not torch.allclose(x.double(), y.double(), rtol=1e-4, atol=1e-5):
                    fails.append(f"{name}: {k} max err {float((x.double() - y).abs().max()):.3g}")
        except Exception as e:  # noqa: BLE001 - collected and reported by the parent
            fails.append(f"{name}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
    return fails


def test_tensor_parallel_autograd_contract(tmp_path):
    """On a 2-rank vocab-parallel group, every path: second-order gradients raise, reentrant and non-reentrant
    checkpointing give the oracle's gradients (hidden: full; weight and bias: this rank's rows), D = 0 gives the
    oracle's value, and an fp16 loss scaled by GradScaler's scales is no less accurate than the materialized one."""
    cases = []
    for path in PATHS:
        cases.append((path, "torch", "second_order", None))
        for reentrant in (True, False):
            cases.append((path, "torch", "checkpoint", reentrant))
        cases.append((path, "torch", "zero_dim", None))
    cases.append(("mean", "torch", "loss_scale", None))
    for path in ("mean", "entropy"):
        cases.append((path, "triton", "checkpoint", False))
        cases.append((path, "triton", "zero_dim", None))
    res = run_ranks(_tp_body, 2, tmp_path, kw={"cases": cases}, timeout=400)
    fails = [f"rank {r}: {f}" for r, fs in res.items() for f in fs]
    assert not fails, "\n".join(fails[:20])
