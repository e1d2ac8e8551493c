"""Tensor parallelism over a vocab-parallel head: the handshake and the collectives of the protocol (``collectives``)
and the DTensor translation (``dtensor``). Built on ``cce_dist.core``; knows nothing of Triton or autograd
(tests/test_layering.py)."""
