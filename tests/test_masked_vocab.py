"""A ``-inf`` bias over a whole vocab tile, split, chunk or tensor-parallel shard (vocab padding, a masked vocabulary)
gives the materialized program's loss and gradients, never NaN.

Regression: the running row max of a slice with no finite logit stays ``-inf``, and the kernels and the torch path
took their exponents relative to it (``-inf - -inf = NaN``): with ``impl="triton"`` a bias that is ``-inf`` on ids
``[0, 512)`` (16 whole vocab tiles of the interpreter's 32, 8 whole chunks of the chunked backward's 64) or ``[0, 300)``
(9 whole tiles, 4 whole chunks, then a partly masked tile) of ``V = 600`` gave NaN losses, logprobs, entropies and
gradients (every backward schedule: the chunked default, the per-tile one and the owner-computes one), and under
tensor parallelism a rank whose whole shard is masked made every rank's results NaN (both implementations, both
statistics collectives, 2 and 3 ranks, with and without an empty shard; cross-entropy, logprobs + entropy, row outputs
and the torch distillation). On one device the torch path forms a whole shard's rows at once and the distillation
kernels already took their exponents relative to a safe max (``kernels/distill.py``'s ``_center``): both are covered
on a group, where a shard is masked whole.

References (tests/oracle.py, float32 like the library's compute dtype, so the tolerances of test_numerics):

- cross-entropy and row outputs: the materialized program itself at the ``-inf`` bias (``F.cross_entropy``'s loss
  is finite without label smoothing; with it the loss is ``+inf``, the smoothing term's mean over a ``-inf`` logit,
  and its gradient is finite: a masked entry's ``db`` is the uniform term ``-eps / V`` times the upstream sum);
- logprobs + entropy and distillation: the materialized program's limit, ``-1e4`` for ``-inf`` (its own
  ``p * log p`` is ``0 * -inf = NaN`` at a masked token; at ``-1e4`` every masked ``p`` is exactly 0 in float32, as
  in tests/test_distill_regressions.py).

A row whose every logit is ``-inf`` keeps the materialized program's NaN (no distribution): checked last.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TRITON, close_report, leaf, problem
from oracle import oracle_cross_entropy, oracle_distill, oracle_logits, oracle_logprobs

from cce_dist import ROW_OUTPUTS, VocabShard, linear_cross_entropy, linear_distillation, linear_logprobs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

N, D, V, IGN = 10, 16, 600, -100
IGNORED = 3  # one ignored row
#: the masked ids [0, hi): 512 = 16 whole interpreter vocab tiles (32) and 8 whole backward chunks (64); 300 = 9 whole
#: tiles, 4 whole chunks and a tile (288-320) partly masked
MASKS = [512, 300]
LIMIT = -1e4  # the materialized program's limit for a -inf bias entry
ATOL, RTOL = 3e-5, 1e-4  # float32 against the float32 materialized program (as tests/test_numerics.py)

# one-head forms: (function, keywords, reference kind)
FORMS = {
    "ce_none_zloss": (linear_cross_entropy, dict(reduction="none", z_loss=1e-3), "exact"),
    "ce_none_smooth": (linear_cross_entropy, dict(reduction="none", label_smoothing=0.1), "exact"),
    "ce_mean_smooth": (linear_cross_entropy, dict(reduction="mean", label_smoothing=0.1), "exact"),
    "ce_sum": (linear_cross_entropy, dict(reduction="sum", grad_in_forward=False), "exact"),
    "logprobs_entropy": (linear_logprobs, dict(return_entropy=True, temperature=0.7), "limit"),
    "row_outputs": (linear_cross_entropy, dict(reduction="none", row_outputs=ROW_OUTPUTS), "exact"),
}
DISTILL = {
    "jsd_hard": dict(divergence="jsd", hard_label_weight=0.25, reduction="none", temperature=0.8),
    "kl": dict(divergence="kl", reduction="none"),
    "kl_hard_sum": dict(divergence="kl", hard_label_weight=0.5, reduction="sum"),
}


def _problem(hi: int, seed: int = 0):
    """``(h, w, b, t)`` with ``b = -inf`` on ``[0, hi)``, targets in ``[hi, V)`` (a masked target's loss is inf,
    as materialized), row IGNORED ignored; rows 0 and 1 target their predicted token (``is_top1``)."""
    h, w, b, t = problem(N, D, V, w_scale=0.5, target_range=(hi, V), ignore=(IGNORED,), ignore_index=IGN, seed=seed)
    b[:hi] = -math.inf
    pred = oracle_logits(h, w, b).argmax(-1)
    t[:2] = pred[:2]
    return h, w, b, t


def _distill_problem(hi: int, seed: int = 0):
    """Both heads masked on ``[0, hi)`` (vocab padding): ``(sh, sw, sb, th, tw, tb, t)``, targets in ``[hi, V)``."""
    g = torch.Generator().manual_seed(seed)
    sh, sw, sb = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g) * 0.5, torch.randn(V, generator=g)
    th, tw, tb = torch.randn(N, 12, generator=g), torch.randn(V, 12, generator=g) * 0.5, torch.randn(V, generator=g)
    t = torch.randint(hi, V, (N,), generator=g)
    t[IGNORED] = IGN
    sb[:hi] = tb[:hi] = -math.inf
    return sh, sw, sb, th, tw, tb, t


def _limit(b: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(b), torch.full_like(b, LIMIT), b)


def _upstream(outs, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g) if o.dim() else torch.tensor(1.0) for o in outs]


def _split(result):
    """``(differentiable outputs, RowOutputs or None)`` of a call's result."""
    extra = None
    if isinstance(result, tuple) and not isinstance(result[-1], torch.Tensor):
        result, extra = result[0], result[-1]
    outs = list(result) if isinstance(result, tuple) else [result]
    return outs, extra


