"""Property-based fuzzing of ``linear_distillation`` against the materialized two-head program.

Each example draws a tiny problem (N 0-9 tokens, flat or ``[2, N/2]``; V 1-40; D_s, D_t 1-16 drawn apart),
each head's dtype (fp32 / bf16 / fp16 weight, the hidden fp32 / bf16 / the weight's), both biases (with
``-inf`` entries in either head: masked tokens), a softcap (none, one, or one per head), a temperature
log-uniform in [0.05, 20], the divergence's ``beta``, ``hard_label_weight`` (with targets: none, some or
all of them ``ignore_index``, an in-vocab one included), ``scale_by_temperature_squared``, the reduction,
chunk sizes and the grad-in-forward schedule (torch), ``deterministic`` (triton), random subsets of the
student's tensors requiring grad, and the upstream gradient: random, zero, ``inf`` on ignored rows only
(``reduction="none"``), or ``inf`` everywhere. It checks the loss and every student gradient (dH, dW, db)
against ``oracle_distill`` (``tests/oracle.py``: both heads' logits formed with ``F.linear``,
everything after in float64).

The judge is ``tests/test_fuzz.py``'s (``grad_report`` and its tolerances, in ``tests/fuzz_common.py``): the
reference is the materialized program *in the heads' own dtypes* (``oracle_distill(..., student_dtype=,
teacher_dtype=)``: each projection rounded to its head's compute dtype as the contract says, then float64; its
autograd rounds the logits' gradient to the student's dtype before the dH / dW GEMMs, as a materialized
low-precision backward does), with ``grad_tol`` / ``store_rounding_tol`` (a few units of that dtype's resolution at
the gradient's scale); an output outside that tolerance still passes when it is no farther from the unrounded
float64 program than the same-dtype program is, within 2x (``grad_report``: sums of cancelling terms, and logits one
rounding apart). The loss is judged the same way, with a float32 tolerance that grows with the soft logits' range
(``|log p|``, which every divergence term carries).

Masked tokens (as ``cce_dist/impl/torch_distill.py``'s module docstring documents them). A ``-inf`` bias entry
without a softcap on that head is a masked token (probability 0). The materialized program gives NaN there
(``0 * -inf``) or, where the divergence really is infinite, ``+inf``: teacher mass on a student-masked
token for ``kl``, student mass on a teacher-masked one for ``reverse_kl`` (a hard-label target is never a
student-masked token here). Rows of that kind must come out ``+inf`` (a scalar reduction too; with
``hard_label_weight=1`` the divergence's weight 0 times ``+inf`` is NaN, as materialized); every other
row must be finite and equal to the program whose masked logits are a finite -3e4 (``exp`` of it over
T <= 20 is exactly 0 in float64: the same probabilities and ``0 log 0 = 0``), gradients included (not the
program with those vocab rows removed: a token masked in one head only is still in the other head's softmax). With a
softcap on the head the ``-inf`` raw logit is capped to ``-softcap`` (finite), as materialized. A teacher
probability between 0 and 1e-30 on a student-masked token (where float32 underflow may legitimately drop
it) may give either.

Upstream gradients: ignored rows get exactly zero gradient whatever the upstream (``inf`` included);
``loss * 0`` gives exactly zero gradients (rows with finite loss); with ``inf`` upstream on counted rows
only the ignored rows' dH is checked (zero).

Budget (as ``tests/test_fuzz.py``): CI runs a fixed, derandomized number of examples per property;
``CCE_FUZZ_EXAMPLES=N`` runs N fresh ones. Families counted in ``fuzz_common.CHECKED`` (read by
``python -m benchmarks.reliability_counts --suites fuzz``): ``torch distillation <divergence>`` and
``triton distillation <divergence>`` (the interpreter; its shapes are the smallest).
"""

from __future__ import annotations

import math

import pytest
import torch
from fuzz_common import (
    CHECKED,
    DTYPES,
    EPS,
    backward_grads,
    fuzz_settings,
    grad_report,
    grad_tol,
    leaves,
    needs_triton,
    store_rounding_tol,
)
from oracle import oracle_distill, oracle_logits

