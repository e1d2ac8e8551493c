"""Data-parallel vocab-sharded heads (``VocabShard(data_parallel=True)``, FSDP2's layout) against the single-process
program over the concatenated batch (tests/oracle.py), on 2 and 4 gloo ranks.

Each rank holds its own tokens (different counts, one rank none) and a vocab shard (uneven; an empty one on 4 ranks).
Rank ``r``'s result must be the oracle's on its own rows; its dH the oracle's gradient of ``sum_s g_s * loss_s`` on
its rows (``g_s``: a different upstream value per rank, so a rank that applied another rank's would fail); its dW /
db the oracle's rows ``[start, stop)`` divided by the factor (the group size by default, FSDP2's mean).
"""

import pytest
import torch
from helpers import Failures
from oracle import oracle_cross_entropy, oracle_distill, oracle_logprobs

import cce_dist
from cce_dist.testing import CollectiveLog

#: per world: every rank's token count, and its vocab rows [start, stop) (V = the last stop)
LAYOUTS = {
    2: ((7, 0), ((0, 20), (20, 37))),
    4: ((5, 0, 9, 2), ((0, 12), (12, 12), (12, 30), (30, 40))),
}
D = 6


def _full(world, seed=0, d=D, dtype=torch.float32):
    counts, bounds = LAYOUTS[world]
    v, n = bounds[-1][1], sum(counts)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(v, d, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.3).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = -100
    t[0] = v - 1  # a target in the last shard
    cw = torch.rand(v, generator=g, dtype=torch.float64).to(dtype) + 0.25
    return counts, bounds, h, w, b, t, cw


def _rows(counts, r):
    a = sum(counts[:r])
    return slice(a, a + counts[r])


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _cross_entropy(rank, world, group, reduction, options, factor):
    counts, bounds, H, W, B, T, CW = _full(world)
    f = Failures(atol=2e-5, rtol=2e-5)
    kw = dict(options)
    cw = CW if kw.pop("class_weight", False) else None
    return_lse = kw.get("return_lse", False)
    # the oracle: every rank's loss over its own rows, weighted by its upstream g_s, summed
    h_ref, w_ref, b_ref = _leaf(H), _leaf(W), _leaf(B)
    total, want = 0.0, None
    for s in range(world):
        sl = _rows(counts, s)
        out = oracle_cross_entropy(
            h_ref[sl],
            w_ref,
            T[sl],
            b_ref,
            reduction=reduction,
            return_lse=return_lse,
            class_weight=cw,
            **{k: v for k, v in kw.items() if k not in ("return_lse", "grad_in_forward")},
        )
        loss_s, lse_s = out if return_lse else (out, None)
        g_s = _upstream(loss_s, s)
        total = total + (loss_s * g_s).sum() + (0.0 if lse_s is None else (lse_s * 0.5 * g_s).sum())
        if s == rank:
            want = (loss_s.detach(), None if lse_s is None else lse_s.detach())
    total.backward()
    start, stop = bounds[rank]
    shard = cce_dist.VocabShard(group, start, stop, data_parallel=True, grad_divide_factor=factor)
    sl = _rows(counts, rank)
    h, w, b = _leaf(H[sl]), _leaf(W[start:stop]), _leaf(B[start:stop])
    out = cce_dist.linear_cross_entropy(
        h, w, T[sl], bias=b, shard=shard, reduction=reduction, class_weight=cw, impl="torch", **kw
    )
    loss, lse = out if return_lse else (out, None)
    g = _upstream(loss, rank)
    ((loss * g).sum() + (0.0 if lse is None else (lse * 0.5 * g).sum())).backward()
    case = f"ce {reduction} {options} factor={factor}"
    div = world if factor is None else factor
    f.close(loss, want[0], "loss (own rows)", case)
    f.close(lse, want[1], "lse (own rows)", case)
    f.close(h.grad, h_ref.grad[sl], "dH (own rows)", case)
    f.close(w.grad, w_ref.grad[start:stop] / div, "dW (shard / factor)", case)
    f.close(b.grad, b_ref.grad[start:stop] / div, "db (shard / factor)", case)
    f.check(h.grad.shape == (counts[rank], D), f"dH shape {tuple(h.grad.shape)}", case)
    return f.result()


def _upstream(loss, rank):
    """A different upstream gradient per rank (and per row for per-row outputs)."""
    if loss.dim() == 0:
        return torch.tensor(1.0 + 0.75 * rank)
    return torch.linspace(-1.0, 2.0, loss.numel()).reshape(loss.shape) + rank


