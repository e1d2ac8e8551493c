"""Triton kernels (cce_dist.kernels) against a plain PyTorch oracle.

Without a GPU the kernels run in Triton's CPU interpreter, which reads TRITON_INTERPRET when
triton is first imported: it is set below before anything imports triton (conftest.py does the
same). Shapes stay tiny so the interpreter finishes the file in well under a minute; the
interpreter config uses 16x32 tiles with 16-wide D chunks, so N in {1, 7, 20, 33}, V_local in
{1, 37, 70, 100} and D in {16, 24, 40} cover one and several token / vocab tiles, ragged last
tiles and a ragged D loop.

The oracle materializes the logits of the shard in float64 from the same (low-precision) input
values, rounds them to the compute dtype as the contract says, and applies softcap / temperature /
statistics / gradients in float64, so it is more exact than any implementation under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from helpers import problem  # noqa: E402

import cce_dist.kernels as K  # noqa: E402
from cce_dist.core.backend import ALPHA, BETA, DELTA, GAMMA  # noqa: E402
from cce_dist.core.stats import ARGMAX, ENTROPY, MAX, NUM_STATS, SUM, SUM_SCALE, SUMEXP, SUMSQ, TARGET  # noqa: E402
from cce_dist.core.stats import entropy as stats_entropy  # noqa: E402
from cce_dist.core.stats import lse as stats_lse  # noqa: E402
from cce_dist.impl import torch_cross_entropy  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
if not K.available():  # pragma: no cover - e.g. a GPU machine where triton is broken
    pytest.skip("cce_dist.kernels not available", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IGNORE = -100


# ------------------------------------------------------------------------------------------------
# inputs and oracle
# ------------------------------------------------------------------------------------------------


def make_inputs(n, d, v, dtype, *, bias, vocab_start, seed=0):
    """A vocab shard ``[vocab_start, vocab_start + v)`` of helpers.problem: logits of O(1..3), global targets in
    the shard, below it, above it, and ignored."""
    h, w, b, t = problem(
        n,
        d,
        v,
        dtype=dtype,
        bias=bias,
        w_scale=1.5 / d**0.5,
        b_scale=0.5,
        target_range=(0, vocab_start + v + 20),
        seed=seed,
        device=DEVICE,
    )
    if n > 2:
        t[0] = IGNORE
        t[1] = vocab_start + v - 1  # last local row: the ragged last tile
    return h, w, b, t


def oracle_logits(h, w, b, softcap, temperature):
    """(raw, c, z) in float64; raw rounded to the compute dtype like F.linear's output."""
    raw = h.double() @ w.double().T
    if b is not None:
        raw = raw + b.double()
    raw = raw.to(h.dtype).double()
    c = softcap * torch.tanh(raw / softcap) if softcap else raw
    return raw, c, c / temperature


def local_targets(t, vocab_start, v):
    loc = t - vocab_start
    ok = (loc >= 0) & (loc < v)
    return loc, ok


def oracle_stats(h, w, b, t, vocab_start, softcap, temperature):
    _, _, z = oracle_logits(h, w, b, softcap, temperature)
    m = z.max(1).values
    ex = torch.exp(z - m[:, None])
    loc, ok = local_targets(t, vocab_start, w.shape[0])
    x = torch.where(ok, z.gather(1, loc.clamp(0, w.shape[0] - 1)[:, None])[:, 0], 0.0)
    return torch.stack([m, ex.sum(1), x, z.sum(1) * SUM_SCALE, (ex * (z - m[:, None])).sum(1)] + _no_row_outputs(m), 1)


def _no_row_outputs(m):
    """The ARGMAX / SUMSQ columns as the kernel writes them when no row output asks for them (+inf, 0):
    tests/test_row_outputs.py checks their values when asked."""
    return [torch.full_like(m, float("inf")), torch.zeros_like(m)]


def oracle_draw(h, w, b, t, lse, coef, vocab_start, softcap, temperature, *, alpha_delta=True, gamma_weights=None):
    """d raw (float64 [N, V]) for the given coefficients, following the contract literally (``gamma_weights [V]``:
    the GAMMA term weighed per vocab row)."""
    _, c, z = oracle_logits(h, w, b, softcap, temperature)
    coef = coef.double()
    p = torch.exp(z - lse.double()[:, None])
    loc, ok = local_targets(t, vocab_start, w.shape[0])
    onehot = torch.zeros_like(z)
    rows = ok.nonzero()[:, 0]
    onehot[rows, loc[rows]] = 1.0
    gw = 1.0 if gamma_weights is None else gamma_weights.double()[None, :]
    dz = coef[:, BETA, None] * onehot + coef[:, GAMMA, None] * gw
    if alpha_delta:  # BETA is the target's excess over ALPHA: (p - onehot) * ALPHA
        dz = dz + (p - onehot) * coef[:, ALPHA, None] + p * coef[:, DELTA, None] * (z - lse.double()[:, None])
    draw = dz / temperature
    if softcap:
        draw = draw * (1 - (c / softcap) ** 2)
    return draw


def oracle_grads(h, w, b, t, lse, coef, vocab_start, softcap, temperature, gamma_weights=None):
    draw = oracle_draw(h, w, b, t, lse, coef, vocab_start, softcap, temperature, gamma_weights=gamma_weights)
    return draw @ w.double(), draw.T @ h.double(), (draw.sum(0) if b is not None else None)


def materialized_grads(h, w, b, t, lse, coef, vocab_start, softcap, temperature):
    """The usual materialized backward *in the compute dtype*: logits from F.linear in that dtype,
    softmax math in fp32, d logits rounded to the dtype, gradient matmuls in the dtype (outputs
    rounded to it). The kernels must be no worse than this."""
    raw = torch.nn.functional.linear(h, w, b).float()
    c = softcap * torch.tanh(raw / softcap) if softcap else raw
    z = c / temperature
    p = torch.exp(z - lse[:, None])
    loc, ok = local_targets(t, vocab_start, w.shape[0])
    onehot = torch.zeros_like(z)
    rows = ok.nonzero()[:, 0]
    onehot[rows, loc[rows]] = 1.0
    dz = (p - onehot) * coef[:, ALPHA, None] + p * coef[:, DELTA, None] * (z - lse[:, None])
    dz = dz + coef[:, BETA, None] * onehot + coef[:, GAMMA, None]
    draw = dz / temperature
    if softcap:
        draw = draw * (1 - (c / softcap) ** 2)
    d = draw.to(h.dtype)
    return (d @ w).float(), (d.T @ h).float(), (d.float().sum(0) if b is not None else None)


