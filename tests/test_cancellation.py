"""Gradients whose terms cancel, against the materialized program in float64: the error must stay
at the level of float32 rounding of the *result*, not of the cancelled terms.

- dW of a bf16 head is summed over tokens in float32: a token chunk's partial sum must not be
  rounded to bf16 before it joins the accumulation (with small chunks whose partials cancel, that
  rounding made dW ~16x worse than the materialized bf16 program).
- When ``p`` is ~1 at the target, ``p * ALPHA - g`` cancels: the z-loss, label-smoothing and
  entropy terms of the target's gradient must not be formed after that cancellation (the backend
  contract's BETA is the target's excess over ALPHA, and ``p - 1`` is exact near 1).
"""

from __future__ import annotations

import torch

from cce_dist import torch_impl

U32 = 2.0**-24  # unit roundoff of float32


def test_dw_token_chunk_partials_accumulate_in_float32():
    """bf16 head, V = 1, 3 tokens per chunk, chunk partials of magnitude ~3 that cancel across
    chunks: every product dz_i * h_i is exact in float32 (dz = +-1, h_i with 8 significant bits),
    so float32 accumulation of N terms is within N * u32 * sum |dz_i h_i| of the exact sum, while a
    bf16 rounding of a chunk's partial errs by up to 2^-7 (half a bf16 ulp at 3)."""
    n, d = 24, 8
    i = torch.arange(n)[:, None]
    j = torch.arange(d)[None, :]
    h = (1.0 + ((3 * i + j) % 7 + 1) * 2.0**-7).to(torch.bfloat16)  # exact in bf16
    w = torch.full((1, d), 0.125, dtype=torch.bfloat16)
    targets = torch.full((n,), -100)  # no target in the shard: dz = p * ALPHA, and p = 1 (V = 1)
    z = (h.float() @ w.float().T)[:, 0].to(torch.bfloat16).float()
    coef = torch.zeros(n, 4)
    sign = torch.where((torch.arange(n) // 3) % 2 == 0, 1.0, -1.0)  # alternate sign per chunk
    coef[:, 0] = sign  # ALPHA
    _, dw, _ = torch_impl.grads(h, w, None, targets, z, coef, vocab_start=0, softcap=None, temperature=1.0,
                                need_hidden=False, need_weight=True, need_bias=False, chunk_size=3)
    exact = (sign.double()[:, None] * h.double()).sum(0)
    bound = n * U32 * h.double().abs().sum(0)
    assert ((dw[0].double() - exact).abs() <= bound).all(), (dw[0] - exact).abs().max()
