"""Training demo with a vocab-parallel head: cce_dist against the materialized loss.

Run from the repository root as a module, e.g. ``torchrun --standalone --nproc-per-node 2 -m
launch.train`` (or ``bash launch/run_demo.sh``); see launch/README.md.
"""
