"""What the single-device test modules share (test_fp32_oracle, test_shapes_and_ignore, test_low_precision,
test_module_form, test_validation, test_memory): their shapes, their inputs and their comparisons against the
materialized oracle (tests/oracle.py).

Shapes are deliberately odd: N = 37 tokens, V = 53 (prime) vocab entries, D = 19, and a chunk_size that gives 5
tokens per chunk (8 chunks, the last one partial). ``make_inputs`` is ``helpers.problem`` with this suite's
defaults. The modules run with one intra-op thread (the ``one_intra_op_thread`` fixture of tests/conftest.py).
"""

from __future__ import annotations

import math

import torch
from helpers import Problem, leaf, problem

N, V, D = 37, 53, 19
CHUNK = 5 * V + 7  # 5 tokens of V logits per chunk: 8 chunks for N = 37, the last holds 2 tokens
IGN = -100
GIF = [None, True, False]  # grad_in_forward: default, forced fused schedule, forced recompute
REDUCTIONS = ["mean", "sum", "none"]


def opts_id(opts: dict) -> str:
    """A test id for a dict of options."""
    return ",".join(f"{k}={v}" for k, v in opts.items()) or "plain"


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
) -> Problem:
    """(hidden, weight, bias, targets) with logits of std ~ ``scale``; ~ignore_frac targets ignored
    (``helpers.problem``: weight * scale / sqrt(d), bias * 0.5; ``shape`` replaces ``(n,)``)."""
    return problem(
        shape if shape is not None else n,
        d,
        v,
        dtype=dtype,
        weight_dtype=wdtype,
        bias_dtype=bdtype,
        bias=bias,
        w_scale=scale / math.sqrt(d),
        b_scale=0.5,
        ignore_frac=ignore_frac,
        ignore_index=ignore_index,
        seed=seed,
    )


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
