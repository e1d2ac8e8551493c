"""Memory on one device: nothing ``[N, V]``-sized is saved for backward, held between forward and backward, or
allocated, for cross-entropy (both schedules, ``return_lse``) and logprobs with entropy; and the chunk rule
(``chunk_size`` bounds the logit block).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from oracle import oracle_cross_entropy
from single_device import leaves, make_inputs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cce_dist import linear_cross_entropy, linear_logprobs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tiny shapes: see tests/conftest.py


# ----------------------------------------------------------------------------------------------
# memory: nothing [N, V]-sized is saved for backward or allocated
# ----------------------------------------------------------------------------------------------

MN, MV, MD = 96, 1000, 8  # N*V = 96000 logits; V*D = 8000 (dW), N*D = 768
MCHUNK = 2000  # two tokens of logits per chunk


class _MaxAllocation(TorchDispatchMode):
    """Records the largest tensor (elements) any aten op produces while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.max_op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor) and x.numel() > self.max_numel:
                self.max_numel, self.max_op = x.numel(), str(func)
        return out


def _memory_cases():
    return [
        (
            "ce-fused",
            lambda h, w, b, t: (
                linear_cross_entropy(h, w, t, bias=b, chunk_size=MCHUNK, label_smoothing=0.1, z_loss=1e-3, softcap=5.0),
            ),
        ),
        (
            "ce-recompute",
            lambda h, w, b, t: (
                linear_cross_entropy(h, w, t, bias=b, chunk_size=MCHUNK, grad_in_forward=False, label_smoothing=0.1),
            ),
        ),
        (
            "ce-none-lse",
            lambda h, w, b, t: linear_cross_entropy(
                h, w, t, bias=b, chunk_size=MCHUNK, reduction="none", return_lse=True, z_loss=1e-3
            ),
        ),
        (
            "logprobs-entropy",
            lambda h, w, b, t: linear_logprobs(
                h, w, t, bias=b, chunk_size=MCHUNK, return_entropy=True, temperature=0.7, softcap=4.0
            ),
        ),
    ]


_MEM = _memory_cases()


def _mem_inputs(dtype):
    h, w, b, t = make_inputs(MN, MV, MD, dtype=dtype, seed=28)
    return leaves(h, w, b) + (t,)


def _run_fwd_bwd(fn, h, w, b, t):
    outs = fn(h, w, b, t)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [c[1] for c in _MEM], ids=[c[0] for c in _MEM])
def test_no_nv_sized_tensor_saved_for_backward(dtype, fn):
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size())
        return x

    def run(f):
        saved.clear()
        h, w, b, t = _mem_inputs(dtype)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            outs = f(h, w, b, t)
        total = sum(saved)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return total, max(saved, default=0)

    nv_bytes = MN * MV * 4
    # sanity: the counter sees the materialized program's [N, V] logits
    o_total, o_max = run(lambda h, w, b, t: (oracle_cross_entropy(h, w, t, b, dtype=dtype),))
    assert o_max >= MN * MV * torch.finfo(dtype).bits // 8
    total, biggest = run(fn)
    # hidden, weight, bias, targets (+ their casts) and O(N) row vectors at most
    bound = 4 * (2 * MN * MD + 2 * MV * MD + 2 * MV + 16 * MN)
    assert biggest < nv_bytes // 8, f"saved a tensor of {biggest} bytes"
    assert total <= bound, f"saved {total} bytes for backward (bound {bound}, [N, V] fp32 = {nv_bytes})"


