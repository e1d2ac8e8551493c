"""Distributed fault injection: no silent wrong loss, no endless hang.

1. ``test_rank_local_fault[case]`` (3 ranks, a persistent rank pool): the table ``LOCAL_FAULTS``
   says what every rank and what rank 1 alone does wrong (out-of-range or negative target, wrong
   shapes, an empty batch, disagreeing N, disagreeing shard layouts, a differing option) and the
   error each rank must raise; after it the group is still in step (the next correct call is
   exact). NaN / Inf on one rank only (hidden row, weight shard, sequence-parallel slice, upstream
   gradient) must come out as NaN / Inf in the affected rows on every rank, never as a finite
   number, with the unaffected rows exact. Separately: a differing head dtype under sequence
   parallelism (2 ranks).
2. ``test_rank_dies_mid_step[where]`` (a group of 3 or 2): rank 1 calls ``os._exit`` before the
   call, between the two statistics all-reduces, inside the fused (grad-in-forward) schedule's
   second token chunk, or just before the backward's dH all-reduce. Every survivor must raise
   within the group timeout.
3. ``test_rank_stalls_survivors_time_out[how]`` (2 ranks): rank 1 never joins (sleeps past the
   timeout) before the call, after a rank-local error with ``VocabShard(check=False)``, or by
   skipping backward. The survivor must raise a timeout error within the group timeout.

Ranks that die or stall get a fresh group each (``dist_utils.spawn_ranks`` with
``hard_exit=True``: a rank reports and leaves with ``os._exit``, since ``destroy_process_group``
blocks once a peer is dead). The parent's deadline turns any hang into a failure.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from dist_utils import spawn_ranks
from helpers import close_report, problem
from oracle import oracle_cross_entropy

from cce_dist import VocabShard, linear_cross_entropy

PG_TIMEOUT = 10.0  # seconds: the gloo group timeout set for every group that loses a rank here
SLACK = 25.0  # scheduling slack on a loaded 2-core CI box


# ----------------------------------------------------------------------------------------------
# the shared problem
# ----------------------------------------------------------------------------------------------

V, D, N = 13, 8, 12
BOUNDS = [(0, 4), (4, 9), (9, 13)]


# H [N, D], W * 0.5, b * 0.3, the sixth target ignored
_problem = functools.partial(problem, N, D, V, w_scale=0.5, b_scale=0.3, ignore=(5,), seed=3)


# ----------------------------------------------------------------------------------------------
# 1. rank-local faults on 3 ranks
# ----------------------------------------------------------------------------------------------


class Call:
    """One rank's call: fine inputs (``_problem()``, this rank's rows of BOUNDS) that a fault spoils."""

    def __init__(self, rank):
        self.H, self.W, _, self.t = _problem()
        self.rank = rank
        self.start, self.stop = BOUNDS[rank]
        self.h, self.targets = self.H.clone(), self.t.clone()
        self.w = None  # None: W[start:stop] at call time
        self.kw = dict(impl="torch", reduction="none")
        self.skw = {}
        self.upstream = torch.ones(N)

    def __call__(self, group):
        """Returns (loss rows, dH) on this rank; raises what cce_dist raises."""
        w = self.W[self.start : self.stop].clone() if self.w is None else self.w
        h = self.h.requires_grad_(True)
        w.requires_grad_(True)
        shard = VocabShard(group, self.start, self.stop, **self.skw)
        loss = linear_cross_entropy(h, w, self.targets, shard=shard, **self.kw)
        loss.backward(self.upstream)
        return loss.detach(), h.grad.detach()


def _target(i, value):
    def f(c):
        c.targets[i] = value

    return f


def _hidden(fn):
    return lambda c: setattr(c, "h", fn(c.H).clone())


def _tokens(n):
    def f(c):
        c.h, c.targets = c.H[:n].clone(), c.t[:n].clone()

    return f


def _start(start):
    def f(c):
        c.start = start

    return f


def _even_padded_vocab(c):
    """Rank 1 believes in an even split of a padded 15-row vocab; the others in BOUNDS."""
    c.start, c.stop = 5, 10
    c.w = torch.cat([c.W, torch.zeros(2, D)])[c.start : c.stop].clone()


def _nan_weight(c):
    c.w = c.W[c.start : c.stop].clone()
    c.w[0, 3] = float("nan")


def _nan_hidden_row(c):
    c.h[2] = float("nan")


def _sp_slices(c):
    c.skw["sequence_parallel"] = True
    c.h = c.H[c.rank * 4 : (c.rank + 1) * 4].clone()


def _inf_sp_rows(c):
    c.h[0, 0] = float("inf")  # global row 4
    c.h[2, :] = float("-inf")  # global row 6


def _nan_upstream(c):
    c.upstream[3] = float("nan")


# the same faults applied to the full problem: the oracle of the affected rows
def _ref_nan_hidden_row(H, W, up):
    H[2] = float("nan")


def _ref_nan_weight(H, W, up):
    W[BOUNDS[1][0], 3] = float("nan")


def _ref_inf_sp_rows(H, W, up):
    H[4, 0] = float("inf")
    H[4 + 2, :] = float("-inf")


def _ref_nan_upstream(H, W, up):
    up[3] = float("nan")


OTHERS = r"rank\(s\) \[1\] of the tensor-parallel group rejected their inputs"


@dataclass(frozen=True)
class LocalFault:
    """``every`` is applied on every rank, then ``bad`` on rank 1 (the odd rank out).

    Either ``raises``: the (type, regex) that rank 1's and the other ranks' error must be an
    instance of and match; or ``reference``: the fault applied to the full problem, whose
    materialized program's non-finite rows every rank must reproduce (nothing raised).
    """

    name: str
    bad: Callable | None = None
    every: Callable | None = None
    raises: dict = field(default_factory=dict)  # {"rank1": (type, regex), "others": (type, regex)}
    reference: Callable | None = None


def _raise(rank1, others=None):
    return {"rank1": (ValueError, rank1), "others": (ValueError, rank1 if others is None else others)}


LOCAL_FAULTS = [
    LocalFault("oob_target_one_rank", bad=_target(2, V), raises=_raise(r"target", r"target")),
    LocalFault("negative_target_one_rank", bad=_target(2, -3), raises=_raise(r"targets contain id -3", OTHERS)),
    LocalFault(
        "huge_target_all_ranks",
        every=_target(2, 2**40),
        raises=_raise(r"targets contain id 1099511627776, outside the vocabulary \[0, 13\)"),
    ),
    LocalFault(
        "hidden_rows_one_rank",
        bad=_hidden(lambda H: H[:11]),
        raises=_raise(r"targets must have shape \(11,\) \(hidden.shape\[:-1\]\), got \(12,\)", OTHERS),
    ),
    LocalFault(
        "weight_rows_one_rank",
        bad=lambda c: setattr(c, "w", c.W[c.start : c.stop - 1].clone()),
        raises=_raise(r"weight.shape\[0\] \(4\) must equal the shard size", OTHERS),
    ),
    LocalFault(
        "hidden_dim_one_rank",
        bad=_hidden(lambda H: torch.randn(N, D + 1)),
        raises=_raise(r"hidden's last dimension \(9\) must equal weight.shape\[1\] \(8\)", OTHERS),
    ),
    LocalFault("n_disagree", bad=_tokens(11), raises=_raise(r"disagree on the number of tokens.*\[12, 11, 12\]")),
    LocalFault(
        "empty_batch_one_rank", bad=_tokens(0), raises=_raise(r"disagree on the number of tokens.*\[12, 0, 12\]")
    ),
    LocalFault("layout_overlap", bad=_start(3), raises=_raise(r"do not tile \[0, V\): overlap")),
    LocalFault("layout_gap", bad=_start(5), raises=_raise(r"do not tile \[0, V\): gap")),
    LocalFault("layout_even_vs_uneven", bad=_even_padded_vocab, raises=_raise(r"do not tile \[0, V\)")),
    LocalFault(
        "z_loss_differs", bad=lambda c: c.kw.update(z_loss=1e-3), raises=_raise(r"disagree on the loss options")
    ),
    LocalFault(
        "nan_hidden_row_one_rank_allgather",
        every=lambda c: c.skw.update(stats_collective="allgather"),
        bad=_nan_hidden_row,
        reference=_ref_nan_hidden_row,
    ),
    LocalFault(
        "nan_hidden_row_one_rank_allreduce",
        every=lambda c: c.skw.update(stats_collective="allreduce"),
        bad=_nan_hidden_row,
        reference=_ref_nan_hidden_row,
    ),
    LocalFault("nan_weight_one_rank", bad=_nan_weight, reference=_ref_nan_weight),
    LocalFault("inf_hidden_sp_one_rank", every=_sp_slices, bad=_inf_sp_rows, reference=_ref_inf_sp_rows),
    LocalFault("nan_upstream_grad_one_rank", bad=_nan_upstream, reference=_ref_nan_upstream),
]
LOCAL_FAULT_BY_NAME = {f.name: f for f in LOCAL_FAULTS}


def _healthy(rank, group) -> float:
    """A correct call after the fault: |loss - oracle| (the group must still be in step)."""
    H, W, b, t = _problem(seed=11)
    start, stop = BOUNDS[rank]
    loss = linear_cross_entropy(
        H, W[start:stop], t, bias=b[start:stop], shard=VocabShard(group, start, stop), label_smoothing=0.1, impl="torch"
    )
    ref = oracle_cross_entropy(H, W, t, b, label_smoothing=0.1)
    return abs(float(loss) - float(ref))


def _local_fault_body(rank, world, group, name):
    """What fault ``name`` did on this rank (its error, or its loss rows and dH), then the next call's error."""
    fault = LOCAL_FAULT_BY_NAME[name]
    call = Call(rank)
    if fault.every is not None:
        fault.every(call)
    if rank == 1 and fault.bad is not None:
        fault.bad(call)
    t0 = time.monotonic()
    try:
        loss, dh = call(group)
        rec = {"error": None, "loss": loss, "dh": dh}
    except Exception as e:  # noqa: BLE001 - recorded for the parent
        expected = fault.raises.get("rank1" if rank == 1 else "others")
        rec = {
            "type": type(e).__name__,
            "error": str(e),
            "ok_type": bool(expected and isinstance(e, expected[0])),
        }
    rec["seconds"] = time.monotonic() - t0
    rec["healthy_err"] = _healthy(rank, group)
    return rec


