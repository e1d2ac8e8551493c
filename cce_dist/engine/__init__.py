"""The orchestration every loss runs through: validation (``prepare``), the handshake and plan (``driver``), the
autograd Functions (``autograd``, ``distill_autograd``) and the ``torch.compile`` custom ops (``compile``). Uses every
layer below it; only the public modules at the top import it (tests/test_layering.py)."""
