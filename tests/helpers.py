"""Helpers shared by the test modules (import them from here, never from another test module).

- ``close_report(got, want, atol, rtol)``: None if two tensors match (non-finite entries exactly),
  else a message naming the worst element.
- ``Failures``: collects failing checks of a case (named) instead of raising, so that a rank keeps
  issuing its collectives in step with its peers; the parent asserts there are none.
- ``leaf(x)``: a detached copy of ``x`` that requires grad (None stays None), for the oracle's inputs.
- ``TRITON``: whether ``cce_dist.kernels`` can run here (a GPU, or Triton's CPU interpreter).

The reference program itself lives in tests/oracle.py; spawning ranks in tests/dist_utils.py; counting
collectives in ``cce_dist.testing.CollectiveLog`` (shared with the benchmarks).
"""

from __future__ import annotations

import torch

__all__ = ["TRITON", "leaf", "close_report", "Failures"]


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
