"""Helpers shared by the test modules (import them from here, never from another test module:
tests/test_layering.py checks that no ``test_*`` module imports another).

- ``problem(n, d, v, *, dtype, bias, w_scale, b_scale, ignore, ignore_frac, seed, ...)``: the standard one-head
  problem ``Problem(hidden, weight, bias, targets)``; ``distill_problem(n, ds, dt, v, *, ...)``: the two-head one,
  ``DistillProblem(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
  targets)``. The test modules build their standard problems with these (a module binds its shapes and scales
  with ``functools.partial``); problems of another kind stay in their module (Megatron's layouts, token ids, the
  closed-form N*V > 2**31 problem, hypothesis strategies, one-off tensors inside a test).
- ``integer_problem(n, d, v, seed, dtype)``: ``(hidden, weight, targets)`` whose logits are exact integers with a
  tie between ids 3 and 17 (test_row_outputs and test_row_outputs_parallel).
- ``close_report(got, want, atol, rtol)``: None if two tensors match (non-finite entries exactly),
  else a message naming the worst element.
- ``Failures``: collects failing checks of a case (named) instead of raising, so that a rank keeps
  issuing its collectives in step with its peers; the parent asserts there are none.
- ``leaf(x)``: a detached copy of ``x`` that requires grad (None stays None), for the oracle's inputs.
- ``TRITON``: whether ``cce_dist.kernels`` can run here (a GPU, or Triton's CPU interpreter).

What else the test modules share, each in one non-test module of tests/:

- tests/oracle.py: every reference program (cross-entropy, logprobs, logits, distillation), float64 capable;
- tests/single_device.py: the shapes, inputs and comparisons of the single-device modules (test_fp32_oracle,
  test_shapes_and_ignore, test_low_precision, test_module_form, test_validation, test_memory);
- tests/fuzz_common.py: the fuzz budget, the checked-case counter and the gradient judge of test_fuzz and
  test_fuzz_distill;
- tests/dist_utils.py: spawning ranks; tests/triton_oldest.py: the oldest supported Triton; tests/conftest.py:
  TRITON_INTERPRET, the gpu / slow marks, the ``rank_pool`` and ``one_intra_op_thread`` fixtures;
- ``cce_dist.testing.CollectiveLog``: counting collectives (shared with the benchmarks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "TRITON",
    "leaf",
    "close_report",
    "Failures",
    "Problem",
    "problem",
    "DistillProblem",
    "distill_problem",
    "integer_problem",
]


def _triton_ok() -> bool:
    try:
        from cce_dist import kernels

        return kernels.available()
    except Exception:  # noqa: BLE001
        return False


TRITON = _triton_ok()


def leaf(x: torch.Tensor | None) -> torch.Tensor | None:
    """A fresh leaf: ``x`` detached, copied and requiring grad (None stays None)."""
    return None if x is None else x.detach().clone().requires_grad_(True)


def close_report(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str | None:
    """None if ``got`` matches ``want`` (non-finite entries must match exactly), else a message."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.detach().double(), want.detach().double()
    fin = torch.isfinite(w)
    if not torch.equal(torch.isnan(g), torch.isnan(w)):
        return (
            f"NaN pattern differs: got {torch.isnan(g).nonzero().flatten().tolist()[:8]}, want "
            f"{torch.isnan(w).nonzero().flatten().tolist()[:8]}"
        )
    inf_w = torch.isinf(w)
    if not torch.equal(g[inf_w], w[inf_w]) or bool(torch.isinf(g[~inf_w]).any()):
        return "Inf pattern differs"
    if fin.any():
        err = (g[fin] - w[fin]).abs()
        lim = atol + rtol * w[fin].abs()
        if bool((err > lim).any()):
            k = int(torch.argmax(err - lim))
            return (
                f"max err {float(err.max()):.3g} (at {k}: got {float(g[fin][k]):.6g}, want {float(w[fin][k]):.6g}, "
                f"atol {atol:.3g}, rtol {rtol:.3g})"
            )
    return None


