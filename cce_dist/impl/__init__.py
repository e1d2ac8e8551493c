"""The implementations beside the Triton kernels (``cce_dist.kernels``): the torch cross-entropy / logprobs backend,
the torch distillation backend and the Triton distillation backend's host side. Built on ``cce_dist.core`` and the
kernels only: no autograd, no torch.distributed (tests/test_layering.py)."""
