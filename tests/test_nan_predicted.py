"""row_outputs "predicted" / "is_top1" on rows with NaN logits follow ``torch.argmax``.

The rule (``cce_dist.core.stats.holds_max``): a NaN logit is the maximum and the first NaN wins; otherwise the largest
value, the lowest id on a tie; ``is_top1 = valid & (predicted == target)``. Every path must give it, whatever the
order tiles, splits, chunks and ranks come in: the Triton forward (whose ``tl.max`` skips NaN: it predicted the
largest finite logit, and INT64_MIN for a row of NaN or of -inf only), its split merge, the all-gather combine
(``stats.combine_stack``: INT64_MIN from casting +inf), the all-reduce key (``parallel.max_id_key``: a NaN's bits
ordered below -inf or above +inf by its sign), and the compiled op.

The problem puts NaN at chosen (row, id) pairs: a row of group g has the hidden entry +inf on dim g, where the group's
ids have head entries 0 (their logit is ``inf * 0 = NaN``), two ids +1 (+inf: a NaN still beats it) and the others
-1 (-inf); every other row has 0 there (``0 * +-1 = 0``). Exact whatever the GEMM's order or FMA (finite entries that
overflow to inf would not be: an FMA of ``inf`` and an exact ``-1e40`` is inf, not NaN). Groups put their NaNs in the
first tile, a later one, the ragged last one, and several per row across tiles (the interpreter's vocab tile is 32
ids). One row has a NaN hidden entry (every logit NaN: id 0), one has every logit -inf (id 0). The reference is
``torch.argmax`` of the materialized logits (tests/oracle.py); ids are exact, so the comparisons are exact.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from helpers import TRITON
from oracle import oracle_logits

from cce_dist import VocabShard, linear_cross_entropy, linear_logprobs
from cce_dist.core import stats as S
from cce_dist.tp.collectives import from_max_id_key, max_id_key

N, D, V = 20, 16, 70
#: group g: its rows, and the ids whose logit is NaN in those rows (the first NaN, by id, is the predicted one)
GROUPS = {
    0: ((0, 1), (1,)),  # first tile
    1: ((2, 3), (40,)),  # a later tile
    2: ((4, 5, 6), (50, 12, 66)),  # several across tiles: 12 (first tile) wins
    3: ((7, 8), (34, 33)),  # two in one tile: 33
    4: ((9, 10), (69,)),  # the ragged last tile
}
ALL_NAN_ROW, NEG_INF_ROW, IGNORED_ROW = 11, 12, 19
NAMES = ("predicted", "is_top1")
POS_INF = (20, 60)  # ids whose logit is +inf in every group's rows
IMPLS = ["torch"] + (["triton"] if TRITON else [])
CASES = ("plain", "bias")  # "bias": a NaN bias entry (id 45, every row) and a -inf one (id 3), with a softcap


def nan_problem(case="plain", seed=0):
    """``(hidden, weight, bias, targets, kw)``: the module docstring's problem; ``kw`` the call's softcap (bias)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.zeros(N, D)
    w = torch.zeros(V, D)
    h[:, 11:] = torch.randn(N, D - 11, generator=g)
    w[:, 11:] = torch.randn(V, D - 11, generator=g)
    for gi, (rows, ids) in GROUPS.items():
        h[list(rows), gi] = float("inf")
        w[:, gi] = -1.0  # -inf logits in the group's rows ...
        w[list(POS_INF), gi] = 1.0  # ... +inf ones (a NaN still beats them) ...
        w[list(ids), gi] = 0.0  # ... and NaN ones (inf * 0)
    h[ALL_NAN_ROW, 12] = float("nan")
    h[NEG_INF_ROW, 10] = float("inf")  # every head row has -1 on dim 10: each logit of this row is -inf
    w[:, 10] = -1.0
    t = torch.randint(0, V, (N,), generator=g)
    t[0], t[4], t[5], t[7], t[8], t[9] = 1, 12, 50, 34, 33, 3  # the first NaN (top-1), a later NaN, ...
    t[ALL_NAN_ROW] = t[NEG_INF_ROW] = 0
    t[IGNORED_ROW] = -100
    b, kw = None, {}
    if case == "bias":
        b = torch.zeros(V)
        b[45] = float("nan")
        b[3] = float("-inf")
        kw = dict(softcap=5.0)
    return h, w, b, t, kw


