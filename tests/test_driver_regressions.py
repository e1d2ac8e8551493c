"""Regressions for the defects users reported against the driver (issue 21).

Each test failed on the code before its fix; numbers are compared with the plain materialized program
(``F.linear`` + ``F.cross_entropy`` / ``log_softmax``).
"""

from __future__ import annotations

import copy
import functools
import math
import pickle
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import TRITON, problem

from cce_dist import (
    InputError,
    LinearCrossEntropy,
    VocabShard,
    linear_cross_entropy,
    linear_distillation,
    linear_logprobs,
)

N, D, V = 12, 16, 40


# hidden, weight (* 0.3) and bias (* 0.1) as leaves that require grad; the targets each test makes itself
_problem = functools.partial(problem, N, D, V, w_scale=0.3, b_scale=0.1, requires_grad=True)


def _grads(*ts):
    return [None if t is None else t.grad for t in ts]


def _plain_ce_sum(h, w, b, t):
    return F.cross_entropy(F.linear(h.float(), w.float(), None if b is None else b.float()), t, reduction="sum")


# ----------------------------------------------------------------------------------------------
# 1. all targets ignored + an infinite upstream gradient: zero gradients, never NaN
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("grad_in_forward", [None, False])
def test_all_ignored_infinite_upstream_gives_zero_grads(dtype, reduction, grad_in_forward):
    """HF Trainer on a micro-batch without labels: ``loss / num_items_in_batch`` with 0 items."""
    h, w, b, _ = _problem(dtype=dtype)
    t = torch.full((N,), -100)
    loss = linear_cross_entropy(h, w, t, bias=b, reduction=reduction, grad_in_forward=grad_in_forward)
    (loss / 0.0).backward()
    hr, wr, br = (x.detach().clone().requires_grad_() for x in (h, w, b))
    (_plain_ce_sum(hr, wr, br, t) / 0.0).backward()
    for got, want in zip(_grads(h, w, b), _grads(hr, wr, br)):
        assert torch.equal(want, torch.zeros_like(want))  # the plain program: exactly 0
        assert got.dtype == dtype and torch.equal(got, torch.zeros_like(got)), got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_partly_ignored_infinite_upstream_ignored_rows_stay_zero(dtype):
    """An ignored row's hidden gradient is 0 whatever the upstream value, as in the plain program."""
    h, w, b, _ = _problem(dtype=dtype)
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    t[::3] = -100
    (linear_cross_entropy(h, w, t, bias=b, reduction="sum") * math.inf).backward()
    hr = h.detach().clone().requires_grad_()
    (_plain_ce_sum(hr, w.detach(), b.detach(), t) * math.inf).backward()
    ignored = t == -100
    assert torch.equal(hr.grad[ignored], torch.zeros_like(hr.grad[ignored]))
    assert torch.equal(h.grad[ignored], torch.zeros_like(h.grad[ignored]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("g", [1.0, 2.0**16, -3.0, 1e-30])
def test_fused_finite_upstream_scales_as_before(dtype, g):
    """The fix leaves a finite upstream's scaling alone: the fused path against the two-pass one (its own
    algorithm, so to the dtype's tolerance), and exactly g times the gradients at g = 1 for a power of two."""
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
    t[1] = -100
    got = {}
    for key, upstream, gif in (("g", g, None), ("one", 1.0, None), ("two_pass", g, False)):
        h, w, b, _ = _problem(dtype=dtype)
        (linear_cross_entropy(h, w, t, bias=b, grad_in_forward=gif) * upstream).backward()
        got[key] = _grads(h, w, b)
    tol = dict(atol=1e-5 * abs(g), rtol=1.3e-6) if dtype == torch.float32 else dict(atol=1e-3 * abs(g), rtol=1e-2)
    for a, b in zip(got["g"], got["two_pass"]):
        torch.testing.assert_close(a, b, **tol)
    if math.frexp(abs(g))[0] == 0.5 and dtype != torch.float16:  # fp16 is held in float32: rounded after g
        for a, b in zip(got["g"], got["one"]):
            assert torch.equal(a, (b.float() * g).to(dtype))


def test_logprobs_all_ignored_infinite_upstream_gives_zero_grads():
    h, w, b, _ = _problem()
    t = torch.full((N,), -100)
    lp, ent = linear_logprobs(h, w, t, bias=b, return_entropy=True)
    ((lp.sum() + ent.sum()) / 0.0).backward()
    for got in _grads(h, w, b):
        assert torch.equal(got, torch.zeros_like(got)), got


def test_compiled_all_ignored_infinite_upstream_gives_zero_grads():
    h, w, b, _ = _problem()
    t = torch.full((N,), -100)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(h, w, b, t):
        return linear_cross_entropy(h, w, t, bias=b, reduction="sum") / 0.0

    f(h, w, b, t).backward()
    for got in _grads(h, w, b):
        assert torch.equal(got, torch.zeros_like(got)), got


def _tp_inf_body(rank, world, group, sequence_parallel, partly):
    """Fused TP cross-entropy times inf: the gradients of ignored rows (all, or every third) on this rank."""
    h, w, b, _ = _problem()
    t = torch.full((N,), -100)
    if partly:
        t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
        t[::3] = -100
    per = V // world
    shard = VocabShard(group, rank * per, (rank + 1) * per, sequence_parallel=sequence_parallel)
    rows = slice(rank * N // world, (rank + 1) * N // world) if sequence_parallel else slice(None)
    hl = h.detach()[rows].clone().requires_grad_()
    wl = w.detach()[rank * per : (rank + 1) * per].clone().requires_grad_()
    bl = b.detach()[rank * per : (rank + 1) * per].clone().requires_grad_()
    loss = linear_cross_entropy(hl, wl, t, bias=bl, reduction="sum", shard=shard)
    (loss * math.inf if partly else loss / 0.0).backward()
    ignored = (t == -100)[rows]
    if partly:
        return hl.grad[ignored]
    return hl.grad, wl.grad, bl.grad


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("partly", [False, True])
def test_tp_fused_infinite_upstream_ignored_rows_zero(rank_pool, sequence_parallel, partly):
    results = rank_pool(2).run(_tp_inf_body, sequence_parallel=sequence_parallel, partly=partly)
    for grads in results.values():
        for got in grads if isinstance(grads, tuple) else (grads,):
            assert torch.equal(got, torch.zeros_like(got)), got


# ----------------------------------------------------------------------------------------------
# 6. options given as numpy scalars or 0-dim CPU tensors
# ----------------------------------------------------------------------------------------------

_SCALAR_KINDS = {
    "numpy": lambda x: np.float32(x) if isinstance(x, float) else np.int64(x),
    "tensor": lambda x: torch.tensor(x),
}


def _ce_call(opts):
    h, w, b, _ = _problem(seed=3)
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(3))
    t[0] = -1
    return linear_cross_entropy(h, w, t, bias=b, **opts)


def _lp_call(opts):
    h, w, b, _ = _problem(seed=4)
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(4))
    return linear_logprobs(h, w, t, bias=b, return_entropy=True, **opts)


def _distill_call(opts):
    h, w, _, _ = _problem(seed=5)
    th, tw, _, _ = _problem(seed=6)
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(5))
    return linear_distillation(h, w, th.detach(), tw.detach(), t, divergence="jsd", **opts)