CE_CASES = [
    ("mean", {}),
    ("mean", {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 3.0}),
    ("mean", {"class_weight": True, "label_smoothing": 0.05}),
    ("sum", {"class_weight": True, "z_loss": 1e-2}),
    ("none", {"return_lse": True, "softcap": 2.0}),
    ("mean", {"grad_in_forward": True}),  # asks for the fused schedule: data_parallel runs the two-pass one
]


@pytest.mark.parametrize("world", [2, 4])
def test_cross_entropy_matches_concatenated_batch(rank_pool, world):
    pool = rank_pool(world)
    failures = []
    for reduction, options in CE_CASES:
        for factor in (None, 1.0):
            res = pool.run(_cross_entropy, reduction=reduction, options=options, factor=factor, timeout=300)
            failures += [x for r in res.values() for x in r["failures"]]
    assert not failures, "\n".join(failures)


def _logprobs(rank, world, group, stats_collective, check):
    counts, bounds, H, W, B, T, _ = _full(world, seed=1)
    f = Failures(atol=2e-5, rtol=2e-5)
    h_ref, w_ref, b_ref = _leaf(H), _leaf(W), _leaf(B)
    lp_all, ent_all = oracle_logprobs(h_ref, w_ref, T, b_ref, temperature=0.7, softcap=4.0, return_entropy=True)
    g_lp = torch.linspace(-1, 1, T.numel())
    g_ent = torch.linspace(0.5, -0.3, T.numel())
    ((lp_all * g_lp).sum() + (ent_all * g_ent).sum()).backward()
    start, stop = bounds[rank]
    shard = cce_dist.VocabShard(group, start, stop, data_parallel=True, stats_collective=stats_collective, check=check)
    sl = _rows(counts, rank)
    h, w, b = _leaf(H[sl]), _leaf(W[start:stop]), _leaf(B[start:stop])
    (lp, ent), ro = cce_dist.linear_logprobs(
        h,
        w,
        T[sl],
        bias=b,
        shard=shard,
        temperature=0.7,
        softcap=4.0,
        return_entropy=True,
        impl="torch",
        row_outputs=("predicted", "is_top1"),
    )
    ((lp * g_lp[sl]).sum() + (ent * g_ent[sl]).sum()).backward()
    case = f"logprobs {stats_collective} check={check}"
    f.close(lp, lp_all[sl], "logprobs", case)
    f.close(ent, ent_all[sl], "entropy", case)
    with torch.no_grad():
        z = torch.nn.functional.linear(H[sl], W, B)
        z = 4.0 * torch.tanh(z / 4.0)
    valid = T[sl] != -100
    want = torch.where(valid, z.argmax(-1), -1)  # -1 at ignored rows (the row outputs' contract)
    f.check(torch.equal(ro.predicted, want), f"predicted {ro.predicted} vs {want}", case)
    f.check(torch.equal(ro.is_top1, valid & (want == T[sl])), f"is_top1 {ro.is_top1}", case)
    f.close(h.grad, h_ref.grad[sl], "dH", case)
    f.close(w.grad, w_ref.grad[start:stop] / world, "dW / P", case)
    f.close(b.grad, b_ref.grad[start:stop] / world, "db / P", case)
    return f.result()


@pytest.mark.parametrize("world", [2, 4])
def test_logprobs_entropy_row_outputs_match_concatenated_batch(rank_pool, world):
    pool = rank_pool(world)
    failures = []
    for sc, check in (("allgather", True), ("allreduce", True), ("auto", False)):
        res = pool.run(_logprobs, stats_collective=sc, check=check, timeout=300)
        failures += [x for r in res.values() for x in r["failures"]]
    assert not failures, "\n".join(failures)


