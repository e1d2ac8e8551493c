"""Checks of ``oracle_distill`` (tests/oracle.py), the materialized reference of ``cce_dist.linear_distillation``,
against independent formulas: PyTorch's ``kl_div`` (Hinton et al.'s soft loss) and JSD's known limits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from helpers import distill_problem
from oracle import oracle_distill


def _inputs(seed):
    """float64 student and teacher hidden states and heads, no biases."""
    p = distill_problem(
        6,
        5,
        7,
        9,
        bias=False,
        draw_dtype=torch.float64,
        student_dtype=torch.float64,
        teacher_dtype=torch.float64,
        seed=seed,
    )
    return p.student_hidden, p.student_weight, p.teacher_hidden, p.teacher_weight


def test_oracle_kl_is_pytorch_kl_div_times_t_squared():
    sh, sw, th, tw = _inputs(0)
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