_NUMERIC_OPTIONS = [
    (_ce_call, dict(label_smoothing=0.1, z_loss=1e-3, softcap=20.0, ignore_index=-1, chunk_size=100, shift=1)),
    (_lp_call, dict(temperature=0.7, softcap=15.0, ignore_index=-1, chunk_size=64, shift=1)),
    (
        _distill_call,
        dict(temperature=0.7, beta=0.3, hard_label_weight=0.25, softcap=(20.0, 30.0), ignore_index=-1, chunk_size=64),
    ),
    (_distill_call, dict(softcap=25.0)),
]


@pytest.mark.parametrize("kind", sorted(_SCALAR_KINDS))
@pytest.mark.parametrize("case", range(len(_NUMERIC_OPTIONS)))
def test_numeric_options_accept_real_scalars(kind, case):
    """Every numeric option as a numpy scalar / 0-dim tensor gives what the Python number (its float()) gives."""
    call, opts = _NUMERIC_OPTIONS[case]
    conv = _SCALAR_KINDS[kind]
    given = {k: tuple(conv(x) for x in v) if isinstance(v, tuple) else conv(v) for k, v in opts.items()}
    plain = {k: tuple(float(x) for x in v) if isinstance(v, tuple) else type(opts[k])(v) for k, v in given.items()}
    got, want = call(given), call(plain)
    for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(a, b)


