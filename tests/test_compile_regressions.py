"""torch.compile regressions: the compiled path runs the eager validation (a vocabulary too large for exact predicted
ids is refused, not answered wrongly), the public entry points trace on the torch floor (no ``locals()``, which
Dynamo 2.10 / 2.11 cannot trace), distillation under compile says what to do instead of failing inside Dynamo, and
tracing the entry points warns nothing."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

import cce_dist
from cce_dist import api, distill
from cce_dist.engine import compile as _compile  # noqa: F401 - registers the cce_dist custom ops

# ---------------------------------------------------------------------------------------------------------------
# 1. predicted / is_top1 beyond 2**24 ids: the same refusal as eager
# ---------------------------------------------------------------------------------------------------------------

TOO_LARGE = r"row_outputs 'predicted' / 'is_top1' need a vocabulary below 2\*\*24 ids"


def _beyond_exact_ids():
    """V = 2**24 + 2 (D = 1: 64 MiB of float32 head) whose top logit is id 2**24 + 1, which float32 rounds to 2**24."""
    v = 2**24 + 2
    w = torch.zeros(v, 1)
    w[v - 1] = 1.0
    h = torch.ones(2, 1)
    t = torch.tensor([v - 1, 0])
    return h, w, t


@pytest.mark.parametrize("form", ["cross_entropy", "logprobs"])
@pytest.mark.parametrize("names", [("predicted",), ("predicted", "is_top1"), ("is_top1",)])
def test_compiled_refuses_predicted_beyond_exact_float32_ids(form, names):
    h, w, t = _beyond_exact_ids()
    fn = cce_dist.linear_cross_entropy if form == "cross_entropy" else cce_dist.linear_logprobs

    def loss(h, w, t):
        return fn(h, w, t, impl="torch", row_outputs=names)

    with pytest.raises(ValueError, match=TOO_LARGE):
        loss(h, w, t)
    torch._dynamo.reset()
    # before: predicted 16777217 came back as 16777216 and is_top1 False, silently. The eager check now runs while
    # Dynamo traces the call: fullgraph=True reports the ValueError (its type and message) as an observed exception
    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="ValueError.*" + TOO_LARGE):
        compiled(h, w, t)
    # without fullgraph Dynamo breaks the graph there and the call raises the ValueError itself
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=TOO_LARGE):
        torch.compile(loss, backend="eager")(h, w, t)


def test_compiled_row_outputs_below_the_limit_still_work():
    """The check runs at trace time on the vocabulary size; a vocabulary within it compiles and matches eager."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g)
    t = torch.tensor([1, 2, -100, 10, 0])
    names = ("predicted", "is_top1", "log_sum_sq_probs", "mean_logit")

    def loss(h, w, t):
        return cce_dist.linear_cross_entropy(h, w, t, impl="torch", row_outputs=names)

    torch._dynamo.reset()
    got_loss, got = torch.compile(loss, fullgraph=True, backend="eager")(h, w, t)
    ref_loss, ref = loss(h, w, t)
    torch.testing.assert_close(got_loss, ref_loss)
    for name in names:
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), msg=name)


# ---------------------------------------------------------------------------------------------------------------
# 2. no locals() in the public entry points (Dynamo of torch 2.10 / 2.11 cannot trace it)
# ---------------------------------------------------------------------------------------------------------------


def _calls(module):
    tree = ast.parse(inspect.getsource(module))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


@pytest.mark.parametrize("module", [api, distill], ids=lambda m: m.__name__)
def test_entry_points_do_not_call_locals(module):
    lines = [n.lineno for n in _calls(module) if isinstance(n.func, ast.Name) and n.func.id in ("locals", "vars")]
    assert not lines, f"{module.__name__} calls locals()/vars() on lines {lines}"


