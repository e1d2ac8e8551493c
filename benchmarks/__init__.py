"""Benchmarks of cce_dist, one module per question (see benchmarks/README.md).

Run them from the repository root as modules, e.g. ``python -m benchmarks.cpu_single --quick``;
they share helpers through ``from benchmarks.common import ...``.
"""
