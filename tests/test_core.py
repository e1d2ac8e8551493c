"""Single-device tests of cce_dist against the materialized oracle (tests/oracle.py).

Covers forward and backward (hidden, weight, bias) for every option and combinations
of them, both schedules of the torch implementation (gradients formed in forward, and the
recompute-in-backward path), reductions, per-token upstream gradients, shift, edge shapes,
low-precision and mixed dtypes, autocast, non-negativity, no in-place writes, the module form,
input validation, and memory (no [N, V]-sized tensor saved or allocated).

Shapes are deliberately odd: N = 37 tokens, V = 53 (prime) vocab entries, D = 19, and a
chunk_size that gives 5 tokens per chunk (8 chunks, the last one partial).
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from helpers import leaf
from oracle import oracle_cross_entropy, oracle_logits, oracle_logprobs, shift_targets
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import cce_dist
from cce_dist import LinearCrossEntropy, linear_cross_entropy, linear_logprobs

N, V, D = 37, 53, 19
CHUNK = 5 * V + 7  # 5 tokens of V logits per chunk: 8 chunks for N = 37, the last holds 2 tokens
IGN = -100
GIF = [None, True, False]  # grad_in_forward: default, forced fused schedule, forced recompute
REDUCTIONS = ["mean", "sum", "none"]

CE_OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"label_smoothing": 1.0},
    {"z_loss": 1e-2},
    {"softcap": 3.0},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0},
    {"label_smoothing": 0.1, "ignore_index": 7},  # an ignore_index inside [0, V)
    {"z_loss": 1e-3, "softcap": 2.0, "ignore_index": -1},
]
LP_OPTIONS = [
    {},
    {"softcap": 3.0},
    {"temperature": 0.7},
    {"temperature": 1.9, "softcap": 4.0},
    {"temperature": 0.5, "ignore_index": 7},
]


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These shapes are tiny: intra-op threads only add synchronization (10x slower measured on a
    loaded 2-core machine), and under ``-n 2`` the xdist workers already use both cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _id(opts: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in opts.items()) or "plain"


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def make_inputs(
    n=N,
    v=V,
    d=D,
    *,
    shape=None,
    dtype=torch.float32,
    bias=True,
    seed=0,
    scale=2.0,
    ignore_frac=0.2,
    ignore_index=IGN,
    wdtype=None,
    bdtype=None,
):
    """(hidden, weight, bias, targets) with logits of std ~ ``scale``; ~ignore_frac targets ignored."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape) if shape is not None else (n,)
    h = torch.randn(*shape, d, generator=g)
    w = torch.randn(v, d, generator=g) * (scale / math.sqrt(d))
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    t = torch.randint(0, v, shape, generator=g)
    if ignore_frac:
        t[torch.rand(shape, generator=g) < ignore_frac] = ignore_index
    wdtype = wdtype or dtype
    bdtype = bdtype or wdtype
    return h.to(dtype), w.to(wdtype), None if b is None else b.to(bdtype), t


def leaves(h, w, b):
    return leaf(h), leaf(w), leaf(b)


def grads(outputs, inputs, grad_outputs):
    """d(outputs)/d(inputs) for the given upstream gradients (None for inputs that are None)."""
    present = [x for x in inputs if x is not None]
    got = iter(torch.autograd.grad(outputs, present, grad_outputs, retain_graph=True))
    return [None if x is None else next(got) for x in inputs]


def upstream(out: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A non-trivial upstream gradient: 0.7 for a scalar, random (mixed signs) per token."""
    if out.dim() == 0:
        return torch.tensor(0.7)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=g)


def assert_close32(got, want, *, rtol=2e-4, atol=2e-5, what=""):
    """Tight fp32 comparison; the absolute part scales with the reference's magnitude."""
    assert got is not None and want is not None, what
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(1.0, float(want.detach().float().abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(
        got.detach().float(), want.detach().float(), rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}"
    )


def max_err(x, ref):
    if x.numel() == 0:
        return 0.0
    return float((x.detach().float() - ref.detach().float()).abs().max())


def assert_no_worse_than_materialized(got, mat, ref, dtype, what):
    """Low-precision accuracy rule.

    ``ref`` is the fp32 oracle on the same (already rounded) input values; ``mat`` is the
    materialized computation in ``dtype`` (logits rounded to ``dtype`` by one F.linear, softmax
    in fp32; its backward does the dtype GEMMs autograd does). Rounding the logits to bf16/fp16 is
    an error every implementation inherits, so an absolute tolerance cannot be fixed in advance:
    we measure the materialized error and require cce_dist's to be at most 2x of it, plus one
    ``dtype`` resolution step at the reference's largest magnitude. That slack covers one extra
    rounding of the output (cce_dist rounds gradients from fp32 accumulators to ``dtype``; the
    materialized GEMM rounds differently) when the materialized error happens to be tiny.
    """
    e_mat, e_got = max_err(mat, ref), max_err(got, ref)
    slack = torch.finfo(dtype).eps * max(float(ref.detach().float().abs().max()), 1e-3)
    assert e_got <= 2.0 * e_mat + slack, (
        f"{what}: cce_dist error {e_got:.3e} > 2 * materialized {e_mat:.3e} + {slack:.3e}"
    )


def snapshot(*ts):
    return [None if t is None else t.detach().clone() for t in ts]


def assert_unchanged(before, *ts):
    for b, t in zip(before, ts):
        if t is None:
            continue
        assert torch.equal(b, t.detach()), "an input was modified in place"


# ----------------------------------------------------------------------------------------------
# fp32: forward and backward against the oracle, every option, both schedules
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opts", CE_OPTIONS, ids=_id)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_cross_entropy_fp32_matches_oracle(opts, reduction, gif, bias):
    ign = opts.get("ignore_index", IGN)
    h, w, b, t = make_inputs(bias=bias, ignore_index=ign, seed=len(_id(opts)))
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    before = snapshot(h, w, b, t)
    loss = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, chunk_size=CHUNK, grad_in_forward=gif, impl="torch", **opts
    )
    ref = oracle_cross_entropy(h2, w2, t, b2, reduction=reduction, **opts)
    assert loss.dtype == torch.float32
    assert loss.shape == ref.shape == ((N,) if reduction == "none" else ())
    assert_close32(loss, ref, what="loss")
    g = upstream(ref)
    got, want = grads(loss, (h1, w1, b1), g), grads(ref, (h2, w2, b2), g)
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        if y is not None:
            assert_close32(x, y, what=f"d{name}")
    assert_unchanged(before, h, w, b, t)


@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.3, "z_loss": 1e-2, "softcap": 4.0}], ids=_id)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", [None, False], ids=lambda g: f"gif={g}")
def test_return_lse_with_gradient_through_lse(opts, reduction, gif):
    h, w, b, t = make_inputs(seed=3)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    loss, lse = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, return_lse=True, chunk_size=CHUNK, grad_in_forward=gif, **opts
    )
    rloss, rlse = oracle_cross_entropy(h2, w2, t, b2, reduction=reduction, return_lse=True, **opts)
    assert lse.dtype == torch.float32 and lse.shape == t.shape
    assert_close32(loss, rloss, what="loss")
    assert_close32(lse, rlse, what="lse")
    g_loss, g_lse = upstream(rloss, seed=5), upstream(rlse, seed=6)
    got = grads((loss, lse), (h1, w1, b1), (g_loss, g_lse))
    want = grads((rloss, rlse), (h2, w2, b2), (g_loss, g_lse))
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        assert_close32(x, y, what=f"d{name}")
    # a gradient through lse alone (the loss unused)
    got = grads(lse, (h1, w1, b1), g_lse)
    want = grads(rlse, (h2, w2, b2), g_lse)
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        assert_close32(x, y, what=f"lse-only d{name}")