def _nonfinite_reference(fault):
    """The materialized program on the full problem with the fault applied."""
    H, W, b, t = _problem()
    up = torch.ones(N)
    fault.reference(H, W, up)
    h = H.clone().requires_grad_(True)
    loss = oracle_cross_entropy(h, W, t, reduction="none")
    loss.backward(up)
    return loss.detach(), h.grad


def _nan_rows(x: torch.Tensor) -> list[int]:
    return (~torch.isfinite(x.reshape(x.shape[0], -1))).any(1).nonzero().flatten().tolist()


def _check_raised(fault, recs):
    problems = []
    for r in range(3):
        rec = recs[r]
        typ, want = fault.raises["rank1" if r == 1 else "others"]
        if rec["error"] is None:
            problems.append(f"{fault.name}: rank {r} raised nothing (loss {rec['loss'].tolist()[:3]}...)")
        elif not re.search(want, rec["error"]):
            problems.append(f"{fault.name}: rank {r} raised {rec['type']}: {rec['error']!r}, want /{want}/")
        elif not rec["ok_type"]:
            problems.append(f"{fault.name}: rank {r} raised {rec['type']} (not a {typ.__name__}/InputError)")
    return problems


def _check_nonfinite(fault, recs):
    problems = []
    ref_loss, ref_dh = _nonfinite_reference(fault)
    for r in range(3):
        rec = recs[r]
        if rec["error"] is not None:
            problems.append(f"{fault.name}: rank {r} raised {rec['type']}: {rec['error']}")
            continue
        loss, dh = rec["loss"], rec["dh"]
        sl = slice(r * 4, (r + 1) * 4) if fault.name == "inf_hidden_sp_one_rank" else slice(0, N)
        ref_dh_r, valid = ref_dh[sl], (_problem().targets != -100)[sl]
        if _nan_rows(loss) != _nan_rows(ref_loss):
            problems.append(
                f"{fault.name}: rank {r}: non-finite loss rows {_nan_rows(loss)}, oracle {_nan_rows(ref_loss)}"
            )
        if float(loss[5]) != 0.0:
            problems.append(f"{fault.name}: rank {r}: the ignored row's loss is {float(loss[5])}, not 0")
        fin = torch.isfinite(ref_loss)
        if m := close_report(loss[fin], ref_loss[fin], 1e-5, 1e-5):
            problems.append(f"{fault.name}: rank {r}: finite loss rows: {m}")
        # dH of valid rows: non-finite exactly where the oracle's is, exact elsewhere (the
        # gradient of an ignored row is unspecified once non-finite values are around)
        dh_v, ref_v = dh[valid], ref_dh_r[valid]
        if _nan_rows(dh_v) != _nan_rows(ref_v):
            problems.append(
                f"{fault.name}: rank {r}: non-finite dH rows {_nan_rows(dh_v)} (of the valid rows), "
                f"oracle {_nan_rows(ref_v)}"
            )
        ok = [i for i in range(ref_v.shape[0]) if i not in _nan_rows(ref_v) + _nan_rows(dh_v)]
        if m := close_report(dh_v[ok], ref_v[ok], 2e-5, 1e-4):
            problems.append(f"{fault.name}: rank {r}: finite dH rows: {m}")
    return problems


