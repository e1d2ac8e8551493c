"""The materialized reference of ``cce_dist.linear_distillation``, and checks of the reference itself.

``oracle_distill`` forms both heads' full ``[N, V]`` logits with ``F.linear`` in each head's
projection dtype (float64 by default: the exact formula; ``torch.bfloat16`` gives the logits a
bf16 materialized program would round to), then everything in float64: softcap, temperature,
``log_softmax``, the divergence, ``T**2``, the hard-label ``F.cross_entropy``, ``ignore_index``,
the reduction. It is differentiable with ordinary autograd (the teacher's tensors are detached),
so the same call gives the reference gradients of the student's hidden, weight and bias.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from oracle import _rounded

Tensor = torch.Tensor


def _logits(h, w, b, cap, temperature, dtype, contract=None):
    if contract is None:
        z = F.linear(h.to(dtype), w.to(dtype), None if b is None else b.to(dtype)).double()
    else:  # tests/oracle.py's contract: the values rounded to ``contract``, gradients straight through
        z = _rounded(F.linear(*(_rounded(x, contract) for x in (h, w, b))), contract)
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    return z, z / temperature


def oracle_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor | None = None,
    *,
    divergence: str = "kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    scale_by_temperature_squared: bool = True,
    hard_label_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    softcap=None,
    student_dtype: torch.dtype = torch.float64,
    teacher_dtype: torch.dtype = torch.float64,
    student_contract: torch.dtype | None = None,
) -> Tensor:
    """float64 loss of the materialized two-head program (keywords as in ``linear_distillation``).

    ``student_contract`` (with float64 student tensors and ``student_dtype=torch.float64``): the student's
    inputs and raw logits take the values of their rounding to that dtype, gradients passed straight through
    (``tests/oracle.py``'s ``contract``)."""
    caps = softcap if isinstance(softcap, tuple) else (softcap, softcap)
    d = student_hidden.shape[-1]
    z1, zs = _logits(
        student_hidden.reshape(-1, d),
        student_weight,
        student_bias,
        caps[0],
        temperature,
        student_dtype,
        student_contract,
    )
    tb = None if teacher_bias is None else teacher_bias.detach()
    _, zt = _logits(
        teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]),
        teacher_weight.detach(),
        tb,
        caps[1],
        temperature,
        teacher_dtype,
    )
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    if divergence == "kl":
        div = (lt.exp() * (lt - ls)).sum(-1)
    elif divergence == "reverse_kl":
        div = (ls.exp() * (ls - lt)).sum(-1)
    elif divergence == "jsd":
        lm = torch.logaddexp(lt + math.log(beta), ls + math.log1p(-beta))  # log(beta p_t + (1-beta) p_s)
        div = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    else:
        raise ValueError(divergence)
    t2 = temperature**2 if scale_by_temperature_squared else 1.0
    rows = (1.0 - hard_label_weight) * t2 * div
    n = rows.shape[0]
    if targets is None:
        valid = torch.ones(n, dtype=torch.bool)
    else:
        t = targets.reshape(-1).long()
        valid = t != ignore_index
        if hard_label_weight:
            rows = rows + hard_label_weight * F.cross_entropy(z1, t, ignore_index=ignore_index, reduction="none")
    rows = torch.where(valid, rows, torch.zeros_like(rows))
    if reduction == "none":
        return rows.reshape(student_hidden.shape[:-1])
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / valid.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# the reference against independent formulas (PyTorch's kl_div; JSD's known limits)
# ----------------------------------------------------------------------------------------------


def _inputs(seed=0, n=6, ds=5, dt=7, v=9):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, ds, generator=g, dtype=torch.float64),
        torch.randn(v, ds, generator=g, dtype=torch.float64),
        torch.randn(n, dt, generator=g, dtype=torch.float64),
        torch.randn(v, dt, generator=g, dtype=torch.float64),
    )


def test_oracle_kl_is_pytorch_kl_div_times_t_squared():
    sh, sw, th, tw = _inputs()
    temp = 2.5
    ls = F.log_softmax(sh @ sw.T / temp, -1)
    lt = F.log_softmax(th @ tw.T / temp, -1)
    want = F.kl_div(ls, lt, log_target=True, reduction="batchmean") * temp**2  # Hinton et al.'s soft loss
    got = oracle_distill(sh, sw, th, tw, temperature=temp)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    rev = F.kl_div(lt, ls, log_target=True, reduction="batchmean")
    got = oracle_distill(sh, sw, th, tw, divergence="reverse_kl", temperature=temp, scale_by_temperature_squared=False)
    torch.testing.assert_close(got, rev, rtol=1e-12, atol=1e-12)


def test_oracle_jsd_limits_and_symmetry():
    sh, sw, th, tw = _inputs(1)
    # beta -> 0: JSD / beta -> KL(p_t || p_s); beta -> 1: JSD / (1 - beta) -> KL(p_s || p_t)
    # (first order in beta; the next term is O(beta * chi-square), below 1e-4 relative at beta = 1e-8)
    eps = 1e-8
    kl = oracle_distill(sh, sw, th, tw)
    rkl = oracle_distill(sh, sw, th, tw, divergence="reverse_kl")
    torch.testing.assert_close(oracle_distill(sh, sw, th, tw, divergence="jsd", beta=eps) / eps, kl, rtol=1e-4, atol=0)
    torch.testing.assert_close(
        oracle_distill(sh, sw, th, tw, divergence="jsd", beta=1 - eps) / eps, rkl, rtol=1e-4, atol=0
    )
    # beta = 1/2 is the symmetric JSD, bounded by log 2
    a = oracle_distill(sh, sw, th, tw, divergence="jsd", reduction="none")
    b = oracle_distill(th, tw, sh, sw, divergence="jsd", reduction="none")
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert bool((a > 0).all()) and bool((a < math.log(2)).all())
