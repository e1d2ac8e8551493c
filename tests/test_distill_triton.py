"""linear_distillation(impl="triton") (cce_dist/kernels/distill.py) against the float64 materialized oracle
(tests/oracle.py) and against impl="torch".

Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET
before triton is imported), whose 16 x 32 tiles with 16-wide D chunks make these tiny shapes cover
several token tiles (N = 21), several vocab tiles with a ragged last one (V = 70), a ragged D loop
for both heads (D_s = 20, D_t = 40: different hidden sizes) and, at the kernel level, several
vocab splits.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from helpers import distill_problem
from oracle import oracle_distill

pytest.importorskip("triton")

from cce_dist import VocabShard, linear_distillation  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

N_SHAPE = (3, 7)
DS, DT, V = 20, 40, 70

# float32 logits and accumulation (both implementations) against float64: a few float32 ulps of
# each quantity's scale (the same bound as tests/test_distill.py's torch implementation).
F32 = dict(rtol=2e-5, atol=2e-6)
# triton against torch, both float32: only the summation order differs (tile vs chunk sums).
SAME = dict(rtol=1e-5, atol=1e-6)


# every tensor randn * scale, the heads * 0.4 (student) and * 0.3 (teacher): logits of O(1..3); one ignored row in
# each token tile; on DEVICE, the student's tensors leaves that require grad
_problem = functools.partial(
    distill_problem,
    N_SHAPE,
    DS,
    DT,
    V,
    weight_scale=(0.4, 0.3),
    ignore=((0, 1), (2, 3), (2, 6)),
    device=DEVICE,
    requires_grad=True,
)


def _grads(out, ins, up):
    return torch.autograd.grad(out, [x for x in ins if x is not None], grad_outputs=up)


def run(kw, seed=0, s_dtype=torch.float32, t_dtype=torch.float32, bias=True, no_targets=False, scale=1.0):
    """``(triton (loss, grads), torch (loss, grads), oracle (loss, grads))`` of one case; per-row
    upstream gradients for reduction="none"."""
    sh, sw, sb, th, tw, tb, t = _problem(
        seed=seed, student_dtype=s_dtype, teacher_dtype=t_dtype, bias=bias, scale=scale
    )
    targets = None if no_targets else t
    up = None
    res = []
    for impl in ("triton", "torch"):
        out = linear_distillation(sh, sw, th, tw, targets, student_bias=sb, teacher_bias=tb, impl=impl, **kw)
        if up is None and kw.get("reduction") == "none":
            up = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
        res.append((out, _grads(out, (sh, sw, sb), up)))
    okw = {k: v for k, v in kw.items() if k not in ("grad_in_forward", "deterministic")}
    ref = oracle_distill(
        sh.cpu(),
        sw.cpu(),
        th.cpu(),
        tw.cpu(),
        None if targets is None else targets.cpu(),
        student_bias=None if sb is None else sb.cpu(),
        teacher_bias=None if tb is None else tb.cpu(),
        student_dtype=s_dtype if s_dtype != torch.float32 else torch.float64,
        teacher_dtype=t_dtype if t_dtype != torch.float32 else torch.float64,
        **okw,
    )
    res.append((ref, _grads(ref, (sh, sw, sb), None if up is None else up.double())))
    return res


def check(got, want, tol, what=""):
    names = ("loss", "student_hidden", "student_weight", "student_bias")
    for name, a, b in zip(names, (got[0],) + tuple(got[1]), (want[0],) + tuple(want[1])):
        if name != "loss":
            assert a.dtype == b.dtype or want[0].dtype == torch.float64, name  # gradients in their tensor's dtype
        torch.testing.assert_close(a.double().cpu(), b.double().cpu(), **tol, msg=lambda m, n=name: f"{what} {n}: {m}")


DIVS = [("kl", {}), ("reverse_kl", {}), ("jsd", {"beta": 0.5}), ("jsd", {"beta": 0.2})]


@pytest.mark.parametrize("div,extra", DIVS, ids=["kl", "reverse_kl", "jsd0.5", "jsd0.2"])
def test_matches_oracle_and_torch_fp32(div, extra):
    """Every divergence over the whole product of temperature, softcap per head (none, student only, teacher only,
    both) and the hard-label mix, with the reduction, both autograd schedules and T**2 on / off spread over it so
    that every pair of those values occurs (the reduction and T**2 act on the host, after the kernels); loss and
    every student gradient."""
    caps = [None, (4.0, None), (None, 3.0), (5.0, 6.0)]
    cases = [(temp, cap, w) for temp in (1.0, 2.0) for cap in caps for w in (0.0, 0.25)]
    for i, (temp, cap, w) in enumerate(cases):
        kw = dict(divergence=div, temperature=temp, softcap=cap, hard_label_weight=w, **extra)
        kw["reduction"] = ("mean", "sum", "none")[i % 3]
        kw["grad_in_forward"] = (None, False)[(i // 3) % 2]
        kw["scale_by_temperature_squared"] = (i // 7) % 2 == 0
        tri, tor, ref = run(kw, seed=i)
        check(tri, ref, F32, str(kw))
        check(tri, tor, SAME, str(kw))


@pytest.mark.parametrize("div", ["kl", "reverse_kl", "jsd"])
def test_no_targets_no_bias(div):
    for kw in (dict(divergence=div, temperature=1.5), dict(divergence=div, reduction="none")):
        tri, tor, ref = run(kw, bias=False, no_targets=True)
        check(tri, ref, F32, str(kw))
        check(tri, tor, SAME, str(kw))


def test_large_logits_stay_exact():
    """Logits of magnitude ~100: every term is formed relative to the global lse (no cancellation)."""
    for div in ("kl", "reverse_kl", "jsd"):
        tri, _, ref = run(dict(divergence=div, reduction="none", hard_label_weight=0.5), seed=3, scale=3.5)
        # loss terms of order 100 in float32 logits: a few ulps of 100; gradients: of their scale
        torch.testing.assert_close(tri[0].double().cpu(), ref[0], rtol=1e-5, atol=1e-4)
        for a, b in zip(tri[1], ref[1]):
            torch.testing.assert_close(a.double().cpu(), b.double(), rtol=1e-4, atol=1e-4 * float(b.abs().max()))


@pytest.mark.parametrize(
    "s_dtype,t_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
    ids=["bf16-fp32", "fp32-bf16", "bf16-bf16", "fp16-fp16"],
)
@pytest.mark.parametrize("div", ["kl", "reverse_kl", "jsd"])
def test_low_precision_heads(s_dtype, t_dtype, div):
    """Each head projects in its own dtype. The oracle rounds the logits to the same dtype (the
    materialized bf16 program), then float64. In the interpreter the kernel rounds like F.linear
    (float32 sums of <= 40 products, then round-to-nearest-even), so the loss agrees to float32
    accumulation (measured <= 6e-7 relative; asserted 1e-5). On a GPU tl.dot sums in another order,
    so a logit may round to the neighbouring value (2**-8 relative), which moves the loss by at most
    2**-8 * max|logit| / T: asserted as 1e-2 of the loss scale there. The gradients come back in the
    low dtype, rounded once (2**-8) after low-precision GEMMs on both sides: 2e-2 of the gradient's
    scale (as for the torch implementation in tests/test_distill.py; measured <= 2.3e-3). fp16
    (2**-11) fits the same bounds."""
    kw = dict(divergence=div, temperature=2.0, hard_label_weight=0.3, softcap=(5.0, 6.0), reduction="none")
    tri, tor, ref = run(kw, seed=5, s_dtype=s_dtype, t_dtype=t_dtype)
    for got in (tri, tor):
        loss_tol = 1e-5 if INTERPRET else 1e-2
        torch.testing.assert_close(
            got[0].double().cpu(), ref[0], rtol=loss_tol, atol=loss_tol * float(ref[0].detach().abs().max())
        )
        for a, b in zip(got[1], ref[1]):
            assert a.dtype == s_dtype
            scale = b.double().abs().max()
            torch.testing.assert_close(a.double().cpu(), b.double(), rtol=2e-2, atol=2e-2 * float(scale))


def test_ignored_rows_give_zero_and_no_gradient():
    """Ignored rows: 0 loss and exactly no gradient contribution, even with non-finite hidden states."""
    sh, sw, sb, th, tw, tb, t = _problem(seed=9)
    with torch.no_grad():
        sh[0, 1] = float("nan")  # t[0, 1] is ignored
    out = linear_distillation(
        sh, sw, th, tw, t, student_bias=sb, teacher_bias=tb, impl="triton", reduction="none", hard_label_weight=0.5
    )
    assert out[0, 1] == 0 and out[2, 3] == 0 and torch.isfinite(out).all()
    gh, gw, gb = _grads(out.sum(), (sh, sw, sb), None)
    assert torch.isfinite(gw).all() and torch.isfinite(gb).all()
    assert torch.equal(gh[0, 1], torch.zeros_like(gh[0, 1])) and torch.equal(gh[2, 3], torch.zeros_like(gh[2, 3]))


def test_splits_and_tiles_agree_with_the_oracle():
    """Kernel level: the statistics, the KLs' cross sums (formed in the statistics pass, relative to
    running maxima that move from tile to tile) and the JSD's per-row sums of 1, 2 and 3 vocab splits
    (and a second tile shape) are the oracle's, so the merge of split slabs is exercised."""
    from cce_dist.core import stats as S
    from cce_dist.kernels import distill as KD

    sh, sw, sb, th, tw, tb, t = (x.detach() if x is not None else x for x in _problem(seed=4))
    hs, ht, tt = sh.reshape(-1, DS), th.reshape(-1, DT), t.reshape(-1)
    zs = (hs.double() @ sw.double().T + sb.double()) / 1.5
    zt = (ht.double() @ tw.double().T + tb.double()) / 1.5
    z1 = zs * 1.5
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    lm = torch.logaddexp(lt + torch.tensor(0.3).log(), ls + torch.tensor(0.7).log())
    want_jsd = torch.stack([(lt.exp() * (lt - lm)).sum(-1), (ls.exp() * (ls - lm)).sum(-1)], 1)
    want_kl = {"kl": (lt.exp() * (lt - ls)).sum(-1), "reverse_kl": (ls.exp() * (ls - lt)).sum(-1)}
    for splits, blocks in ((1, None), (2, None), (3, None), (2, (32, 16, 16, 32))):
        geo = dict(softcap=(None, None), temperature=1.5, _splits=splits, _blocks=blocks)
        for cross in ("kl", "reverse_kl"):
            st, slabs = KD.stats(hs, sw, sb, ht, tw, tb, tt, vocab_start=0, hard=True, cross=cross, **geo)
            assert st.shape == (3, hs.shape[0], S.NUM_STATS)
            lse = torch.stack([S.lse(st[i]) for i in range(3)], 1)
            for i, z in enumerate((zs, zt, z1)):
                torch.testing.assert_close(lse[:, i].double(), torch.logsumexp(z, -1), rtol=1e-6, atol=1e-6)
            ok = (tt >= 0) & (tt < V)
            want_x = torch.where(ok, z1.gather(1, tt.clamp(0)[:, None])[:, 0], 0.0)
            torch.testing.assert_close(st[2, :, S.TARGET].double(), want_x, rtol=1e-6, atol=1e-6)
            got = KD.cross_rows(slabs, st.transpose(0, 1), cross=cross)[:, 0]
            torch.testing.assert_close(got.double(), want_kl[cross], rtol=1e-5, atol=1e-6)
        rows = KD.rows(hs, sw, sb, ht, tw, tb, KD.norms(st.transpose(0, 1)), divergence="jsd", beta=0.3, **geo)
        torch.testing.assert_close(rows.double(), want_jsd, rtol=1e-5, atol=1e-6)


