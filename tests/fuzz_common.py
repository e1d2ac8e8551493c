"""What the two fuzz modules share (tests/test_fuzz.py: cross-entropy and logprobs; tests/test_fuzz_distill.py:
distillation): the example budget, the count of checked cases, and the judge of a gradient.

- ``LONG``, ``fuzz_settings(ci_examples)``: CI runs ``ci_examples`` fixed, derandomized examples per property;
  ``CCE_FUZZ_EXAMPLES=N`` runs N fresh ones.
- ``CHECKED``: the cases checked and found right, by property family; both modules count into it and
  ``python -m benchmarks.reliability_counts`` reads it from this module.
- ``needs_triton``, ``DTYPES``, ``EPS``: the Triton skip mark, the head dtypes drawn, their unit roundoff.
- The judge: ``grad_tol``, ``store_rounding_tol``, ``grad_report`` (the precision contract: within tolerance of
  the same-dtype oracle, or no farther from the float64 program than it is, within 2x), ``exact_grads``.
- ``leaves(*ts, need=)``, ``backward_grads(outputs, inputs, upstreams)``.
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
from helpers import TRITON, close_report

hyp = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402

LONG = int(os.environ.get("CCE_FUZZ_EXAMPLES", "0") or 0)

#: cases this process checked against the oracle and found right, by property family (counted after
#: the last assertion of a case; read by ``python -m benchmarks.reliability_counts``). For a
#: property that failed, hypothesis's shrinking adds the passing cases it tried.
CHECKED: collections.Counter = collections.Counter()


def fuzz_settings(ci_examples: int) -> settings:
    """CI: ``ci_examples`` fixed, derandomized examples; long mode: CCE_FUZZ_EXAMPLES fresh ones."""
    return settings(
        max_examples=LONG or ci_examples,
        derandomize=not LONG,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


needs_triton = pytest.mark.skipif(not TRITON, reason="cce_dist.kernels unavailable (triton missing / no interpreter)")

EPS = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def grad_tol(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """Absolute tolerance for a gradient in ``dtype``: a few units of its resolution at its scale."""
    scale = float(ref.detach().float().abs().max()) if ref.numel() else 0.0
    k = 2e-5 if dtype == torch.float32 else 12 * EPS[dtype]
    return k * scale + (1e-7 if dtype == torch.float32 else EPS[dtype] * 1e-2)


def store_rounding_tol(compute: torch.dtype, stored: torch.dtype, ref: torch.Tensor) -> float:
    """Extra tolerance when a gradient computed in ``compute`` is stored in a coarser ``stored`` dtype.

    The oracle and cce_dist each round their (already slightly different) ``compute``-dtype gradient
    once more to ``stored`` (e.g. an fp16 head with a bf16 hidden: dH is formed in fp16 and returned
    in bf16), so the two may land on neighbouring ``stored`` values: one ulp of ``stored``, which is
    at most ``2 * EPS[stored] * |ref|`` for bf16 / fp16 (EPS is their unit roundoff).
    """
    if stored == compute or stored == torch.float32 or EPS[stored] <= EPS[compute]:
        return 0.0
    scale = float(ref.detach().float().abs().max()) if ref.numel() else 0.0
    return 2 * EPS[stored] * scale


def grad_report(got: torch.Tensor, want: torch.Tensor, tol: float, exact, contract_exact=None) -> str | None:
    """None if a gradient meets the precision contract, else a message.

    First check: within ``tol`` of the same-dtype oracle ``want``. A gradient that is a sum of
    terms cancelling each other (e.g. ``db_j = sum_i g_i (p_ij - [t_i = j])`` with the target's
    ``p ~ 1``) has a rounding error of ``eps * sum |terms|``, not ``eps * |result|``, and the
    low-precision oracle, which rounds every ``dz`` to its dtype before summing, can be the one that
    is off. So a gradient outside ``tol`` still passes when it is no farther from the float64
    gradient than the same-dtype materialized program is (the contract: never worse than the
    materialized loss in the same dtype), within 2x. ``exact()`` returns the float64 gradient
    (computed only when needed).

    ``contract_exact()`` (optional) returns the float64 gradient of the precision contract's program
    (``tests/oracle.py``, ``contract=``: the logits rounded to the compute dtype as both programs round
    them). Where that shared rounding dominates, the oracle's own extra roundings (of ``dz`` before its
    sums) can land it near the unrounded float64 value by chance; so the 2x comparison also passes when
    it holds against this reference, which measures what each program adds beyond the rounding the
    contract prescribes.
    """
    r = close_report(got.float(), want.float(), tol, 0.0)
    if r is None:
        return None
    x, y, e = got.double(), want.double(), exact().double()
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all()) and bool(torch.isfinite(e).all())):
        return r
    err_got, err_want = float((x - e).abs().max()), float((y - e).abs().max())
    if err_got <= 2.0 * err_want:
        return None
    msg = f"{r}; float64 error {err_got:.3g} > 2x the same-dtype oracle's {err_want:.3g}"
    if contract_exact is None:
        return msg
    c = contract_exact().double()
    if not bool(torch.isfinite(c).all()):
        return msg
    err_got_c, err_want_c = float((x - c).abs().max()), float((y - c).abs().max())
    if err_got_c <= 2.0 * err_want_c:
        return None
    return f"{msg}; against the contract's float64 program {err_got_c:.3g} > 2x {err_want_c:.3g}"


def exact_grads(oracle, outs_needed, inputs, need, ups, contract=None):
    """Lazily the gradients of ``oracle(h, w, b, dtype=float64, contract=contract)`` w.r.t. float64 copies of
    ``inputs`` (h, w, b) (the first ``outs_needed`` outputs, upstream ``ups``): index -> tensor."""
    cache = {}

    def get(i: int) -> torch.Tensor:
        if not cache:
            h, w, b = leaves(*(None if x is None else x.double() for x in inputs), need=need)
            refs = oracle(h, w, b, dtype=torch.float64, contract=contract)
            refs = refs if isinstance(refs, tuple) else (refs,)
            cache.update(enumerate(backward_grads(list(refs)[:outs_needed], (h, w, b), ups)))
        return cache[i]

    return get


def leaves(*ts, need=None):
    need = need or (True,) * len(ts)
    return [
        None if t is None else t.detach().clone().requires_grad_(bool(r and t.is_floating_point()))
        for t, r in zip(ts, need)
    ]


def backward_grads(outputs, inputs, upstreams):
    pairs = [(o, u) for o, u in zip(outputs, upstreams) if o is not None and o.requires_grad]
    if not pairs:
        return [None] * len(inputs)
    torch.autograd.backward([o for o, _ in pairs], [u for _, u in pairs])
    return [None if (x is None or not x.requires_grad) else x.grad for x in inputs]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
