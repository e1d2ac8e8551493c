"""Checking an integration: which ``torch.distributed`` collectives a block of code issues.

:class:`CollectiveLog` wraps the collectives of ``torch.distributed`` (and of any module that
imported them by name, e.g. Megatron's ``mappings``) and records every call made while it is
counting: its name, the shape and dtype of the tensor it carries, the reduce op and the bytes this
rank sends and receives. The test suite checks the tensor-parallel protocol with it (one MAX + one
SUM of row statistics per chunk, one dH reduction, ...), the benchmarks count bytes per step with
it, and a user can check their own integration the same way::

    from cce_dist.testing import CollectiveLog

    with CollectiveLog(hidden_size=hidden.shape[-1]) as log:
        loss = linear_cross_entropy(hidden, weight, targets, shard=shard)
        loss.backward()
    print(log.summary()["count"], log.classify()["stats"])

Not thread-safe (it patches module attributes); nothing here runs on import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["COLLECTIVES", "Collective", "CollectiveLog"]

#: The ``torch.distributed`` functions a :class:`CollectiveLog` wraps (those that exist in the installed torch).
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
)

# (output, input) positional slots and keyword names of the collectives that take both
_OUT_IN = {
    "all_gather": (("tensor_list",), ("tensor",)),
    "all_gather_into_tensor": (("output_tensor",), ("input_tensor",)),
    "all_gather_single": (("output_tensor",), ("input_tensor",)),  # torch >= 2.13 (FSDP2's all-gather)
    "_all_gather_base": (("output_tensor",), ("input_tensor",)),
    "reduce_scatter": (("output",), ("input_list",)),
    "reduce_scatter_tensor": (("output",), ("input",)),
    "reduce_scatter_single": (("output",), ("input",)),  # torch >= 2.13 (FSDP2's reduce-scatter)
    "_reduce_scatter_base": (("output",), ("input",)),
    "all_to_all_single": (("output",), ("input",)),
    "all_to_all": (("output_tensor_list",), ("input_tensor_list",)),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


@dataclass(frozen=True)
class Collective:
    """One recorded call. ``shape`` / ``dtype``: of the tensor this rank contributes (None if it sends none);
    ``op``: the reduce op's name (all_reduce / reduce / reduce_scatter), else None; bytes this rank sends / receives."""

    name: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    op: str | None
    in_bytes: int
    out_bytes: int


def _record(name: str, args: tuple, kwargs: dict) -> Collective:
    def arg(i: int, keys: tuple[str, ...]) -> Any:
        if len(args) > i:
            return args[i]
        return next((kwargs[k] for k in keys if k in kwargs), None)

    if name in _OUT_IN:
        out_keys, in_keys = _OUT_IN[name]
        out, inp = arg(0, out_keys), arg(1, in_keys)
    else:  # one tensor, in and out
        out = inp = arg(0, ("tensor",))
    op = kwargs.get("op", args[1] if name == "all_reduce" and len(args) > 1 else None)
    if op is None and name == "reduce_scatter_single" and len(args) > 2:
        op = args[2]
    if op is None and name in (
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_reduce",
    ):
        op = "SUM"  # the default of every reducing collective
    t = _first_tensor(inp)
    return Collective(
        name=name,
        shape=None if t is None else tuple(t.shape),
        dtype=None if t is None else t.dtype,
        op=None if op is None else str(op).rsplit(".", 1)[-1].upper(),
        in_bytes=_nbytes(inp),
        out_bytes=_nbytes(out),
    )


class CollectiveLog:
    """Records the ``torch.distributed`` collectives issued while counting.

    ``with CollectiveLog() as log:`` installs the wrappers, counts, and removes them. For many steps, install once and
    count per step: ``log = CollectiveLog().install()``, ``with log.counting(): ...``, ``log.uninstall()``.

    Args:
        hidden_size: the ``D`` of the problem, which lets :meth:`classify` tell the hidden-state collectives (token
            all-gather, dH reduction) from the statistics ones; pick a ``D`` no statistics width equals (4 or 5).
        extra_modules: modules that imported collectives by name (``from torch.distributed import all_reduce``); their
            attributes are wrapped too.
    """

    def __init__(self, hidden_size: int | None = None, extra_modules: Iterable[Any] = ()):
        import torch.distributed as dist

        self.hidden_size = hidden_size
        self.calls: list[Collective] = []
        self._modules = [dist, *extra_modules]
        self._dist = dist
        self._enabled = False
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._enabled:
                self.calls.append(_record(name, args, kwargs))
            return fn(*args, **kwargs)

        wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    def install(self) -> CollectiveLog:
        """Wrap the collectives (recording only while :meth:`counting`)."""
        originals = {n: getattr(self._dist, n) for n in COLLECTIVES if hasattr(self._dist, n)}
        for n, f in originals.items():
            w = self._wrap(n, f)
            for mod in self._modules:
                if mod is self._dist or getattr(mod, n, None) is f:
                    self._saved.append((mod, n, f))
                    setattr(mod, n, w)
        return self

    def uninstall(self) -> None:
        """Put the original functions back."""
        for mod, n, f in reversed(self._saved):
            setattr(mod, n, f)
        self._saved.clear()

    @contextlib.contextmanager
    def counting(self) -> Iterator[CollectiveLog]:
        """Record the calls of the block (forgetting earlier ones)."""
        self.calls, self._enabled = [], True
        try:
            yield self
        finally:
            self._enabled = False

    def __enter__(self) -> CollectiveLog:
        self.install()
        self.calls, self._enabled = [], True
        return self

    def __exit__(self, *exc: object) -> None:
        self._enabled = False
        self.uninstall()

    def summary(self) -> dict:
        """Counts and bytes in total and per collective, and every call (JSON-ready)."""
        by_name: dict[str, dict[str, int]] = {}
        for c in self.calls:
            d = by_name.setdefault(c.name, {"count": 0, "in_bytes": 0, "out_bytes": 0})
            d["count"] += 1
            d["in_bytes"] += c.in_bytes
            d["out_bytes"] += c.out_bytes
        return {
            "count": len(self.calls),
            "in_bytes": sum(c.in_bytes for c in self.calls),
            "out_bytes": sum(c.out_bytes for c in self.calls),
            "by_op": by_name,
            "calls": [{**asdict(c), "dtype": str(c.dtype)} for c in self.calls],
        }

    def classify(self) -> dict[str, list[Collective]]:
        """The calls by role in cce_dist's protocol: handshake (int64 all-gather), layout (int64 all-reduce),
        gather_tokens / dh (floating, last dim ``hidden_size``), stats (other floating all-reduce / all-gather),
        other."""
        d = self.hidden_size
        out: dict[str, list[Collective]] = {
            k: [] for k in ("handshake", "layout", "gather_tokens", "dh", "stats", "other")
        }
        for c in self.calls:
            floating = c.dtype is not None and c.dtype.is_floating_point
            if c.dtype == torch.int64 and c.name == "all_gather":
                out["handshake"].append(c)
            elif c.dtype == torch.int64 and c.name == "all_reduce":
                out["layout"].append(c)
            elif floating and c.shape and d is not None and c.shape[-1] == d:
                out["gather_tokens" if c.name in ("all_gather", "all_gather_into_tensor") else "dh"].append(c)
            elif floating and c.name in ("all_reduce", "all_gather"):
                out["stats"].append(c)
            else:
                out["other"].append(c)
        return out