def _distill(rank, world, group, divergence, with_targets, reduction):
    counts, bounds, H, W, B, T, _ = _full(world, seed=2)
    _, _, HT, WT, BT, _, _ = _full(world, seed=3)
    f = Failures(atol=2e-5, rtol=2e-5)
    kw = dict(divergence=divergence, temperature=1.5, hard_label_weight=0.3 if with_targets else 0.0)
    h_ref, w_ref, b_ref = _leaf(H.double()), _leaf(W.double()), _leaf(B.double())
    total, want = 0.0, None
    for s in range(world):
        sl = _rows(counts, s)
        loss_s = oracle_distill(
            h_ref[sl],
            w_ref,
            HT[sl].double(),
            WT.double(),
            T[sl] if with_targets else None,
            reduction=reduction,
            student_bias=b_ref,
            teacher_bias=BT.double(),
            **kw,
        )
        g_s = _upstream(loss_s, s).double()
        total = total + (loss_s * g_s).sum()
        if s == rank:
            want = loss_s.detach()
    total.backward()
    start, stop = bounds[rank]
    shard = cce_dist.VocabShard(group, start, stop, data_parallel=True)
    sl = _rows(counts, rank)
    h, w, b = _leaf(H[sl]), _leaf(W[start:stop]), _leaf(B[start:stop])
    loss = cce_dist.linear_distillation(
        h,
        w,
        HT[sl],
        WT[start:stop],
        T[sl] if with_targets else None,
        shard=shard,
        reduction=reduction,
        student_bias=b,
        teacher_bias=BT[start:stop],
        impl="torch",
        **kw,
    )
    (loss * _upstream(loss, rank)).sum().backward()
    case = f"distill {divergence} targets={with_targets} {reduction}"
    f.close(loss, want, "loss", case)
    f.close(h.grad, h_ref.grad[sl], "dH", case)
    f.close(w.grad, w_ref.grad[start:stop] / world, "dW / P", case)
    f.close(b.grad, b_ref.grad[start:stop] / world, "db / P", case)
    return f.result()


@pytest.mark.parametrize("world", [2, 4])
def test_distillation_matches_concatenated_batch(rank_pool, world):
    pool = rank_pool(world)
    failures = []
    for divergence, with_targets, reduction in (
        ("kl", True, "mean"),
        ("jsd", False, "sum"),
        ("reverse_kl", True, "none"),
    ):
        res = pool.run(_distill, divergence=divergence, with_targets=with_targets, reduction=reduction, timeout=300)
        failures += [x for r in res.values() for x in r["failures"]]
    assert not failures, "\n".join(failures)


def _traffic(rank, world, group):
    """The collectives of one forward + backward: the handshake, the token gather (padded to the largest count),
    the statistics, the upstream gather, the dH reduction; nothing of the head's size."""
    counts, bounds, H, W, B, T, _ = _full(world)
    start, stop = bounds[rank]
    shard = cce_dist.VocabShard(group, start, stop, data_parallel=True, stats_collective="allgather")
    sl = _rows(counts, rank)
    h, w = _leaf(H[sl]), _leaf(W[start:stop])
    with CollectiveLog(hidden_size=D) as log:
        cce_dist.linear_cross_entropy(h, w, T[sl], shard=shard, impl="torch").backward()
    return [(c.name, c.shape, str(c.dtype), c.in_bytes, c.out_bytes) for c in log.calls]


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_of_one_step(rank_pool, world):
    counts, bounds = LAYOUTS[world]
    m, n = max(counts), sum(counts)
    res = rank_pool(world).run(_traffic, timeout=300)
    for calls in res.values():
        names = [c[0] for c in calls]
        # handshake, targets, hidden, statistics (forward); upstream gather, dH all-reduce (gloo) (backward)
        assert names == ["all_gather"] * 5 + ["all_reduce"], calls
        assert calls[1][1] == (m, 1) and calls[2][1] == (m, D), calls  # padded to the largest count
        assert calls[5][1] == (n, D) and calls[5][2] == "torch.float32", calls
        assert calls[3][1] == (n, 7) and calls[4][1] == (m, 2), calls  # statistics; upstream (loss, lse)
        assert calls[2][4] == world * m * D * 4 and calls[5][3] == n * D * 4, calls  # bytes: tokens, not the head


def _errors(rank, world, group):
    counts, bounds, H, W, B, T, _ = _full(world)
    start, stop = bounds[rank]
    sl = _rows(counts, rank)
    out = []

    def expect(exc, match, fn):
        try:
            fn()
        except exc as e:
            if match not in str(e):
                out.append(f"rank {rank}: {exc.__name__} without {match!r}: {e}")
        else:
            out.append(f"rank {rank}: no {exc.__name__} ({match!r})")

    shard = cce_dist.VocabShard(group, start, stop, data_parallel=True)
    # one rank reads the head as tensor-parallel: every rank raises, naming the option
    mixed = shard if rank else cce_dist.VocabShard(group, start, stop)
    expect(
        cce_dist.InputError,
        "data_parallel",
        lambda: cce_dist.linear_cross_entropy(H[sl], W[start:stop], T[sl], shard=mixed),
    )
    # a target id outside the vocabulary on the last rank only: every rank raises (its own targets are checked)
    t_bad = T[sl].clone()
    if rank == world - 1 and t_bad.numel():
        t_bad[0] = bounds[-1][1]
    expect(
        cce_dist.InputError if rank != world - 1 else ValueError,
        "outside the vocabulary",
        lambda: cce_dist.linear_cross_entropy(H[sl], W[start:stop], t_bad, shard=shard),
    )
    # a different hidden size on rank 0
    h_bad = H[sl] if rank else torch.randn(counts[0], D + 1)
    w_bad = W[start:stop] if rank else torch.randn(stop - start, D + 1)
    expect(cce_dist.InputError, "hidden size", lambda: cce_dist.linear_cross_entropy(h_bad, w_bad, T[sl], shard=shard))
    # the group still works
    loss = cce_dist.linear_cross_entropy(H[sl], W[start:stop], T[sl], shard=shard)
    out += [] if torch.isfinite(loss) else [f"rank {rank}: loss {loss}"]
    return out


