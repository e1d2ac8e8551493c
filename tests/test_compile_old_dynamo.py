"""The compiled path calls nothing that the Dynamo of the torch floor cannot trace.

torch 2.10 / 2.11 (the floor, and the GPU image's torch) cannot trace some builtins that newer Dynamo can:
``locals()``, the ``re`` behind Triton's version check, and ``torch._C._is_autocast_available`` behind
``torch.amp.is_autocast_available``. The last one broke every ``torch.compile(fullgraph=True)`` of the public
functions on torch 2.10 ("Attempted to call function marked as skipped") while CI's torch traced it. CI runs the
newest torch, so this test stands in for the old Dynamo: the helper is replaced by one that raises while Dynamo traces
it, and every public loss must still compile with ``fullgraph=True`` (and give the eager numbers)."""

from __future__ import annotations

import pytest
import torch

import cce_dist

UNTRACEABLE_ON_THE_FLOOR = [(torch.amp, "is_autocast_available")]


@pytest.fixture
def old_dynamo(monkeypatch):
    for owner, name in UNTRACEABLE_ON_THE_FLOOR:
        real = getattr(owner, name)

        def refuse(*args, _real=real, _name=name, **kwargs):
            if torch.compiler.is_compiling():
                raise RuntimeError(f"{_name} cannot be traced by the Dynamo of torch 2.10 / 2.11")
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, refuse)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


LOSSES = {
    "cross_entropy": lambda h, w, t: cce_dist.linear_cross_entropy(h, w, t, impl="torch"),
    "cross_entropy_none": lambda h, w, t: cce_dist.linear_cross_entropy(h, w, t, impl="torch", reduction="none"),
    "logprobs": lambda h, w, t: cce_dist.linear_logprobs(h, w, t, impl="torch", return_entropy=True)[0],
}


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_public_losses_compile_without_builtins_old_dynamo_cannot_trace(old_dynamo, loss):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, generator=g, requires_grad=True)
    w = torch.randn(13, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 13, (6,), generator=g)
    fn = LOSSES[loss]
    want = fn(h, w, t)
    want_grads = torch.autograd.grad(want.sum(), (h, w))
    got = torch.compile(fn, fullgraph=True, backend="eager")(h, w, t)
    got_grads = torch.autograd.grad(got.sum(), (h, w))
    # the same implementation and chunking as eager, but eager's scalar loss runs the fused schedule (gradients formed
    # in forward) and the compiled one the two-pass schedule (gradients in backward): the same float32 terms, summed
    # in another order where the CPU's vector width changes how torch reduces them (1 ulp of the loss seen on one
    # Xeon, 0 on CI's), so the values within a few ulps (rtol 1e-6, ~8 ulps) and the gradients within ~100
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("field", ["z_loss", "label_smoothing", "softcap"])
def test_options_rebuilt_from_graph_proxies_are_not_validated_again(field):
    """Dynamo of torch 2.10 / 2.11 rebuilds the frozen options passed to CrossEntropyRows.apply from torch.fx proxies
    under dynamic=True; re-validating them raised "z_loss must be a finite number >= 0, got Proxy(item)" inside
    Dynamo. A rebuild is accepted as is; a real bad value still raises."""
    from cce_dist.options import CrossEntropyOptions

    graph = torch.fx.Graph()
    proxy = torch.fx.Proxy(graph.placeholder("x"), torch.fx.proxy.GraphAppendingTracer(graph))
    rebuilt = CrossEntropyOptions(**{field: proxy})
    assert getattr(rebuilt, field) is proxy
    with pytest.raises(ValueError, match=field):
        CrossEntropyOptions(**{field: float("nan")})


#: the modules Dynamo traces under torch.compile (the public entry points, the engine, the core)
TRACED_PACKAGES = ("cce_dist.api", "cce_dist.distill", "cce_dist.engine", "cce_dist.core")
LITERAL = (type(None), bool, int, float, str)


def _literal(v) -> bool:
    return isinstance(v, LITERAL) or (isinstance(v, tuple) and all(_literal(x) for x in v))


def _traced_modules():
    import importlib
    import pkgutil

    for name in TRACED_PACKAGES:
        mod = importlib.import_module(name)
        yield mod
        for info in pkgutil.iter_modules(getattr(mod, "__path__", [])):
            yield importlib.import_module(f"{name}.{info.name}")


def test_traced_code_has_only_literal_defaults():
    """A default value that is an object (``slice(None)``, a dataclass instance) or a dataclass ``default_factory``
    broke the Dynamo of torch 2.10 / 2.11 ("SourcelessBuilder.create does not know how to wrap <class 'slice'>",
    a ``default_factory`` field left None) where newer Dynamo traces it: in the traced modules every default of a
    function, method or dataclass field is a literal (None, bool, int, float, str or a tuple of them)."""
    import dataclasses
    import inspect

    bad = []
    for mod in _traced_modules():
        for obj_name, obj in vars(mod).items():
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            functions = [(obj_name, obj)] if inspect.isfunction(obj) else []
            if inspect.isclass(obj):
                functions += [(f"{obj_name}.{n}", f) for n, f in vars(obj).items() if inspect.isfunction(f)]
                functions += [
                    (f"{obj_name}.{n}", f.__func__) for n, f in vars(obj).items() if isinstance(f, staticmethod)
                ]
                if dataclasses.is_dataclass(obj):
                    for f in dataclasses.fields(obj):
                        if f.default_factory is not dataclasses.MISSING:
                            bad.append(f"{mod.__name__}.{obj_name}.{f.name}: default_factory")
                        elif f.default is not dataclasses.MISSING and not _literal(f.default):
                            bad.append(f"{mod.__name__}.{obj_name}.{f.name} = {f.default!r}")
            for fn_name, fn in functions:
                if getattr(fn, "__module__", None) != mod.__name__:
                    continue
                for p in inspect.signature(fn).parameters.values():
                    if p.default is not inspect.Parameter.empty and not _literal(p.default):
                        bad.append(f"{mod.__name__}.{fn_name}({p.name}={p.default!r})")
    assert not bad, bad