@pytest.mark.parametrize("module", [api, distill], ids=lambda m: m.__name__)
def test_entry_points_pass_each_option_under_its_own_name(module):
    """``Options.from_keywords(name=name, ...)``: every option is passed by its own parameter's name, so no value can
    land in another field (from_keywords checks that the names are exactly the fields)."""
    calls = [n for n in _calls(module) if isinstance(n.func, ast.Attribute) and n.func.attr == "from_keywords"]
    assert calls
    for call in calls:
        assert not call.args
        for kw in call.keywords:
            assert isinstance(kw.value, ast.Name) and kw.value.id == kw.arg, ast.dump(kw)


def test_from_keywords_takes_exactly_the_fields():
    from cce_dist.core.options import LogprobOptions

    fields = {name: getattr(LogprobOptions(), name) for name in LogprobOptions.FIELD_NAMES}
    assert LogprobOptions.from_keywords(**fields) == LogprobOptions()
    with pytest.raises(TypeError, match="temperature"):
        LogprobOptions.from_keywords(**{k: v for k, v in fields.items() if k != "temperature"})
    with pytest.raises(TypeError, match="not_an_option"):
        LogprobOptions.from_keywords(**fields, not_an_option=1)


def test_public_functions_compile_fullgraph():
    """The public functions themselves under torch.compile(fullgraph=True) (on torch 2.10 / 2.11 this failed on
    ``locals()``): the eager numbers and gradients."""
    g = torch.Generator().manual_seed(2)
    h0, w0 = torch.randn(6, 8, generator=g), torch.randn(11, 8, generator=g)
    t = torch.tensor([1, 2, -100, 10, 0, 3])

    def loss(h, w, t):
        ce = cce_dist.linear_cross_entropy(h, w, t, label_smoothing=0.1, impl="torch")
        lp, ent = cce_dist.linear_logprobs(h, w, t, temperature=0.7, return_entropy=True, impl="torch")
        return ce - lp.sum() + ent.mean()

    torch._dynamo.reset()
    out = []
    for fn in (torch.compile(loss, fullgraph=True, backend="aot_eager"), loss):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        value = fn(h, w, t)
        value.backward()
        out.append((value.detach(), h.grad, w.grad))
    for got, ref in zip(*out):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# 3. distillation under torch.compile: a clear refusal naming the alternative
# ---------------------------------------------------------------------------------------------------------------


def _distill_inputs():
    g = torch.Generator().manual_seed(4)
    sh = torch.randn(5, 8, generator=g, requires_grad=True)
    sw = torch.randn(11, 8, generator=g, requires_grad=True)
    th, tw = torch.randn(5, 6, generator=g), torch.randn(11, 6, generator=g)
    return sh, sw, th, tw


def test_distillation_fullgraph_refused_clearly():
    sh, sw, th, tw = _distill_inputs()

    def loss(sh, sw, th, tw):
        return cce_dist.linear_distillation(sh, sw, th, tw, impl="torch")

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    # raised before Dynamo reaches the chunked loops (it failed there on a data-dependent branch); fullgraph=True
    # reports the NotImplementedError (type and message) as an observed exception
    with pytest.raises(Exception, match=r"NotImplementedError.*torch\.compile.*torch\.compiler\.disable"):
        compiled(sh, sw, th, tw)


def test_distillation_without_fullgraph_runs_eagerly():
    """Without fullgraph the refusal is a graph break: the loss runs eagerly and gives the eager values."""
    sh, sw, th, tw = _distill_inputs()

    def loss(sh, sw, th, tw):
        return cce_dist.linear_distillation(sh, sw, th, tw, impl="torch")

    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(loss, backend="eager")(sh, sw, th, tw), loss(sh, sw, th, tw))


