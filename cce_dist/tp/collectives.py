"""The handshake and the collectives of the tensor-parallel protocol, over a :class:`cce_dist.core.shard.VocabShard`.

Knows nothing of Triton or autograd: the autograd Functions call :class:`Comm` at fixed points.

Per call, on a group of ``P`` ranks:

1. handshake (``VocabShard.check=True``, the default): one all-gather of a few int64 per rank
   (its input verdict, token count, shard bounds, an option fingerprint, a target checksum).
   A rank whose inputs were rejected tells the others here, so every rank raises instead of
   waiting in a collective that one rank never joins; ranks that disagree on the layout, the
   options, N or the targets raise on every rank too.
2. statistics: ``"allreduce"`` = all-reduce MAX of the row max, then one all-reduce SUM of the
   rescaled statistics stacked in one buffer; or ``"allgather"`` = one all-gather of the raw
   statistics, combined locally. ``"auto"`` picks per call from rows x ranks
   (see ``AUTO_ALLGATHER_MAX_ROWS_X_RANKS``).
3. backward: dW and db stay local; the partial dH is all-reduced (reduce-scattered under sequence
   parallelism) exactly once, or left to the caller's layer (``reduce_hidden_grad=False``).

Under ``VocabShard.data_parallel`` (an FSDP2 mesh whose ranks hold vocab shards and their own tokens, any number per
rank) the handshake exchanges the token counts instead of comparing them (and skips the target checksum: targets
differ by rank), :meth:`Comm.gather_tokens` / :meth:`Comm.gather_rows` all-gather the ranks' rows padded to the
largest count (:func:`gather_rows`), :meth:`Comm.reduce_hidden_grad` reduce-scatters dH back to the owners
(:func:`reduce_scatter_rows`), and :meth:`Comm.param_grad` divides the weight and bias gradients by the shard's
divide factor (docs/fsdp.md).
"""

from __future__ import annotations

import sys
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import stats
from ..core.shard import VocabShard

#: ``stats_collective="auto"`` all-gathers the raw statistics (one round trip, P * 5 floats per row
#: received) while rows * P is at most this, and uses the two all-reduces (two round trips, 5
#: floats per row) above it: the all-gather wins while latency dominates, the all-reduces once
#: the P-fold bytes do. Measured on gloo/CPU at P = 2, 4, 8 in benchmarks/tp_collectives.py
#: (the all-gather was faster up to this N*P in every group size, slower beyond it at P >= 4; the
#: timings: benchmarks/results/tp_collectives.md). The decision depends only on N and P, so every
#: rank makes the same one.
AUTO_ALLGATHER_MAX_ROWS_X_RANKS = 32768


#: the longest :func:`released` waits for a backend's worker thread to let go of a finished collective's tensors
RELEASE_TIMEOUT_S = 10.0