hyp = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cce_dist import linear_distillation  # noqa: E402

# examples per property (one property per implementation and divergence) in CI
CI_TORCH = 60
CI_TRITON = 6

DIVERGENCES = ["kl", "reverse_kl", "jsd"]
MASK_VALUE = -3.0e4  # finite in fp16 / bf16; exp(-3e4 / 20 - ...) == 0 exactly in float64
INF = float("inf")


def _masked_to_finite(b: torch.Tensor | None) -> torch.Tensor | None:
    if b is None:
        return None
    return torch.where(torch.isneginf(b), torch.full_like(b, MASK_VALUE), b)


@st.composite
def distill_problems(draw, *, small: bool):
    n = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 9] if small else list(range(10))))
    v = draw(st.sampled_from([1, 2, 3, 7, 16, 33, 40]) if small else st.integers(1, 40))
    ds = draw(st.integers(1, 16))
    dt = draw(st.integers(1, 16))
    batched = draw(st.booleans()) and n > 0 and n % 2 == 0
    shape = (2, n // 2) if batched else (n,)
    heads = {}
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    for who, d in (("s", ds), ("t", dt)):
        wdtype = draw(st.sampled_from(DTYPES), label=f"{who} weight dtype")
        hdtype = draw(st.sampled_from([wdtype, torch.float32, torch.bfloat16]), label=f"{who} hidden dtype")
        scale = draw(st.sampled_from([0.05, 0.5, 1.0, 3.0]), label=f"{who} scale")
        h = (torch.randn(*shape, d, generator=g) * scale).to(hdtype)
        w = (torch.randn(v, d, generator=g) / math.sqrt(d) * 2).to(wdtype)
        b = None
        if draw(st.booleans(), label=f"{who} bias"):
            offset = draw(st.sampled_from([0.0, 0.0, 0.0, 40.0, -60.0]), label=f"{who} offset")
            b = torch.randn(v, generator=g) * 0.5 + offset
            n_mask = draw(st.sampled_from([0, 1, 2]), label=f"{who} masked tokens") if v > 1 else 0
            n_mask = min(n_mask, v - 1)  # never the whole vocabulary
            if n_mask:
                b[torch.randperm(v, generator=g)[:n_mask]] = -INF
            b = b.to(wdtype)
        heads[who] = (h, w, b)
    return heads, dict(n=n, v=v, ds=ds, dt=dt, shape=shape, seed=seed)


def _soft_probs(h, w, b, cap, temperature):
    """float64 softmax of a head's soft logits (masked tokens at -3e4: probability exactly 0)."""
    z = oracle_logits(
        h.double(), w.double(), _masked_to_finite(b), softcap=cap, temperature=temperature, dtype=torch.float64
    )
    return z.reshape(-1, w.shape[0]).softmax(-1)


def _mask(b, cap):
    """bool [V]: the head's masked tokens (a -inf bias entry and no softcap on that head)."""
    if b is None or cap is not None:
        return None
    m = torch.isneginf(b)
    return m if bool(m.any()) else None


def check_distillation(data, impl: str, divergence: str):
    small = impl == "triton"
    heads, m = data.draw(distill_problems(small=small), label="problem")
    (hs, ws, bs), (ht, wt, bt) = heads["s"], heads["t"]
    n, v, shape = m["n"], m["v"], m["shape"]
    temperature = data.draw(
        st.sampled_from([1.0, 0.05, 20.0]) | st.floats(math.log(0.05), math.log(20.0)).map(math.exp),
        label="temperature",
    )
    beta = data.draw(st.sampled_from([0.5, 0.1, 0.9]) | st.floats(0.01, 0.99), label="beta")
    cap_choice = st.sampled_from([None, None, 0.7, 5.0, 30.0])
    softcap = data.draw(
        st.one_of(cap_choice, st.tuples(cap_choice, cap_choice)),
        label="softcap",
    )
    caps = softcap if isinstance(softcap, tuple) else (softcap, softcap)
    mask_s, mask_t = _mask(bs, caps[0]), _mask(bt, caps[1])
    ignore_index = data.draw(st.sampled_from([-100, -1, 0] if v > 1 else [-100, -1]), label="ignore_index")
    target_mode = data.draw(st.sampled_from(["none", "all", "some", "some", "ignored"]), label="targets")
    g = torch.Generator().manual_seed(m["seed"] + 1)
    targets = None
    if target_mode != "none":
        # targets among the student's unmasked tokens (a masked target's CE is +inf: not drawn here)
        allowed = torch.arange(v) if mask_s is None else (~mask_s).nonzero().flatten()
        targets = allowed[torch.randint(0, len(allowed), shape, generator=g)]
        if target_mode == "some":
            targets = torch.where(torch.rand(shape, generator=g) < 0.3, torch.full_like(targets, ignore_index), targets)
        elif target_mode == "ignored":
            targets = torch.full_like(targets, ignore_index)
        if data.draw(st.booleans(), label="int32 targets"):
            targets = targets.to(torch.int32)
    hard = data.draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]), label="hard_label_weight") if targets is not None else 0.0
    t2 = data.draw(st.booleans(), label="scale_by_temperature_squared")
    reduction = data.draw(st.sampled_from(["mean", "sum", "none"]), label="reduction")
    extra = {}
    if impl == "torch":
        extra["chunk_size"] = data.draw(st.sampled_from([1, 3, max(v - 1, 1), None]), label="chunk_size")
        extra["grad_in_forward"] = data.draw(st.sampled_from([None, False, True]), label="grad_in_forward")
    else:
        extra["deterministic"] = data.draw(st.booleans(), label="deterministic")
    need = data.draw(
        st.sampled_from([(True, True, True)]) | st.tuples(st.booleans(), st.booleans(), st.booleans()),
        label="requires grad (h, w, b)",
    )
    up_mode = data.draw(st.sampled_from(["rand"] * 4 + ["zero", "inf_ignored", "inf"]), label="upstream")
    kw = dict(
        divergence=divergence,
        beta=beta,
        temperature=temperature,
        scale_by_temperature_squared=t2,
        hard_label_weight=hard,
        ignore_index=ignore_index,
        reduction=reduction,
        softcap=softcap,
        impl=impl,
        **extra,
    )
    okw = {
        k: kw[k]
        for k in (
            "divergence",
            "beta",
            "temperature",
            "scale_by_temperature_squared",
            "hard_label_weight",
            "ignore_index",
            "reduction",
            "softcap",
        )
    }
    cd_s, cd_t = ws.dtype, wt.dtype
    valid = torch.ones(n, dtype=torch.bool) if targets is None else (targets.reshape(-1) != ignore_index)

    # rows whose divergence is +inf (documented), and those where float32 underflow may decide it
    inf_rows = torch.zeros(n, dtype=torch.bool)
    either_rows = torch.zeros(n, dtype=torch.bool)
    if n:
        for who_mask, other in (
            (mask_s if divergence == "kl" else None, (ht, wt, bt, caps[1])),
            (mask_t if divergence == "reverse_kl" else None, (hs, ws, bs, caps[0])),
        ):
            if who_mask is None:
                continue
            p = _soft_probs(other[0], other[1], other[2], other[3], temperature)[:, who_mask].sum(-1)
            inf_rows |= p > 1e-30
            either_rows |= (p > 0) & (p <= 1e-30)
    inf_rows &= valid
    either_rows &= valid

    # upstream gradient of the loss
    out_shape = shape if reduction == "none" else ()
    ignored = (~valid).reshape(shape)
    if up_mode == "zero":
        up = torch.zeros(out_shape)
    elif up_mode == "inf":
        up = torch.full(out_shape, INF)
    else:
        up = (
            torch.randn(out_shape, generator=g)
            if reduction == "none"
            else torch.tensor(float(torch.rand(1, generator=g)) + 0.5)
        )
        if up_mode == "inf_ignored" and reduction == "none":
            up = torch.where(ignored, torch.full_like(up, INF), up)

    s1 = leaves(hs, ws, bs, need=need)
    th1, tw1 = ht.detach().clone().requires_grad_(ht.is_floating_point()), wt.detach().clone()
    before = [x.clone() for x in (hs, ws, ht, wt) + tuple(x for x in (bs, bt, targets) if x is not None)]
    out = linear_distillation(s1[0], s1[1], th1, tw1, targets, student_bias=s1[2], teacher_bias=bt, **kw)

    fails = []
    if out.dtype != torch.float32:
        fails.append(f"loss dtype {out.dtype}")
    if tuple(out.shape) != tuple(out_shape):
        fails.append(f"loss shape {tuple(out.shape)} != {tuple(out_shape)}")

    def ref(h_, w_, b_, s_dtype, t_dtype, reduction=reduction, contract=None):
        ht_ = ht.double() if t_dtype == torch.float64 else ht
        wt_ = wt.double() if t_dtype == torch.float64 else wt
        bt_ = _masked_to_finite(bt)
        bt_ = None if bt_ is None else (bt_.double() if t_dtype == torch.float64 else bt_)
        return oracle_distill(
            h_,
            w_,
            ht_,
            wt_,
            targets,
            student_bias=b_,
            teacher_bias=bt_,
            student_dtype=s_dtype,
            teacher_dtype=t_dtype,
            student_contract=contract,
            **{**okw, "reduction": reduction},
        )

    bs_fin = _masked_to_finite(bs)
    s2 = leaves(hs, ws, bs_fin, need=need)
    want = ref(*s2, cd_s, cd_t)

    def exact_of(reduction=reduction):
        h3 = leaves(*(None if x is None else x.double() for x in (hs, ws, bs_fin)), need=need)
        return h3, ref(*h3, torch.float64, torch.float64, reduction=reduction)

    # forward tolerance: float32 statistics and log-probabilities (|log p| up to the soft logits' range: a float32
    # soft logit of magnitude |z| = |raw| / T carries an ulp of |z|, as in the materialized float32 program)
    def zmax(h, w, b, cap, temp, mask):
        if h.numel() == 0 or w.numel() == 0:
            return 0.0
        z = oracle_logits(
            h.double(), w.double(), _masked_to_finite(b), softcap=cap, temperature=temp, dtype=torch.float64
        ).abs()
        z = z.reshape(-1, w.shape[0]) if mask is None else z.reshape(-1, w.shape[0])[:, ~mask]  # masked: not logits
        return float(z.max()) if z.numel() else 0.0

    zsoft = max(zmax(hs, ws, bs, caps[0], temperature, mask_s), zmax(ht, wt, bt, caps[1], temperature, mask_t))
    z1 = zmax(hs, ws, bs, caps[0], 1.0, mask_s)
    lv = math.log(max(v, 1))
    tsq = temperature**2 if t2 else 1.0
    e32 = 2.0**-23
    row_tol = (1 - hard) * tsq * 16 * e32 * (1 + 2 * zsoft + lv) + hard * 8 * e32 * (1 + 2 * z1 + lv)
    n_sum = max(int(valid.sum()), 1) if reduction == "sum" else 1
    atol = row_tol * n_sum

    any_inf = bool(inf_rows.any())
    # with hard_label_weight = 1 the divergence's weight is 0: the materialized program's 0 * inf is NaN
    bad = torch.isnan if hard == 1.0 else torch.isposinf
    bad_name = "NaN (0 * inf, as materialized)" if hard == 1.0 else "+inf"
    finite_rows = valid & ~inf_rows & ~either_rows
    if reduction == "none":
        got_rows = out.detach().reshape(-1)
        if bool((got_rows[~valid] != 0).any()):
            fails.append("an ignored row's loss is not 0")
        if any_inf and not bool(bad(got_rows[inf_rows]).all()):
            fails.append(
                f"rows {inf_rows.nonzero().flatten().tolist()} should be {bad_name}, got {got_rows[inf_rows].tolist()}"
            )
        ebad = either_rows & ~bad(got_rows) & ~torch.isfinite(got_rows)
        if bool(ebad.any()):
            fails.append(f"rows {ebad.nonzero().flatten().tolist()} neither +inf nor finite")
        if bool(finite_rows.any()):
            # an either row that came out finite is judged like the others
            judged = finite_rows | (either_rows & torch.isfinite(got_rows))
            w_rows = want.detach().reshape(-1)
            e_rows = exact_of("none")[1].detach().reshape(-1)
            if r := grad_report(got_rows[judged], w_rows[judged], atol, lambda: e_rows[judged]):
                fails.append(f"loss rows: {r}")
    elif any_inf:
        if not bool(bad(out.detach())):
            fails.append(f"loss should be {bad_name} (rows {inf_rows.nonzero().flatten().tolist()}), got {float(out)}")
    elif bool(either_rows.any()) and bool(bad(out.detach())):
        pass  # float32 may drop a tiny teacher mass or keep it
    else:
        if r := grad_report(
            out.detach().reshape(1),
            want.detach().reshape(1),
            atol + 4 * e32 * float(want.detach().abs()),
            lambda: exact_of()[1].detach().reshape(1),
        ):
            fails.append(f"loss: {r}")

    # gradients
    finite_loss = not (any_inf or bool(either_rows.any()))
    if out.requires_grad:
        got = backward_grads([out], s1, [up])
        if th1.grad is not None:
            fails.append("the teacher's hidden state got a gradient")
        names = ("dH", "dW", "db")
        for name, x, src, nd in zip(names, got, (hs, ws, bs), need):
            if src is None or not nd:
                if x is not None:
                    fails.append(f"{name} given but not wanted")
                continue
            if x is None:
                fails.append(f"{name} missing")
                continue
            if x.dtype != src.dtype or x.shape != src.shape:
                fails.append(f"{name} dtype/shape {x.dtype} {tuple(x.shape)}")
        dh = got[0]
        if dh is not None and bool(ignored.any()):
            if bool((dh[ignored] != 0).any()):
                fails.append(f"dH of ignored rows not zero (upstream {up_mode})")
        if not bool(valid.any()):
            for name, x in zip(names, got):
                if x is not None and bool((x != 0).any()):
                    fails.append(f"{name} not zero with every row ignored (upstream {up_mode})")
        elif up_mode == "zero" and finite_loss:
            for name, x in zip(names, got):
                if x is not None and bool((x != 0).any()):
                    fails.append(f"{name} not zero for loss * 0")
        elif up_mode in ("rand", "inf_ignored") and finite_loss and (up_mode == "rand" or reduction == "none"):
            want_g = backward_grads([want], s2, [up])
            exact_cache, contract_cache = {}, {}

            def contract_exact(i):
                # the float64 program of the contract: the student's logits rounded to its compute dtype as both
                # programs round them, the teacher's as materialized, everything after in float64
                if not contract_cache:
                    h3 = leaves(*(None if x is None else x.double() for x in (hs, ws, bs_fin)), need=need)
                    e = ref(*h3, torch.float64, cd_t, contract=cd_s)
                    contract_cache.update(enumerate(backward_grads([e], h3, [up.double()])))
                return contract_cache[i]

            def exact(i):
                if not exact_cache:
                    h3, e = exact_of()
                    exact_cache.update(enumerate(backward_grads([e], h3, [up.double()])))
                return exact_cache[i]

            # reverse_kl / jsd gradients carry log-ratios (|ls - lt| up to twice the soft logits' range)
            factor = 1 + (2 * zsoft if divergence != "kl" else 0.0)
            # The logits' gradient dz is a difference of terms (kl: T**2 / T * (p_s - p_t); the hard term p1 - onehot)
            # that cancel where they agree: float32 gets each term to an ulp or so, so its error scales with the
            # terms, not with their difference (grad_tol's scale). And a low-precision backward rounds dz (or, fused,
            # the gradient at unit upstream) to the head's dtype before the GEMMs, an error of u * |dz| per term
            # that the GEMM's cancellation keeps (u: the dtype's unit roundoff; the same-dtype materialized program
            # makes it too, differently). So a few float32 ulps of every term plus 2u of every |dz|, chained
            # through |W|, |H|:
            ps = _soft_probs(hs, ws, bs, caps[0], temperature)
            pt = _soft_probs(ht, wt, bt, caps[1], temperature)
            terms = (1 - hard) * tsq / temperature * (ps + pt) * factor
            if hard:
                p1 = _soft_probs(hs, ws, bs, caps[0], 1.0)
                onehot = torch.zeros_like(p1)
                t1 = targets.reshape(-1).long()
                onehot[valid, t1[valid]] = 1.0
                terms = terms + hard * (p1 + onehot)
                dz_abs = (1 - hard) * tsq / temperature * (ps + pt) * factor + hard * (p1 - onehot).abs()
            else:
                dz_abs = terms
            a = up.double().reshape(-1) if reduction == "none" else up.double().expand(n)
            if reduction == "mean":
                a = a / max(int(valid.sum()), 1)
            a = torch.where(valid, a.abs(), torch.zeros_like(a))[:, None]
            u = EPS[cd_s] if cd_s != torch.float32 else 0.0
            dz = (4 * e32 * terms + 2 * u * dz_abs) * a  # [N, V]
            cancel = [
                float((dz @ ws.double().abs()).max()),
                float((dz.t() @ hs.reshape(n, -1).double().abs()).max()),
                float(dz.sum(0).max()),
            ]
            for i, (name, x, y, src) in enumerate(zip(names, got, want_g, (hs, ws, bs))):
                if x is None or y is None:
                    continue
                lowp = cd_s if cd_s != torch.float32 else src.dtype
                tol = grad_tol(lowp, y) * factor + store_rounding_tol(lowp, src.dtype, y) + cancel[i]
                if r := grad_report(x, y, tol, lambda i=i: exact(i), lambda i=i: contract_exact(i)):
                    fails.append(f"{name}: {r}")
    after = [x for x in (hs, ws, ht, wt) + tuple(x for x in (bs, bt, targets) if x is not None)]
    if not all(torch.equal(a, c) for a, c in zip(before, after)):
        fails.append("an input was modified in place")
    assert not fails, (
        f"{impl} distillation {kw} n={n} v={v} ds={m['ds']} dt={m['dt']} student {hs.dtype}/{cd_s} teacher "
        f"{ht.dtype}/{cd_t} targets={target_mode} upstream={up_mode} masks s={mask_s} t={mask_t}: " + "; ".join(fails)
    )
    CHECKED[f"{impl} distillation {divergence}"] += 1


