"""linear_distillation on a vocab-parallel group (gloo ranks spawned from pytest) against the
single-device float64 oracle (tests/oracle.py).

Every rank builds the same full problem from one seed (both heads ``[V, D]`` with biases,
hidden states of different sizes, targets, upstream gradients), keeps its rows ``[start, stop)``
of both heads (and its slice of the tokens under sequence parallelism), and compares the loss,
dH (full, or its sequence slice) and its slice of dW / db with the oracle's. Uneven layouts,
one with an empty shard; both statistics collectives; both schedules. A spawn costs ~10 s, so
each test runs many cases in one spawn and reports every failing case by its options.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_utils import run_ranks
from helpers import distill_problem
from oracle import oracle_distill

from cce_dist import VocabShard, linear_distillation

DS, DT, V = 8, 12, 13
N = 12  # tokens; sequence parallel splits them over 2 or 3 ranks
CHUNK = 13 * 4  # logits per head per chunk: several chunks, as the layout's largest shard allows

LAYOUTS = {
    2: [[(0, 5), (5, 13)], [(0, 12), (12, 13)]],
    3: [[(0, 6), (6, 6), (6, 13)], [(0, 3), (3, 10), (10, 13)]],
}

# float32 logits and accumulation vs float64: a few float32 ulps of each quantity's scale
TOL = dict(rtol=3e-5, atol=3e-6)


def _problem(seed: int):
    """The full problem (both heads with biases, two ignored tokens) and, drawn next, a per-token upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    return (*distill_problem(N, DS, DT, V, ignore=(2, 7), seed=g), torch.randn(N, generator=g))


def _cases():
    divs = [dict(divergence="kl"), dict(divergence="reverse_kl"), dict(divergence="jsd", beta=0.3)]
    extras = [dict(), dict(temperature=2.0, softcap=(4.0, 5.0), hard_label_weight=0.4)]
    reductions = ["mean", "none"]
    for i, (d, e, r) in enumerate(itertools.product(divs, extras, reductions)):
        yield i, {**d, **e, "reduction": r}


def _body(rank, world, group, layouts, sequence_parallel):
    failures = []
    for li, layout in enumerate(layouts):
        start, stop = layout[rank]
        for i, kw in _cases():
            collective = ("allreduce", "allgather")[(i + li) % 2]
            gif = None if i % 3 else False
            sh, sw, sb, th, tw, tb, t, up = _problem(100 * li + i)
            # every fourth case without the handshake (check=False: the vocab size alone, as cross-entropy allows)
            check = i % 4 != 3
            shard = VocabShard(
                group, start, stop, sequence_parallel=sequence_parallel, stats_collective=collective, check=check
            )
            sl = slice(rank * N // world, (rank + 1) * N // world) if sequence_parallel else slice(None)
            h_loc = sh[sl].clone().unsqueeze(1).requires_grad_()  # [n/P, 1, D]: SP splits dim 0
            w_loc = sw[start:stop].clone().requires_grad_()
            b_loc = sb[start:stop].clone().requires_grad_()
            targets = None if i in (4, 9) else t  # reverse_kl / mean and jsd / none without targets (no hard term)
            out = linear_distillation(
                h_loc,
                w_loc,
                th[sl].unsqueeze(1),
                tw[start:stop],
                None if targets is None else targets.unsqueeze(1),
                student_bias=b_loc,
                teacher_bias=tb[start:stop],
                shard=shard,
                chunk_size=CHUNK,
                grad_in_forward=gif,
                **kw,
            )
            up_loc = up.unsqueeze(1) if kw["reduction"] == "none" else None
            gh, gw, gb = torch.autograd.grad(out, [h_loc, w_loc, b_loc], grad_outputs=up_loc)
            shf = sh.double().requires_grad_()
            swf = sw.double().requires_grad_()
            sbf = sb.double().requires_grad_()
            ref = oracle_distill(
                shf, swf, th.double(), tw.double(), targets, student_bias=sbf, teacher_bias=tb.double(), **kw
            )
            rh, rw, rb = torch.autograd.grad(ref, [shf, swf, sbf], grad_outputs=None if up_loc is None else up.double())
            name = f"layout={layout} {kw} {collective} gif={gif} targets={targets is not None} check={check}"
            checks = [
                ("loss", out.reshape(-1), ref.reshape(-1)),
                ("dH", gh.reshape(-1, DS), rh[sl]),
                ("dW", gw, rw[start:stop]),
                ("db", gb, rb[start:stop]),
            ]
            for what, a, b in checks:
                try:
                    torch.testing.assert_close(a.double(), b.double(), **TOL)
                except AssertionError as e:
                    failures.append(f"rank {rank} {name} {what}: {str(e).splitlines()[:3]}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_vocab_parallel_matches_oracle(tmp_path, world, sequence_parallel):
    results = run_ranks(
        _body, world, tmp_path, kw=dict(layouts=LAYOUTS[world], sequence_parallel=sequence_parallel), timeout=300
    )
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures[:20])


def _bad_teacher_body(rank, world, group, bad_rank):
    sh, sw, sb, th, tw, tb, t, _ = _problem(0)
    bounds = LAYOUTS[world][0][rank]
    start, stop = bounds
    t_rows = tw[start:stop]
    if rank == bad_rank:  # this rank's teacher head holds one row more than its student shard
        t_rows = tw[start : stop + 1]
    shard = VocabShard(group, start, stop)
    try:
        linear_distillation(sh.requires_grad_(), sw[start:stop], th, t_rows, t, shard=shard)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def test_teacher_rows_mismatch_raises_on_every_rank(tmp_path):
    """One rank's teacher head does not hold its student's vocab rows: every rank raises (no hang)."""
    results = run_ranks(_bad_teacher_body, 2, tmp_path, kw=dict(bad_rank=0), timeout=120)
    assert results[0] is not None and "teacher_weight.shape[0]" in results[0], results
    assert results[1] is not None and "rank(s) [0]" in results[1], results


def _disagree_body(rank, world, group):
    sh, sw, sb, th, tw, tb, t, _ = _problem(0)
    start, stop = LAYOUTS[world][0][rank]
    temp = 1.0 if rank == 0 else 2.0  # ranks disagree on an option
    try:
        linear_distillation(
            sh, sw[start:stop], th, tw[start:stop], t, temperature=temp, shard=VocabShard(group, start, stop)
        )
    except ValueError as e:
        return str(e)
    return None


def test_ranks_disagreeing_on_options_raise(tmp_path):
    results = run_ranks(_disagree_body, 2, tmp_path, timeout=120)
    for r in range(2):
        assert results[r] is not None and "disagree on the loss options" in results[r], results