@pytest.mark.parametrize("fault", LOCAL_FAULTS, ids=lambda f: f.name)
def test_rank_local_fault(rank_pool, fault):
    """A fault on one rank (or on all): a clear error on every rank, or non-finite values exactly
    where the oracle has them; either way the next correct call on the group is exact."""
    recs = rank_pool(3).run(_local_fault_body, name=fault.name, timeout=200)
    problems = _check_raised(fault, recs) if fault.reference is None else _check_nonfinite(fault, recs)
    for r in range(3):
        if recs[r]["healthy_err"] > 1e-5:
            problems.append(f"{fault.name}: rank {r}: the next correct call is off by {recs[r]['healthy_err']}")
    assert not problems, "\n".join(problems)


def _dtype_body(rank, world, group):
    """Sequence parallel, rank 1's head in bf16, the others' in fp32 (a configuration error)."""
    H, W, b, t = _problem()
    start, stop = [(0, 6), (6, 13)][rank]
    w = W[start:stop].clone()
    if rank == 1:
        w = w.to(torch.bfloat16)
    h = H[rank * 6 : (rank + 1) * 6].clone().requires_grad_(True)
    try:
        linear_cross_entropy(
            h,
            w.requires_grad_(True),
            t,
            impl="torch",
            reduction="none",
            shard=VocabShard(group, start, stop, sequence_parallel=True),
        )
        return None
    except ValueError as e:
        return str(e)