@pytest.mark.parametrize("opts", LP_OPTIONS, ids=_id)
@pytest.mark.parametrize("which", ["logprob", "entropy", "both", "no_entropy"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_logprobs_entropy_fp32_matches_oracle(opts, which, bias):
    ign = opts.get("ignore_index", IGN)
    h, w, b, t = make_inputs(bias=bias, ignore_index=ign, seed=11)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    before = snapshot(h, w, b, t)
    ret_ent = which != "no_entropy"
    out = linear_logprobs(h1, w1, t, bias=b1, return_entropy=ret_ent, chunk_size=CHUNK, **opts)
    ref = oracle_logprobs(h2, w2, t, b2, return_entropy=ret_ent, **opts)
    if not ret_ent:
        out, ref = (out,), (ref,)
    for x, y, name in zip(out, ref, ("logprob", "entropy")):
        assert x.dtype == torch.float32 and x.shape == t.shape
        assert_close32(x, y, what=name)
    valid = t != ign
    assert bool((out[0][~valid] == 0).all())
    if which == "logprob":
        sel = [0]
    elif which == "entropy":
        sel = [1]
    else:
        sel = list(range(len(out)))
    gs = [upstream(ref[i], seed=20 + i) for i in sel]
    got = grads([out[i] for i in sel], (h1, w1, b1), gs)
    want = grads([ref[i] for i in sel], (h2, w2, b2), gs)
    for name, x, y in zip(("hidden", "weight", "bias"), got, want):
        if y is not None:
            assert_close32(x, y, what=f"d{name}")
    assert_unchanged(before, h, w, b, t)


@pytest.mark.parametrize("chunk_size", [1, V - 1, V, V + 1, 3 * V + 1, N * V - 1, N * V, 1 << 30, None])
@pytest.mark.parametrize("gif", [None, False], ids=lambda g: f"gif={g}")
def test_chunk_sizes(chunk_size, gif):
    """Any chunk_size (smaller than a row, not a multiple of V, larger than everything) is exact."""
    opts = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}
    h, w, b, t = make_inputs(seed=4)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=chunk_size, grad_in_forward=gif, **opts)
    ref = oracle_cross_entropy(h2, w2, t, b2, **opts)
    assert_close32(loss, ref)
    for x, y in zip(grads(loss, (h1, w1, b1), None), grads(ref, (h2, w2, b2), None)):
        assert_close32(x, y)
    lp, ent = linear_logprobs(h1, w1, t, bias=b1, chunk_size=chunk_size, return_entropy=True, temperature=0.8)
    rlp, rent = oracle_logprobs(h2, w2, t, b2, return_entropy=True, temperature=0.8)
    assert_close32(lp, rlp)
    assert_close32(ent, rent)
    g = (upstream(rlp, 2), upstream(rent, 3))
    for x, y in zip(grads((lp, ent), (h1, w1, b1), g), grads((rlp, rent), (h2, w2, b2), g)):
        assert_close32(x, y)