def test_saved_tensors_hold_no_logits_block():
    """The recompute schedule saves the inputs and per-row statistics: nothing else of [N, V] size."""
    sh, sw, sb, th, tw, tb, t = _problem(seed=2)
    n = sh.shape[0] * sh.shape[1]
    inputs = {(n, DS), (V, DS), (V,), (n, DT), (V, DT), (n,)}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        out = linear_distillation(sh, sw, th, tw, t, student_bias=sb, impl="triton", reduction="none")
    assert saved, "the Function saved nothing?"
    others = [s for s in saved if s not in inputs]
    assert others and all(torch.Size(s).numel() <= 3 * 5 * n for s in others), saved  # [N, k, NUM_STATS] at most
    assert out.shape == N_SHAPE


def test_impl_triton_errors_name_the_argument(monkeypatch):
    sh, sw, sb, th, tw, tb, t = (x.detach().cpu() for x in _problem(seed=1))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter
    with pytest.raises(RuntimeError, match="impl='triton'.*TRITON_INTERPRET=1.*impl='torch'"):
        linear_distillation(sh, sw, th, tw, t, impl="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1" if INTERPRET else "0")
    with pytest.raises(TypeError, match="deterministic"):
        linear_distillation(sh, sw, th, tw, t, impl="triton", deterministic="yes")