def _oracle(h, w, b, t, **kw):
    """``(logits, predicted, is_top1)``: the materialized float32 logits and ``torch.argmax``'s outputs of them."""
    z = oracle_logits(h, w, b, **kw)
    valid = t != -100
    pred = torch.where(valid, z.argmax(-1), -1)
    return z, pred, valid & (pred == t)


def _call(kind, h, w, b, t, kw, **more):
    if kind == "ce":
        _, rows = linear_cross_entropy(h, w, t, bias=b, reduction="none", row_outputs=NAMES, **kw, **more)
    else:
        (_, _), rows = linear_logprobs(
            h, w, t, bias=b, temperature=0.8, return_entropy=True, row_outputs=NAMES, **kw, **more
        )
    return rows


def _want(kind, h, w, b, t, kw):
    return _oracle(h, w, b, t, **kw, **({} if kind == "ce" else dict(temperature=0.8)))


def _check_design(case, z, pred, top1):
    """The problem's logits are NaN exactly where the module docstring says (and torch.argmax picks as it says)."""
    nan = torch.isnan(z)
    want = torch.zeros(N, V, dtype=torch.bool)
    for rows, ids in GROUPS.values():
        want[torch.tensor(rows)[:, None], torch.tensor(ids)[None, :]] = True
    want[ALL_NAN_ROW] = True
    if case == "bias":
        want[:, 45] = True
    assert torch.equal(nan, want)
    if case == "plain":
        assert bool(torch.isneginf(z[NEG_INF_ROW]).all())
        assert pred[:13].tolist() == [1, 1, 40, 40, 12, 12, 12, 33, 33, 69, 69, 0, 0]
        assert top1[[0, 4, 8, ALL_NAN_ROW, NEG_INF_ROW]].all() and not top1[[5, 7, 9, IGNORED_ROW]].any()


@pytest.mark.skipif(not TRITON, reason="cce_dist.kernels unavailable (triton missing / no interpreter)")
@pytest.mark.parametrize("kind", ["ce", "logprobs"])
@pytest.mark.parametrize("case", CASES)
def test_triton_predicts_the_first_nan_as_torch_argmax(case, kind):
    h, w, b, t, kw = nan_problem(case)
    got = _call(kind, h, w, b, t, kw, impl="triton")
    z, pred, top1 = _want(kind, h, w, b, t, kw)
    _check_design(case, z, pred, top1)
    assert torch.equal(got.predicted, pred), (got.predicted.tolist(), pred.tolist())
    assert torch.equal(got.is_top1, top1)
    assert torch.equal(_call(kind, h, w, b, t, kw, impl="torch").predicted, pred)


@pytest.mark.skipif(not TRITON, reason="cce_dist.kernels unavailable (triton missing / no interpreter)")
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("case", CASES)
def test_triton_split_merge_keeps_the_lowest_nan_id(case, splits):
    from cce_dist import kernels as K

    h, w, b, t, _ = nan_problem(case)
    start = 37  # a shard of a larger vocabulary: global ids
    kw = dict(vocab_start=start, softcap=None, temperature=1.0, need_argmax=True, _splits=splits)
    st = K.row_stats(h, w, b, t + start, **kw)
    z = oracle_logits(h, w, b)
    assert torch.equal(st[:, S.ARGMAX], z.argmax(-1).float() + start)
    assert torch.equal(torch.isnan(st[:, S.MAX]), torch.isnan(z).any(-1))  # a NaN logit: MAX NaN


@pytest.mark.skipif(not TRITON, reason="cce_dist.kernels unavailable (triton missing / no interpreter)")
@pytest.mark.parametrize("case", CASES)
def test_compiled_row_outputs_predict_the_first_nan(case):
    h, w, b, t, kw = nan_problem(case)

    def f(h, w, b, t):
        return linear_cross_entropy(h, w, t, bias=b, reduction="none", row_outputs=NAMES, impl="triton", **kw)

    torch._dynamo.reset()
    _, got = torch.compile(f, backend="eager", fullgraph=True)(h, w, b, t)
    _, pred, top1 = _oracle(h, w, b, t, **kw)
    assert torch.equal(got.predicted, pred) and torch.equal(got.is_top1, top1)


# ----------------------------------------------------------------------------------------------
# the statistics: a NaN max wins, the lowest NaN id among the slices holding one, in any order
# ----------------------------------------------------------------------------------------------


