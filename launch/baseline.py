"""The materialized vocab-parallel cross-entropy, Megatron style, in plain torch.distributed.

This is the program cce_dist is compared against in ``launch/train.py``:

1. ``_CopyToGroup``: identity in forward; in backward all-reduce the (partial) hidden-state
   gradient over the TP group (Megatron's ``copy_to_tensor_model_parallel_region``, the input
   region of a ``ColumnParallelLinear``).
2. Each rank materializes its local logits ``h @ W_local.T`` as a float32 ``[N, V_local]`` block
   (in bf16 runs the bf16 product is kept as well, then cast).
3. ``_VocabParallelCE``: all-reduce MAX of the row max, all-reduce SUM of the target logit (only
   the rank owning the target contributes) and of the sum of exponentials; the softmax is kept
   for backward, where ``d logits = (softmax - onehot) * g`` stays local to the shard.

Three collectives in forward, one in backward, and a ``[N, V_local]`` float32 buffer alive from
forward to backward: exactly what cce_dist avoids.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        if dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(g, group=ctx.group)
        return g, None


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, group, ignore_index):
        # logits: float32 [N, V_local] for global ids [start, start + V_local); targets: global ids.
        n, v_local = logits.shape
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        z = logits.sub_(row_max.unsqueeze(1))  # in place, as Megatron does (a temporary here)

        local = targets - start
        mine = (local >= 0) & (local < v_local)
        idx = local.clamp(0, v_local - 1)
        target_logit = z.gather(1, idx.unsqueeze(1)).squeeze(1) * mine
        dist.all_reduce(target_logit, group=group)

        z.exp_()  # z now holds exp(logits - max)
        sum_exp = z.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        valid = targets != ignore_index
        loss = torch.where(valid, sum_exp.log() - target_logit, torch.zeros_like(sum_exp))
        z.div_(sum_exp.unsqueeze(1))  # softmax, kept for backward
        ctx.save_for_backward(z, idx, mine & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, onehot_rows, valid = ctx.saved_tensors
        grad = softmax  # in place, as Megatron does: the saved softmax is not needed again
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, idx] -= onehot_rows.to(grad.dtype)
        grad.mul_((g * valid).unsqueeze(1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    start: int,
    group,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over non-ignored tokens; ``hidden [..., D]``, global ``targets [...]``.

    Returns the global loss on every rank; ``hidden`` receives the full gradient (all-reduced over
    ``group``), ``weight_shard`` the gradient of its own rows.
    """
    h = _CopyToGroup.apply(hidden.reshape(-1, hidden.shape[-1]), group)
    logits = F.linear(h, weight_shard).float()  # the materialized [N, V_local] block
    t = targets.reshape(-1)
    loss = _VocabParallelCE.apply(logits, t, start, group, ignore_index)
    n_valid = (t != ignore_index).sum().clamp(min=1)
    return loss.sum() / n_valid


def logits_bytes(n_tokens: int, v_local: int, compute_dtype: torch.dtype) -> int:
    """Bytes of the logits block the materialized path holds per rank: the float32 copy kept for
    backward (as the softmax), plus the compute-dtype product when that is not float32."""
    b = n_tokens * v_local * 4
    if compute_dtype != torch.float32:
        b += n_tokens * v_local * torch.finfo(compute_dtype).bits // 8
    return b