def test_head_dtype_differs_under_sequence_parallel(rank_pool):
    """Found by this suite (gloo aborted the bf16 rank on the hidden all-gather); now every rank
    raises an InputError from the handshake, which compares compute dtypes."""
    got = rank_pool(2).run(_dtype_body, timeout=120)
    assert sorted(got) == [0, 1]
    for r, res in got.items():
        assert res is not None and re.search(r"disagree on the loss options.*compute dtype", res), f"rank {r}: {res}"


# ----------------------------------------------------------------------------------------------
# 2. a rank dies mid-step
# ----------------------------------------------------------------------------------------------


def _die(rank, out_dir, where):
    with open(os.path.join(out_dir, f"death_{rank}.json"), "w") as f:
        json.dump({"where": where, "time": time.time()}, f)
    os._exit(7)


def _die_between_stat_allreduces(rank, out_dir, where):
    import cce_dist.core.stats as S

    S.rescale = lambda *a, **k: _die(rank, out_dir, where)  # called after the MAX, before the SUM


def _die_in_second_reduce_stats(rank, out_dir, where):
    import cce_dist.tp.collectives as P

    orig, calls = P.Comm.reduce_stats, []

    def reduce_stats(self, local_stats):
        calls.append(1)
        if len(calls) == 2:
            _die(rank, out_dir, where)
        return orig(self, local_stats)

    P.Comm.reduce_stats = reduce_stats