def test_module_and_shard_accept_numpy_scalars():
    loss = LinearCrossEntropy(label_smoothing=np.float32(0.1), reduction="sum")
    assert loss.options.label_smoothing == float(np.float32(0.1)) and type(loss.options.label_smoothing) is float
    shard = VocabShard(None, np.int64(0), np.int64(V))
    assert (shard.start, shard.stop) == (0, V) and type(shard.stop) is int


@pytest.mark.parametrize(
    "value, why",
    [
        (torch.tensor(0.7, requires_grad=True), "requires grad"),
        (torch.tensor([0.7, 0.8]), "shape (2,)"),
        (torch.tensor(0.7, device="meta"), "synchronize"),
    ],
)
@pytest.mark.parametrize("fn", ["linear_logprobs", "linear_distillation"])
def test_rejected_scalar_types_name_the_argument(value, why, fn):
    call = _lp_call if fn == "linear_logprobs" else _distill_call
    with pytest.raises(TypeError, match=r"temperature must be a number, got a torch\.Tensor.*") as info:
        call(dict(temperature=value))
    assert why in str(info.value)


# ----------------------------------------------------------------------------------------------
# 7. copy.deepcopy of a model holding a VocabShard; pickling names the shard
# ----------------------------------------------------------------------------------------------


class _Policy(torch.nn.Module):
    def __init__(self, w, shard):
        super().__init__()
        self.lm_head = torch.nn.Parameter(w)
        self.loss = LinearCrossEntropy(shard=shard, reduction="sum")

    def forward(self, h, t):
        return self.loss(h, self.lm_head, t)


def _deepcopy_body(rank, world, group):
    h, w, _, _ = _problem(seed=7)
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(7))
    per = V // world
    policy = _Policy(w.detach()[rank * per : (rank + 1) * per].clone(), VocabShard.even(V, group))
    ref = copy.deepcopy(policy)  # raised "cannot pickle ProcessGroup" before
    out = {
        "shares_group": ref.loss.options.shard.group is group,
        "copied_param": ref.lm_head is not policy.lm_head and torch.equal(ref.lm_head, policy.lm_head),
        "same_loss": torch.equal(ref(h.detach(), t), policy(h.detach(), t)),
    }
    try:
        pickle.dumps(policy.loss.options.shard)
        out["pickle_error"] = None
    except TypeError as e:
        out["pickle_error"] = str(e)
    return out


def test_deepcopy_of_model_with_vocab_shard_shares_group(rank_pool):
    for res in rank_pool(2).run(_deepcopy_body).values():
        assert res["shares_group"] and res["copied_param"] and res["same_loss"], res
        msg = res["pickle_error"]
        assert msg is not None and "VocabShard" in msg and "process group" in msg and "deepcopy" in msg, msg


def test_vocab_shard_without_group_still_pickles():
    shard = VocabShard(None, 0, V, stats_collective="allgather")
    assert pickle.loads(pickle.dumps(shard)) == shard == copy.deepcopy(shard)


# ----------------------------------------------------------------------------------------------
# 8. the handshake names the component the ranks disagree on
# ----------------------------------------------------------------------------------------------