@pytest.mark.parametrize("needs", ["hidden", "weight", "bias", "hidden+bias", "weight+bias"])
@pytest.mark.parametrize("gif", [None, False], ids=lambda g: f"gif={g}")
def test_subset_of_inputs_requires_grad(needs, gif):
    h, w, b, t = make_inputs(seed=5)
    want_h, want_w, want_b = ("hidden" in needs), ("weight" in needs), ("bias" in needs)
    h1, w1, b1 = (leaf(x) if f else x.clone() for x, f in ((h, want_h), (w, want_w), (b, want_b)))
    h2, w2, b2 = (leaf(x) if f else x.clone() for x, f in ((h, want_h), (w, want_w), (b, want_b)))
    loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=gif, label_smoothing=0.1)
    ref = oracle_cross_entropy(h2, w2, t, b2, label_smoothing=0.1)
    loss.backward()
    ref.backward()
    for x, y in ((h1, h2), (w1, w2), (b1, b2)):
        if y.requires_grad:
            assert_close32(x.grad, y.grad)
        else:
            assert x.grad is None


def test_no_grad_and_no_requires_grad():
    h, w, b, t = make_inputs(seed=6)
    ref = oracle_cross_entropy(h, w, t, b, z_loss=1e-3)
    plain = linear_cross_entropy(h, w, t, bias=b, chunk_size=CHUNK, z_loss=1e-3)
    assert plain.grad_fn is None and not plain.requires_grad
    assert_close32(plain, ref)
    h1, w1, b1 = leaves(h, w, b)
    with torch.no_grad():
        out = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, z_loss=1e-3)
        lp = linear_logprobs(h1, w1, t, bias=b1, chunk_size=CHUNK)
    assert not out.requires_grad and not lp.requires_grad
    assert torch.equal(out, plain)
    assert_close32(lp, oracle_logprobs(h, w, t, b))


def test_impl_auto_equals_torch_on_cpu():
    h, w, b, t = make_inputs(seed=7)
    a = linear_cross_entropy(h, w, t, bias=b, impl="auto", chunk_size=CHUNK, reduction="none")
    c = linear_cross_entropy(h, w, t, bias=b, impl="torch", chunk_size=CHUNK, reduction="none")
    assert torch.equal(a, c)


def test_deterministic_repeat():
    h, w, b, t = make_inputs(seed=8)
    outs = []
    for _ in range(2):
        h1, w1, b1 = leaves(h, w, b)
        loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, label_smoothing=0.1)
        loss.backward()
        outs.append((loss.detach(), h1.grad, w1.grad, b1.grad))
    for x, y in zip(*outs):
        assert torch.equal(x, y)


@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
def test_int32_targets_and_noncontiguous_inputs(gif):
    h, w, b, t = make_inputs(seed=9)
    # hidden and weight as transposed views of column-major storage, targets as int32
    h_nc = leaf(h.t().contiguous()).t()
    w_nc_leaf = leaf(w.t().contiguous())
    w_nc = w_nc_leaf.t()
    assert not h_nc.is_contiguous() and not w_nc.is_contiguous()
    h_leaf = h_nc._base if h_nc._base is not None else h_nc
    loss = linear_cross_entropy(
        h_nc, w_nc, t.to(torch.int32), bias=b, chunk_size=CHUNK, grad_in_forward=gif, label_smoothing=0.1
    )
    h2, w2 = leaf(h), leaf(w)
    ref = oracle_cross_entropy(h2, w2, t, b, label_smoothing=0.1)
    assert_close32(loss, ref)
    loss.backward()
    ref.backward()
    assert_close32(h_leaf.grad.t(), h2.grad)
    assert_close32(w_nc_leaf.grad.t(), w2.grad)