@pytest.mark.parametrize("div", ["kl", "reverse_kl", "jsd"])
def test_deterministic_kernels_match_oracle(div):
    """deterministic=True (dH and dW / db kernels that own their output rows, no float atomics), and
    the same under torch.use_deterministic_algorithms(True): the oracle's numbers, the same bits twice."""
    kw = dict(divergence=div, temperature=2.0, softcap=(4.0, None), hard_label_weight=0.3, reduction="none")
    tri, _, ref = run(dict(kw, deterministic=True), seed=6)
    check(tri, ref, F32, str(kw))
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        again, _, _ = run(dict(kw, grad_in_forward=False), seed=6)
    finally:
        torch.use_deterministic_algorithms(prev)
    for a, b in zip((tri[0],) + tuple(tri[1]), (again[0],) + tuple(again[1])):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# vocab parallel: 2 gloo ranks, uneven shards and an empty one
# ----------------------------------------------------------------------------------------------

TP_LAYOUTS = [[(0, 37), (37, 70)], [(0, 70), (70, 70)]]


def _tp_body(rank, world, group):
    failures = []
    cases = [
        dict(divergence="kl", reduction="mean"),
        dict(divergence="reverse_kl", reduction="none", temperature=2.0, softcap=(4.0, 5.0), hard_label_weight=0.4),
        dict(divergence="jsd", beta=0.3, reduction="sum", hard_label_weight=0.2, grad_in_forward=False),
    ]
    for li, layout in enumerate(TP_LAYOUTS):
        start, stop = layout[rank]
        for i, kw in enumerate(cases):
            sp = i == 1  # one sequence-parallel case
            sh, sw, sb, th, tw, tb, t = (x.detach() for x in _problem(seed=10 * li + i))
            n = 20  # tokens, flattened: an even split under sequence parallelism
            sh, th, t = sh.reshape(-1, DS)[:n], th.reshape(-1, DT)[:n], t.reshape(-1)[:n]
            sl = slice(rank * n // world, (rank + 1) * n // world) if sp else slice(None)
            h_loc = sh[sl].clone().requires_grad_()
            w_loc = sw[start:stop].clone().requires_grad_()
            b_loc = sb[start:stop].clone().requires_grad_()
            shard = VocabShard(
                group, start, stop, sequence_parallel=sp, stats_collective=("allreduce", "allgather")[i % 2]
            )
            out = linear_distillation(
                h_loc,
                w_loc,
                th[sl],
                tw[start:stop],
                t,
                student_bias=b_loc,
                teacher_bias=tb[start:stop],
                shard=shard,
                impl="triton",
                **kw,
            )
            up = (
                torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
                if kw["reduction"] == "none"
                else None
            )
            gh, gw, gb = torch.autograd.grad(out, [h_loc, w_loc, b_loc], grad_outputs=up)
            okw = {k: v for k, v in kw.items() if k != "grad_in_forward"}
            ins = [x.double().requires_grad_() for x in (sh, sw, sb)]
            ref = oracle_distill(
                ins[0], ins[1], th.double(), tw.double(), t, student_bias=ins[2], teacher_bias=tb.double(), **okw
            )
            rh, rw, rb = torch.autograd.grad(ref, ins, grad_outputs=None if up is None else up.double())
            for what, a, b in (
                ("loss", out, ref),
                ("dH", gh, rh[sl]),
                ("dW", gw, rw[start:stop]),
                ("db", gb, rb[start:stop]),
            ):
                try:
                    torch.testing.assert_close(a.double(), b.double(), rtol=3e-5, atol=3e-6)
                except AssertionError as e:
                    failures.append(f"rank {rank} layout {layout} {kw} {what}: {str(e).splitlines()[:3]}")
    return failures


def test_vocab_parallel_two_ranks_matches_oracle(tmp_path):
    from dist_utils import run_ranks

    results = run_ranks(_tp_body, 2, tmp_path, timeout=300)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_zero_hidden_size(impl):
    """A zero hidden size (the student's logits are its bias) runs (the torch implementation under
    impl="triton", whose kernels need D > 0), with the oracle's loss and bias gradient: the same as
    a hidden size of 1 with zero hidden states. Before, flattening ``[..., 0]`` with reshape(-1, 0) raised."""
    g = torch.Generator().manual_seed(0)
    sb = torch.randn(V, generator=g).to(DEVICE).requires_grad_()
    th, tw = torch.randn(2, 3, DT, generator=g).to(DEVICE), torch.randn(V, DT, generator=g).to(DEVICE)
    sh = torch.zeros(2, 3, 0, device=DEVICE, requires_grad=True)
    sw = torch.zeros(V, 0, device=DEVICE, requires_grad=True)
    out = linear_distillation(sh, sw, th, tw, student_bias=sb, impl=impl, divergence="jsd", temperature=2.0)
    gh, gw, gb = torch.autograd.grad(out, [sh, sw, sb])
    assert gh.shape == sh.shape and gw.shape == sw.shape
    sb1 = sb.detach().cpu().double().requires_grad_()
    ref = oracle_distill(
        torch.zeros(2, 3, 1, dtype=torch.float64),
        torch.zeros(V, 1, dtype=torch.float64),
        th.cpu(),
        tw.cpu(),
        student_bias=sb1,
        divergence="jsd",
        temperature=2.0,
    )
    (rb,) = torch.autograd.grad(ref, [sb1])
    torch.testing.assert_close(out.double().cpu(), ref, **F32)
    torch.testing.assert_close(gb.double().cpu(), rb, **F32)
