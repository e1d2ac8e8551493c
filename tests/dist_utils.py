"""Run test bodies on P gloo ranks spawned from pytest, with a deadline so a hang fails fast.

Two ways, one implementation of a rank (``_init_group`` + ``_report``):

``RankPool`` (and the ``rank_pool`` fixture in conftest.py): persistent ranks that stay joined
in one group and run one case after another, so every case is its own pytest item::

    def body(rank, world, group, **kw):   # module-level (it is pickled into the ranks)
        ...return something picklable...

    def test_x(rank_pool, case):
        results = rank_pool(3).run(body, case=case)   # {rank: result}

A case that raises on any rank, or does not finish within its timeout (a hang), fails the test
and the pool is torn down (a fresh one is spawned for the next case), so a broken group never
leaks into the next case. Bodies should therefore collect their failing checks and return them
rather than raise between collectives (see helpers.Failures).

``run_ranks`` / ``spawn_ranks``: a fresh group for one body, for tests whose ranks die
(``os._exit``), stall or create subgroups they cannot clean up::

    run_ranks(body, world=3, tmp_path=tmp_path, kw=dict(...))

Each rank joins a file:// rendezvous (no ports), runs with torch's threads set to 1, and reports
its exception (with traceback) to the parent. Both fork their ranks from a forkserver that has
imported torch and cce_dist once (a 2-3 rank spawn costs well under a second instead of each rank
importing torch anew on a loaded 2-core machine: 79 s -> 26 s for test_class_weight's group tests);
ranks then see the environment of when that server started, so a body that needs the caller's
current environment passes ``start_method="spawn"``.
"""

from __future__ import annotations

import datetime
import itertools
import multiprocessing as mp
import os
import queue as _queue
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["run_ranks", "spawn_ranks", "RankPool", "RankPools"]


PRELOAD = ["torch", "torch.distributed", "cce_dist"]