def _die_before_dh_allreduce(rank, out_dir, where):
    import cce_dist.tp.collectives as P

    P.Comm.reduce_hidden_grad = lambda self, dh: _die(rank, out_dir, where)


@dataclass(frozen=True)
class Death:
    """Rank 1 of a group of ``world`` ranks runs ``victim`` (which makes it ``os._exit`` there)."""

    where: str
    world: int
    victim: Callable
    kw: dict = field(default_factory=lambda: dict(impl="torch", reduction="none"))
    skw: dict = field(default_factory=dict)


DEATHS = [
    Death(
        "between_stat_allreduces",
        3,
        _die_between_stat_allreduces,
        skw=dict(stats_collective="allreduce"),
    ),
    Death("before_call", 2, _die),
    Death(
        "fused_second_chunk",
        2,
        _die_in_second_reduce_stats,
        kw=dict(impl="torch", reduction="mean", chunk_size=4 * 7),  # 4 tokens per chunk: 3 chunks
    ),
    Death("before_dh_allreduce", 2, _die_before_dh_allreduce),
]


def _death_body(rank, world, group, out_dir, death):
    H, W, b, t = _problem()
    start, stop = {3: BOUNDS, 2: [(0, 6), (6, 13)]}[world][rank]
    if rank == 1:
        death.victim(rank, out_dir, death.where)
    h = H.clone().requires_grad_(True)
    w = W[start:stop].clone().requires_grad_(True)
    t0 = time.time()
    try:
        loss = linear_cross_entropy(h, w, t, shard=VocabShard(group, start, stop, **death.skw), **death.kw)
        loss.sum().backward()
        return {"where": death.where, "error": None, "t_error": time.time(), "t0": t0}
    except Exception as e:  # noqa: BLE001
        return {"where": death.where, "error": f"{type(e).__name__}: {e}", "t_error": time.time(), "t0": t0}


@pytest.mark.parametrize("death", DEATHS, ids=lambda d: d.where)
def test_rank_dies_mid_step(tmp_path, death):
    """Rank 1 dies at ``death.where``; every survivor raises within the group timeout."""
    got = spawn_ranks(
        _death_body,
        death.world,
        tmp_path,
        kw=dict(out_dir=str(tmp_path), death=death),
        may_die=[1],
        hard_exit=True,
        timeout=240,
        pg_timeout=PG_TIMEOUT,
    )
    dead_at = json.load(open(tmp_path / "death_1.json"))  # the victim did die
    problems = []
    for r in sorted(set(range(death.world)) - {1}):
        err, res = got[r]
        if err is not None:
            problems.append(f"rank {r}: the test body itself failed: {err}")
            continue
        if res["error"] is None:
            problems.append(f"rank {r} ({res['where']}): no error although rank 1 died")
            continue
        if not isinstance(res["error"], str) or not re.search(r"RuntimeError|DistBackendError", res["error"]):
            problems.append(f"rank {r} ({res['where']}): unexpected error {res['error']}")
        waited = res["t_error"] - max(res["t0"], dead_at["time"])
        if waited > PG_TIMEOUT + SLACK:
            problems.append(f"rank {r} ({res['where']}): error only after {waited:.1f}s")
    assert not problems, "\n".join(problems)
    assert len(got) == death.world - 1