# ----------------------------------------------------------------------------------------------
# shift, edge shapes, ignore handling
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift", [True, 2, 20], ids=lambda s: f"shift={s}")
@pytest.mark.parametrize("shape", [(3, 11), (11,)], ids=["BSD", "SD"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", [None, False], ids=lambda g: f"gif={g}")
def test_shift(shift, shape, reduction, gif):
    h, w, b, t = make_inputs(shape=shape, seed=12, ignore_frac=0.1)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    before = snapshot(t)
    loss = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, shift=shift, chunk_size=2 * V, grad_in_forward=gif, label_smoothing=0.1
    )
    ref = oracle_cross_entropy(h2, w2, t, b2, reduction=reduction, shift=shift, label_smoothing=0.1)
    assert loss.shape == ref.shape
    assert_close32(loss, ref)
    if reduction == "none":  # the last `shift` positions are ignored
        assert bool((loss[..., -int(shift) :] == 0).all())
    g = upstream(ref)
    for x, y in zip(grads(loss, (h1, w1, b1), g), grads(ref, (h2, w2, b2), g)):
        assert_close32(x, y)
    # the oracle's shift agrees with an explicit shift of the targets, and cce_dist does too
    st = shift_targets(t, shift, IGN)
    assert torch.equal(st[..., : max(shape[-1] - int(shift), 0)], t[..., int(shift) :])
    explicit = linear_cross_entropy(h, w, st, bias=b, reduction=reduction, chunk_size=2 * V, label_smoothing=0.1)
    assert_close32(loss, explicit)
    lp = linear_logprobs(h1, w1, t, bias=b1, shift=shift, chunk_size=2 * V, temperature=0.9)
    rlp = oracle_logprobs(h2, w2, t, b2, shift=shift, temperature=0.9)
    assert lp.shape == t.shape
    assert_close32(lp, rlp)
    assert_unchanged(before, t)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
@pytest.mark.parametrize("case", ["N=1", "D=1", "V=1", "V=2", "duplicate_targets", "shared_target_in_chunk"])
def test_edge_shapes_and_targets(case, reduction, gif):
    n, v, d = N, V, D
    if case == "N=1":
        n = 1
    elif case == "D=1":
        d = 1
    elif case == "V=1":
        v = 1
    elif case == "V=2":
        v = 2
    h, w, b, t = make_inputs(n, v, d, seed=13, ignore_frac=0.0 if case == "N=1" else 0.2)
    if case == "duplicate_targets":
        t[t != IGN] = 5  # every valid token has the same target
    elif case == "shared_target_in_chunk":
        t[:] = torch.arange(n) // 3 % v  # consecutive tokens (same chunk) share targets
    opts = {"label_smoothing": 0.1, "z_loss": 1e-3}
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    loss = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, chunk_size=3 * v + 1, grad_in_forward=gif, **opts
    )
    ref = oracle_cross_entropy(h2, w2, t, b2, reduction=reduction, **opts)
    assert_close32(loss, ref)
    g = upstream(ref)
    for x, y in zip(grads(loss, (h1, w1, b1), g), grads(ref, (h2, w2, b2), g)):
        assert_close32(x, y)
    lp, ent = linear_logprobs(h1, w1, t, bias=b1, chunk_size=3 * v + 1, return_entropy=True)
    rlp, rent = oracle_logprobs(h2, w2, t, b2, return_entropy=True)
    assert_close32(lp, rlp)
    assert_close32(ent, rent)


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 5)], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
def test_empty_batch(shape, reduction, gif):
    h, w, b, t = make_inputs(shape=shape, seed=14)
    h1, w1, b1 = leaves(h, w, b)
    loss = linear_cross_entropy(
        h1, w1, t, bias=b1, reduction=reduction, chunk_size=CHUNK, grad_in_forward=gif, label_smoothing=0.1, z_loss=1e-3
    )
    ref = oracle_cross_entropy(h, w, t, b, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
    assert loss.dtype == torch.float32
    if reduction == "none":
        assert loss.shape == shape
    else:
        assert loss.shape == () and float(loss.detach()) == 0.0 == float(ref)
    gh, gw, gb = grads(loss, (h1, w1, b1), upstream(loss) if loss.numel() else torch.zeros(shape))
    assert gh.shape == h.shape and gw.shape == w.shape and gb.shape == b.shape
    assert not gw.any() and not gb.any() and not gh.any()
    lp, ent = linear_logprobs(h1, w1, t, bias=b1, return_entropy=True, chunk_size=CHUNK)
    assert lp.shape == ent.shape == shape
    gh, gw, gb = grads((lp, ent), (h1, w1, b1), (torch.zeros(shape), torch.zeros(shape)))
    assert not gw.any() and not gb.any()


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
@pytest.mark.parametrize("ignore_index", [IGN, 0], ids=lambda i: f"ignore={i}")
def test_all_targets_ignored(reduction, gif, ignore_index):
    h, w, b, t = make_inputs(seed=15)
    t[:] = ignore_index
    h1, w1, b1 = leaves(h, w, b)
    loss = linear_cross_entropy(
        h1,
        w1,
        t,
        bias=b1,
        reduction=reduction,
        chunk_size=CHUNK,
        grad_in_forward=gif,
        ignore_index=ignore_index,
        label_smoothing=0.2,
        z_loss=1e-2,
        softcap=3.0,
    )
    assert torch.isfinite(loss).all()
    assert not loss.any(), "all-ignored loss must be exactly 0 (mean: 0, not NaN)"
    ref = oracle_cross_entropy(
        h, w, t, b, reduction=reduction, ignore_index=ignore_index, label_smoothing=0.2, z_loss=1e-2, softcap=3.0
    )
    assert torch.equal(loss.detach(), ref)
    for g in grads(loss, (h1, w1, b1), upstream(loss)):
        assert torch.isfinite(g).all() and not g.any()
    lp, ent = linear_logprobs(h1, w1, t, bias=b1, return_entropy=True, chunk_size=CHUNK, ignore_index=ignore_index)
    assert not lp.any() and not ent.any()
    for g in grads((lp, ent), (h1, w1, b1), (upstream(lp, 1), upstream(ent, 2))):
        assert torch.isfinite(g).all() and not g.any()


def test_ignored_rows_have_no_gradient():
    """Gradient rows of ignored tokens are exactly zero, whatever their upstream gradient."""
    h, w, b, t = make_inputs(seed=16, ignore_frac=0.4)
    ignored = t == IGN
    assert ignored.any() and (~ignored).any()
    for gif in GIF:
        h1 = leaf(h)
        loss = linear_cross_entropy(
            h1, w, t, bias=b, chunk_size=CHUNK, grad_in_forward=gif, reduction="sum", label_smoothing=0.3
        )
        (gh,) = torch.autograd.grad(loss, h1)
        assert not gh[ignored].any() and gh[~ignored].abs().sum(1).gt(0).all()
    h1 = leaf(h)
    lp, ent = linear_logprobs(h1, w, t, bias=b, chunk_size=CHUNK, return_entropy=True)
    (gh,) = torch.autograd.grad((lp, ent), h1, (torch.ones(N), torch.ones(N)))
    assert not gh[ignored].any()


@pytest.mark.parametrize("form", ["fused", "recompute", "logprobs"])
@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_nonfinite_hidden_in_ignored_row_gives_finite_grads(form, bad):
    """Ignored tokens contribute no gradient, even if their (padding) hidden states are garbage."""
    h, w, b, t = make_inputs(seed=32, ignore_frac=0.0)
    t[0] = IGN
    clean = h.clone()
    clean[0] = 0.0
    dirty = h.clone()
    dirty[0] = bad

    def run(x):
        x1, w1, b1 = leaves(x, w, b)
        if form == "logprobs":
            lp, ent = linear_logprobs(x1, w1, t, bias=b1, return_entropy=True, chunk_size=CHUNK)
            outs, gs = (lp, ent), (torch.ones(N), torch.ones(N))
        else:
            outs = (linear_cross_entropy(x1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=form == "fused"),)
            gs = (torch.tensor(1.0),)
        return [o.detach() for o in outs] + grads(outs, (x1, w1, b1), gs)

    for got, want in zip(run(dirty), run(clean)):
        assert torch.isfinite(got).all()
        assert_close32(got, want)


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
@pytest.mark.parametrize("form,opts", LOWP_CASES, ids=lambda x: x if isinstance(x, str) else _id(x))
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
    from cce_dist import stats as S
    from cce_dist import torch_impl

    h, w, b, t = make_inputs(n=48, dtype=dtype, seed=41, bias=bias, ignore_frac=0.0)
    got = {}
    for native in (False, True):
        monkeypatch.setattr(torch_impl, "_native_low_precision_gemm", lambda dt, native=native: native)
        got[native] = torch_impl.row_stats(h, w, b, t, vocab_start=0, softcap=None, temperature=1.0, chunk_size=7 * V)
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
    from cce_dist import formulas, torch_impl
    from cce_dist import stats as S

    h, w, b, t = make_inputs(n=48, dtype=dtype, seed=43, bias=True, ignore_frac=0.0)
    kw = dict(vocab_start=0, softcap=softcap, temperature=1.0)
    got = {}
    for native in (False, True):
        monkeypatch.setattr(torch_impl, "_native_low_precision_gemm", lambda dt, native=native: native)
        stats = torch_impl.row_stats(h, w, b, t, **kw, chunk_size=7 * V)
        coef = formulas.logprob_coef(
            stats, t >= 0, torch.randn(t.shape[0], generator=torch.Generator().manual_seed(1)), None
        )
        got[native] = torch_impl.grads(
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
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1}, {"z_loss": 1e-4}, {"softcap": 30.0}], ids=_id)
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