class _Retained(TorchDispatchMode):
    """Weakly tracks every tensor any op produces; ``alive_bytes`` = storage still held later.

    Unlike saved_tensors_hooks this also sees what a Function keeps on ``ctx`` by other means
    (e.g. gradients formed in forward)."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs.extend(weakref.ref(x) for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor))
        return out

    def alive_bytes(self, exclude=()):
        gc.collect()
        excluded = {e.untyped_storage().data_ptr() for e in exclude}
        storages = {}
        for r in self.refs:
            x = r()
            if x is not None:
                st = x.untyped_storage()
                if st.data_ptr() not in excluded and st.nbytes():
                    storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [c[1] for c in _MEM], ids=[c[0] for c in _MEM])
def test_memory_held_between_forward_and_backward(dtype, fn):
    """What the graph keeps alive after forward (saved tensors, ctx attributes) is O(N*D + V*D)."""
    h, w, b, t = _mem_inputs(dtype)
    mode = _Retained()
    with mode:
        outs = oracle_cross_entropy(h, w, t, b, dtype=dtype)
    assert mode.alive_bytes(exclude=[outs]) >= MN * MV * 4  # sanity: sees the oracle's fp32 logits
    del outs
    mode = _Retained()
    with mode:
        outs = fn(h, w, b, t)
    held = mode.alive_bytes(exclude=outs)
    bound = 4 * (MN * MD + MV * MD + MV + 16 * MN)  # fp32 dH + dW + db (fused), or casts + row vectors
    assert held <= bound, f"the graph holds {held} bytes between forward and backward (bound {bound})"
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    del outs
    assert mode.alive_bytes() == 0  # everything is released after backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fn", [c[1] for c in _MEM], ids=[c[0] for c in _MEM])
def test_no_nv_sized_tensor_allocated(dtype, fn):
    # sanity: the detector sees the materialized program's [N, V] logits
    mode = _MaxAllocation()
    with mode:
        _run_fwd_bwd(lambda h, w, b, t: (oracle_cross_entropy(h, w, t, b),), *_mem_inputs(dtype))
    assert mode.max_numel >= MN * MV
    mode = _MaxAllocation()
    with mode:
        _run_fwd_bwd(fn, *_mem_inputs(dtype))
    # the largest tensor is a chunk of logits, the dW accumulator [V, D], dH [N, D] or a row vector
    bound = max(MCHUNK, MV * MD, MN * MD, 8 * (MN + MV))
    assert mode.max_numel <= bound, f"{mode.max_op} produced {mode.max_numel} elements (bound {bound})"
    assert bound * 8 < MN * MV


def test_default_chunk_rule():
    """chunk_size=None: 2**24 logits per chunk, but never fewer than 256 tokens (thin GEMMs are
    slow); an explicit int is a hard cap of at least one token."""
    from cce_dist.impl.torch_cross_entropy import chunk_tokens

    assert chunk_tokens(4096, 65536, None) == 256  # 2**24 logits
    assert chunk_tokens(4096, 32768, None) == 512
    assert chunk_tokens(4096, 262144, None) == 256  # the token floor, not 2**24 // V = 64
    assert chunk_tokens(100, 262144, None) == 100  # never more than the tokens there are
    assert chunk_tokens(4096, 262144, 1 << 24) == 64  # an explicit cap is honoured
    assert chunk_tokens(4096, 262144, 5) == 1
    assert chunk_tokens(0, 0, None) == 1


def test_chunk_size_bounds_the_logit_block():
    """With a tiny head dimension, the largest allocation tracks chunk_size, not N * V."""
    n, v, d = 64, 2000, 2
    h, w, b, t = make_inputs(n, v, d, seed=29)
    sizes = {}
    for cs in (v, 4 * v, 16 * v):
        mode = _MaxAllocation()
        with mode:
            h1, w1, b1 = leaves(h, w, b)
            lp, ent = linear_logprobs(h1, w1, t, bias=b1, chunk_size=cs, return_entropy=True)
            torch.autograd.backward((lp, ent), (torch.ones(n), torch.ones(n)))
        sizes[cs] = mode.max_numel
        assert mode.max_numel <= max(cs, v * d, 8 * (n + v)), (cs, mode.max_op, mode.max_numel)
    assert sizes[16 * v] > sizes[v]  # the knob really changes the block size
    assert max(sizes.values()) < n * v
