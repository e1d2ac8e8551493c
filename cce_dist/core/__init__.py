"""The layer everything builds on: the row statistics and their monoid (``stats``), the loss formulas, the options of
every entry point, the row outputs, class weights, the backend protocol and what the implementations ask of the
device (``runtime``). Imports nothing else of cce_dist (tests/test_layering.py)."""
