"""Peak tensor memory of a code region, on any device.

``TensorMemory`` is a ``TorchDispatchMode`` that sees every ATen op run inside it (autograd's
backward ops included) and counts the bytes of each *new* storage an op returns until that storage
is freed (a weak reference to the storage fires then). Views and in-place results share a storage
with an input and are not counted again. ``peak`` is the high-water mark of those live bytes: the
extra tensor memory the region needed on top of what existed before it, like
``torch.cuda.max_memory_allocated() - memory_allocated()`` measured around the region, but also on
CPU, where PyTorch keeps no allocator statistics and the process RSS mixes in allocator caching.

It ignores allocator rounding and caching, and memory that kernels allocate outside of tensors
(e.g. a BLAS workspace); both are small next to an ``[N, V]`` logits block.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemory(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[tuple, weakref.ref] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key, nbytes):
        if self.live.pop(key, None) is not None:
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            (str(t.device), t.untyped_storage().data_ptr())
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            nbytes = st.nbytes()
            key = (str(t.device), st.data_ptr())
            if nbytes == 0 or key in inputs or key in self.live:
                continue
            self.live[key] = weakref.ref(st, lambda _r, k=key, n=nbytes: self._free(k, n))
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        return out