# ----------------------------------------------------------------------------------------------
# module form, in-place safety, autograd behaviour
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"reduction": "none", "label_smoothing": 0.1},
        {"reduction": "sum", "z_loss": 1e-3, "softcap": 5.0, "shift": True},
        {"return_lse": True, "ignore_index": 3},
        {"grad_in_forward": False, "chunk_size": 2 * V},
    ],
    ids=_id,
)
def test_module_equals_function(opts):
    h, w, b, t = make_inputs(seed=22, ignore_index=opts.get("ignore_index", IGN))
    kw = dict({"chunk_size": CHUNK}, **opts)
    mod = LinearCrossEntropy(**kw)
    assert isinstance(mod, torch.nn.Module)
    assert mod.options == cce_dist.CrossEntropyOptions(**kw)
    for k, v in opts.items():
        if k != "shift":
            assert f"{k}={v!r}" in repr(mod)
    h1, w1, b1 = leaves(h, w, b)
    h2, w2, b2 = leaves(h, w, b)
    a = mod(h1, w1, t, b1)
    c = linear_cross_entropy(h2, w2, t, bias=b2, **kw)
    a, c = (a if isinstance(a, tuple) else (a,)), (c if isinstance(c, tuple) else (c,))
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    gs = [upstream(x, seed=i) for i, x in enumerate(a)]
    for x, y in zip(grads(a, (h1, w1, b1), gs), grads(c, (h2, w2, b2), gs)):
        assert torch.equal(x, y)
    with pytest.raises((AttributeError, TypeError)):
        mod.options.reduction = "sum"  # frozen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", ["fused", "recompute", "none", "lse", "logprobs"])
def test_inputs_not_modified_in_place(dtype, form):
    h, w, b, t = make_inputs(dtype=dtype, seed=23)
    h1, w1, b1 = leaves(h, w, b)
    before = snapshot(h1, w1, b1, t)
    opts = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}
    if form == "logprobs":
        out = linear_logprobs(h1, w1, t, bias=b1, chunk_size=CHUNK, softcap=3.0, temperature=0.7, return_entropy=True)
    elif form == "lse":
        out = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, return_lse=True, **opts)
    else:
        out = linear_cross_entropy(
            h1,
            w1,
            t,
            bias=b1,
            chunk_size=CHUNK,
            reduction="none" if form == "none" else "mean",
            grad_in_forward=form == "fused",
            **opts,
        )
    outs = out if isinstance(out, tuple) else (out,)
    assert_unchanged(before, h1, w1, b1, t)
    gs = [upstream(o, seed=i) for i, o in enumerate(outs)]
    gs_before = snapshot(*gs)
    torch.autograd.backward(outs, gs)
    assert_unchanged(before, h1, w1, b1, t)
    assert_unchanged(gs_before, *gs)


@pytest.mark.parametrize("gif", [None, True])
def test_double_backward_through_fused_loss_raises(gif):
    h, w, b, t = make_inputs(seed=24)
    h1, w1, b1 = leaves(h, w, b)
    loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=gif)
    loss.backward(retain_graph=True)
    first = h1.grad.clone()
    assert first.any()
    with pytest.raises(RuntimeError, match="grad_in_forward"):
        loss.backward()
    assert torch.equal(h1.grad, first)  # the failed second backward added nothing


def test_double_backward_recompute_path_works():
    h, w, b, t = make_inputs(seed=25)
    h1, w1, b1 = leaves(h, w, b)
    loss = linear_cross_entropy(h1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=False, label_smoothing=0.1)
    loss.backward(retain_graph=True)
    once = [x.grad.clone() for x in (h1, w1, b1)]
    loss.backward()
    for x, g in zip((h1, w1, b1), once):
        assert_close32(x.grad, 2 * g)


