"""linear_distillation on one device against the float64 materialized oracle (tests/oracle.py).

Every case compares the loss and every student gradient (hidden, weight, bias); the teacher must
get none. Shapes are tiny (N=12, D_s=8, D_t=12, V=11) and ``chunk_size`` small, so each call runs
several token chunks (the chunk boundary is where a per-chunk bug would show).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers import distill_problem
from oracle import oracle_distill

from cce_dist import DistillationOptions, InputError, linear_distillation  # noqa: F401 (InputError: API check)

N_SHAPE = (3, 4)
DS, DT, V = 8, 12, 11
CHUNK = V * 5  # 5 tokens per chunk: chunks of 5, 5, 2 tokens

# float32: the library computes the logits in float32 (rounding 2**-24 relative) and accumulates
# in float32; against float64 the losses and gradients agree to a few float32 ulps of their scale.
F32 = dict(rtol=2e-5, atol=2e-6)


IGNORED = ((0, 1), (2, 3))  # two ignored tokens
# every tensor randn * scale; the student's hidden, weight and bias are leaves that require grad
_problem = functools.partial(distill_problem, N_SHAPE, DS, DT, V, ignore=IGNORED, requires_grad=True)


def student_grads(loss, sh, sw, sb, upstream=None):
    ins = [x for x in (sh, sw, sb) if x is not None]
    return torch.autograd.grad(loss, ins, grad_outputs=upstream)


def compare(
    kw,
    s_dtype=torch.float32,
    t_dtype=torch.float32,
    bias=True,
    tol=F32,
    seed=0,
    upstream=False,
    oracle_dtypes=(torch.float64, torch.float64),
    ignore=True,
    no_targets=False,
):
    sh, sw, sb, th, tw, tb, t = _problem(
        seed=seed, student_dtype=s_dtype, teacher_dtype=t_dtype, bias=bias, ignore=IGNORED if ignore else ()
    )
    targets = None if no_targets else t
    out = linear_distillation(sh, sw, th, tw, targets, student_bias=sb, teacher_bias=tb, chunk_size=CHUNK, **kw)
    okw = {k: v for k, v in kw.items() if k not in ("grad_in_forward", "impl")}
    ref = oracle_distill(
        sh,
        sw,
        th,
        tw,
        targets,
        student_bias=sb,
        teacher_bias=tb,
        student_dtype=oracle_dtypes[0],
        teacher_dtype=oracle_dtypes[1],
        **okw,
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, **tol)
    up = None
    if upstream:  # arbitrary per-row upstream gradients (reduction="none")
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    got = student_grads(out, sh, sw, sb, up)
    want = student_grads(ref, sh, sw, sb, None if up is None else up.double())
    for name, a, b in zip(("student_hidden", "student_weight", "student_bias"), got, want):
        assert a.dtype == b.dtype, name  # gradients come back in each tensor's own dtype
        torch.testing.assert_close(a.double(), b.double(), **tol, msg=lambda m, name=name: f"{name}: {m}")
    return out, ref


DIVS = [("kl", {}), ("reverse_kl", {}), ("jsd", {"beta": 0.5}), ("jsd", {"beta": 0.2})]


@pytest.mark.parametrize("div,extra", DIVS, ids=["kl", "reverse_kl", "jsd0.5", "jsd0.2"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_oracle_fp32(div, extra, reduction):
    """Every divergence x reduction over temperature, softcap per head, the hard-label mix and both schedules."""
    cases = itertools.product([1.0, 2.0], [None, (4.0, None), (None, 3.0)], [0.0, 0.25], [None, False])
    for i, (temp, cap, w, gif) in enumerate(cases):
        kw = dict(
            divergence=div,
            temperature=temp,
            softcap=cap,
            hard_label_weight=w,
            reduction=reduction,
            grad_in_forward=gif,
            **extra,
        )
        if i % 3 == 0:
            kw["scale_by_temperature_squared"] = False
        compare(kw, seed=i, upstream=reduction == "none")


@pytest.mark.parametrize("div", ["kl", "reverse_kl", "jsd"])
def test_no_targets_no_bias(div):
    compare(dict(divergence=div, temperature=1.5), bias=False, no_targets=True)
    compare(dict(divergence=div, reduction="none"), bias=False, no_targets=True, upstream=True)


def test_large_logits_stay_exact():
    """Logits of magnitude ~100: every term is formed relative to the global lse (no cancellation)."""
    for div in ("kl", "reverse_kl", "jsd"):
        sh, sw, sb, th, tw, tb, t = _problem(seed=3, scale=3.5)
        out = linear_distillation(
            sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, divergence=div, chunk_size=CHUNK, reduction="none"
        )
        ref = oracle_distill(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, divergence=div, reduction="none")
        # loss terms of order 100 in float32 logits: a few ulps of 100
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "s_dtype,t_dtype",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
)
@pytest.mark.parametrize("div", ["kl", "jsd"])
def test_low_precision_heads(s_dtype, t_dtype, div):
    """Each head projects in its own dtype. The oracle rounds the logits to the same dtype (what the
    materialized bf16 program computes), then float64: the loss differs only by float32
    accumulation (tight). The gradients come back in bf16, rounded once (2**-8 relative) after
    bf16 GEMMs on both sides: 2e-2 of the gradient's scale."""
    kw = dict(divergence=div, temperature=2.0, hard_label_weight=0.3, softcap=(5.0, 6.0))
    sh, sw, sb, th, tw, tb, t = _problem(seed=5, student_dtype=s_dtype, teacher_dtype=t_dtype)
    out = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, chunk_size=CHUNK, **kw)
    ref = oracle_distill(
        sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, student_dtype=s_dtype, teacher_dtype=t_dtype, **kw
    )
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(student_grads(out, sh, sw, sb), student_grads(ref, sh, sw, sb)):
        assert a.dtype == s_dtype
        scale = b.double().abs().max()
        torch.testing.assert_close(a.double(), b.double(), rtol=2e-2, atol=2e-2 * float(scale))