@pytest.mark.parametrize("divergence", DIVERGENCES)
@fuzz_settings(CI_TORCH)
@given(data=st.data())
def test_fuzz_distill_torch(data, divergence):
    check_distillation(data, "torch", divergence)


@needs_triton
@pytest.mark.parametrize("divergence", DIVERGENCES)
@fuzz_settings(CI_TRITON)
@given(data=st.data())
def test_fuzz_distill_triton_interpreter(data, divergence):
    check_distillation(data, "triton", divergence)


@needs_triton
@pytest.mark.parametrize("divergence", ["kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("head", ["teacher", "student"])
@pytest.mark.parametrize("offset", [-60.0, -100.0, -1000.0])
def test_triton_one_head_far_below_the_other(divergence, head, offset):
    """Found by the fuzz (V = 1, T = 0.05, a teacher bias of -60.5: soft logits ~1200 below the student's). The
    divergences are unchanged by a constant added to one head's logits. The Triton JSD was NaN once the offset
    reached about 88: the rows kernel took exp(z - M) of the zero-filled lanes past V too, which overflowed where
    M < -88, and inf * 0 is NaN in the masked sum. Loss and every student gradient against the torch
    implementation (fp32, one ulp-level summation-order difference allowed)."""
    g = torch.Generator().manual_seed(0)
    sh, sw = torch.randn(3, 4, generator=g), torch.randn(2, 4, generator=g)
    th, tw = torch.randn(3, 4, generator=g), torch.randn(2, 4, generator=g)
    bias = torch.full((2,), offset)
    kw = dict(divergence=divergence, reduction="sum")
    kw["teacher_bias" if head == "teacher" else "student_bias"] = bias

    def run(impl):
        h, w = sh.clone().requires_grad_(), sw.clone().requires_grad_()
        loss = linear_distillation(h, w, th, tw, impl=impl, **kw)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    want, got = run("torch"), run("triton")
    assert all(bool(torch.isfinite(x).all()) for x in want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