@pytest.mark.parametrize("gif", GIF, ids=lambda g: f"gif={g}")
def test_grad_accumulation_and_graph_composition(gif):
    """Two losses sharing inputs (and combined with other terms) accumulate gradients correctly."""
    h, w, b, t = make_inputs(seed=26)
    t2 = torch.roll(t, 1)
    h1, w1, b1 = leaves(h, w, b)
    x1 = h1 * 1.5  # non-leaf hidden
    total = (
        linear_cross_entropy(x1, w1, t, bias=b1, chunk_size=CHUNK, grad_in_forward=gif)
        + 0.5
        * linear_cross_entropy(x1, w1, t2, bias=b1, chunk_size=CHUNK, grad_in_forward=gif, reduction="sum", z_loss=1e-3)
        + (w1**2).sum() * 1e-3
    )
    total.backward()
    h2, w2, b2 = leaves(h, w, b)
    x2 = h2 * 1.5
    ref = (
        oracle_cross_entropy(x2, w2, t, b2)
        + 0.5 * oracle_cross_entropy(x2, w2, t2, b2, reduction="sum", z_loss=1e-3)
        + (w2**2).sum() * 1e-3
    )
    ref.backward()
    assert_close32(total, ref)
    for x, y in ((h1, h2), (w1, w2), (b1, b2)):
        assert_close32(x.grad, y.grad)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def _good():
    h, w, b, t = make_inputs(n=6, v=11, d=4, seed=27, ignore_frac=0.0)
    return h, w, b, t


def _bad_cases():
    h, w, b, t = _good()
    cases = [
        # (id, exception, regex, callable)
        (
            "hidden_dim",
            ValueError,
            r"hidden.*weight|weight.*hidden",
            lambda: linear_cross_entropy(torch.randn(6, 5), w, t),
        ),
        ("bias_len", ValueError, r"bias", lambda: linear_cross_entropy(h, w, t, bias=torch.randn(10))),
        ("bias_2d", ValueError, r"bias", lambda: linear_cross_entropy(h, w, t, bias=torch.randn(11, 1))),
        ("targets_float", TypeError, r"targets", lambda: linear_cross_entropy(h, w, t.float())),
        ("targets_bool", TypeError, r"targets", lambda: linear_cross_entropy(h, w, t > 3)),
        ("targets_too_big", ValueError, r"targets", lambda: linear_cross_entropy(h, w, t.clone().fill_(11))),
        ("targets_negative", ValueError, r"targets", lambda: linear_cross_entropy(h, w, t.clone().fill_(-1))),
        (
            "targets_other_ignore",
            ValueError,
            r"targets",
            lambda: linear_cross_entropy(h, w, t.clone().fill_(-100), ignore_index=-1),
        ),
        ("targets_shape", ValueError, r"targets", lambda: linear_cross_entropy(h, w, t[:5])),
        ("targets_shape_2d", ValueError, r"targets", lambda: linear_cross_entropy(h, w, t.reshape(2, 3))),
        ("reduction", ValueError, r"reduction", lambda: linear_cross_entropy(h, w, t, reduction="avg")),
        ("impl", ValueError, r"impl", lambda: linear_cross_entropy(h, w, t, impl="cuda")),
        ("impl_lp", ValueError, r"impl", lambda: linear_logprobs(h, w, t, impl="fast")),
        ("ls_neg", ValueError, r"label_smoothing", lambda: linear_cross_entropy(h, w, t, label_smoothing=-0.1)),
        ("ls_big", ValueError, r"label_smoothing", lambda: linear_cross_entropy(h, w, t, label_smoothing=1.5)),
        ("ls_nan", ValueError, r"label_smoothing", lambda: linear_cross_entropy(h, w, t, label_smoothing=math.nan)),
        ("zl_neg", ValueError, r"z_loss", lambda: linear_cross_entropy(h, w, t, z_loss=-1e-4)),
        ("zl_nan", ValueError, r"z_loss", lambda: linear_cross_entropy(h, w, t, z_loss=math.nan)),
        ("softcap_0", ValueError, r"softcap", lambda: linear_cross_entropy(h, w, t, softcap=0.0)),
        ("softcap_neg", ValueError, r"softcap", lambda: linear_cross_entropy(h, w, t, softcap=-3.0)),
        ("softcap_lp", ValueError, r"softcap", lambda: linear_logprobs(h, w, t, softcap=0)),
        ("temp_0", ValueError, r"temperature", lambda: linear_logprobs(h, w, t, temperature=0.0)),
        ("temp_neg", ValueError, r"temperature", lambda: linear_logprobs(h, w, t, temperature=-1.0)),
        ("temp_nan", ValueError, r"temperature", lambda: linear_logprobs(h, w, t, temperature=math.nan)),
        ("hidden_int", TypeError, r"hidden", lambda: linear_cross_entropy(h.long(), w, t)),
        ("weight_int", TypeError, r"weight", lambda: linear_cross_entropy(h, w.to(torch.int32), t)),
        ("bias_int", TypeError, r"bias", lambda: linear_cross_entropy(h, w, t, bias=b.long())),
        ("targets_not_tensor", TypeError, r"targets", lambda: linear_cross_entropy(h, w, t.tolist())),
        ("weight_1d", ValueError, r"weight", lambda: linear_cross_entropy(h, w[0], t)),
        ("chunk_size", ValueError, r"chunk_size", lambda: linear_cross_entropy(h, w, t, chunk_size=0)),
        ("chunk_size_bool", ValueError, r"chunk_size", lambda: linear_cross_entropy(h, w, t, chunk_size=True)),
        ("chunk_size_float", ValueError, r"chunk_size", lambda: linear_logprobs(h, w, t, chunk_size=2.0**20)),
        ("shift_neg", ValueError, r"shift", lambda: linear_cross_entropy(h, w, t, shift=-1)),
        ("lp_targets_too_big", ValueError, r"targets", lambda: linear_logprobs(h, w, t.clone().fill_(11))),
        ("lp_hidden_int", TypeError, r"hidden", lambda: linear_logprobs(h.long(), w, t)),
        ("lp_targets_float", TypeError, r"targets", lambda: linear_logprobs(h, w, t.double())),
        ("module_reduction", ValueError, r"reduction", lambda: LinearCrossEntropy(reduction="avg")),
        ("module_label_smoothing", ValueError, r"label_smoothing", lambda: LinearCrossEntropy(label_smoothing=2)),
        ("module_targets", ValueError, r"targets", lambda: LinearCrossEntropy()(h, w, t.clone().fill_(99))),
    ]
    return cases