def test_bf16_hidden_fp32_heads():
    """bf16 activations with float32 heads: computed in float32, gradient back in bf16."""
    sh, sw, sb, th, tw, tb, t = _problem(seed=6)
    sh = sh.detach().bfloat16().requires_grad_()
    th = th.bfloat16()
    out = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, chunk_size=CHUNK, divergence="jsd")
    ref = oracle_distill(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, divergence="jsd")
    torch.testing.assert_close(out.double(), ref, **F32)
    (gh,) = torch.autograd.grad(out, [sh])
    (rh,) = torch.autograd.grad(ref, [sh])
    assert gh.dtype == torch.bfloat16
    torch.testing.assert_close(gh.double(), rh.double(), rtol=1e-2, atol=1e-2 * float(rh.abs().max()))


def test_teacher_gets_no_gradient_and_inputs_untouched():
    sh, sw, sb, th, tw, tb, t = _problem(seed=8)
    th.requires_grad_()
    tw.requires_grad_()
    tb.requires_grad_()
    before = [x.detach().clone() for x in (sh, sw, sb, th, tw, tb, t)]
    for gif in (None, False):
        loss = linear_distillation(
            sh,
            sw,
            th,
            tw,
            t,
            student_bias=sb,
            teacher_bias=tb,
            divergence="jsd",
            hard_label_weight=0.5,
            grad_in_forward=gif,
        )
        loss.backward()
        assert th.grad is None and tw.grad is None and tb.grad is None
        assert sh.grad is not None and sw.grad is not None and sb.grad is not None
    for a, b in zip(before, (sh, sw, sb, th, tw, tb, t)):
        assert torch.equal(a, b.detach())


def test_all_ignored_mean_is_zero_with_zero_grads():
    sh, sw, sb, th, tw, tb, t = _problem(seed=9)
    t.fill_(-100)
    for gif in (None, False):
        loss = linear_distillation(
            sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, grad_in_forward=gif, hard_label_weight=0.5
        )
        assert float(loss.detach()) == 0.0
        for gr in student_grads(loss, sh, sw, sb):
            assert torch.equal(gr, torch.zeros_like(gr))


def test_forward_only_no_grad():
    sh, sw, sb, th, tw, tb, t = _problem(seed=10)
    with torch.no_grad():
        out = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, divergence="reverse_kl")
    ref = oracle_distill(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, divergence="reverse_kl")
    torch.testing.assert_close(out.double(), ref, **F32)


def test_fused_single_backward_and_recompute_twice():
    sh, sw, sb, th, tw, tb, t = _problem(seed=11)
    loss = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="grad_in_forward=False"):
        loss.backward()
    loss = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, grad_in_forward=False)
    g1 = torch.autograd.grad(loss, [sw], retain_graph=True)[0]
    g2 = torch.autograd.grad(loss * 3.0, [sw])[0]
    torch.testing.assert_close(g2, 3.0 * g1)


def test_saved_tensors_hold_no_logits_block():
    """The recompute schedule saves hidden states, heads and per-row statistics: nothing [N, V]."""
    n, v = 40, 37
    g = torch.Generator().manual_seed(0)
    sh = torch.randn(n, DS, generator=g, requires_grad=True)
    sw = torch.randn(v, DS, generator=g, requires_grad=True)
    th, tw = torch.randn(n, DT, generator=g), torch.randn(v, DT, generator=g)
    saved = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = linear_distillation(sh, sw, th, tw, divergence="jsd", reduction="none", chunk_size=v * 8)
    assert saved, "the Function saved nothing?"
    for shape in saved:
        numel = 1
        for s in shape:
            numel *= s
        assert numel < n * v, f"a saved tensor of shape {shape} is as large as an [N, V] block"
    assert out.shape == (n,)


