"""torch.compile(fullgraph=True) of a model that calls the loss: same numbers as eager; opcheck."""

import pytest
import torch
from torch import nn

import cce_dist
import cce_dist.engine.compile  # noqa: F401  (registers the cce_dist:: ops)

V, D = 53, 16


class TinyLM(nn.Module):
    """Embedding -> tanh -> linear head, scored with every output form of the library."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids, targets):
        h = torch.tanh(self.emb(ids))
        ce = cce_dist.linear_cross_entropy(
            h,
            self.head.weight,
            targets,
            bias=self.head.bias,
            shift=1,
            label_smoothing=0.1,
            z_loss=1e-3,
            softcap=3.0,
            impl="torch",
        )
        rows, lse = cce_dist.linear_cross_entropy(
            h, self.head.weight, targets, reduction="none", return_lse=True, impl="torch"
        )
        lp, ent = cce_dist.linear_logprobs(
            h, self.head.weight, targets, temperature=0.7, return_entropy=True, impl="torch"
        )
        return ce + 0.5 * rows.mean() + 0.01 * lse.square().mean() - 0.3 * lp.sum() - 0.1 * ent.mean()


def _data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (3, 7), generator=g)
    targets = torch.randint(0, V, (3, 7), generator=g)
    targets[0, :2] = -100
    return ids, targets


def _run(fn, model, ids, targets):
    model.zero_grad(set_to_none=True)
    loss = fn(ids, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check_backend(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyLM()
    ids, targets = _data()
    ref, ref_g = _run(model, model, ids, targets)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got, got_g = _run(compiled, model, ids, targets)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert set(got_g) == set(ref_g) == {"emb.weight", "head.weight", "head.bias"}
    for name in ref_g:
        torch.testing.assert_close(
            got_g[name], ref_g[name], rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_matches_eager(backend):
    _check_backend(backend)


@pytest.mark.slow
def test_fullgraph_inductor_matches_eager():
    """Inductor on CPU compiles C++ (minutes on a small machine): excluded from the default run."""
    _check_backend("inductor")


def test_custom_ops_in_graph_and_shard_refused():
    """The traced graph holds the cce_dist ops (no graph break); shard= under compile says what to do."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    h, w, t = torch.randn(4, 8), torch.randn(11, 8), torch.tensor([1, 2, -100, 10])

    @torch.compile(fullgraph=True, backend=counter)
    def f(h, w, t):
        return cce_dist.linear_cross_entropy(h, w, t, impl="torch")

    torch.testing.assert_close(f(h, w, t), cce_dist.linear_cross_entropy(h, w, t, impl="torch"))
    assert counter.frame_count == 1
    targets = [str(n.target) for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
    assert any("cce_dist.row_stats" in s for s in targets), targets
    # a new token count recompiles once with dynamic shapes (the fake impls are shape-generic)
    h2, t2 = torch.randn(9, 8), torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, -100])
    torch.testing.assert_close(f(h2, w, t2), cce_dist.linear_cross_entropy(h2, w, t2, impl="torch"))
    h3, t3 = torch.randn(13, 8), torch.arange(13) % 11
    torch.testing.assert_close(f(h3, w, t3), cce_dist.linear_cross_entropy(h3, w, t3, impl="torch"))
    assert counter.frame_count == 2

    shard = cce_dist.VocabShard(None, 0, 11)

    @torch.compile(fullgraph=True, backend="eager")
    def g(h, w, t):
        return cce_dist.linear_cross_entropy(h, w, t, shard=shard)

    with pytest.raises(Exception, match="one device only"):
        g(h, w, t)