def _oracle_form(form, h, w, b, t):
    """The reference ``(outputs, row outputs dict or None, (dh, dw, db))`` of a one-head form on the full vocab."""
    fn, kw, kind = FORMS[form]
    kw = {k: v for k, v in kw.items() if k not in ("grad_in_forward", "row_outputs")}
    hh, ww, bb = leaf(h), leaf(w), leaf(_limit(b) if kind == "limit" else b)
    oracle = oracle_cross_entropy if fn is linear_cross_entropy else oracle_logprobs
    out = oracle(hh, ww, t, bb, ignore_index=IGN, **kw)
    outs = list(out) if isinstance(out, tuple) else [out]
    torch.autograd.backward(outs, _upstream(outs))
    rows = None
    if form == "row_outputs":
        with torch.no_grad():
            z = oracle_logits(h, w, b)
            valid = t != IGN
            pred = torch.where(valid, z.argmax(-1), -1)
            lsq = torch.logsumexp(2 * torch.log_softmax(z, -1), -1)
            rows = dict(
                predicted=pred,
                is_top1=valid & (pred == t),
                log_sum_sq_probs=torch.where(valid, lsq, 0.0),
                mean_logit=torch.where(valid, z.mean(-1), 0.0),  # -inf: the mean over -inf logits
            )
    return [o.detach() for o in outs], rows, (hh.grad, ww.grad, bb.grad)


def _run_form(form, h, w, b, t, **kw):
    """The library's ``(outputs, RowOutputs or None, (dh, dw, db))`` (``kw``: impl, shard, ...)."""
    fn, fkw, _ = FORMS[form]
    hh, ww, bb = leaf(h), leaf(w), leaf(b)
    outs, rows = _split(fn(hh, ww, t, bias=bb, ignore_index=IGN, **fkw, **kw))
    torch.autograd.backward(outs, _upstream(outs))
    return [o.detach() for o in outs], rows, (hh.grad, ww.grad, bb.grad)