# ----------------------------------------------------------------------------------------------
# 3. a rank stalls: survivors time out within the group timeout
# ----------------------------------------------------------------------------------------------


def _stall_never_calls(h, w, t, shard):
    pass


def _stall_after_local_error(h, w, t, shard):
    linear_cross_entropy(h, w, t[:-1], shard=shard, impl="torch")  # wrong targets shape: raises here


def _stall_skipping_backward(h, w, t, shard):
    linear_cross_entropy(h, w, t, shard=shard, impl="torch", reduction="none")


# how -> (what the stalled rank 1 does before it stalls, whether the shard runs the handshake)
STALLS = {
    "never_calls": (_stall_never_calls, True),
    "local_error_without_handshake": (_stall_after_local_error, False),
    "skips_backward": (_stall_skipping_backward, True),
}


def _stall_body(rank, world, group, out_dir, how):
    stall, check = STALLS[how]
    H, W, b, t = _problem()
    start, stop = [(0, 6), (6, 13)][rank]
    h = H.clone().requires_grad_(True)
    w = W[start:stop].clone().requires_grad_(True)
    shard = VocabShard(group, start, stop, check=check)
    done = os.path.join(out_dir, "stall_done")
    t0 = time.time()
    if rank == 1:
        try:
            stall(h, w, t, shard)
            own = None
        except ValueError as e:
            own = str(e)
        # alive but absent (stuck in I/O, in an exception handler, ...) until the peer has given up
        while not os.path.exists(done) and time.time() - t0 < 150:
            time.sleep(0.2)
        return {"where": how, "stalled": True, "own_error": own}
    try:
        loss = linear_cross_entropy(h, w, t, shard=shard, impl="torch", reduction="none")
        t0 = time.time()  # from here on this rank waits for its peer only
        loss.sum().backward()
        err = None
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    waited = time.time() - t0
    open(done, "w").close()
    return {"where": how, "stalled": False, "error": err, "waited": waited}


@pytest.mark.parametrize("how", list(STALLS))
def test_rank_stalls_survivors_time_out(tmp_path, how):
    """Rank 1 stalls (``how``); its peer raises a timeout error within the group timeout, not before."""
    got = spawn_ranks(
        _stall_body,
        2,
        tmp_path,
        kw=dict(out_dir=str(tmp_path), how=how),
        hard_exit=True,
        timeout=240,
        pg_timeout=PG_TIMEOUT,
    )
    problems = []
    for r, (err, res) in sorted(got.items()):
        if err is not None:
            problems.append(f"rank {r}: the test body failed: {err}")
            continue
        if res["stalled"]:
            if res["where"] == "local_error_without_handshake" and not res["own_error"]:
                problems.append(f"rank {r}: the bad rank raised no local error")
            continue
        if res["error"] is None:
            problems.append(f"rank {r} ({res['where']}): returned although its peer never joined")
        elif not re.search(r"[Tt]imed? ?out|timeout", res["error"]):
            problems.append(f"rank {r} ({res['where']}): not a timeout error: {res['error'][:300]}")
        if res["waited"] > PG_TIMEOUT + SLACK:
            problems.append(f"rank {r} ({res['where']}): error only after {res['waited']:.1f}s")
        if res["waited"] < PG_TIMEOUT * 0.5:
            problems.append(f"rank {r} ({res['where']}): error after {res['waited']:.1f}s, before the timeout?")
    assert not problems, "\n".join(problems)
    assert sorted(got) == [0, 1]


# fault figures for docs/reliability.md
N_FAULTS = len(LOCAL_FAULTS) + len(DEATHS) + len(STALLS)