class Failures:
    """The failing checks of one or more cases, each prefixed with its case name.

    Checks never raise: a rank that stopped at its first failure would leave its peers waiting in
    a collective. ``result()`` is what a rank returns to the parent.
    """

    def __init__(self, atol: float = 3e-5, rtol: float = 1e-4):
        self.items: list[str] = []
        self.cases = 0
        self.atol, self.rtol = atol, rtol

    def close(self, got, want, what, case, atol=None, rtol=None):
        """``got`` and ``want`` both None, or both tensors of one shape that ``torch.allclose`` in float64."""
        atol = self.atol if atol is None else atol
        rtol = self.rtol if rtol is None else rtol
        if got is None or want is None:
            if (got is None) != (want is None):
                self.items.append(
                    f"[{case}] {what}: got {'None' if got is None else 'a tensor'}, "
                    f"want {'None' if want is None else 'a tensor'}"
                )
            return
        got64 = got.detach().to(torch.float64)
        want64 = want.detach().to(torch.float64)
        if got64.shape != want64.shape:
            self.items.append(f"[{case}] {what}: shape {tuple(got64.shape)} != {tuple(want64.shape)}")
            return
        if not torch.allclose(got64, want64, atol=atol, rtol=rtol):
            err = (got64 - want64).abs().max().item()
            self.items.append(f"[{case}] {what}: max abs err {err:.3g} (atol {atol}, rtol {rtol})")

    def check(self, cond, msg, case):
        if not cond:
            self.items.append(f"[{case}] {msg}")

    def result(self) -> dict:
        return {"cases": self.cases, "failures": self.items}


# ----------------------------------------------------------------------------------------------
# the problem factories: every random (hidden, weight, bias, targets) of the suite is drawn here
# ----------------------------------------------------------------------------------------------