def _compare(got, want, what, failures, vocab=slice(None)):
    """Append what differs (``vocab``: the rows of dW / db this shard holds)."""
    outs, rows, grads = got
    r_outs, r_rows, r_grads = want
    for k, (o, r) in enumerate(zip(outs, r_outs)):
        if (m := close_report(o, r, ATOL, RTOL)) is not None:
            failures.append(f"{what}: output {k}: {m}")
    if r_rows is not None:
        for name, r in r_rows.items():
            o = getattr(rows, name)
            ok = torch.equal(o, r) if name in ("predicted", "is_top1") else close_report(o, r, ATOL, RTOL) is None
            if not ok:
                failures.append(f"{what}: {name}: got {o.tolist()}, want {r.tolist()}")
    for name, o, r, sl in zip(("dH", "dW", "db"), grads, r_grads, (slice(None), vocab, vocab)):
        if not bool(torch.isfinite(o).all()):
            failures.append(f"{what}: {name} is not finite")
        elif (m := close_report(o, r[sl], ATOL, RTOL)) is not None:
            failures.append(f"{what}: {name}: {m}")


def _oracle_distill(form, sh, sw, sb, th, tw, tb, t):
    kw = DISTILL[form]
    hh, ww, bb = leaf(sh), leaf(sw), leaf(_limit(sb).double())
    loss = oracle_distill(
        hh, ww, th, tw, t, student_bias=bb, teacher_bias=_limit(tb).double(), ignore_index=IGN, **kw
    ).float()
    torch.autograd.backward([loss], _upstream([loss]))
    return [loss.detach()], None, (hh.grad, ww.grad, bb.grad)


def _run_distill(form, sh, sw, sb, th, tw, tb, t, **kw):
    hh, ww, bb = leaf(sh), leaf(sw), leaf(sb)
    loss = linear_distillation(
        hh, ww, th, tw, t, student_bias=bb, teacher_bias=tb, ignore_index=IGN, **DISTILL[form], **kw
    )
    torch.autograd.backward([loss], _upstream([loss]))
    return [loss.detach()], None, (hh.grad, ww.grad, bb.grad)


@pytest.fixture
def backward_schedule(request, monkeypatch):
    """The Triton backward schedule: "chunked" (the default), "tiles" or "owner" (chosen where the chunked one
    cannot run: here by a patched verdict); ``deterministic`` selects between the last two."""
    schedule = request.param
    if schedule != "chunked":
        from cce_dist.kernels import backward as B

        monkeypatch.setattr(B, "_chunked_verdict", lambda device, deterministic: (False, "test"))
    return dict(deterministic=True) if schedule == "owner" else {}


# ----------------------------------------------------------------------------------------------
# one device: whole vocab tiles, splits and backward chunks masked
# ----------------------------------------------------------------------------------------------


def _fully_masked(form, failures, **kw):
    """Every bias entry -inf, so every logit of every row: no distribution, the materialized NaN (``F.cross_entropy``,
    ``log_softmax``) in every counted row, never a finite number; the ignored row stays 0. (Kept behaviour: the
    guards must not hide it.) Forward only: the materialized gradients are NaN everywhere."""
    h, w, b, t = _problem(300)
    b[:] = -math.inf
    fn, fkw, _ = FORMS[form]
    fkw = {k: v for k, v in fkw.items() if k != "row_outputs"}  # the predicted token of no distribution: not here
    outs, _ = _split(fn(h, w, t, bias=b, ignore_index=IGN, **fkw, **kw))
    oracle = oracle_cross_entropy if fn is linear_cross_entropy else oracle_logprobs
    ref = oracle(h, w, t, b, ignore_index=IGN, **{k: v for k, v in fkw.items() if k != "grad_in_forward"})
    for k, (o, r) in enumerate(zip(outs, list(ref) if isinstance(ref, tuple) else [ref])):
        assert bool(torch.isnan(r[t != IGN] if r.dim() else r).all())  # the reference's NaN
        if (m := close_report(o, r, ATOL, RTOL)) is not None:
            failures.append(f"{form}, every logit -inf: output {k}: {m}")


