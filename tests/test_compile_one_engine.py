"""The compiled path runs the eager engine (issue 28): under ``torch.compile(fullgraph=True)`` Dynamo traces the same
driver, autograd Functions and formulas as eager, and only the backend's two primitives are custom ops.

- Every option of both losses: the compiled forward and every gradient equal the eager two-pass path's bit for bit
  (``grad_in_forward=False``: the compiled path never forms gradients in forward).
- A formula of :mod:`cce_dist.core.formulas` changed at run time changes the compiled result exactly as it changes the
  eager one: the compiled path has no copy of its own.
- compile.py defines no loss formula: it does not import :mod:`cce_dist.core.formulas` nor the class-weight terms.
"""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

import cce_dist
from cce_dist.core import formulas
from cce_dist.engine import compile as C

V, D, N = 29, 8, 12


def _inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.7
    b = torch.randn(V, generator=g) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[[2, 7]] = -100
    return h, w, b, t


def _run(fn, h, w, b, t, **kw):
    """``fn``'s outputs (flattened, floating ones upstream-weighted into one scalar) and the gradients."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    out = fn(h, w, t, bias=b, **kw)
    flat = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            flat.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif x is not None and hasattr(x, "__dataclass_fields__"):
            for name in x.__dataclass_fields__:
                walk(getattr(x, name))

    walk(out)
    g = torch.Generator().manual_seed(7)
    total = sum((x * torch.randn(x.shape, generator=g)).sum() for x in flat if x.requires_grad)
    grads = torch.autograd.grad(total, [x for x in (h, w, b) if x is not None])
    return [x.detach() for x in flat], list(grads)


def _same(fn, compiled_backend="eager", **kw):
    torch._dynamo.reset()
    h, w, b, t = _inputs(bias=kw.pop("bias", True))
    t = torch.where(t == -100, kw.get("ignore_index", -100), t)
    compiled = torch.compile(fn, fullgraph=True, backend=compiled_backend)
    got, got_g = _run(compiled, h, w, b, t, **kw)
    want, want_g = _run(fn, h, w, b, t, **kw)
    assert len(got) == len(want) and len(got_g) == len(want_g)
    for i, (x, y) in enumerate(zip(got + got_g, want + want_g)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())), (i, x, y)


def _ce(h, w, t, **kw):
    return cce_dist.linear_cross_entropy(h, w, t, impl="torch", grad_in_forward=False, **kw)


def _lp(h, w, t, **kw):
    return cce_dist.linear_logprobs(h, w, t, impl="torch", **kw)


CE_CASES = {
    "mean": {},
    "sum": dict(reduction="sum"),
    "none_lse": dict(reduction="none", return_lse=True),
    "smoothing_zloss_softcap": dict(label_smoothing=0.1, z_loss=1e-3, softcap=3.0),
    "no_bias": dict(bias=False, label_smoothing=0.2),
    "ignore_index": dict(ignore_index=V, reduction="none"),
    "shift": dict(shift=1, z_loss=1e-2, return_lse=True),
    "class_weight": dict(class_weight="w", label_smoothing=0.1, z_loss=1e-3),
    "class_weight_softcap_sum": dict(class_weight="w", label_smoothing=0.1, softcap=2.0, reduction="sum"),
    "row_outputs": dict(row_outputs=("predicted", "is_top1", "log_sum_sq_probs", "mean_logit"), return_lse=True),
}


@pytest.mark.parametrize("case", list(CE_CASES))
def test_cross_entropy_compiled_is_eager_bitwise(case):
    kw = dict(CE_CASES[case])
    if kw.get("class_weight") == "w":
        kw["class_weight"] = torch.rand(V, generator=torch.Generator().manual_seed(3)) + 0.25
    _same(_ce, **kw)


LP_CASES = {
    "plain": {},
    "entropy": dict(return_entropy=True),
    "temperature_softcap": dict(return_entropy=True, temperature=0.7, softcap=4.0),
    "no_bias_shift": dict(bias=False, shift=1, return_entropy=True),
    "row_outputs": dict(return_entropy=True, row_outputs=("predicted", "is_top1", "log_sum_sq_probs")),
}


@pytest.mark.parametrize("case", list(LP_CASES))
def test_logprobs_compiled_is_eager_bitwise(case):
    _same(_lp, **LP_CASES[case])


def test_aot_eager_matches_eager():
    """Behind AOTAutograd too (one case each: its graphs run the same ops)."""
    _same(_ce, compiled_backend="aot_eager", label_smoothing=0.1, z_loss=1e-3, softcap=3.0)
    _same(_lp, compiled_backend="aot_eager", return_entropy=True, temperature=0.7)


# ---------------------------------------------------------------------------------------------------------------
# one engine: a formula changed once changes both paths
# ---------------------------------------------------------------------------------------------------------------


def _doubled(fn, index=None):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if index is None:
            return out * 2.0
        return tuple(x * 2.0 if i == index else x for i, x in enumerate(out))

    return wrapper


@pytest.mark.parametrize(
    "formula, index, loss, kw",
    [
        ("cross_entropy_rows", 0, _ce, dict(label_smoothing=0.1)),  # the loss rows
        ("cross_entropy_coef", None, _ce, dict(reduction="none", z_loss=1e-3)),  # the gradient coefficients
        ("logprob_rows", 1, _lp, dict(return_entropy=True)),  # the entropy
        ("logprob_coef", None, _lp, dict(return_entropy=True)),
        ("fold_lse_residual", None, _lp, dict(temperature=0.5)),  # a precaution inside the formulas
    ],
)
def test_a_changed_formula_changes_compiled_and_eager_alike(monkeypatch, formula, index, loss, kw):
    """Proof that the compiled path runs cce_dist.core.formulas (through the autograd Functions), not a copy: doubling a
    formula's output doubles the same values on both paths, which still agree bit for bit."""
    torch._dynamo.reset()
    h, w, b, t = _inputs()
    before, before_g = _run(loss, h, w, b, t, **kw)
    monkeypatch.setattr(formulas, formula, _doubled(getattr(formulas, formula), index))
    _same(loss, **kw)  # compiled == eager with the changed formula
    after, after_g = _run(loss, h, w, b, t, **kw)
    changed = [not torch.equal(x, y) for x, y in zip(before + before_g, after + after_g)]
    assert any(changed), "the patched formula did not change the eager result"
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------------
# compile.py holds no formula
# ---------------------------------------------------------------------------------------------------------------