def _slices():
    """Three slices of 4 rows: row 0 NaN in b and c (ids 9, 6), row 1 NaN in a only, row 2 none (max 5 tied between
    a and c), row 3 NaN everywhere."""
    nan = float("nan")
    out = []
    for m, i in (
        ([1.0, nan, 5.0, nan], [4, 20, 9, 1]),
        ([nan, 3.0, 2.0, nan], [9, 7, 12, 30]),
        ([nan, float("inf"), 5.0, -nan], [6, 6, 3, 2]),
    ):
        st = S.empty_stats(4)
        st[:, S.MAX] = torch.tensor(m)
        st[:, S.ARGMAX] = torch.tensor(i, dtype=torch.float32)
        st[:, S.SUMEXP] = 1.0
        out.append(st)
    return out


def test_combine_keeps_the_lowest_nan_id_in_any_order():
    a, b, c = _slices()
    want = torch.tensor([6.0, 20.0, 3.0, 1.0])
    for order in ((a, b, c), (c, b, a), (b, a, c), (c, a, b)):
        assert torch.equal(S.combine_stack(torch.stack(order))[:, S.ARGMAX], want)
        assert torch.equal(S.combine(S.combine(order[0], order[1]), order[2])[:, S.ARGMAX], want)
        assert torch.equal(S.combine(order[0], S.combine(order[1], order[2]))[:, S.ARGMAX], want)


def test_max_id_key_puts_nan_above_inf_whatever_its_sign():
    a, b, c = _slices()
    want = torch.tensor([6.0, 20.0, 3.0, 1.0])
    keys = [max_id_key(s[:, S.MAX], s[:, S.ARGMAX]) for s in (a, b, c)]
    m, ids = from_max_id_key(torch.stack(keys).amax(0))
    assert torch.equal(ids, want)
    assert torch.isnan(m).tolist() == [True, True, False, True] and float(m[2]) == 5.0
    neg_nan = torch.tensor([-float("nan")])
    assert bool(max_id_key(neg_nan, torch.tensor([3.0])) > max_id_key(torch.tensor([float("inf")]), torch.zeros(1)))


def test_predicted_never_casts_a_non_finite_id():
    """An ARGMAX with no id (+inf: no slice had a logit; NaN) is -1, never INT64_MIN."""
    from cce_dist.core.outputs import row_outputs

    st = S.empty_stats(2)
    st[1, S.ARGMAX] = float("nan")
    got = row_outputs(st, torch.tensor([0, 1]), torch.tensor([True, True]), NAMES, vocab_size=V, shape=(2,))
    assert got.predicted.tolist() == [-1, -1] and not got.is_top1.any()


# ----------------------------------------------------------------------------------------------
# on a vocab-parallel group (gloo ranks): both collectives, an empty shard, the lower NaN on a later rank
# ----------------------------------------------------------------------------------------------

LAYOUTS = {
    2: [[(0, 35), (35, 70)], [(35, 70), (0, 35)]],
    3: [[(0, 20), (20, 20), (20, 70)], [(50, 70), (0, 13), (13, 50)]],
}


def _group_body(rank, world, group, layouts, impls):
    failures = []
    for case in CASES:
        h, w, b, t, kw = nan_problem(case)
        for layout in layouts:
            start, stop = layout[rank]
            for kind in ("ce", "logprobs"):
                _, pred, top1 = _want(kind, h, w, b, t, kw)
                for impl in impls:
                    for collective in ("allgather", "allreduce"):
                        shard = VocabShard(group, start, stop, stats_collective=collective)
                        bias = None if b is None else b[start:stop]
                        got = _call(kind, h, w[start:stop], bias, t, kw, shard=shard, impl=impl)
                        name = f"rank {rank} {case} layout={layout} {kind} {impl} {collective}"
                        if not torch.equal(got.predicted, pred):
                            failures.append(f"{name}: predicted {got.predicted.tolist()} != {pred.tolist()}")
                        if not torch.equal(got.is_top1, top1):
                            failures.append(f"{name}: is_top1 {got.is_top1.tolist()} != {top1.tolist()}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_a_group_predicts_the_first_nan_as_one_process(tmp_path, world):
    kw = dict(layouts=LAYOUTS[world], impls=IMPLS)
    results = run_ranks(_group_body, world, tmp_path, kw=kw, timeout=600)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures[:20])
