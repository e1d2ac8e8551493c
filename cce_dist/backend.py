"""The stable public path of the backend contract (``cce_dist.backend``), kept for code that imports it from here. The
code lives in :mod:`cce_dist.core.backend`; this module only re-exports it (tests/test_layering.py)."""

from .core.backend import ALPHA, BETA, DELTA, GAMMA, NUM_COEFS, Backend, DistillPass

__all__ = ["ALPHA", "BETA", "DELTA", "GAMMA", "NUM_COEFS", "Backend", "DistillPass"]