_BAD = _bad_cases()


@pytest.mark.parametrize("exc,pattern,call", [c[1:] for c in _BAD], ids=[c[0] for c in _BAD])
def test_bad_input_raises_clear_error(exc, pattern, call):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("arg", ["hidden", "weight", "bias"])
@pytest.mark.parametrize("fn", ["ce", "lp"])
def test_non_tensor_argument_is_a_type_error(arg, fn):
    h, w, b, t = _good()
    kw = {"hidden": h, "weight": w, "bias": b}
    kw[arg] = kw[arg].tolist()
    f = linear_cross_entropy if fn == "ce" else linear_logprobs
    with pytest.raises(TypeError, match=arg):
        f(kw["hidden"], kw["weight"], t, bias=kw["bias"])


@pytest.mark.parametrize("tdtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8], ids=str)
@pytest.mark.parametrize("form", ["ce", "lp"])
def test_integer_target_dtypes(tdtype, form):
    """Any integer dtype holding valid ids works like int64, or is refused with a TypeError naming targets."""
    h, w, b, t = _good()
    f = (
        (lambda tt: linear_cross_entropy(h, w, tt, bias=b, reduction="none"))
        if form == "ce"
        else (lambda tt: linear_logprobs(h, w, tt, bias=b))
    )
    ref = f(t)
    try:
        got = f(t.to(tdtype))
    except TypeError as e:
        assert "targets" in str(e)
        return
    assert torch.equal(got, ref)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_single_unbatched_token(reduction):
    """hidden [D] with a 0-dim target: one token, loss of targets' shape ()."""
    h, w, b, t = make_inputs(n=1, seed=31, ignore_frac=0.0)
    h1, h2 = leaf(h[0]), leaf(h[0])
    loss = linear_cross_entropy(h1, w, t[0], bias=b, reduction=reduction, label_smoothing=0.1)
    ref = oracle_cross_entropy(h2, w, t[0], b, reduction=reduction, label_smoothing=0.1)
    assert loss.shape == ref.shape == ()
    assert_close32(loss, ref)
    assert_close32(torch.autograd.grad(loss, h1)[0], torch.autograd.grad(ref, h2)[0])
    lp = linear_logprobs(h[0], w, t[0], bias=b)
    assert lp.shape == () and float(lp) <= 0
    assert_close32(lp, oracle_logprobs(h[0], w, t[0], b))


def test_bad_input_leaves_inputs_untouched():
    h, w, b, t = _good()
    t_bad = t.clone()
    t_bad[2] = 11
    before = snapshot(h, w, b, t_bad)
    with pytest.raises(ValueError):
        linear_cross_entropy(h, w, t_bad, bias=b)
    assert_unchanged(before, h, w, b, t_bad)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    h, w, b, t = _good()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"impl='triton'"):
        linear_cross_entropy(h, w, t, impl="triton")
    with pytest.raises(RuntimeError, match=r"impl='triton'"):
        linear_logprobs(h, w, t, impl="triton")


# ----------------------------------------------------------------------------------------------
# memory: nothing [N, V]-sized is saved for backward or allocated
# ----------------------------------------------------------------------------------------------

MN, MV, MD = 96, 1000, 8  # N*V = 96000 logits; V*D = 8000 (dW), N*D = 768
MCHUNK = 2000  # two tokens of logits per chunk