class Problem(NamedTuple):
    """One head's inputs: ``hidden [*shape, D]``, ``weight [V, D]``, ``bias [V]`` (or None), ``targets [*shape]``."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    targets: torch.Tensor


def _generator(seed: int | torch.Generator) -> torch.Generator:
    return seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)


def _ignore(t: torch.Tensor, g: torch.Generator, ignore, ignore_frac: float, ignore_index: int) -> torch.Tensor:
    if ignore_frac:
        t[torch.rand(t.shape, generator=g) < ignore_frac] = ignore_index
    for i in ignore:
        t[i] = ignore_index
    return t


def problem(
    n: int | tuple[int, ...],
    d: int,
    v: int,
    *,
    dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
    bias_dtype: torch.dtype | None = None,
    bias: bool = True,
    w_scale: float = 1.0,
    b_scale: float = 1.0,
    ignore=(),
    ignore_frac: float = 0.0,
    ignore_index: int = -100,
    target_range: tuple[int, int] | None = None,
    seed: int | torch.Generator = 0,
    device: torch.device | str | None = None,
    requires_grad: bool = False,
) -> Problem:
    """The standard one-head problem, drawn in this order from one generator (``seed``, or a
    ``torch.Generator`` the caller goes on drawing from):

    - ``hidden = randn(*n, d)`` (``n``: the token count, or the tokens' shape);
    - ``weight = randn(v, d) * w_scale``; ``bias = randn(v) * b_scale`` if ``bias``;
    - ``targets = randint(*target_range, n)`` (default ``[0, v)``); then, with ``ignore_frac``, each
      target is ``ignore_index`` with that probability (one ``rand(n)`` draw), and so is ``targets[i]``
      for each index ``i`` in ``ignore`` (ints, tuples or slices).

    Then the tensors are cast (float32 draws): ``hidden`` to ``dtype``, ``weight`` to ``weight_dtype``
    (default ``dtype``), ``bias`` to ``bias_dtype`` (default the weight's); moved to ``device``; and
    with ``requires_grad`` hidden, weight and bias are leaves that require grad. Targets are int64.
    """
    g = _generator(seed)
    shape = (n,) if isinstance(n, int) else tuple(n)
    h = torch.randn(*shape, d, generator=g)
    w = torch.randn(v, d, generator=g) * w_scale
    b = torch.randn(v, generator=g) * b_scale if bias else None
    lo, hi = target_range if target_range is not None else (0, v)
    t = _ignore(torch.randint(lo, hi, shape, generator=g), g, ignore, ignore_frac, ignore_index)
    weight_dtype = weight_dtype or dtype
    bias_dtype = bias_dtype or weight_dtype
    h, w = h.to(dtype), w.to(weight_dtype)
    b = None if b is None else b.to(bias_dtype)
    if device is not None:
        h, w, t = h.to(device), w.to(device), t.to(device)
        b = None if b is None else b.to(device)
    if requires_grad:
        h, w = h.requires_grad_(), w.requires_grad_()
        b = None if b is None else b.requires_grad_()
    return Problem(h, w, b, t)


class DistillProblem(NamedTuple):
    """Both heads' inputs of ``linear_distillation``, in the order of its positional arguments and biases."""

    student_hidden: torch.Tensor
    student_weight: torch.Tensor
    student_bias: torch.Tensor | None
    teacher_hidden: torch.Tensor
    teacher_weight: torch.Tensor
    teacher_bias: torch.Tensor | None
    targets: torch.Tensor


def distill_problem(
    n: int | tuple[int, ...],
    ds: int,
    dt: int,
    v: int,
    *,
    student_dtype: torch.dtype = torch.float32,
    teacher_dtype: torch.dtype = torch.float32,
    bias: bool = True,
    scale: float = 1.0,
    hidden_scale: float = 1.0,
    weight_scale: float | tuple[float, float] = 1.0,
    draw_dtype: torch.dtype = torch.float32,
    ignore=(),
    ignore_index: int = -100,
    seed: int | torch.Generator = 0,
    device: torch.device | str | None = None,
    requires_grad: bool = False,
) -> DistillProblem:
    """The standard two-head (distillation) problem, drawn in this order from one generator (``seed``, or
    a ``torch.Generator`` the caller goes on drawing from), each float tensor ``randn(...) * s * scale`` drawn
    in ``draw_dtype``:

    - the student's ``hidden [*n, ds]`` (``s = hidden_scale``), ``weight [v, ds]`` (``s`` = the first of
      ``weight_scale``), ``bias [v]`` (``s = 1``, if ``bias``);
    - the teacher's ``hidden [*n, dt]``, ``weight [v, dt]`` (the second of ``weight_scale``), ``bias [v]``;
    - ``targets = randint(0, v, n)``, ``ignore_index`` at each index in ``ignore``.

    Then the student's tensors are cast to ``student_dtype``, the teacher's to ``teacher_dtype``, all moved
    to ``device``; with ``requires_grad`` the student's hidden, weight and bias are leaves that require grad
    (the teacher's never do).
    """
    g = _generator(seed)
    shape = (n,) if isinstance(n, int) else tuple(n)
    ws = weight_scale if isinstance(weight_scale, tuple) else (weight_scale, weight_scale)

    def r(*size, s=1.0):
        return torch.randn(*size, generator=g, dtype=draw_dtype) * s * scale

    sh, sw = r(*shape, ds, s=hidden_scale), r(v, ds, s=ws[0])
    sb = r(v) if bias else None
    th, tw = r(*shape, dt, s=hidden_scale), r(v, dt, s=ws[1])
    tb = r(v) if bias else None
    t = _ignore(torch.randint(0, v, shape, generator=g), g, ignore, 0.0, ignore_index)

    def cast(x, dtype, grad=False):
        if x is None:
            return None
        x = x.to(dtype)
        x = x if device is None else x.to(device)
        return x.requires_grad_() if grad else x

    return DistillProblem(
        cast(sh, student_dtype, requires_grad),
        cast(sw, student_dtype, requires_grad),
        cast(sb, student_dtype, requires_grad),
        cast(th, teacher_dtype),
        cast(tw, teacher_dtype),
        cast(tb, teacher_dtype),
        t if device is None else t.to(device),
    )


def integer_problem(n=24, d=6, v=29, seed=0, dtype=torch.float32):
    """Small-integer hidden states and head rows: every logit is an exact integer (ties are exact), and rows 3 and
    17 of the head are equal (a tie between ids 3 and 17 wherever either is the max)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-3, 4, (n, d), generator=g).to(dtype)
    w = torch.randint(-3, 4, (v, d), generator=g).to(dtype)
    w[17] = w[3]
    h[:4] = w[3]  # rows whose max is the tie
    t = torch.randint(0, v, (n,), generator=g)
    t[1] = 17  # a target that ties with the (lower) predicted id 3: not top-1
    t[0] = 3  # the lowest of the tie: top-1
    t[5] = t[9] = -100
    return h, w, t