def test_distillation_behind_compiler_disable_matches_eager():
    """The alternative the refusal names: the loss behind torch.compiler.disable inside a compiled model."""
    sh0, sw0, th, tw = _distill_inputs()
    disabled = torch.compiler.disable(cce_dist.linear_distillation)

    def loss(sh, sw, th, tw):
        return disabled(torch.tanh(sh), sw, th, tw, divergence="jsd", impl="torch")

    def eager(sh, sw, th, tw):
        return cce_dist.linear_distillation(torch.tanh(sh), sw, th, tw, divergence="jsd", impl="torch")

    torch._dynamo.reset()
    out = []
    for fn in (torch.compile(loss, backend="aot_eager"), eager):
        sh, sw = sh0.detach().clone().requires_grad_(), sw0.detach().clone().requires_grad_()
        value = fn(sh, sw, th, tw)
        value.backward()
        out.append((value.detach(), sh.grad, sw.grad))
    for got, ref in zip(*out):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_triton_impl_resolves_under_fullgraph():
    """impl="triton" is resolved by the driver at trace time without tracing the Triton version check (a regular
    expression Dynamo of torch 2.10 / 2.11 cannot trace): the eager numbers."""
    pytest.importorskip("cce_dist.kernels")
    from cce_dist import kernels

    if not kernels.available():
        pytest.skip("the Triton kernels cannot run here")
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(5, 16, generator=g), torch.randn(11, 16, generator=g)
    t = torch.tensor([1, 2, -100, 10, 0])

    def loss(h, w, t):
        return cce_dist.linear_logprobs(h, w, t, impl="triton", return_entropy=True)

    torch._dynamo.reset()
    for got, ref in zip(torch.compile(loss, fullgraph=True, backend="eager")(h, w, t), loss(h, w, t)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# 4. no warning from tracing cce_dist
# ---------------------------------------------------------------------------------------------------------------


def _compiled_calls():
    """One call of each compiled form: the scalar loss, per-token losses with the lse, logprobs with the entropy and
    row outputs, the module."""
    return {
        "cross_entropy": lambda h, w, t, impl: cce_dist.linear_cross_entropy(h, w, t, impl=impl),
        "cross_entropy_none": lambda h, w, t, impl: sum(
            x.sum() for x in cce_dist.linear_cross_entropy(h, w, t, impl=impl, reduction="none", return_lse=True)
        ),
        "logprobs": lambda h, w, t, impl: sum(
            x.sum() for x in cce_dist.linear_logprobs(h, w, t, impl=impl, return_entropy=True)
        ),
        "row_outputs": lambda h, w, t, impl: cce_dist.linear_logprobs(h, w, t, impl=impl, row_outputs=("is_top1",))[
            0
        ].sum(),
        "module": lambda h, w, t, impl: cce_dist.LinearCrossEntropy(impl=impl)(h, w, t),
    }


@pytest.mark.parametrize("impl", ["torch", "auto", "triton"])
@pytest.mark.parametrize("form", list(_compiled_calls()))
def test_tracing_cce_dist_warns_nothing(form, impl):
    """torch.compile of each entry point, forward and backward, warns nothing: Dynamo warned "Silent incorrectness is
    only a *potential* risk" where it traced the ``functools.cache``-wrapped ``impl.backends.triton`` (impl="triton",
    and "auto" on CUDA tensors; torch 2.13 and 2.15). Dynamo warns once per message and process, so its memo is
    cleared first."""
    if impl == "triton":
        pytest.importorskip("cce_dist.kernels")
        from cce_dist import kernels

        if not kernels.available():
            pytest.skip("the Triton kernels cannot run here")
    import warnings

    import torch._dynamo.utils as dynamo_utils

    getattr(dynamo_utils, "warn_once_cache", set()).clear()
    g = torch.Generator().manual_seed(9)
    h = torch.randn(5, 16, generator=g, requires_grad=True)
    w = torch.randn(11, 16, generator=g, requires_grad=True)
    t = torch.tensor([1, 2, -100, 10, 0])
    call = _compiled_calls()[form]
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = torch.compile(lambda h, w, t: call(h, w, t, impl), fullgraph=True, backend="eager")(h, w, t)
        got_grads = torch.autograd.grad(got, (h, w))
    assert [f"{x.category.__name__}: {x.message}" for x in seen] == []
    want = call(h, w, t, impl)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, torch.autograd.grad(want, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
