"""Helpers shared by the test modules (import them from here, never from another test module).

- ``close_report(got, want, atol, rtol)``: None if two tensors match (non-finite entries exactly),
  else a message naming the worst element.
- ``Failures``: collects failing checks of a case (named) instead of raising, so that a rank keeps
  issuing its collectives in step with its peers; the parent asserts there are none.
- ``CountCollectives``: records every ``torch.distributed`` collective issued inside a block
  (name, shape, dtype, reduce op) and classifies them into the steps of the TP protocol.
- ``leaf(x)``: a detached copy of ``x`` that requires grad (None stays None), for the oracle's inputs.
- ``TRITON``: whether ``cce_dist.kernels`` can run here (a GPU, or Triton's CPU interpreter).

The reference program itself lives in tests/oracle.py; spawning ranks in tests/dist_utils.py.
"""

from __future__ import annotations

import torch

__all__ = ["TRITON", "leaf", "close_report", "Failures", "CountCollectives", "COLLECTIVES"]


def _triton_ok() -> bool:
    try:
        from cce_dist import kernels

        return kernels.available()
    except Exception:  # noqa: BLE001
        return False


TRITON = _triton_ok()


def leaf(x: torch.Tensor | None) -> torch.Tensor | None:
    """A fresh leaf: ``x`` detached, copied and requiring grad (None stays None)."""
    return None if x is None else x.detach().clone().requires_grad_(True)


def close_report(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str | None:
    """None if ``got`` matches ``want`` (non-finite entries must match exactly), else a message."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.detach().double(), want.detach().double()
    fin = torch.isfinite(w)
    if not torch.equal(torch.isnan(g), torch.isnan(w)):
        return (
            f"NaN pattern differs: got {torch.isnan(g).nonzero().flatten().tolist()[:8]}, want "
            f"{torch.isnan(w).nonzero().flatten().tolist()[:8]}"
        )
    inf_w = torch.isinf(w)
    if not torch.equal(g[inf_w], w[inf_w]) or bool(torch.isinf(g[~inf_w]).any()):
        return "Inf pattern differs"
    if fin.any():
        err = (g[fin] - w[fin]).abs()
        lim = atol + rtol * w[fin].abs()
        if bool((err > lim).any()):
            k = int(torch.argmax(err - lim))
            return (
                f"max err {float(err.max()):.3g} (at {k}: got {float(g[fin][k]):.6g}, want {float(w[fin][k]):.6g}, "
                f"atol {atol:.3g}, rtol {rtol:.3g})"
            )
    return None


class Failures:
    """The failing checks of one or more cases, each prefixed with its case name.

    Checks never raise: a rank that stopped at its first failure would leave its peers waiting in
    a collective. ``result()`` is what a rank returns to the parent.
    """

    def __init__(self, atol: float = 3e-5, rtol: float = 1e-4):
        self.items: list[str] = []
        self.cases = 0
        self.atol, self.rtol = atol, rtol

    def close(self, got, want, what, case, atol=None, rtol=None):
        """``got`` and ``want`` both None, or both tensors of one shape that ``torch.allclose`` in float64."""
        atol = self.atol if atol is None else atol
        rtol = self.rtol if rtol is None else rtol
        if got is None or want is None:
            if (got is None) != (want is None):
                self.items.append(
                    f"[{case}] {what}: got {'None' if got is None else 'a tensor'}, "
                    f"want {'None' if want is None else 'a tensor'}"
                )
            return
        got64 = got.detach().to(torch.float64)
        want64 = want.detach().to(torch.float64)
        if got64.shape != want64.shape:
            self.items.append(f"[{case}] {what}: shape {tuple(got64.shape)} != {tuple(want64.shape)}")
            return
        if not torch.allclose(got64, want64, atol=atol, rtol=rtol):
            err = (got64 - want64).abs().max().item()
            self.items.append(f"[{case}] {what}: max abs err {err:.3g} (atol {atol}, rtol {rtol})")

    def check(self, cond, msg, case):
        if not cond:
            self.items.append(f"[{case}] {msg}")

    def result(self) -> dict:
        return {"cases": self.cases, "failures": self.items}


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
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


class CountCollectives:
    """Record every torch.distributed collective issued inside the block: (name, shape, dtype, op).

    ``hidden_size`` (the D of the problem) lets ``classify`` tell the hidden-state collectives
    (token all-gather, dH reduction) from the statistics ones; pick a D that no statistics width
    equals (they are 4 or 5 wide).
    """

    def __init__(self, hidden_size: int | None = None):
        self.calls: list[tuple] = []
        self.hidden_size = hidden_size

    def __enter__(self):
        import torch.distributed as dist

        self.calls, self._orig = [], {}
        for name in COLLECTIVES:
            f = getattr(dist, name, None)
            if f is not None:
                self._orig[name] = f
                setattr(dist, name, self._wrap(name, f))
        return self

    def _wrap(self, name, f):
        def wrapped(*a, **k):
            t = a[0] if a else k.get("tensor")
            if name == "all_gather" and len(a) > 1:
                t = a[1]
            op = k.get("op", a[1] if name == "all_reduce" and len(a) > 1 else None)
            if isinstance(t, torch.Tensor):
                self.calls.append((name, tuple(t.shape), t.dtype, str(op)))
            else:
                self.calls.append((name, None, None, str(op)))
            return f(*a, **k)

        return wrapped

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, f in self._orig.items():
            setattr(dist, name, f)
        return False

    def classify(self) -> dict[str, list]:
        """Split the calls into handshake / layout / token gather / dH reduction / statistics / other."""
        d = self.hidden_size
        out: dict[str, list] = {k: [] for k in ("handshake", "layout", "gather_tokens", "dh", "stats", "other")}
        for c in self.calls:
            name, shape, dtype, _ = c
            if dtype == torch.int64 and name == "all_gather":
                out["handshake"].append(c)
            elif dtype == torch.int64 and name == "all_reduce":
                out["layout"].append(c)
            elif dtype is not None and dtype.is_floating_point and shape and d is not None and shape[-1] == d:
                out["gather_tokens" if name in ("all_gather", "all_gather_into_tensor") else "dh"].append(c)
            elif dtype is not None and dtype.is_floating_point and name in ("all_reduce", "all_gather"):
                out["stats"].append(c)
            else:
                out["other"].append(c)
        return out