def make_coef(n, seed=1, zero_rows=(2, 5)):
    """Random ALPHA, BETA, GAMMA, DELTA per row, a few all-zero rows (they must contribute 0)."""
    g = torch.Generator().manual_seed(seed)
    coef = torch.randn(n, 4, generator=g)
    for r in zero_rows:
        if r < n:
            coef[r] = 0.0
    return coef.to(DEVICE)


def shard_lse(h, w, b, softcap, temperature, extra=0.5):
    """A 'global' lse: this shard's log-sum-exp plus mass from other shards (so p <= 1)."""
    _, _, z = oracle_logits(h, w, b, softcap, temperature)
    return (torch.logsumexp(z, 1) + extra).float()


def max_err(a, r):
    return (a.double() - r.double()).abs().max().item()


def scale(r):
    return max(r.double().abs().max().item(), 1e-30)


# ------------------------------------------------------------------------------------------------
# forward: row statistics
# ------------------------------------------------------------------------------------------------

SHAPES = [(1, 16, 1), (7, 16, 37), (33, 40, 100), (7, 40, 100), (33, 16, 37), (20, 24, 70)]
# (bias, softcap, temperature, vocab_start): every combination, each on a different shape.
COMBOS = [
    (bias, softcap, temp, vs)
    for bias in (False, True)
    for softcap in (None, 4.0)
    for temp in (1.0, 0.7)
    for vs in (0, 37)
]


def _check_stats(st, h, w, b, t, vocab_start, softcap, temperature):
    ref = oracle_stats(h, w, b, t, vocab_start, softcap, temperature)
    assert st.dtype == torch.float32 and st.shape == ref.shape
    assert torch.isfinite(st[:, :ARGMAX]).all()  # ARGMAX is +inf where no row output asks for it
    v = w.shape[0]
    raw, _, z = oracle_logits(h, w, b, softcap, temperature)
    zmax = z.abs().max().item()
    if h.dtype == torch.float32:
        # fp32: the kernel's fp32 accumulation order differs from float64 by ~1e-7 relative;
        # the CPU interpreter's tanh (no libdevice) adds ~1e-7 * softcap absolute.
        tl_ = 2e-6 * max(zmax, 1.0)
    else:
        # bf16/fp16: torch's F.linear and the kernel accumulate in a different order, so an
        # individual logit may round to the neighbouring value of the compute dtype: one ulp,
        # <= eps * |raw|, shrunk by softcap (derivative <= 1) and scaled by 1/temperature.
        tl_ = 2 * torch.finfo(h.dtype).eps * raw.abs().max().item() / temperature
    assert max_err(st[:, MAX], ref[:, MAX]) <= tl_
    assert max_err(st[:, TARGET], ref[:, TARGET]) <= tl_
    assert max_err(st[:, SUM], ref[:, SUM]) <= v * tl_ * SUM_SCALE
    # SUMEXP / ENTROPY are relative to the row max: compare them through lse and entropy (which do
    # not depend on the max) and, where the max agrees exactly, directly.
    assert max_err(stats_lse(st), stats_lse(ref)) <= 2 * tl_ + 1e-6
    assert max_err(stats_entropy(st), stats_entropy(ref)) <= 4 * tl_ * max(zmax, 1.0) + 1e-5
    same_max = st[:, MAX].double() == ref[:, MAX]
    if h.dtype == torch.float32 and same_max.any():
        s_ref = ref[same_max, SUMEXP]
        assert max_err(st[same_max, SUMEXP], s_ref) <= 1e-5 * scale(s_ref)
        e_ref = ref[same_max, ENTROPY]
        assert max_err(st[same_max, ENTROPY], e_ref) <= 1e-5 * (scale(e_ref) + scale(s_ref))
    # Targets outside the shard (and ignore_index) contribute exactly 0.
    _, ok = local_targets(t, vocab_start, v)
    assert (st[~ok, TARGET] == 0).all()
    return ref