@pytest.mark.skipif(not TRITON, reason="no cce_dist.kernels")
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("hi", MASKS)
def test_masked_tiles_match_the_materialized_program(form, hi):
    """The Triton kernels (the torch path forms the whole shard's rows at once, so one device never shows it: its
    masked shard is under tensor parallelism below)."""
    h, w, b, t = _problem(hi)
    failures: list[str] = []
    _compare(_run_form(form, h, w, b, t, impl="triton"), _oracle_form(form, h, w, b, t), form, failures)
    _fully_masked(form, failures, impl="triton")
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not TRITON, reason="no cce_dist.kernels")
@pytest.mark.parametrize("backward_schedule", ["chunked", "tiles", "owner"], indirect=True)
@pytest.mark.parametrize("form", ["ce_none_smooth", "logprobs_entropy"])
@pytest.mark.parametrize("hi", MASKS)
def test_masked_tiles_every_triton_backward_schedule(backward_schedule, form, hi):
    h, w, b, t = _problem(hi, seed=1)
    failures: list[str] = []
    got = _run_form(form, h, w, b, t, impl="triton", **backward_schedule)
    _compare(got, _oracle_form(form, h, w, b, t), form, failures)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------------------
# tensor parallel: a rank's whole shard masked (vocab padding), with and without an empty shard
# ----------------------------------------------------------------------------------------------

#: (layout by rank, masked [0, hi)): the masked shard on rank 0 or a later one, an empty shard, two masked ranks
LAYOUTS = {
    2: [([(0, 300), (300, 600)], 300), ([(512, 600), (0, 512)], 512)],
    3: [
        ([(0, 300), (300, 300), (300, 600)], 300),
        ([(300, 600), (0, 300), (600, 600)], 300),
        ([(0, 256), (256, 512), (512, 600)], 512),
    ],
}
TP_FORMS = ["ce_none_smooth", "ce_mean_smooth", "ce_sum", "logprobs_entropy", "row_outputs"]
TP_DISTILL = ["jsd_hard", "kl", "kl_hard_sum"]
TP_CASES = [
    pytest.param(
        world,
        k,
        impl,
        id=f"world{world}-layout{k}-{impl}",
        marks=pytest.mark.skipif(impl == "triton" and not TRITON, reason="no cce_dist.kernels"),
    )
    for world in (2, 3)  # the world outermost: the rank pool is spawned once per world
    for k in range(len(LAYOUTS[world]))
    for impl in ("torch", "triton")
]


def _tp_body(rank, world, group, layout, hi, impl):
    start, stop = layout[rank]
    failures: list[str] = []
    h, w, b, t = _problem(hi, seed=2)
    p = _distill_problem(hi, seed=2)
    sh, sw, sb, th, tw, tb, tt = p
    for collective in ("allreduce", "allgather"):
        shard = VocabShard(group, start, stop, stats_collective=collective)
        sl = slice(start, stop)
        for form in TP_FORMS:
            got = _run_form(form, h, w[sl], b[sl], t, impl=impl, shard=shard)
            _compare(got, _oracle_form(form, h, w, b, t), f"rank {rank} {collective} {form}", failures, sl)
        for form in TP_DISTILL:
            det = impl == "triton" and form == "kl"  # the kernels' deterministic backward too
            got = _run_distill(
                form, sh, sw[sl], sb[sl], th, tw[sl], tb[sl], tt, impl=impl, shard=shard, deterministic=det
            )
            _compare(got, _oracle_distill(form, *p), f"rank {rank} {collective} {form}", failures, sl)
    return failures


@pytest.mark.parametrize("world,k,impl", TP_CASES)
def test_masked_shard_on_a_group(rank_pool, world, k, impl):
    layout, hi = LAYOUTS[world][k]
    results = rank_pool(world).run(_tp_body, layout=layout, hi=hi, impl=impl, timeout=600)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures[:20])
