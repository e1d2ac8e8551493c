"""Run a test body on P gloo ranks spawned from pytest, with a deadline so a hang fails fast.

Usage::

    def body(rank, world, group, **kw):   # module-level (it is pickled into the child processes)
        ...assert...

    def test_x(tmp_path):
        run_ranks(body, world=3, tmp_path=tmp_path, kw=dict(...))

Each rank joins a file:// rendezvous in ``tmp_path`` (no ports), runs ``body`` with torch's
threads set to 1, and reports its exception (with traceback) to the parent, which re-raises the
first one. A rank that has not finished within ``timeout`` seconds fails the test.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import traceback
from typing import Any, Callable, Optional


def _child(fn, rank, world, init_file, kw, queue, pg_timeout):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            result = fn(rank, world, dist.group.WORLD, **kw)
        finally:
            dist.destroy_process_group()
        queue.put((rank, None, result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None))


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    tmp_path,
    kw: Optional[dict] = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    expect_errors: bool = False,
) -> dict[int, Any]:
    """Spawn ``world`` ranks running ``fn(rank, world, group, **kw)``.

    Returns ``{rank: result}``; with ``expect_errors=True`` returns ``{rank: error text or None}``
    instead of raising, so fault-injection tests can assert what each rank reported.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_file = os.path.join(str(tmp_path), f"rdzv_{os.getpid()}_{id(fn)}")
    procs = [ctx.Process(target=_child, args=(fn, r, world, init_file, kw or {}, queue, pg_timeout))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, Optional[str]] = {}
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world)) - set(errors))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s (hang?); "
                                   f"reported so far: {errors}")
            try:
                rank, err, res = queue.get(timeout=min(left, 1.0))
            except _q.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    missing = sorted(set(range(world)) - set(errors))
                    if missing:
                        raise RuntimeError(f"ranks {missing} died without reporting (exit codes "
                                           f"{[p.exitcode for p in procs]})")
                continue
            errors[rank] = err
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if expect_errors:
        return errors
    failed = {r: e for r, e in errors.items() if e}
    if failed:
        r = min(failed)
        raise AssertionError(f"rank {r} failed:\n{failed[r]}")
    return results