def test_compile_module_defines_no_loss_formula():
    """compile.py imports neither the formulas nor the class-weight terms nor the Functions' internals: only the
    backend protocol, the option checks it needs and the second-order rule."""
    tree = ast.parse(inspect.getsource(C))
    imported = {
        (node.module or "", alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    modules = {m for m, _ in imported} | {name for m, name in imported if m == ""}
    assert not modules & {"formulas", "class_weight", "outputs"}, imported
    assert ("autograd", "refuse_second_order") in imported
    assert {name for m, name in imported if m == "autograd"} == {"refuse_second_order"}


def test_dynamic_shapes_and_a_new_vocabulary():
    """dynamic=True: the token count stays symbolic, the vocabulary size is specialized (the driver's int; Dynamo
    cannot lift a symbolic size that only the backward reads), so a new vocabulary recompiles and stays exact."""
    torch._dynamo.reset()

    def loss(h, w, t, bias=None):
        return _ce(h, w, t, bias=bias, label_smoothing=0.1, reduction="none")

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=True)
    g = torch.Generator().manual_seed(5)
    for n, v in ((6, 29), (9, 29), (7, 31)):
        h, w = torch.randn(n, D, generator=g), torch.randn(v, D, generator=g)
        t = torch.randint(0, v, (n,), generator=g)
        got, got_g = _run(compiled, h, w, None, t)
        want, want_g = _run(loss, h, w, None, t)
        for x, y in zip(got + got_g, want + want_g):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