def _disagree_body(rank, world, group, case):
    """Ranks that differ in one component (and, like data-parallel ranks of a wrongly sharded head, in their
    targets too); returns the error each rank raised."""
    h, w, _, _ = _problem(seed=8)
    gen = torch.Generator().manual_seed(8 + (rank if case != "temperature" else 0))
    t = torch.randint(0, V, (N,), generator=gen)  # differs by rank except for "temperature"
    per = V // world
    start, stop = rank * per, (rank + 1) * per
    if case == "weight_rows":  # rank 1's weight holds more rows than the layout leaves it: [10, 40) overlaps
        start, stop = (0, per) if rank == 0 else (per // 2, V)
    if case == "hidden_size" and rank == 1:
        h, w = h[:, : D // 2], w[:, : D // 2]
    shard = VocabShard(group, start, stop)
    try:
        if case == "temperature":
            th, tw, _, _ = _problem(seed=9)
            linear_distillation(h, w[start:stop], th, tw[start:stop].detach(), t, shard=shard, temperature=1.0 + rank)
        else:
            linear_cross_entropy(h, w[start:stop], t, shard=shard)
    except InputError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "case, lead, absent",
    [
        (
            "weight_rows",
            r"^cce_dist: the vocab rows the ranks' weights hold \(weight\.shape\[0\] by rank: \[20, 30\]\)",
            None,
        ),
        ("hidden_size", r"^cce_dist: ranks of the tensor-parallel group disagree on the hidden size .*weight", None),
        ("targets", r"^cce_dist: ranks of the tensor-parallel group disagree on the target ids", "weight"),
        (
            "temperature",
            r"^cce_dist: ranks of the tensor-parallel group disagree on the loss options: temperature",
            "label_smoothing",
        ),
    ],
)
def test_handshake_names_what_differs(rank_pool, case, lead, absent):
    for rank, msg in rank_pool(2).run(_disagree_body, case=case).items():
        assert msg is not None and re.search(lead, msg), f"rank {rank}: {msg}"
        if case in ("weight_rows", "hidden_size"):
            assert "target ids" in msg and msg.index("target ids") > msg.index("weight"), msg  # named, but second
        if absent is not None:
            assert absent not in msg, msg


# ----------------------------------------------------------------------------------------------
# 1 (other paths): the Triton kernels (interpreter on CPU) and distillation
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not TRITON, reason="needs triton (interpreter on CPU)")
@pytest.mark.parametrize("form", ["ce_sum", "ce_mean", "logprobs"])
def test_triton_all_ignored_infinite_upstream_gives_zero_grads(form):
    h, w, b, _ = _problem()
    t = torch.full((N,), -100)
    if form == "logprobs":
        lp, ent = linear_logprobs(h, w, t, bias=b, impl="triton", return_entropy=True)
        out = lp.sum() + ent.sum()
    else:
        out = linear_cross_entropy(h, w, t, bias=b, impl="triton", reduction=form[3:])
    (out / 0.0).backward()
    for got in _grads(h, w, b):
        assert torch.equal(got, torch.zeros_like(got)), got


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("grad_in_forward", [None, False])
def test_distillation_all_ignored_infinite_upstream_gives_zero_grads(impl, grad_in_forward):
    """Both distillation paths (the fused one holds gradients from the forward) give zeros (issue 21.1)."""
    if impl == "triton" and not TRITON:
        pytest.skip("needs triton (interpreter on CPU)")
    h, w, b, _ = _problem()
    th, tw, _, _ = _problem(seed=1)
    t = torch.full((N,), -100)
    loss = linear_distillation(
        h, w, th.detach(), tw.detach(), t, student_bias=b, reduction="sum", impl=impl, grad_in_forward=grad_in_forward
    )
    (loss / 0.0).backward()
    for got in _grads(h, w, b):
        assert torch.equal(got, torch.zeros_like(got)), got


@pytest.mark.parametrize("kind", sorted(_SCALAR_KINDS))
def test_scalar_options_under_compile(kind):
    """Under torch.compile: fullgraph names the option (Dynamo traces the value as data); otherwise the call
    graph-breaks and gives the eager result."""
    h, w, b, _ = (x.detach() for x in _problem(seed=10))
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(10))
    value = _SCALAR_KINDS[kind](0.1)

    def f(h, w, t):
        return linear_cross_entropy(h, w, t, label_smoothing=value)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"label_smoothing must be a Python number under torch\.compile"):
        torch.compile(f, fullgraph=True, backend="eager")(h, w, t)
    torch._dynamo.reset()
    got = torch.compile(f, backend="eager")(h, w, t)
    assert torch.equal(got, linear_cross_entropy(h, w, t, label_smoothing=float(value)))