def test_errors_raise_on_every_rank(rank_pool):
    res = rank_pool(4).run(_errors, timeout=300)
    problems = [p for r in res.values() for p in r]
    assert not problems, "\n".join(problems)


def test_local_field_checks():
    with pytest.raises(ValueError, match="data_parallel=True and sequence_parallel=True exclude each other"):
        cce_dist.VocabShard(None, 0, 4, data_parallel=True, sequence_parallel=True)
    with pytest.raises(ValueError, match="requires reduce_hidden_grad=True"):
        cce_dist.VocabShard(None, 0, 4, data_parallel=True, reduce_hidden_grad=False)
    with pytest.raises(ValueError, match="grad_divide_factor applies to data_parallel=True only"):
        cce_dist.VocabShard(None, 0, 4, grad_divide_factor=2.0)
    with pytest.raises(ValueError, match="grad_divide_factor must be a finite number > 0"):
        cce_dist.VocabShard(None, 0, 4, data_parallel=True, grad_divide_factor=0)
    with pytest.raises(TypeError, match="data_parallel must be a bool"):
        cce_dist.VocabShard(None, 0, 4, data_parallel=1)
    assert cce_dist.VocabShard(None, 0, 4, data_parallel=True).divide_factor == 1.0
    assert cce_dist.VocabShard(None, 0, 4, data_parallel=True, grad_divide_factor=3).divide_factor == 3.0


def test_one_rank_group_divides_by_the_factor():
    """A one-rank data-parallel shard: the single-device result, the weight gradient divided by the factor."""
    _, _, H, W, B, T, _ = _full(2)
    h, w = _leaf(H), _leaf(W)
    cce_dist.linear_cross_entropy(
        h, w, T, shard=cce_dist.VocabShard(None, 0, W.shape[0], data_parallel=True, grad_divide_factor=4.0)
    ).backward()
    h_ref, w_ref = _leaf(H), _leaf(W)
    oracle_cross_entropy(h_ref, w_ref, T).backward()
    torch.testing.assert_close(w.grad, w_ref.grad / 4, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=2e-5, atol=2e-6)


def _padded_reduce_scatter(rank, world, group):
    """reduce_scatter_rows' branch for backends with a reduce-scatter (NCCL: rows padded to [P, m, ...]), run on gloo
    with reduce_scatter_tensor emulated by an all-reduce: the same rows as gloo's all-reduce branch."""
    import torch.distributed as dist

    from cce_dist.tp import collectives as C

    counts = LAYOUTS[world][0]
    full = torch.randn(sum(counts), 3, generator=torch.Generator().manual_seed(rank))
    want = C.reduce_scatter_rows(full.clone(), counts, rank, group)  # gloo: all-reduce + slice

    def emulated(out, inp, group=None):
        dist.all_reduce(inp, group=group)
        out.copy_(inp.view(world, -1, *inp.shape[1:])[rank])

    saved = dist.get_backend, dist.reduce_scatter_tensor
    dist.get_backend, dist.reduce_scatter_tensor = (lambda group=None: "nccl"), emulated
    try:
        got = C.reduce_scatter_rows(full.clone(), counts, rank, group)
    finally:
        dist.get_backend, dist.reduce_scatter_tensor = saved
    # the same sums (gloo's ring may add the padded buffer's elements in another order: float32 rounding only)
    return got.shape == (counts[rank], 3) and bool(torch.allclose(got, want, rtol=1e-6, atol=1e-6))


@pytest.mark.parametrize("world", [2, 4])
def test_padded_reduce_scatter_branch(rank_pool, world):
    assert all(rank_pool(world).run(_padded_reduce_scatter, timeout=120).values())