def test_dynamic_compile_with_options_as_arguments():
    """torch.compile(dynamic=True) may pass float options (label smoothing, z-loss, softcap,
    temperature) as symbolic floats: validating them must trace (it once called math.isfinite,
    which Dynamo cannot), and every value must give the eager numbers."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 8, generator=g)
    w = torch.randn(11, 8, generator=g)
    t = torch.tensor([1, 2, -100, 10, 0, 3])

    def loss(h, w, t, ls, zl, cap, temp):
        ce = cce_dist.linear_cross_entropy(h, w, t, label_smoothing=ls, z_loss=zl, softcap=cap, impl="torch")
        lp, ent = cce_dist.linear_logprobs(h, w, t, temperature=temp, return_entropy=True, impl="torch")
        return ce - lp.sum() + ent.mean()

    f = torch.compile(loss, backend="aot_eager", dynamic=True, fullgraph=True)
    for opts in ((0.1, 1e-3, 3.0, 0.7), (0.2, 0.0, 5.0, 1.3)):
        grads = []
        for fn in (f, loss):
            h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
            out = fn(h1, w1, t, *opts)
            out.backward()
            grads.append((out.detach(), h1.grad, w1.grad))
        for got, ref in zip(*grads):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _op_args():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 8, generator=g)
    w = torch.randn(11, 8, generator=g)
    b = torch.randn(11, generator=g)
    t = torch.tensor([1, 2, -100, 10, 0])
    return h, w, b, t


def _stats_options(impl="torch", **changes):
    kw = dict(
        vocab_start=0,
        softcap=2.0,
        temperature=0.5,
        impl=impl,
        ignore_index=-100,
        chunk_size=16,  # several vocab chunks
        need_entropy=True,
        need_sum=True,
        need_argmax=True,
        need_sumsq=True,
    )
    return {**kw, **changes}


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("with_gamma_weights", [False, True])
@pytest.mark.parametrize("needs", [(True, True, True), (False, True, False), (True, False, True)])
def test_opcheck(with_bias, with_gamma_weights, needs):
    """The two primitives: schema, fake implementation (shapes and dtypes), no aliasing, dynamic shapes."""
    h, w, b, t = _op_args()
    b = b if with_bias else None
    ops = torch.ops.cce_dist
    torch.library.opcheck(ops.row_stats.default, (h, w, b, t), _stats_options())
    stats = ops.row_stats(h, w, b, t, **_stats_options())
    lse = stats[:, 0] + stats[:, 1].log()
    coef = torch.rand(5, 4)
    gw = torch.rand(w.shape[0]) + 0.5 if with_gamma_weights else None
    need_h, need_w, need_b = needs
    torch.library.opcheck(
        ops.grads.default,
        (h, w, b, t, lse, coef, gw),
        dict(
            vocab_start=0,
            softcap=2.0,
            temperature=0.5,
            impl="torch",
            need_hidden=need_h,
            need_weight=need_w,
            need_bias=need_b,
            chunk_size=16,
            filter_eps=None,
            deterministic=False,
        ),
    )


def test_ops_are_the_backend_primitives():
    """The ops are exactly the two primitives of the backend protocol (no loss formula, no autograd formula) and the
    identity whose backward refuses second-order gradients; the primitives give the implementation's own numbers, bit
    for bit."""
    from cce_dist.backend import Backend
    from cce_dist.engine.compile import ops_backend
    from cce_dist.impl import torch_cross_entropy as torch_impl

    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("cce_dist::"))
    assert names == ["cce_dist::first_order", "cce_dist::grads", "cce_dist::row_stats"], names
    h, w, b, t = _op_args()
    ops = ops_backend("torch", h, ignore_index=-100)
    assert isinstance(ops, Backend) and ops.name == "torch"
    assert ops.fused_cross_entropy is None and ops.distill is None
    kw = dict(vocab_start=0, softcap=2.0, temperature=0.5, chunk_size=16)
    got = ops.row_stats(h, w, b, t, **kw, need_argmax=True)
    want = torch_impl.row_stats(h, w, b, t, **kw, need_argmax=True)
    assert torch.equal(got, want)
    lse, coef = got[:, 0] + got[:, 1].log(), torch.rand(5, 4)
    gkw = dict(kw, need_hidden=True, need_weight=False, need_bias=True)
    for x, y in zip(ops.grads(h, w, b, t, lse, coef, **gkw), torch_impl.grads(h, w, b, t, lse, coef, **gkw)):
        assert (x is None and y is None) or torch.equal(x, y)


def test_op_rejects_out_of_range_targets():
    h, w, b, t = _op_args()
    with pytest.raises(ValueError, match=r"targets contain id 11, outside the vocabulary \[0, 11\)"):
        torch.ops.cce_dist.row_stats(h, w, b, torch.tensor([0, 1, 2, 3, 11]), **_stats_options())
    with pytest.raises(ValueError, match=r"targets contain id -1"):
        torch.ops.cce_dist.row_stats(h, w, b, torch.tensor([0, 1, -1, 3, 4]), **_stats_options())
    torch.ops.cce_dist.row_stats(h, w, b, torch.tensor([0, 1, -100, 3, 10]), **_stats_options())  # in range


def test_called_not_traced_functions_carry_dynamos_mark_without_importing_dynamo():
    """The functions torch.compile calls instead of tracing carry the mark ``torch.compiler.assume_constant_result``
    sets (``cce_dist.core.runtime.constant_result`` sets it directly), and importing cce_dist and its integrations
    does not import Dynamo (the public decorator would: 2 s of every ``import cce_dist`` on a CPU)."""
    import subprocess
    import sys

    from cce_dist.core.runtime import constant_result, f32_out_gemm
    from cce_dist.engine.compile import _resolved_name

    def by_torch() -> int:
        return 1

    def by_us() -> int:
        return 1

    torch.compiler.assume_constant_result(by_torch)
    assert vars(by_torch) and vars(constant_result(by_us)) == vars(by_torch)
    for fn in (f32_out_gemm, _resolved_name):
        assert {k: getattr(fn, k, None) for k in vars(by_torch)} == vars(by_torch), fn
    probe = (
        "import sys, cce_dist, cce_dist.engine.compile, cce_dist.kernels, cce_dist.fsdp, cce_dist.hf, cce_dist.trl\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