def _owners(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Per tensor: its C++ owners (``_use_count``) and the references to its Python object (``sys.getrefcount``;
    while C++ owners besides the Python object exist, one of these is theirs)."""
    return [(t._use_count(), sys.getrefcount(t)) for t in tensors]  # type: ignore[attr-defined]  # not in the stubs


@contextmanager
def released(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Run the blocking collective on ``tensors`` in the ``with`` body; leave only once the backend holds none of them.

    Why (issue 28, item 6): gloo runs a collective on a worker thread of the process group. ``wait()`` wakes the
    caller as soon as the result is there, and the worker drops its reference to the operation (a ``Work`` holding
    the tensors) a moment later. If the caller has dropped its own by then (a blocking ``dist.all_reduce`` does, on
    return), the worker destroys the ``Work`` and with it the last C++ reference to a tensor that has a Python
    object, which takes the GIL (torch's PyObject preservation). When the collective was among a script's last, the
    interpreter may be finalizing by then (the worker thread was not scheduled in between, e.g. on a busy machine);
    CPython ends a thread that asks for the GIL then with ``pthread_exit``, whose unwinding through that ``noexcept``
    destructor calls ``std::terminate``: "terminate called without an active exception", SIGABRT at exit after a
    correct run (a core dump shows ``~AsyncAllreduceWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
    ``PyThread_exit_thread`` on a ``ProcessGroupGloo::runLoop`` thread while the main thread is in
    ``Py_FinalizeEx``). ``destroy_process_group`` does not help: the group's worker threads outlive it.

    So, after the body, wait (sleeping, which releases the GIL the worker may need) until every tensor has as many
    owners and Python references as before it: then the worker has destroyed the ``Work`` and, where that took the
    GIL, finished with it. Nearly always the first check passes (the worker was quicker than the caller); the wait is
    bounded by :data:`RELEASE_TIMEOUT_S` in case something else keeps the operation alive. Only CPU tensors are
    waited for: there the call returns after the collective ran. With CUDA tensors (NCCL) it returns once the
    collective is queued, and the tensors are released when the device is done: waiting would serialize the host
    with the device. A body that raises is not waited for."""
    tensors = list(tensors)
    if not all(t.device.type == "cpu" for t in tensors):
        yield
        return
    before = _owners(tensors)
    yield
    deadline = None
    delay = 0.0
    while any(now[0] > was[0] or now[1] > was[1] for now, was in zip(_owners(tensors), before)):
        if deadline is None:
            deadline = time.monotonic() + RELEASE_TIMEOUT_S
        elif time.monotonic() > deadline:
            return
        time.sleep(delay)  # releases the GIL
        delay = min(max(2 * delay, 1e-5), 1e-3)


class InputError(ValueError):
    """An input was rejected; under a tensor-parallel group every rank raises it together."""


@dataclass(frozen=True)
class Layout:
    """What every rank agreed on: the global vocab, the token count, the largest shard."""

    vocab_size: int
    n_tokens: int  # the rows every rank scores: under data_parallel, the sum of ``counts``
    max_local: int
    bounds: tuple[tuple[int, int], ...] | None = None  # every rank's [start, stop), if exchanged
    counts: tuple[int, ...] | None = None  # data_parallel: every rank's own token count, in rank order


def fingerprint(*values) -> int:
    """A process-independent 31-bit fingerprint (Python's hash() is salted per process)."""
    return zlib.crc32(repr(values).encode()) & 0x7FFFFFFF


#: modulus and the two independent (a, b, c, k) parameter sets of :func:`targets_checksum`
_CK_PRIME = 2**31 - 1
_CK_PARAMS = (
    (1_540_483_477, 597_399_067, 1_190_494_759, 1_911_520_717),
    (2_028_178_513, 1_103_515_245, 374_761_393, 668_265_263),
)


def targets_checksum(targets: torch.Tensor) -> tuple[int, int]:
    """Two independent mixing sums of the targets, identical on ranks that hold the same ids.

    Each (position i, id t) is mixed non-linearly, ``x = (a*t + b*i + c) mod p``, ``y = x*x mod p``,
    ``y = ((y ^ (y >> 16)) * k) mod p`` (``p = 2**31 - 1``), and the ``y`` are summed. A linear position-weighted sum
    lets edits cancel (+2 at position 0 and -1 at position 1); here two edits cancel only if two pseudo-random values
    collide, about 2**-31 per sum, 2**-62 for both. Every product stays below 2**62 and the sums below 2**63 for up
    to 2**32 tokens, so the int64 arithmetic never wraps and gives the same numbers on every device. Runs on the
    targets' device (no copy to the host).
    """
    if targets.numel() == 0:
        return 0, 0
    p = _CK_PRIME
    t = torch.remainder(targets.reshape(-1).to(torch.int64), p)
    i = torch.arange(t.numel(), device=t.device, dtype=torch.int64) % p
    sums = []
    for a, b, c, k in _CK_PARAMS:
        x = (t * a % p + i * b % p + c) % p
        y = x * x % p
        y = (y ^ (y >> 16)) * k % p
        sums.append(y.sum())
    first, second = (int(v) for v in torch.stack(sums).tolist())
    return first, second


def values_checksum(values: torch.Tensor) -> tuple[int, int]:
    """:func:`targets_checksum` of a floating tensor's float32 bit patterns, identical on ranks holding equal values.

    ``-0.0`` counts as ``0.0`` and every NaN as one NaN (they give the same losses); any other difference, a NaN on
    one rank only included, changes the checksum. Used for ``class_weight``, which every rank passes whole."""
    v = values.detach().reshape(-1).to(torch.float32) + 0.0  # -0.0 + 0.0 == +0.0
    v = torch.where(torch.isnan(v), torch.full_like(v, float("nan")), v)
    return targets_checksum(v.view(torch.int32))


# handshake vector fields: the layout, the target checksums, then one fingerprint per named option (OPTION_SLOTS)
_OK, _N, _START, _STOP, _FP, _CK, _CK2, _TMAX, _D, _NLOC = range(10)
#: named options fingerprinted one by one, so a disagreement names the option that differs; a call with more folds
#: the rest into the last slot (every entry point has fewer)
OPTION_SLOTS = 32
_OPT0 = 10
_FIELDS = _OPT0 + OPTION_SLOTS

NamedOptions = Sequence[tuple[str, object]]


def _option_slots(options: NamedOptions) -> list[tuple[str, object]]:
    """``options`` fitted into :data:`OPTION_SLOTS` (name, value) pairs, the overflow folded into the last."""
    items = [(str(k), v) for k, v in options]
    if len(items) > OPTION_SLOTS:
        rest = items[OPTION_SLOTS - 1 :]
        items = items[: OPTION_SLOTS - 1] + [(", ".join(k for k, _ in rest), tuple(v for _, v in rest))]
    return items


def handshake(
    shard: VocabShard,
    error: BaseException | None,
    *,
    n_tokens: int,
    n_local_tokens: int,
    hidden_dim: int,
    options: NamedOptions,
    targets: torch.Tensor | None,
    ignore_index: int,
    device: torch.device,
) -> Layout:
    """All-gather every rank's verdict and layout; raise the same error class on every rank.

    ``error`` is this rank's own input error (or None). It is re-raised here after the others
    were told, so no rank is left blocked in a collective.

    ``options``: ``(name, value)`` pairs of everything that must agree besides the layout and the targets (the
    loss's form first, then its options, named after the options dataclass's fields). Each is fingerprinted on its
    own, so a disagreement names the option that differs; several differences are reported together, the most
    basic first (the loss, the weight's vocab rows, the hidden size, the token count, the options, the targets),
    since a later one often follows from an earlier (a head sharded over the wrong group also sees other targets).
    """
    world = shard.world_size
    # the data-parallel fields are compared like options, so ranks that disagree on the mode raise together
    slots = _option_slots(
        tuple(options) + (("data_parallel", shard.data_parallel), ("grad_divide_factor", shard.grad_divide_factor))
    )
    info = torch.zeros(_FIELDS, dtype=torch.int64)
    info[_OK] = 0 if error is not None else 1
    if error is None:
        info[_N], info[_START], info[_STOP] = n_tokens, shard.start, shard.stop
        info[_FP], info[_D], info[_NLOC] = fingerprint(*slots), hidden_dim, n_local_tokens
        for i, (name, value) in enumerate(slots):
            info[_OPT0 + i] = fingerprint(name, value)
        info[_TMAX] = -1
        if targets is not None and targets.numel():
            info[_CK], info[_CK2] = targets_checksum(targets)
            valid = targets[targets != ignore_index]
            if valid.numel():
                info[_TMAX] = int(valid.max().item())
    if world == 1:
        rows = info.unsqueeze(0)
    else:
        buf = info.to(device)
        gathered = [torch.empty_like(buf) for _ in range(world)]
        with released([buf, *gathered]):
            dist.all_gather(gathered, buf, group=shard.group)
        rows = torch.stack(gathered).cpu()
    if error is not None:
        raise error
    bad = [r for r in range(world) if rows[r, _OK] == 0]
    if bad:
        raise InputError(
            f"cce_dist: rank(s) {bad} of the tensor-parallel group rejected their inputs (see the error "
            "raised on those ranks); no statistics collective was started"
        )
    problems = _disagreements(rows, slots, shard)
    bounds = tuple((int(a), int(b)) for a, b in rows[:, [_START, _STOP]].tolist())
    tiling = _tiling_problem(bounds)
    if tiling is not None:
        problems.insert(1 if problems and problems[0][0] == "the loss" else 0, ("the weight's vocab rows", tiling))
    if problems:
        first, detail = problems[0]
        text = f"cce_dist: {detail}"
        if len(problems) > 1:
            text += f"; also differing across ranks (possibly as a consequence of {first}): " + "; ".join(
                what for what, _ in problems[1:]
            )
        raise InputError(text)
    vocab_size = check_tiling(bounds)
    tmax = int(rows[:, _TMAX].max())
    if tmax >= vocab_size:
        raise InputError(f"targets contain id {tmax}, outside the vocabulary [0, {vocab_size}) of the group")
    max_local = max(b - a for a, b in bounds)
    if shard.data_parallel:
        counts = tuple(int(n) for n in rows[:, _N].tolist())
        return Layout(vocab_size=vocab_size, n_tokens=sum(counts), max_local=max_local, bounds=bounds, counts=counts)
    return Layout(vocab_size=vocab_size, n_tokens=int(rows[0, _N]), max_local=max_local, bounds=bounds)


def data_parallel_layout(shard: VocabShard, n_tokens: int, device: torch.device) -> Layout:
    """``check=False`` under ``data_parallel``: the ranks' token counts (they decide the gather sizes), the global
    vocab and the largest shard, from one all-gather of three int64 per rank (no checks)."""
    buf = torch.tensor([shard.stop, shard.local_size, n_tokens], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(buf) for _ in range(shard.world_size)]
    with released([buf, *gathered]):
        dist.all_gather(gathered, buf, group=shard.group)
    rows = torch.stack(gathered).cpu().tolist()
    counts = tuple(int(r[2]) for r in rows)
    return Layout(
        vocab_size=max(r[0] for r in rows), n_tokens=sum(counts), max_local=max(r[1] for r in rows), counts=counts
    )


def gather_rows(local: torch.Tensor, counts: Sequence[int], group) -> torch.Tensor:
    """Every rank's ``[counts[r], ...]`` rows, in rank order: ``[sum(counts), ...]``.

    One all-gather of ``[max(counts), ...]`` per rank (gloo's all-gather takes equal sizes only): this rank's rows,
    zero-padded. ``counts`` must be the same on every rank (the handshake's); none is issued when all are 0."""
    world, m = len(counts), max(counts)
    rest = tuple(local.shape[1:])
    if m == 0:
        return local.new_empty((0,) + rest)
    if local.shape[0] == m:
        src = local.contiguous()
    else:
        src = local.new_zeros((m,) + rest)
        src[: local.shape[0]] = local
    out = local.new_empty((world, m) + rest)
    parts = list(out.unbind(0))
    with released([src, *parts]):
        dist.all_gather(parts, src, group=group)
    if all(n == m for n in counts):
        return out.reshape((world * m,) + rest)
    return torch.cat([out[r, :n] for r, n in enumerate(counts)])


def reduce_scatter_rows(full: torch.Tensor, counts: Sequence[int], rank: int, group) -> torch.Tensor:
    """The inverse of :func:`gather_rows` for gradients: ``full [sum(counts), ...]`` summed over the ranks, and this
    rank's ``[counts[rank], ...]`` rows of the sum. gloo (no reduce-scatter): one all-reduce of ``full``, then the
    slice; other backends: one reduce-scatter of the rows padded to ``[P, max(counts), ...]``. ``full`` may be
    overwritten."""
    world, m = len(counts), max(counts)
    rest = tuple(full.shape[1:])
    start = sum(counts[:rank])
    if m == 0:
        return full.new_empty((0,) + rest)
    if dist.get_backend(group) == "gloo":
        with released([full]):
            dist.all_reduce(full, group=group)
        return full[start : start + counts[rank]].clone()
    if all(n == m for n in counts):
        padded = full.contiguous()
    else:
        padded = full.new_zeros((world * m,) + rest)
        for r, n in enumerate(counts):
            a = sum(counts[:r])
            padded[r * m : r * m + n] = full[a : a + n]
    out = full.new_empty((m,) + rest)
    with released([out, padded]):
        dist.reduce_scatter_tensor(out, padded, group=group)
    return out[: counts[rank]]


def _by_value(vals: list) -> str:
    """``[0, 2] | [1]``: the ranks grouped by equal value."""
    groups: dict = {}
    for r, v in enumerate(vals):
        groups.setdefault(v, []).append(r)
    return " | ".join(str(g) for g in groups.values())


def _disagreements(rows: torch.Tensor, slots: list[tuple[str, object]], shard: VocabShard) -> list[tuple[str, str]]:
    """``(what, message)`` for every component the ranks disagree on, the most basic first."""
    out: list[tuple[str, str]] = []
    me = shard.rank
    prefix = "ranks of the tensor-parallel group disagree on"

    def plain(field: int, what: str) -> None:
        vals = rows[:, field].tolist()
        if len(set(vals)) > 1:
            out.append((what.split(" (")[0], f"{prefix} {what}: {vals} (by rank)"))

    def option(i: int) -> None:
        vals = rows[:, _OPT0 + i].tolist()
        if len(set(vals)) > 1:
            name, value = slots[i]
            out.append(
                (
                    name,
                    f"{prefix} the loss options: {name} (rank {me} has {value!r}; ranks with equal values: "
                    f"{_by_value(vals)})",
                )
            )

    if slots and slots[0][0] == "the loss":  # a different entry point on some rank: the rest does not line up
        option(0)
        if out:
            return out
    plain(_D, "the hidden size (hidden.shape[-1] = weight.shape[1], the weight's shape per rank)")
    if not shard.data_parallel:  # data-parallel ranks hold their own tokens: the counts may differ
        plain(_N, "the number of tokens (hidden/targets)")
    if shard.sequence_parallel:
        plain(_NLOC, "the number of local tokens under sequence parallelism")
    for i in range(len(slots)):
        if slots[i][0] != "the loss":
            option(i)
    if len(set(rows[:, _FP].tolist())) > 1 and not any(
        len(set(rows[:, _OPT0 + i].tolist())) > 1 for i in range(len(slots))
    ):  # ranks that name different options (cannot happen within one entry point): the combined fingerprint
        out.append(("the loss options", f"{prefix} the loss options: {_by_value(rows[:, _FP].tolist())}"))
    if shard.data_parallel:  # their own targets too (each rank's ids were range-checked: _TMAX)
        return out
    if len(set(rows[:, _CK].tolist())) > 1 or len(set(rows[:, _CK2].tolist())) > 1:
        out.append(
            (
                "the target ids",
                f"{prefix} the target ids (targets must be identical global ids on every rank; ranks with equal "
                f"targets: {_by_value(list(zip(rows[:, _CK].tolist(), rows[:, _CK2].tolist())))})",
            )
        )
    return out


def _tiling_problem(bounds: Sequence[tuple[int, int]]) -> str | None:
    """Why the ranks' vocab rows (each rank's weight.shape[0] = stop - start rows) do not tile ``[0, V)``, or None."""
    try:
        check_tiling(bounds)
    except InputError as e:
        sizes = [b - a for a, b in bounds]
        return (
            f"the vocab rows the ranks' weights hold (weight.shape[0] by rank: {sizes}) do not fit the shard layout: "
            f"{str(e).removeprefix('cce_dist: ')}. Each rank's weight must be its VocabShard's [start, stop) rows of "
            "the head (a weight sharded by another group, e.g. FSDP's, must be gathered first)"
        )
    return None


def check_tiling(bounds: Sequence[tuple[int, int]]) -> int:
    """The global vocab size if the shards tile ``[0, V)`` exactly; else an InputError."""
    pos = 0
    for a, b in sorted(bounds):
        if a != pos:
            raise InputError(
                f"cce_dist: vocab shards {list(bounds)} (by rank) do not tile [0, V): "
                f"{'gap' if a > pos else 'overlap'} at {min(a, pos)}"
            )
        pos = b
    if pos == 0:
        raise InputError("cce_dist: the vocab shards are all empty")
    return pos


_LOW = 0x7FFFFFFF  # the low 31 bits of a max-id key: 2**31 - 1 - id (a lower id gives a larger key)
_NAN_BITS = 0x7FC00000  # the positive quiet NaN: as a signed int32 above +inf's 0x7F800000


def max_id_key(m: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``int64 [n]`` keys whose maximum over ranks is the larger max and, on a tie, the lower id: the float32 max's
    bits, made monotone as a signed int32, in the high 32 bits; ``2**31 - 1 - id`` in the low ones (an id of +inf,
    an empty slice's, gives 0: it never wins a tie). Exact (:func:`from_max_id_key` recovers both). A NaN max (a
    slice holding a NaN logit, :func:`cce_dist.core.stats.holds_max`) is one positive NaN, above +inf, whatever its sign
    and payload: the NaN slices win, the lowest NaN id among them (``torch.argmax``'s rule)."""
    m = m.float() + 0.0  # + 0.0: -0.0 becomes +0.0, which it equals
    bits = torch.where(torch.isnan(m), _NAN_BITS, m.contiguous().view(torch.int32))
    ordered = torch.where(bits < 0, bits ^ _LOW, bits).to(torch.int64)
    finite = torch.isfinite(ids)
    low = torch.where(finite, _LOW - torch.where(finite, ids, 0.0).to(torch.int64), 0)
    return (ordered << 32) | low


def from_max_id_key(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max float32 [n], id float32 [n])`` of :func:`max_id_key`'s keys (id +inf where no slice had one)."""
    ordered = (key >> 32).to(torch.int32)
    m = torch.where(ordered < 0, ordered ^ _LOW, ordered).view(torch.float32)
    ids = (_LOW - (key & _LOW)).to(torch.float32)
    return m, torch.where(ids >= _LOW, float("inf"), ids)


class Comm:
    """The collectives of one call; a no-op object for a single device."""

    def __init__(self, shard: VocabShard | None, layout: Layout | None):
        self.shard = shard
        self.world = 1 if shard is None else shard.world_size
        self.active = self.world > 1
        self.method = "allreduce" if shard is None else shard.stats_collective
        self.layout = layout
        #: data_parallel: every rank's own token count (the layout's), when the group has more than one rank
        self.counts = layout.counts if (self.active and layout is not None and shard is not None) else None
        if self.active and shard is not None and shard.data_parallel and self.counts is None:
            raise ValueError("cce_dist: a data_parallel shard needs the ranks' token counts (the handshake's layout)")

    @property
    def group(self):
        return self.shard.group if self.shard is not None else None

    def reduce_stats(self, local: torch.Tensor, *, extras: bool = False) -> torch.Tensor:
        """Combine this rank's ``[n, NUM_STATS]`` statistics with the group's.

        ``extras``: the ARGMAX and SUMSQ columns too (the row outputs). With the all-gather every column comes
        along; with the all-reduces the max travels with its id in one int64 MAX all-reduce (:func:`max_id_key`:
        the larger max, on a tie the lower id) instead of the float32 one, and SUMSQ joins the SUM all-reduce: no
        collective more, and without ``extras`` the same bytes as before."""
        if not self.active:
            return local
        method = self.method
        if method == "auto":
            method = "allgather" if local.shape[0] * self.world <= AUTO_ALLGATHER_MAX_ROWS_X_RANKS else "allreduce"
        if method == "allgather":
            out = torch.empty((self.world,) + tuple(local.shape), dtype=local.dtype, device=local.device)
            parts, src = list(out.unbind(0)), local.contiguous()
            with released([src, *parts]):
                dist.all_gather(parts, src, group=self.group)
            return stats.combine_stack(out)
        if extras:
            key = max_id_key(local[:, stats.MAX], local[:, stats.ARGMAX])
            with released([key]):
                dist.all_reduce(key, op=dist.ReduceOp.MAX, group=self.group)
            m, ids = from_max_id_key(key)
        else:
            m = local[:, stats.MAX].clone()  # not contiguous(): for one row that is a view, and the reduce is in place
            with released([m]):
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
            ids = local[:, stats.ARGMAX]
        r = stats.rescale(local, m)
        cols = list(stats.ADDITIVE if extras else (stats.SUMEXP, stats.TARGET, stats.SUM, stats.ENTROPY))
        rest = r[:, cols].contiguous()
        with released([rest]):
            dist.all_reduce(rest, op=dist.ReduceOp.SUM, group=self.group)
        out = r
        out[:, cols] = rest
        out[:, stats.MAX] = m
        out[:, stats.ARGMAX] = ids
        return out

    def _group_shard(self) -> VocabShard | None:
        """The shard when this call's collectives run (a group of more than one rank), else None."""
        return self.shard if self.active else None

    def reduce_sum(self, local: torch.Tensor) -> torch.Tensor:
        """All-reduce SUM of this rank's plain per-row partial sums (e.g. a divergence's sum over its
        vocab rows once the global lse is known); the input itself on a single device."""
        if not self.active:
            return local
        out = local.contiguous().clone()
        with released([out]):
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def gather_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """data_parallel: every rank's own rows ``[n_r, ...]`` in rank order, ``[N, ...]`` (:func:`gather_rows`);
        otherwise (and on one rank) ``rows`` itself. Used for hidden states, target ids and upstream gradients."""
        if self.counts is None:
            return rows
        return gather_rows(rows, self.counts, self.group)

    def own_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """data_parallel: this rank's own rows of a per-row tensor over the gathered tokens (a view); else all."""
        if self.counts is None or self.shard is None:
            return rows
        start = sum(self.counts[: self.shard.rank])
        return rows[start : start + self.counts[self.shard.rank]]

    def param_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """A weight / bias gradient of this shard, divided by the shard's ``divide_factor`` under data_parallel
        (FSDP2's mean over the ranks by default), in its accumulator dtype, before it is rounded to the tensor's."""
        if grad is None or self.shard is None or not self.shard.data_parallel:
            return grad
        factor = self.shard.divide_factor
        return grad if factor == 1.0 else grad / factor

    def gather_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Sequence parallelism: all-gather ``[n/P, ...]`` along dim 0 into ``[n, ...]``; data parallelism: every
        rank's own ``[n_r, ...]`` into ``[sum n_r, ...]`` (:meth:`gather_rows`)."""
        if self.counts is not None:
            return self.gather_rows(hidden)
        shard = self._group_shard()
        if shard is None or not shard.sequence_parallel:
            return hidden
        return gather_rows(hidden, (hidden.shape[0],) * self.world, self.group)  # equal slices

    def local_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The part of a per-row tensor over all (gathered) tokens that matches the rows of
        :meth:`reduce_hidden_grad`'s result: this rank's slice under sequence (or data) parallelism, else all."""
        if self.counts is not None:
            return self.own_rows(rows)
        shard = self._group_shard()
        if shard is None or not shard.sequence_parallel:
            return rows
        return rows.chunk(self.world, 0)[shard.rank]

    def reduce_hidden_grad(self, dh: torch.Tensor) -> torch.Tensor:
        """Reduce the partial dH once: all-reduce, reduce-scatter (sequence parallel; data parallel: uneven, back to
        each token's owner, :func:`reduce_scatter_rows`) or none."""
        shard = self._group_shard()
        if shard is None or not shard.reduce_hidden_grad:
            return dh
        if self.counts is not None:
            return reduce_scatter_rows(dh, self.counts, shard.rank, self.group)
        if shard.sequence_parallel:  # equal slices
            return reduce_scatter_rows(dh, (dh.shape[0] // self.world,) * self.world, shard.rank, self.group)
        with released([dh]):
            dist.all_reduce(dh, group=self.group)
        return dh