class _MaxAllocation(TorchDispatchMode):
    """Records the largest tensor (elements) any aten op produces while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.max_op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.numel() > self.max_numel:
                self.max_numel, self.max_op = x.numel(), str(func)
        return out


def _memory_cases():
    return [
        (
            "ce-fused",
            lambda h, w, b, t: (
                linear_cross_entropy(h, w, t, bias=b, chunk_size=MCHUNK, label_smoothing=0.1, z_loss=1e-3, softcap=5.0),
            ),
        ),
        (
            "ce-recompute",
            lambda h, w, b, t: (
                linear_cross_entropy(h, w, t, bias=b, chunk_size=MCHUNK, grad_in_forward=False, label_smoothing=0.1),
            ),
        ),
        (
            "ce-none-lse",
            lambda h, w, b, t: linear_cross_entropy(
                h, w, t, bias=b, chunk_size=MCHUNK, reduction="none", return_lse=True, z_loss=1e-3
            ),
        ),
        (
            "logprobs-entropy",
            lambda h, w, b, t: linear_logprobs(
                h, w, t, bias=b, chunk_size=MCHUNK, return_entropy=True, temperature=0.7, softcap=4.0
            ),
        ),
    ]


_MEM = _memory_cases()


def _mem_inputs(dtype):
    h, w, b, t = make_inputs(MN, MV, MD, dtype=dtype, seed=28)
    return leaves(h, w, b) + (t,)


def _run_fwd_bwd(fn, h, w, b, t):
    outs = fn(h, w, b, t)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [c[1] for c in _MEM], ids=[c[0] for c in _MEM])
def test_no_nv_sized_tensor_saved_for_backward(dtype, fn):
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size())
        return x

    def run(f):
        saved.clear()
        h, w, b, t = _mem_inputs(dtype)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            outs = f(h, w, b, t)
        total = sum(saved)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return total, max(saved, default=0)

    nv_bytes = MN * MV * 4
    # sanity: the counter sees the materialized program's [N, V] logits
    o_total, o_max = run(lambda h, w, b, t: (oracle_cross_entropy(h, w, t, b, dtype=dtype),))
    assert o_max >= MN * MV * torch.finfo(dtype).bits // 8
    total, biggest = run(fn)
    # hidden, weight, bias, targets (+ their casts) and O(N) row vectors at most
    bound = 4 * (2 * MN * MD + 2 * MV * MD + 2 * MV + 16 * MN)
    assert biggest < nv_bytes // 8, f"saved a tensor of {biggest} bytes"
    assert total <= bound, f"saved {total} bytes for backward (bound {bound}, [N, V] fp32 = {nv_bytes})"


class _Retained(TorchDispatchMode):
    """Weakly tracks every tensor any op produces; ``alive_bytes`` = storage still held later.

    Unlike saved_tensors_hooks this also sees what a Function keeps on ``ctx`` by other means
    (e.g. gradients formed in forward)."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(x) for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))
        return out

    def alive_bytes(self, exclude=()):
        gc.collect()
        excluded = {e.untyped_storage().data_ptr() for e in exclude}
        storages = {}
        for r in self.refs:
            x = r()
            if x is not None:
                st = x.untyped_storage()
                if st.data_ptr() not in excluded and st.nbytes():
                    storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [c[1] for c in _MEM], ids=[c[0] for c in _MEM])
def test_memory_held_between_forward_and_backward(dtype, fn):
    """What the graph keeps alive after forward (saved tensors, ctx attributes) is O(N*D + V*D)."""
    h, w, b, t = _mem_inputs(dtype)
    mode = _Retained()
    with mode:
        outs = oracle_cross_entropy(h, w, t, b, dtype=dtype)
    assert mode.alive_bytes(exclude=[outs]) >= MN * MV * 4  # sanity: sees the oracle's fp32 logits
    del outs
    mode = _Retained()
    with mode:
        outs = fn(h, w, b, t)
    held = mode.alive_bytes(exclude=outs)
    bound = 4 * (MN * MD + MV * MD + MV + 16 * MN)  # fp32 dH + dW + db (fused), or casts + row vectors
    assert held <= bound, f"the graph holds {held} bytes between forward and backward (bound {bound})"
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    del outs
    assert mode.alive_bytes() == 0  # everything is released after backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [c[1] for c in _MEM], ids=[c[0] for c in _MEM])
def test_no_nv_sized_tensor_allocated(dtype, fn):
    # sanity: the detector sees the materialized program's [N, V] logits
    mode = _MaxAllocation()
    with mode:
        _run_fwd_bwd(lambda h, w, b, t: (oracle_cross_entropy(h, w, t, b),), *_mem_inputs(dtype))
    assert mode.max_numel >= MN * MV
    mode = _MaxAllocation()
    with mode:
        _run_fwd_bwd(fn, *_mem_inputs(dtype))
    # the largest tensor is a chunk of logits, the dW accumulator [V, D], dH [N, D] or a row vector
    bound = max(MCHUNK, MV * MD, MN * MD, 8 * (MN + MV))
    assert mode.max_numel <= bound, f"{mode.max_op} produced {mode.max_numel} elements (bound {bound})"
    assert bound * 8 < MN * MV


def test_default_chunk_rule():
    """chunk_size=None: 2**24 logits per chunk, but never fewer than 256 tokens (thin GEMMs are
    slow); an explicit int is a hard cap of at least one token."""
    from cce_dist.torch_impl import chunk_tokens

    assert chunk_tokens(4096, 65536, None) == 256  # 2**24 logits
    assert chunk_tokens(4096, 32768, None) == 512
    assert chunk_tokens(4096, 262144, None) == 256  # the token floor, not 2**24 // V = 64
    assert chunk_tokens(100, 262144, None) == 100  # never more than the tokens there are
    assert chunk_tokens(4096, 262144, 1 << 24) == 64  # an explicit cap is honoured
    assert chunk_tokens(4096, 262144, 5) == 1
    assert chunk_tokens(0, 0, None) == 1


def test_chunk_size_bounds_the_logit_block():
    """With a tiny head dimension, the largest allocation tracks chunk_size, not N * V."""
    n, v, d = 64, 2000, 2
    h, w, b, t = make_inputs(n, v, d, seed=29)
    sizes = {}
    for cs in (v, 4 * v, 16 * v):
        mode = _MaxAllocation()
        with mode:
            h1, w1, b1 = leaves(h, w, b)
            lp, ent = linear_logprobs(h1, w1, t, bias=b1, chunk_size=cs, return_entropy=True)
            torch.autograd.backward((lp, ent), (torch.ones(n), torch.ones(n)))
        sizes[cs] = mode.max_numel
        assert mode.max_numel <= max(cs, v * d, 8 * (n + v)), (cs, mode.max_op, mode.max_numel)
    assert sizes[16 * v] > sizes[v]  # the knob really changes the block size
    assert max(sizes.values()) < n * v