@pytest.mark.parametrize("i", range(len(COMBOS)))
def test_row_stats_fp32_all_combinations(i):
    bias, softcap, temp, vs = COMBOS[i]
    n, d, v = SHAPES[i % len(SHAPES)]
    h, w, b, t = make_inputs(n, d, v, torch.float32, bias=bias, vocab_start=vs, seed=i)
    st = K.row_stats(h, w, b, t, vocab_start=vs, softcap=softcap, temperature=temp)
    _check_stats(st.cpu(), h.cpu(), w.cpu(), None if b is None else b.cpu(), t.cpu(), vs, softcap, temp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("i", [0, 7, 10, 13])
def test_row_stats_half(dtype, i):
    bias, softcap, temp, vs = COMBOS[i]
    n, d, v = (33, 40, 100) if i == 7 else SHAPES[i % len(SHAPES)]
    h, w, b, t = make_inputs(n, d, v, dtype, bias=bias, vocab_start=vs, seed=100 + i)
    st = K.row_stats(h, w, b, t, vocab_start=vs, softcap=softcap, temperature=temp)
    _check_stats(st.cpu(), h.cpu(), w.cpu(), None if b is None else b.cpu(), t.cpu(), vs, softcap, temp)


def test_row_stats_rounds_logits_to_compute_dtype():
    """The target logit and the normalizer come from the same *rounded* logits, so the NLL is never
    negative even when the target is the unique max; and they equal the bf16-rounded values."""
    n, d, v = 7, 16, 37
    h, w, b, t = make_inputs(n, d, v, torch.bfloat16, bias=True, vocab_start=0, seed=3)
    raw = oracle_logits(h.cpu(), w.cpu(), b.cpu(), None, 1.0)[0]
    t = raw.argmax(1).to(t.device)  # target = the row max
    st = K.row_stats(h, w, b, t, vocab_start=0, softcap=None, temperature=1.0).cpu()
    assert torch.equal(st[:, TARGET], st[:, MAX])
    assert (stats_lse(st) - st[:, TARGET] >= 0).all()
    # Every target logit is exactly representable in bf16 (it was rounded once).
    assert torch.equal(st[:, TARGET], st[:, TARGET].bfloat16().float())


def test_row_stats_vocab_splits_agree():
    """Several programs over one token tile's vocab (the small-N occupancy path) merge exactly as
    one program does, up to fp32 rounding of the merge."""
    h, w, b, t = make_inputs(7, 24, 100, torch.float32, bias=True, vocab_start=37, seed=5)
    one = K.row_stats(h, w, b, t, vocab_start=37, softcap=3.0, temperature=0.7, _splits=1).cpu()
    # 4 splits of 32 columns; the last split is ragged (4 columns).
    four = K.row_stats(h, w, b, t, vocab_start=37, softcap=3.0, temperature=0.7, _splits=4).cpu()
    assert torch.equal(one[:, MAX], four[:, MAX])
    assert torch.equal(one[:, TARGET], four[:, TARGET])
    torch.testing.assert_close(four, one, rtol=1e-5, atol=1e-5)
    _check_stats(four, h.cpu(), w.cpu(), b.cpu(), t.cpu(), 37, 3.0, 0.7)


@pytest.mark.parametrize("need_sum,need_entropy", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("splits", [1, 3])
def test_row_stats_optional_columns(need_sum, need_entropy, splits):
    """Without SUM / ENTROPY (the cross-entropy without label smoothing reads neither) the other
    columns are bitwise those of the full kernel, and a requested column still is; one split
    leaves a skipped column 0."""
    h, w, b, t = make_inputs(7, 24, 90, torch.bfloat16, bias=True, vocab_start=11, seed=8)
    kw = dict(vocab_start=11, softcap=3.0, temperature=0.7, _splits=splits)
    full = K.row_stats(h, w, b, t, **kw).cpu()
    part = K.row_stats(h, w, b, t, need_sum=need_sum, need_entropy=need_entropy, **kw).cpu()
    for col, needed in ((MAX, True), (SUMEXP, True), (TARGET, True), (SUM, need_sum), (ENTROPY, need_entropy)):
        if needed:
            assert torch.equal(part[:, col], full[:, col]), col
        elif splits == 1:
            assert not part[:, col].any(), col


def test_row_stats_large_logits_entropy_stable():
    """Logits around 1e3 with a spread of a few units: ENTROPY, kept relative to the running max,
    must not cancel (the naive sum exp(z - m) * z would lose ~3 digits here)."""
    h, w, b, t = make_inputs(7, 16, 100, torch.float32, bias=True, vocab_start=0, seed=6)
    b = b + 1000.0
    st = K.row_stats(h, w, b, t, vocab_start=0, softcap=None, temperature=1.0).cpu()
    ref = oracle_stats(h.cpu(), w.cpu(), b.cpu(), t.cpu(), 0, None, 1.0)
    assert max_err(stats_entropy(st), stats_entropy(ref)) <= 1e-4


def test_row_stats_n0_and_empty_shard():
    h, w, b, t = make_inputs(0, 16, 37, torch.float32, bias=True, vocab_start=0)
    st = K.row_stats(h, w, b, t, vocab_start=0, softcap=None, temperature=1.0)
    assert st.shape == (0, NUM_STATS) and st.dtype == torch.float32
    h, w, b, t = make_inputs(3, 16, 0, torch.float32, bias=True, vocab_start=0)
    st = K.row_stats(h, w, b, t, vocab_start=0, softcap=None, temperature=1.0).cpu()
    assert st.shape == (3, NUM_STATS) and torch.isneginf(st[:, MAX]).all() and (st[:, 1:ARGMAX] == 0).all()
    assert torch.isposinf(st[:, ARGMAX]).all() and (st[:, SUMSQ] == 0).all()  # an empty slice: no argmax


# ------------------------------------------------------------------------------------------------
# backward: gradients
# ------------------------------------------------------------------------------------------------


def _run_grads(h, w, b, t, lse, coef, vs, softcap, temp, **kw):
    kw.setdefault("need_hidden", True)
    kw.setdefault("need_weight", True)
    kw.setdefault("need_bias", b is not None)
    out = K.grads(h, w, b, t, lse, coef, vocab_start=vs, softcap=softcap, temperature=temp, **kw)
    return tuple(None if g is None else g.cpu() for g in out)


def _cpu(*ts):
    return tuple(None if x is None else x.cpu() for x in ts)


def _check_fp32_grads(got, ref, rtol=1e-5):
    # fp32: each gradient element is a sum of O(V) or O(N) products accumulated in fp32 (tl.dot)
    # versus float64 in the oracle; 1e-5 of the output's scale bounds that with margin.
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
            continue
        assert g.dtype == torch.float32 and g.shape == r.shape
        assert max_err(g, r) <= rtol * scale(r), (max_err(g, r), scale(r))


#: Rows per row block of the ``"chunked-rows"`` test schedule: one interpreter token tile, so that
#: N = 20 / 33 / 40 walk 2 / 3 / 3 row blocks (the last one ragged, N not a multiple of BLOCK_N) as
#: a large N does on a GPU (where a row block is thousands of rows).
CHUNK_ROWS = 16


def _schedule(schedule, deterministic):
    """grads() keywords of a test schedule. ``"kernels"``: the schedule without scratch for
    ``deterministic`` (owner-computes kernels if True, one program per tile pair with atomics if
    False); ``"chunked-rows"``: the chunked schedule with row blocks of ``CHUNK_ROWS`` rows; else
    ``_schedule=schedule``."""
    if schedule == "kernels":
        return dict(_schedule="owner" if deterministic else "tiles")
    if schedule == "chunked-rows":
        return dict(_schedule="chunked", _chunk_rows=CHUNK_ROWS)
    return dict(_schedule=schedule)


# Each backward test runs the chunked schedule (the default: dz stored per vocab chunk and row
# block, torch GEMMs), once with every row in one block and once in several row blocks, and the
# scratch-free kernels (atomic per-tile, or owner-computes when deterministic); the interpreter's
# 64-column chunks make the tests' shapes walk several chunks.
BWD_SCHEDULES = ["chunked", "chunked-rows", "kernels"]


@pytest.mark.parametrize("schedule", BWD_SCHEDULES)
@pytest.mark.parametrize("i", range(len(COMBOS)))
def test_grads_fp32_all_combinations(i, schedule):
    bias, softcap, temp, vs = COMBOS[i]
    n, d, v = SHAPES[(i + 2) % len(SHAPES)]
    h, w, b, t = make_inputs(n, d, v, torch.float32, bias=bias, vocab_start=vs, seed=20 + i)
    lse = shard_lse(*_cpu(h, w, b), softcap, temp).to(DEVICE)
    coef = make_coef(n, seed=i)
    det = bool(i % 2)
    got = _run_grads(h, w, b, t, lse, coef, vs, softcap, temp, deterministic=det, **_schedule(schedule, det))
    ref = oracle_grads(*_cpu(h, w, b, t, lse, coef), vs, softcap, temp)
    _check_fp32_grads(got, ref)


@pytest.mark.parametrize("schedule,deterministic", [("chunked", False), ("tiles", False), ("owner", True)])
def test_grads_narrow_vocab_tiles_match_oracle(schedule, deterministic):
    """The register-pressure rules of ``config.backward_config`` halve vocab tiles down to 16 wide, narrower than the
    32-wide gradient-product chunks (64 x 16 x 32 x 32 on a GPU): tiles of 16 vocab rows under 32-wide chunks, over a
    hidden size and a vocab that neither divides, give the oracle's gradients in every schedule."""
    n, d, v = 33, 48, 70
    h, w, b, t = make_inputs(n, d, v, torch.float32, bias=True, vocab_start=0, seed=91)
    lse = shard_lse(*_cpu(h, w, b), 30.0, 0.7).to(DEVICE)
    coef = make_coef(n, seed=92)
    got = _run_grads(
        h, w, b, t, lse, coef, 0, 30.0, 0.7, deterministic=deterministic, _schedule=schedule, _blocks=(16, 16, 16, 32)
    )
    _check_fp32_grads(got, oracle_grads(*_cpu(h, w, b, t, lse, coef), 0, 30.0, 0.7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("schedule", BWD_SCHEDULES)
@pytest.mark.parametrize("i,deterministic", [(7, False), (10, True), (15, False)])
def test_grads_half_no_worse_than_materialized(dtype, i, deterministic, schedule):
    bias, softcap, temp, vs = COMBOS[i]
    n, d, v = 20, 40, 70
    h, w, b, t = make_inputs(n, d, v, dtype, bias=bias, vocab_start=vs, seed=40 + i)
    hc, wc, bc, tc = _cpu(h, w, b, t)
    lse = shard_lse(hc, wc, bc, softcap, temp)
    coef = make_coef(n, seed=i).cpu()
    sched = _schedule(schedule, deterministic)
    got = _run_grads(
        h, w, b, t, lse.to(DEVICE), coef.to(DEVICE), vs, softcap, temp, deterministic=deterministic, **sched
    )
    ref = oracle_grads(hc, wc, bc, tc, lse, coef, vs, softcap, temp)
    mat = materialized_grads(hc, wc, bc, tc, lse, coef, vs, softcap, temp)
    for g, r, m in zip(got, ref, mat):
        if r is None:
            assert g is None
            continue
        # Both round d logits to the compute dtype (the kernel keeps fp32 outputs, the
        # materialized path also rounds its outputs), so the kernel's error should be at most
        # the materialized one; 1.5x + 1 ulp of fp32 leaves room for a logit rounding flip.
        e_k, e_m = max_err(g, r), max_err(m, r)
        assert e_k <= 1.5 * e_m + 1e-6 * scale(r), (e_k, e_m)


@pytest.mark.parametrize("schedule", ["tiles", "chunked"])
@pytest.mark.parametrize("i", [3, 12, 15])
def test_grads_schedules_match_oracle(schedule, i):
    """The one-program-per-tile schedule and the chunked one (dz stored per vocab chunk, torch GEMMs)
    both give the oracle's gradients. N=70, V=200 with the interpreter's 16x32 tiles are 5 x 7 tiles
    whose last row and column are partial; or 4 chunks of 64 vocab columns, the last one 8 wide."""
    bias, softcap, temp, vs = COMBOS[i]
    n, d, v = 70, 24, 200
    h, w, b, t = make_inputs(n, d, v, torch.float32, bias=bias, vocab_start=vs, seed=60 + i)
    lse = shard_lse(*_cpu(h, w, b), softcap, temp).to(DEVICE)
    coef = make_coef(n, seed=i)
    got = _run_grads(h, w, b, t, lse, coef, vs, softcap, temp, _schedule=schedule)
    ref = oracle_grads(*_cpu(h, w, b, t, lse, coef), vs, softcap, temp)
    _check_fp32_grads(got, ref)


@pytest.mark.parametrize("filter_eps", [None, 0.0])
@pytest.mark.parametrize("schedule", ["tiles", "owner", "chunked-rows"])
@pytest.mark.parametrize("i", [0, 3, 12, 15])
def test_grads_gamma_weights_match_oracle(i, schedule, filter_eps):
    """Class weights: the GAMMA term weighed per vocab row (``gamma_weights``, a third of them 0), in the tiles
    (every schedule) and, with filtering and no softcap, added by the launcher; the torch implementation too."""
    bias, softcap, temp, vs = COMBOS[i]
    n, d, v = 33, 24, 100
    h, w, b, t = make_inputs(n, d, v, torch.float32, bias=bias, vocab_start=vs, seed=80 + i)
    lse = shard_lse(*_cpu(h, w, b), softcap, temp).to(DEVICE)
    coef = make_coef(n, seed=i)
    gw = torch.rand(v, generator=torch.Generator().manual_seed(i)) * 2
    gw[::3] = 0.0
    ref = oracle_grads(*_cpu(h, w, b, t, lse, coef), vs, softcap, temp, gamma_weights=gw)
    kw = dict(filter_eps=filter_eps, deterministic=schedule == "owner", gamma_weights=gw.to(DEVICE))
    got = _run_grads(h, w, b, t, lse, coef, vs, softcap, temp, **_schedule(schedule, schedule == "owner"), **kw)
    _check_fp32_grads(got, ref)
    cpu = _cpu(h, w, b, t, lse, coef)
    need = dict(need_hidden=True, need_weight=True, need_bias=b is not None)
    torch_got = torch_cross_entropy.grads(
        *cpu, vocab_start=vs, softcap=softcap, temperature=temp, gamma_weights=gw, chunk_size=7 * v, **need
    )
    _check_fp32_grads(torch_got, ref)


@pytest.mark.parametrize("filter_eps", [None, 0.0])
@pytest.mark.parametrize("i", range(len(COMBOS)))
def test_grads_chunked_row_blocks_match_oracle(i, filter_eps):
    """The chunked schedule in row blocks (as at large N) gives the oracle's gradients with every
    flag set: bias, softcap, temperature, vocab offset, GAMMA (label smoothing) in every row, and
    filtering with eps = 0 (exact: it drops only all-zero tiles, and without a softcap GAMMA is
    added analytically). N = 70, V = 200 with at most 32 rows per block are 3 row blocks (32, 32
    and a ragged 6: N is not a multiple of the 16-row tile) x 4 vocab chunks (64, 64, 64, 8), so
    dW and db add three row blocks per chunk and dH four chunks per row block."""
    bias, softcap, temp, vs = COMBOS[i]
    n, d, v = 70, 24, 200
    h, w, b, t = make_inputs(n, d, v, torch.float32, bias=bias, vocab_start=vs, seed=90 + i)
    lse = shard_lse(*_cpu(h, w, b), softcap, temp).to(DEVICE)
    coef = make_coef(n, seed=i, zero_rows=(2, 5, 33, 69))
    kw = dict(filter_eps=filter_eps, deterministic=bool(i % 2), _schedule="chunked", _chunk_rows=32)
    got = _run_grads(h, w, b, t, lse, coef, vs, softcap, temp, **kw)
    ref = oracle_grads(*_cpu(h, w, b, t, lse, coef), vs, softcap, temp)
    _check_fp32_grads(got, ref)


# NaN / inf hidden rows make NaN logits in the recompute (then selected away): numpy warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_chunked_row_blocks_zero_coef_rows_stay_out():
    """Rows with all-zero coefficients whose hidden states are not finite stay out of dW / db in
    every row block (the GEMMs read such rows of H as 0), and their dH is exactly 0: N = 40 in
    row blocks of 16 (16, 16, 8), idle rows in each."""
    n, d, v = 40, 16, 100
    h, w, b, t = make_inputs(n, d, v, torch.float32, bias=True, vocab_start=0, seed=14)
    lse = shard_lse(*_cpu(h, w, b), None, 1.0).to(DEVICE)
    coef = make_coef(n, zero_rows=(3, 17, 18, 35, 39))
    idle = [3, 17, 18, 35, 39]
    kw = dict(_schedule="chunked", _chunk_rows=16, deterministic=True)
    dh, dw, db = _run_grads(h, w, b, t, lse, coef, 0, None, 1.0, **kw)
    _check_fp32_grads((dh, dw, db), oracle_grads(*_cpu(h, w, b, t, lse, coef), 0, None, 1.0))
    h2 = h.clone()
    h2[idle[:3]] = float("nan")
    h2[idle[3:]] = float("inf")
    dh2, dw2, db2 = _run_grads(h2, w, b, t, lse, coef, 0, None, 1.0, **kw)
    assert (dh2[idle] == 0).all()
    # Bitwise: the same dz and the same GEMMs with the idle rows of H read as 0 instead of as themselves,
    # which contribute 0 * h = 0 either way.
    for x, y in ((dh2, dh), (dw2, dw), (db2, db)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("schedule", ["chunked", "chunked-rows"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_schedules_filter_the_same_tiles(softcap, schedule):
    """With filtering, the chunked schedule (in one or in 3 row blocks) drops exactly the tiles the
    per-tile schedule drops (a dropped tile's dz is zeroed before it is stored): same
    gradients up to fp32 summation order (all sum the same bf16-rounded products in fp32; 1e-5 of
    the scale bounds the reordering of O(V) terms)."""
    n, d, v = 40, 24, 130
    h, w, b, t = make_inputs(n, d, v, torch.bfloat16, bias=True, vocab_start=0, seed=80)
    lse = shard_lse(*_cpu(h, w, b), softcap, 1.0, extra=4.0).to(DEVICE)  # small p: tiles dropped
    coef = make_coef(n, seed=3)
    coef[:, GAMMA] = 0.0  # with a softcap, a row with GAMMA != 0 keeps every tile it is in
    kw = dict(filter_eps=0.05)  # coarse on purpose, so that whole tiles are dropped
    got = _run_grads(h, w, b, t, lse, coef, 0, softcap, 1.0, **_schedule(schedule, False), **kw)
    til = _run_grads(h, w, b, t, lse, coef, 0, softcap, 1.0, _schedule="tiles", **kw)
    exact = _run_grads(h, w, b, t, lse, coef, 0, softcap, 1.0, _schedule="tiles")
    assert any(max_err(a, e) > 0 for a, e in zip(til, exact)), "filter dropped nothing: test is vacuous"
    for a, r in zip(got, til):
        assert max_err(a, r) <= 1e-5 * scale(r), (max_err(a, r), scale(r))


def test_grads_need_flags_and_no_bias():
    h, w, b, t = make_inputs(7, 16, 37, torch.float32, bias=True, vocab_start=0, seed=9)
    lse = shard_lse(*_cpu(h, w, b), None, 1.0).to(DEVICE)
    coef = make_coef(7)
    ref = oracle_grads(*_cpu(h, w, b, t, lse, coef), 0, None, 1.0)
    dh, dw, db = _run_grads(h, w, b, t, lse, coef, 0, None, 1.0, need_hidden=True, need_weight=False, need_bias=False)
    assert dw is None and db is None
    _check_fp32_grads((dh,), ref[:1])
    dh, dw, db = _run_grads(h, w, b, t, lse, coef, 0, None, 1.0, need_hidden=False, need_weight=False, need_bias=True)
    assert dh is None and dw is None
    _check_fp32_grads((db,), ref[2:])
    for det in (False, True):
        dh, dw, db = _run_grads(h, w, None, t, lse, coef, 0, None, 1.0, need_bias=True, deterministic=det)
        assert db is None
        ref_nb = oracle_grads(*_cpu(h, w, None, t, lse, coef), 0, None, 1.0)
        _check_fp32_grads((dh, dw), ref_nb[:2])


# NaN / inf hidden rows make NaN logits in the recompute (then selected away): numpy warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("schedule", BWD_SCHEDULES)
@pytest.mark.parametrize("softcap,deterministic,filter_eps", [(3.0, False, None), (None, True, 1e-3)])
def test_grads_zero_coef_rows_contribute_nothing(softcap, deterministic, filter_eps, schedule):
    """Rows with all-zero coefficients (ignored tokens) give exactly zero gradient and stay out of
    dW / db even when their hidden states are not finite (p * 0 would be NaN)."""
    h, w, b, t = make_inputs(7, 16, 37, torch.float32, bias=True, vocab_start=0, seed=10)
    lse = shard_lse(*_cpu(h, w, b), softcap, 1.0).to(DEVICE)
    coef = make_coef(7, zero_rows=())
    coef[:, GAMMA] = 0.01  # label smoothing: the uniform term (analytic when filtering w/o softcap)
    coef[3:] = 0
    kw = dict(deterministic=deterministic, filter_eps=filter_eps, **_schedule(schedule, deterministic))
    dh, dw, db = _run_grads(h, w, b, t, lse, coef, 0, softcap, 1.0, **kw)
    assert (dh[3:] == 0).all() and dh[:3].abs().sum() > 0
    h2 = h.clone()
    h2[3] = float("nan")
    h2[4:] = float("inf")
    dh2, dw2, db2 = _run_grads(h2, w, b, t, lse, coef, 0, softcap, 1.0, **kw)
    assert torch.isfinite(dw2).all() and torch.isfinite(db2).all() and (dh2[3:] == 0).all()
    torch.testing.assert_close(dh2, dh, rtol=0, atol=0)
    torch.testing.assert_close(dw2, dw, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(db2, db, rtol=1e-6, atol=1e-7)


def test_grads_n0():
    h, w, b, t = make_inputs(0, 16, 37, torch.float32, bias=True, vocab_start=0)
    lse = torch.zeros(0, device=DEVICE)
    coef = torch.zeros(0, 4, device=DEVICE)
    for det in (False, True):
        dh, dw, db = _run_grads(h, w, b, t, lse, coef, 0, None, 1.0, deterministic=det)
        assert dh.shape == (0, 16) and dw.shape == (37, 16) and db.shape == (37,)
        assert (dw == 0).all() and (db == 0).all() and dw.dtype == torch.float32


@pytest.mark.parametrize("schedule", ["chunked", "chunked-rows", "owner"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grads_deterministic_is_bitwise_repeatable(dtype, schedule):
    # 2 token tiles (2 row blocks with "chunked-rows") x 3 vocab tiles (ragged) x 2 D chunks (ragged)
    # in the interpreter.
    h, w, b, t = make_inputs(20, 24, 70, dtype, bias=True, vocab_start=37, seed=11)
    lse = shard_lse(*_cpu(h, w, b), 4.0, 0.7).to(DEVICE)
    coef = make_coef(20)
    sched = _schedule(schedule, True)
    a = _run_grads(h, w, b, t, lse, coef, 37, 4.0, 0.7, deterministic=True, **sched)
    c = _run_grads(h, w, b, t, lse, coef, 37, 4.0, 0.7, deterministic=True, **sched)
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    # ... and agrees with the atomic schedule up to summation order.
    f = _run_grads(h, w, b, t, lse, coef, 37, 4.0, 0.7, deterministic=False, _schedule="tiles")
    for x, y in zip(a, f):
        assert max_err(x, y) <= 1e-5 * scale(y)


def _plan_meta(n, deterministic, v=300, d=64, dtype=torch.bfloat16, **kw):
    """backward.plan_grads() on meta tensors (nothing runs): ``(dh, dw, db, launches)``."""
    from cce_dist.kernels import backward as B

    m = dict(device="meta")
    h, w = torch.empty(n, d, dtype=dtype, **m), torch.empty(v, d, dtype=dtype, **m)
    t, lse, coef = torch.empty(n, dtype=torch.int64, **m), torch.empty(n, **m), torch.empty(n, 4, **m)
    opts = dict(need_hidden=True, need_weight=True, need_bias=False, deterministic=deterministic, **kw)
    return B.plan_grads(h, w, None, t, lse, coef, vocab_start=0, softcap=None, temperature=None, **opts)


def test_schedule_choice_is_chunked_at_any_n(monkeypatch):
    """Without ``_schedule`` the chunked schedule runs at every N, deterministic or not (its row
    blocks keep the scratch within budget: 70,000 and 131,072 bf16 tokens do not fit one 128-column
    chunk of all rows); where it cannot run (``_chunked_verdict`` False: too little free CUDA memory,
    or deterministic algorithms without a pinned cuBLAS workspace) the per-tile kernel, or the
    owner-computes kernels when deterministic. The atomic schedules refuse ``deterministic``."""
    from cce_dist.kernels import backward as B

    def kernels(n, deterministic, **kw):
        return {type(k) if isinstance(k, B._HostStep) else k for k, *_ in _plan_meta(n, deterministic, **kw)[3]}

    chunked = {B._dz_store_kernel, B._HostStep}
    for n in (8192, 70_000, 131_072):
        for det in (False, True):
            assert kernels(n, det) == chunked, (n, det)
    with pytest.raises(ValueError, match="not deterministic"):
        kernels(8192, True, _schedule="tiles")
    with pytest.raises(ValueError, match="_schedule must be None or one of"):
        kernels(8192, False, _schedule="super")  # the 2x2 super-tile schedule was removed (it spilled)
    monkeypatch.setattr(B, "_chunked_verdict", lambda device, deterministic: (False, "too little memory (test)"))
    assert kernels(131_072, False) == {B._grads_fused_kernel}
    assert kernels(131_072, True) == {B._grads_dh_kernel, B._grads_dw_kernel}


def test_chunked_row_blocks_and_chunks_tile_the_shard():
    """``_chunk_rows`` splits the tokens into equal row blocks of a multiple of BLOCK_N rows (the last
    one ragged): N = 70 with at most 32 rows is 3 blocks (32, 32, 6; 70 / 3 rounded up to the 16-row
    tile), each walked per vocab chunk (64, 64, 64, 8 of V = 200) in that order, the dz kernel on
    views of the block's rows, its GEMMs on the same rows; one [32, 64] dz scratch for all."""
    from cce_dist.kernels import backward as B

    n, d, v = 70, 24, 200
    *_, launches = _plan_meta(n, True, v=v, d=d, dtype=torch.float32, _chunk_rows=32)
    dz = [(args, grid) for k, grid, args, _ in launches if k is B._dz_store_kernel]
    steps = [args for k, _, args, _ in launches if isinstance(k, B._HostStep)]
    assert len(launches) == 2 * len(dz)
    want = [
        (c0, c1, r0, r1)
        for c0, c1 in ((0, 64), (64, 128), (128, 192), (192, 200))
        for r0, r1 in ((0, 32), (32, 64), (64, 70))
    ]
    assert steps == want
    for (args, grid), (c0, c1, r0, r1) in zip(dz, want):
        hidden, weight, _, targets, lse, coef, _gamma_w, scratch = args[:8]
        assert hidden.storage_offset() == r0 * d and hidden.shape == (r1 - r0, d)
        assert (targets.storage_offset(), lse.storage_offset(), coef.storage_offset()) == (r0, r0, 4 * r0)
        assert weight.storage_offset() == c0 * d and weight.shape == (c1 - c0, d)
        assert args[9:13] == (r1 - r0, c1 - c0, d, c0)  # N, V, D, vocab_start of the launch
        assert scratch.shape == (32, 64) and grid == (-(-(r1 - r0) // 16) * -(-(c1 - c0) // 32),)
    assert len({id(a[7]) for a, _ in dz}) == 1


def test_chunked_scratch_stays_in_budget_at_any_n():
    """With the GPU's own sizing (sm_90's backward config and no interpreter caps: planned on meta
    tensors in a process without TRITON_INTERPRET, as the AOT test does), the default and the
    deterministic backward at N = 131,072 (and 65,536, and a ragged 70,001 in fp32 with a bias) at
    the paper's D and V pick the chunked schedule (no per-tile or owner-computes kernel), its row
    blocks tile N in order with equal blocks of a multiple of BLOCK_N (the last one ragged), its
    vocab chunks are CHUNK_MIN_COLS wide or wider (but the last), and the scratch it allocates (dz
    and the db partial sums) stays within CHUNK_SCRATCH_BYTES (bytes counted, nothing launched)."""
    code = textwrap.dedent("""
        import json, sys, torch
        from cce_dist.kernels import backward as B, config as C
        props, d, v, out = C.KNOWN_DEVICES["sm_90"], 2304, 256000, []
        for n, dtype, bias, det in [(131072, torch.bfloat16, True, True), (131072, torch.bfloat16, False, False),
                                    (65536, torch.bfloat16, False, True), (70001, torch.float32, True, False)]:
            m = dict(device="meta")
            h, w = torch.empty(n, d, dtype=dtype, **m), torch.empty(v, d, dtype=dtype, **m)
            b = torch.empty(v, dtype=dtype, **m) if bias else None
            t, lse, coef = torch.empty(n, dtype=torch.int64, **m), torch.empty(n, **m), torch.empty(n, 4, **m)
            *_, launches = B.plan_grads(h, w, b, t, lse, coef, vocab_start=0, softcap=None, temperature=None,
                                  need_hidden=True, need_weight=True, need_bias=bias, deterministic=det,
                                  props=props, allow_tf32=True)
            kernels = sorted({type(k).__name__ if isinstance(k, B._HostStep) else k.fn.__name__
                              for k, *_ in launches})
            dz = [(a, kw) for k, _, a, kw in launches if k is B._dz_store_kernel]
            # the dz kernel's arguments: H W Bias Targets LSE Coef GammaW DZ DBP N V D vocab_start ...
            scratch = {id(x): x for a, kw in dz for x in (a[7], a[8] if kw["NEED_DB"] else None) if x is not None}
            out.append(dict(
                n=n, kernels=kernels, block_n=dz[0][1]["BLOCK_N"] if dz else 0,
                scratch_bytes=sum(x.numel() * x.element_size() for x in scratch.values()),
                blocks=[(a[0].storage_offset() // d, a[9], a[12], a[10]) for a, _ in dz],
            ))
        json.dump(dict(cases=out, budget=C.CHUNK_SCRATCH_BYTES, min_cols=C.CHUNK_MIN_COLS), sys.stdout)
    """)
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    import json

    res = json.loads(r.stdout)
    v = 256000
    for case in res["cases"]:
        n, bn = case["n"], case["block_n"]
        assert case["kernels"] == ["_HostStep", "_dz_store_kernel"], case["kernels"]
        assert 0 < case["scratch_bytes"] <= res["budget"], case["scratch_bytes"]
        chunks: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for r0, rows, c0, cols in case["blocks"]:  # in launch order
            chunks.setdefault((c0, cols), []).append((r0, rows))
        spans = list(chunks)
        assert [c0 for c0, _ in spans] == [0] + [c0 + cols for c0, cols in spans[:-1]] and sum(spans[-1]) == v
        assert all(cols >= res["min_cols"] for _, cols in spans[:-1]), spans[:2]
        for blocks in chunks.values():
            nc = blocks[0][1]  # equal blocks of a multiple of BLOCK_N rows, in order, the last one ragged
            assert len(blocks) > 1 and nc % bn == 0, (n, blocks[:2])
            assert blocks == [(r0, min(nc, n - r0)) for r0 in range(0, n, nc)], (n, blocks[:3])


# ------------------------------------------------------------------------------------------------
# gradient filtering
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap,deterministic", [(None, False), (None, True), (4.0, False)])
def test_filter_keeps_target_and_uniform_terms_exact(softcap, deterministic):
    """With ALPHA = DELTA = 0 every p-term is 0, so a filter with a huge threshold may skip every
    tile that has no target, yet the BETA (target) and GAMMA (label smoothing) terms must come
    out exactly as without filtering (GAMMA analytically without a softcap, by not skipping
    tiles with GAMMA != 0 rows with one)."""
    n, d, v, vs = 20, 24, 70, 37
    h, w, b, t = make_inputs(n, d, v, torch.float32, bias=True, vocab_start=vs, seed=12)
    lse = shard_lse(*_cpu(h, w, b), softcap, 0.7).to(DEVICE)
    coef = make_coef(n, seed=3)
    coef[:, ALPHA] = 0
    coef[:, DELTA] = 0
    got = _run_grads(h, w, b, t, lse, coef, vs, softcap, 0.7, filter_eps=1e30, deterministic=deterministic)
    ref = oracle_grads(*_cpu(h, w, b, t, lse, coef), vs, softcap, 0.7)
    _check_fp32_grads(got, ref)


def test_filter_error_is_bounded_and_filter_skips():
    """With random coefficients, skipping tiles whose p-terms are all <= eps * rowscale changes
    each gradient by at most the sum of the skipped terms (bounded per element below), and with
    a moderate eps it does skip something (the result differs from the exact one)."""
    n, d, v, vs, temp = 20, 24, 70, 0, 0.7
    eps = 0.1
    h, w, b, t = make_inputs(n, d, v, torch.float32, bias=True, vocab_start=vs, seed=13)
    hc, wc, bc, tc = _cpu(h, w, b, t)
    lse = shard_lse(hc, wc, bc, None, temp, extra=3.0)  # p <= e^-3: most tiles are small
    coef = make_coef(n, seed=4).cpu()
    exact = oracle_grads(hc, wc, bc, tc, lse, coef, vs, None, temp)
    tcoef = coef[:, BETA] - coef[:, ALPHA]  # the target term's own coefficient
    rowscale = torch.stack([coef[:, ALPHA], tcoef, coef[:, DELTA]], 1).abs().amax(1).double() * eps / temp
    bound_dh = v * rowscale[:, None] * wc.double().abs().amax(0)[None, :]
    bound_dw = (rowscale[:, None] * hc.double().abs()).sum(0)[None, :].expand(v, d)
    bound_db = rowscale.sum()
    for det in (False, True):
        # Fixed small tiles (also on a GPU) so that some tiles are entirely below the threshold.
        dh, dw, db = _run_grads(
            h,
            w,
            b,
            t,
            lse.to(DEVICE),
            coef.to(DEVICE),
            vs,
            None,
            temp,
            filter_eps=eps,
            deterministic=det,
            _blocks=(16, 32, 16, 16),
        )
        for g, r, bound in ((dh, exact[0], bound_dh), (dw, exact[1], bound_dw)):
            assert ((g.double() - r).abs() <= bound + 1e-5 * scale(r)).all()
        assert ((db.double() - exact[2]).abs() <= bound_db + 1e-5 * scale(exact[2])).all()
        assert max_err(dh, exact[0]) > 1e-4 * scale(exact[0])  # something was skipped
    # eps = 0 skips only all-zero tiles: exact.
    got = _run_grads(h, w, b, t, lse.to(DEVICE), coef.to(DEVICE), vs, None, temp, filter_eps=0.0)
    _check_fp32_grads(got, exact)


# ------------------------------------------------------------------------------------------------
# availability and errors
# ------------------------------------------------------------------------------------------------


def test_available():
    assert K.available() is True


def test_mismatched_dtypes_raise():
    h, w, b, t = make_inputs(3, 16, 37, torch.float32, bias=False, vocab_start=0)
    with pytest.raises(ValueError, match="compute dtype"):
        K.row_stats(h.bfloat16(), w, None, t, vocab_start=0, softcap=None, temperature=1.0)


def test_cpu_tensors_without_interpreter_raise():
    """Outside the interpreter, CPU tensors are refused with a message naming the two ways out."""
    code = textwrap.dedent("""
        import torch
        import cce_dist.kernels as K
        assert K.available() == torch.cuda.is_available()
        h = torch.randn(2, 8); w = torch.randn(5, 8); t = torch.zeros(2, dtype=torch.long)
        for call in (
            lambda: K.row_stats(h, w, None, t, vocab_start=0, softcap=None, temperature=1.0),
            lambda: K.grads(h, w, None, t, torch.zeros(2), torch.zeros(2, 4), vocab_start=0,
                            softcap=None, temperature=1.0, need_hidden=True, need_weight=True,
                            need_bias=False),
        ):
            try:
                call()
            except RuntimeError as e:
                assert "TRITON_INTERPRET=1" in str(e) and "impl='torch'" in str(e), e
            else:
                raise SystemExit("no error")
        print("OK")
    """)
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------
# GPU only: production configs (autotuned forward), realistic shapes, 64-bit offsets
# ------------------------------------------------------------------------------------------------


def _chunked_reference(h, w, b, t, vs, softcap, temperature, lse, coef, chunk=1024):
    """fp32 reference on the GPU, materializing [chunk, V] logits at a time."""
    stats, dh = [], []
    dw = torch.zeros(w.shape, dtype=torch.float32, device=h.device)
    db = torch.zeros(w.shape[0], dtype=torch.float32, device=h.device)
    for i in range(0, h.shape[0], chunk):
        sl = slice(i, i + chunk)
        raw = torch.nn.functional.linear(h[sl], w, b).float()
        c = softcap * torch.tanh(raw / softcap) if softcap else raw
        z = c / temperature
        m = z.amax(1)
        ex = torch.exp(z - m[:, None])
        loc, ok = local_targets(t[sl], vs, w.shape[0])
        x = torch.where(ok, z.gather(1, loc.clamp(0, w.shape[0] - 1)[:, None])[:, 0], 0.0)
        cols = [m, ex.sum(1), x, z.sum(1) * SUM_SCALE, (ex * (z - m[:, None])).sum(1)] + _no_row_outputs(m)
        stats.append(torch.stack(cols, 1))
        p = torch.exp(z - lse[sl, None])
        cf = coef[sl]
        dz = p * (cf[:, ALPHA, None] + cf[:, DELTA, None] * (z - lse[sl, None])) + cf[:, GAMMA, None]
        rows = ok.nonzero()[:, 0]
        dz[rows, loc[rows]] += cf[rows, BETA] - cf[rows, ALPHA]  # BETA: the target's excess over ALPHA
        draw = dz / temperature
        if softcap:
            draw = draw * (1 - (c / softcap) ** 2)
        dh.append(draw @ w.float())
        dw += draw.T @ h[sl].float()
        db += draw.sum(0)
    return torch.cat(stats), torch.cat(dh), dw, db


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (not interpreted)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_realistic_shape(dtype):
    torch.manual_seed(0)
    n, d, v, vs = 2048, 1024, 20000 + 37, 1000
    dev = "cuda"
    h = torch.randn(n, d, device=dev).to(dtype)
    w = (torch.randn(v, d, device=dev) / d**0.5).to(dtype)
    b = (torch.randn(v, device=dev) * 0.1).to(dtype)
    t = torch.randint(0, vs + v + 100, (n,), device=dev)
    t[::7] = IGNORE
    coef = torch.randn(n, 4, device=dev) / n
    st = K.row_stats(h, w, b, t, vocab_start=vs, softcap=30.0, temperature=0.9)
    lse = (stats_lse(st) + 0.1).float()
    ref_st, ref_dh, ref_dw, ref_db = _chunked_reference(h, w, b, t, vs, 30.0, 0.9, lse, coef)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(stats_lse(st), stats_lse(ref_st), rtol=1e-4, atol=tol)
    torch.testing.assert_close(st[:, TARGET], ref_st[:, TARGET], rtol=1e-4, atol=tol)
    for det in (False, True):
        dh, dw, db = K.grads(
            h,
            w,
            b,
            t,
            lse,
            coef,
            vocab_start=vs,
            softcap=30.0,
            temperature=0.9,
            need_hidden=True,
            need_weight=True,
            need_bias=True,
            deterministic=det,
        )
        for g, r in ((dh, ref_dh), (dw, ref_dw), (db, ref_db)):
            assert max_err(g, r) <= (1e-4 if dtype == torch.float32 else 1e-2) * scale(r)
    again = K.grads(
        h,
        w,
        b,
        t,
        lse,
        coef,
        vocab_start=vs,
        softcap=30.0,
        temperature=0.9,
        need_hidden=True,
        need_weight=True,
        need_bias=True,
        deterministic=True,
    )
    assert all(
        torch.equal(x, y)
        for x, y in zip(
            again,
            K.grads(
                h,
                w,
                b,
                t,
                lse,
                coef,
                vocab_start=vs,
                softcap=30.0,
                temperature=0.9,
                need_hidden=True,
                need_weight=True,
                need_bias=True,
                deterministic=True,
            ),
        )
    )


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA (not interpreted)")
def test_gpu_64bit_offsets():
    """V_local * D > 2^31 elements: weight / dW offsets need 64-bit arithmetic."""
    free, _ = torch.cuda.mem_get_info()
    n, d, v = 64, 4096, (1 << 19) + 17  # V * D = 2^31 + 69632
    if free < v * d * (2 + 4) * 1.2:
        pytest.skip("not enough GPU memory")
    dev = "cuda"
    torch.manual_seed(0)
    h = torch.randn(n, d, device=dev).bfloat16()
    w = (torch.randn(v, d, device=dev) / d**0.5).bfloat16()
    t = torch.full((n,), v - 1, device=dev)  # targets in the very last rows
    st = K.row_stats(h, w, None, t, vocab_start=0, softcap=None, temperature=1.0)
    tail = slice(v - 300, v)
    z_tail = (h.float() @ w[tail].float().T).bfloat16().float()
    torch.testing.assert_close(st[:, TARGET], z_tail[:, -1], rtol=0, atol=0)
    lse = stats_lse(st).float()
    coef = torch.zeros(n, 4, device=dev)
    coef[:, BETA] = 1.0  # only the target term: dW rows = sum of h over rows targeting them
    _, dw, _ = K.grads(
        h,
        w,
        None,
        t,
        lse,
        coef,
        vocab_start=0,
        softcap=None,
        temperature=1.0,
        need_hidden=False,
        need_weight=True,
        need_bias=False,
        filter_eps=1e30,
    )
    torch.testing.assert_close(dw[-1], h.float().sum(0), rtol=1e-5, atol=1e-4)
    assert dw[: v - 1].abs().max().item() == 0.0