# ----------------------------------------------------------------------------------------------
# validation: clear errors naming the argument
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(divergence="kld"), ValueError, "divergence"),
        (dict(beta=0.0), ValueError, "beta"),
        (dict(beta=1.5), ValueError, "beta"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(temperature=float("inf")), ValueError, "temperature"),
        (dict(hard_label_weight=-0.1), ValueError, "hard_label_weight"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap=(1.0, 2.0, 3.0)), ValueError, "softcap"),
        (dict(softcap=(None, 0.0)), ValueError, "softcap"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
        (dict(impl="cuda"), ValueError, "impl"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(scale_by_temperature_squared=1), TypeError, "scale_by_temperature_squared"),
    ],
)
def test_option_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        DistillationOptions(**kw)
    sh, sw, sb, th, tw, tb, t = _problem()
    with pytest.raises(exc, match=match):
        linear_distillation(sh, sw, th, tw, t, **kw)


def test_input_errors():
    sh, sw, sb, th, tw, tb, t = _problem()
    cases = [
        (dict(teacher_weight=tw[:-1]), "teacher_weight.shape\\[0\\]"),
        (dict(teacher_hidden=th[:, :-1]), "teacher_hidden.shape\\[:-1\\]"),
        (dict(teacher_hidden=th[..., :-1]), "teacher_hidden's last dimension"),
        (dict(student_hidden=sh[..., :-1]), "student_hidden's last dimension"),
        (dict(student_bias=sb[:-1]), "student_bias must have shape"),
        (dict(teacher_bias=tb[:-1]), "teacher_bias must have shape"),
        (dict(targets=t[:, :-1]), "targets must have shape"),
        (dict(targets=t.float()), "targets must be an integer"),
        (dict(targets=t.clone().fill_(V)), "outside the vocabulary"),
        (dict(targets=None, hard_label_weight=0.5), "hard_label_weight=0.5 needs targets"),
        (dict(teacher_weight=tw.long()), "teacher_weight must be a floating-point"),
        (dict(student_hidden=sh.detach().numpy()), "student_hidden must be a torch.Tensor"),
    ]
    base = dict(
        student_hidden=sh,
        student_weight=sw,
        teacher_hidden=th,
        teacher_weight=tw,
        targets=t,
        student_bias=sb,
        teacher_bias=tb,
    )
    for change, match in cases:
        args = {**base, **change}
        with pytest.raises((TypeError, ValueError), match=match):
            linear_distillation(**args)


@pytest.mark.parametrize("div,blocks", [("kl", 3), ("reverse_kl", 4), ("jsd", 4)])
def test_chunk_buffers_are_chunk_sized(monkeypatch, div, blocks):
    """Each call holds a few [V_local, step] float32 blocks (3 for the forward KL), never [N, V]."""
    import cce_dist.impl.torch_distill as DTM

    made = []

    class Counting(DTM.LogitsBlock):
        def __init__(self, v_local, max_tokens, device):
            made.append((v_local, max_tokens))
            super().__init__(v_local, max_tokens, device)

    monkeypatch.setattr(DTM, "LogitsBlock", Counting)
    n, v, step = 40, 37, 8
    g = torch.Generator().manual_seed(0)
    sh = torch.randn(n, DS, generator=g, requires_grad=True)
    sw = torch.randn(v, DS, generator=g, requires_grad=True)
    th, tw = torch.randn(n, DT, generator=g), torch.randn(v, DT, generator=g)
    loss = linear_distillation(sh, sw, th, tw, divergence=div, chunk_size=v * step)
    loss.backward()
    assert made == [(v, step)] * blocks, made


def test_autocast_projects_both_heads_in_the_autocast_dtype():
    """Under CPU autocast(bf16) each head's logits are rounded to bf16 (what the materialized program
    under autocast computes); everything after is float32, gradients come back float32. The loss
    is then exact up to float32 accumulation; gradients pass through bf16 GEMMs on both sides
    (2**-8 relative rounding): 2e-2 of their scale."""
    sh, sw, sb, th, tw, tb, t = _problem(seed=12)
    kw = dict(divergence="reverse_kl", temperature=1.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_distillation(sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, chunk_size=CHUNK, **kw)
    ref = oracle_distill(
        sh,
        sw,
        th,
        tw,
        t,
        student_bias=sb,
        teacher_bias=tb,
        student_dtype=torch.bfloat16,
        teacher_dtype=torch.bfloat16,
        **kw,
    )
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(student_grads(out, sh, sw, sb), student_grads(ref, sh, sw, sb)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b.double(), rtol=2e-2, atol=2e-2 * float(b.abs().max()))