def _context(start_method: str):
    """A multiprocessing context. ``"forkserver"`` forks each rank from a server that has imported
    PRELOAD once (a rank then starts in well under a second instead of importing torch anew), but
    the ranks see the environment of when that server started, not of the call; ``"spawn"``
    starts every rank from scratch with the current environment."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _init_group(rank, world, init_file, pg_timeout):
    import torch
    import torch.distributed as dist
    from interpreter_patch_memo import install

    install()  # as conftest does in the pytest process (a no-op unless TRITON_INTERPRET=1)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    return dist.group.WORLD


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


# ----------------------------------------------------------------------------------------------
# one spawn per body
# ----------------------------------------------------------------------------------------------


def _child(fn, rank, world, init_file, kw, queue, pg_timeout, hard_exit):
    try:
        group = _init_group(rank, world, init_file, pg_timeout)
        import torch.distributed as dist

        try:
            result = fn(rank, world, group, **kw)
        finally:
            if not hard_exit:
                dist.destroy_process_group()
        queue.put((rank, None, result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, _error_text(e), None))
    if hard_exit:
        queue.close()
        queue.join_thread()
        os._exit(0)  # no destroy_process_group: it blocks when a peer has died


def spawn_ranks(
    fn: Callable[..., Any],
    world: int,
    tmp_path,
    kw: dict | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    may_die: Iterable[int] = (),
    hard_exit: bool = False,
    start_method: str = "forkserver",
) -> dict[int, tuple[str | None, Any]]:
    """Spawn ``world`` ranks running ``fn(rank, world, group, **kw)``; ``{rank: (error text or None, result)}``.

    Ranks in ``may_die`` may exit without reporting (they are then absent from the result).
    ``hard_exit=True``: a rank leaves with ``os._exit`` right after reporting instead of calling
    ``destroy_process_group`` (which blocks once a peer has died). ``start_method``: see
    ``_context`` (the module docstring says why forkserver). Raises TimeoutError when a
    rank outside ``may_die`` has not reported within ``timeout`` seconds (a hang), RuntimeError
    when such a rank died without reporting.
    """
    ctx = _context(start_method)
    queue = ctx.Queue()
    init_file = os.path.join(str(tmp_path), f"rdzv_{os.getpid()}_{time.monotonic_ns()}")
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, init_file, kw or {}, queue, pg_timeout, hard_exit))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    need = set(range(world)) - set(may_die)
    got: dict[int, tuple[str | None, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while not need <= set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(need - set(got))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout:.0f}s (hang?); "
                    f"reported so far: { {r: e for r, (e, _) in got.items()} }"
                )
            try:
                rank, err, res = queue.get(timeout=min(left, 1.0))
                got[rank] = (err, res)
            except _queue.Empty:
                dead = [r for r in sorted(need - set(got)) if not procs[r].is_alive()]
                if dead and queue.empty():
                    time.sleep(1.0)  # a report may still be in the pipe
                    if queue.empty():
                        raise RuntimeError(
                            f"ranks {dead} died without reporting (exit codes {[procs[r].exitcode for r in dead]})"
                        ) from None
    finally:
        for p in procs:
            p.join(timeout=pg_timeout + 15 if hard_exit else 5)
            if p.is_alive():
                p.kill()
                p.join()
    return got


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    tmp_path,
    kw: dict | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    expect_errors: bool = False,
) -> dict[int, Any]:
    """Spawn ``world`` ranks running ``fn(rank, world, group, **kw)``.

    Returns ``{rank: result}``; with ``expect_errors=True`` returns ``{rank: error text or None}``
    instead of raising, so fault-injection tests can assert what each rank reported.
    """
    got = spawn_ranks(fn, world, tmp_path, kw=kw, timeout=timeout, pg_timeout=pg_timeout)
    if expect_errors:
        return {r: err for r, (err, _) in got.items()}
    failed = {r: err for r, (err, _) in got.items() if err}
    if failed:
        r = min(failed)
        raise AssertionError(f"rank {r} failed:\n{failed[r]}")
    return {r: res for r, (_, res) in got.items()}


# ----------------------------------------------------------------------------------------------
# persistent ranks
# ----------------------------------------------------------------------------------------------


def _pool_worker(rank, world, init_file, pg_timeout, inbox, outbox):
    try:
        group = _init_group(rank, world, init_file, pg_timeout)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        outbox.put((None, rank, _error_text(e), None))
        return
    outbox.put((None, rank, None, "ready"))
    while True:
        msg = inbox.get()
        if msg is None:
            break
        seq, fn, kw = msg
        try:
            outbox.put((seq, rank, None, fn(rank, world, group, **kw)))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            outbox.put((seq, rank, _error_text(e), None))
    import torch.distributed as dist

    dist.destroy_process_group()


class RankPool:
    """``world`` gloo ranks spawned once, each running the cases it is sent in one process group."""

    def __init__(
        self,
        world: int,
        tmp_dir,
        pg_timeout: float = 60.0,
        start_timeout: float = 180.0,
        start_method: str = "forkserver",
    ):
        ctx = _context(start_method)
        self.world = world
        self._seq = itertools.count()
        self._out = ctx.Queue()
        self._in = [ctx.Queue() for _ in range(world)]
        init_file = os.path.join(str(tmp_dir), f"rdzv_pool{world}_{os.getpid()}_{time.monotonic_ns()}")
        self._procs = [
            ctx.Process(target=_pool_worker, args=(r, world, init_file, pg_timeout, self._in[r], self._out))
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        try:
            self._collect(None, start_timeout, "starting the pool")
        except BaseException:
            self.close(force=True)
            raise

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _collect(self, seq, timeout, what) -> dict[int, tuple[str | None, Any]]:
        got: dict[int, tuple[str | None, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.world)) - set(got))
                raise TimeoutError(
                    f"{what}: ranks {missing} did not finish within {timeout:.0f}s (hang?); "
                    f"reported so far: { {r: e for r, (e, _) in got.items()} }"
                )
            try:
                s, rank, err, res = self._out.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                if dead and self._out.empty():
                    raise RuntimeError(
                        f"{what}: ranks {dead} died (exit codes {[self._procs[r].exitcode for r in dead]})"
                    ) from None
                continue
            if s == seq:  # anything else is a late answer to a case that already failed
                got[rank] = (err, res)
        return got

    def run(self, fn: Callable[..., Any], timeout: float = 120.0, expect_errors: bool = False, **kw) -> dict:
        """Run ``fn(rank, world, group, **kw)`` on every rank; ``{rank: result}``.

        Raises AssertionError with the first failing rank's traceback if any rank raised (with
        ``expect_errors=True`` returns ``{rank: (error text or None, result)}`` instead), and
        TimeoutError / RuntimeError on a hang or a dead rank. After anything but a clean run the
        pool is closed: its group may be out of step.
        """
        seq = next(self._seq)
        try:
            for q in self._in:
                q.put((seq, fn, kw))
            got = self._collect(seq, timeout, getattr(fn, "__name__", str(fn)))
        except BaseException:
            self.close(force=True)
            raise
        failed = {r: err for r, (err, _) in got.items() if err}
        if failed:
            self.close(force=True)
            if not expect_errors:
                r = min(failed)
                raise AssertionError(f"rank {r} failed:\n{failed[r]}")
        if expect_errors:
            return got
        return {r: res for r, (_, res) in got.items()}

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._in:
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001 - already closed
                    pass
        for p in self._procs:
            if not force:
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
            p.join()
        self._procs = [p for p in self._procs if p.is_alive()]


class RankPools:
    """At most one live ``RankPool`` at a time (ranks are processes; memory and cores are few):
    ``pools(world)`` returns the pool of that size, replacing a pool of another size or a closed one."""

    def __init__(self, tmp_dir, pg_timeout: float = 60.0):
        self.tmp_dir, self.pg_timeout = tmp_dir, pg_timeout
        self.pool: RankPool | None = None

    def __call__(self, world: int) -> RankPool:
        p = self.pool
        if p is not None and (p.world != world or not p._procs or not p.alive):
            p.close(force=not p.alive)
            self.pool = p = None
        if p is None:
            self.pool = p = RankPool(world, self.tmp_dir, pg_timeout=self.pg_timeout)
        return p

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
