"""Megatron-core integration: the LM-head loss of a ``ColumnParallelLinear`` output layer.

Importing this module does not import megatron; :func:`output_layer_loss` imports
``megatron.core`` when called (and raises an ImportError naming the ``megatron`` extra when it
is not installed). ``import cce_dist`` never imports this module.

Replaces, in a Megatron GPT model's ``_postprocess``::

    logits, _ = self.output_layer(hidden_states, weight=output_weight)
    loss = self.compute_language_model_loss(labels, logits)      # [b, s]

with::

    loss = output_layer_loss(self.output_layer, hidden_states, labels, weight=output_weight)

without materializing the ``[s, b, V/tp]`` logits (nor their fp32 copy and softmax).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch
import torch.distributed as dist

from .api import linear_cross_entropy
from .parallel import VocabShard

Tensor = torch.Tensor

_EXTRA_HINT = "pip install 'cce_dist[megatron]' (or pip install megatron-core)"

# options that output_layer_loss sets itself, from the layer
_OWNED = {
    "shard": "it is built from the layer (its tp group, sequence_parallel and weight shard)",
    "bias": "the layer's own bias is used (unless the layer has skip_bias_add=True)",
}
# VocabShard fields a caller may set through **loss_options
_SHARD_FIELDS = ("stats_collective", "check")


def _require_megatron():
    try:
        return importlib.import_module("megatron.core")
    except ImportError as e:  # pragma: no cover - exercised with megatron hidden
        raise ImportError(
            f"cce_dist.megatron needs megatron-core, which could not be imported ({e}); install the "
            f"'megatron' extra: {_EXTRA_HINT}"
        ) from e


def _tp_group(layer) -> Optional[dist.ProcessGroup]:
    """The layer's tensor-parallel group: its ``tp_group`` attribute (megatron-core >= 0.12),
    else parallel_state's global TP group (older layers, which always used it)."""
    for name in ("tp_group", "_tp_group"):
        group = getattr(layer, name, None)
        if group is not None:
            return group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def output_layer_loss(output_layer, hidden_states: Tensor, labels: Tensor, *, weight: Optional[Tensor] = None,
                      **loss_options):
    """Per-token LM loss of a Megatron ``ColumnParallelLinear`` head, without the logits.

    Returns what ``compute_language_model_loss(labels, output_layer(hidden_states, weight=weight)[0])``
    returns, i.e. ``vocab_parallel_cross_entropy(logits, labels.T).T``: the float32 per-token
    loss ``[b, s]``, differentiable w.r.t. ``hidden_states``, the weight and the layer's bias, with
    the gradients Megatron's layer + loss would produce for any upstream gradient (a loss mask,
    a sum, a mean over micro-batches...).

    Args:
        output_layer: a megatron-core ``ColumnParallelLinear`` (the GPT ``output_layer``). Read from
            it: ``weight`` ``[V/tp, h]`` (Megatron's even split of the padded vocab: this rank
            holds rows ``[r*V/tp, (r+1)*V/tp)``, ``r`` its rank in the layer's group), ``bias``
            (a vocab shard too; not applied when ``skip_bias_add=True``, as in the layer),
            ``tp_group`` (falls back to ``parallel_state``'s TP group when the layer has none),
            ``sequence_parallel`` and ``disable_grad_reduce``. ``gather_output`` is irrelevant
            (no logits are produced); ``gradient_accumulation_fusion`` is not used: the weight
            gradient lands in ``weight.grad``, which Megatron's DDP hook adds to ``main_grad``.
        hidden_states: ``[s, b, h]``; under sequence parallelism this rank's ``[s/tp, b, h]``
            (gathered inside, and the hidden gradient reduce-scattered back, as the layer does).
        labels: ``[b, s]`` global token ids, identical on every rank of the group (Megatron's
            layout; they are transposed to ``[s, b]`` internally).
        weight: the ``[V/tp, h]`` weight shard to use instead of ``output_layer.weight`` (tied
            embeddings: ``model.shared_embedding_or_output_weight()``; required when the layer
            was built with ``skip_weight_param_allocation=True``).
        **loss_options: forwarded to :func:`cce_dist.linear_cross_entropy` with
            ``reduction="none"`` (any other reduction is rejected): ``ignore_index`` (default
            -100; Megatron has no ignore index and relies on the loss mask, so labels equal to it
            must not occur in Megatron's own path), ``label_smoothing``, ``z_loss``, ``softcap``,
            ``shift`` (applied along the sequence, labels' last dim), ``impl``, ``chunk_size``,
            ``return_lse`` (then ``(loss, lse)``, both ``[b, s]``), ``filter_eps``,
            ``deterministic``; and the :class:`cce_dist.VocabShard` fields ``stats_collective``
            and ``check``.

    Label smoothing differs from Megatron's on purpose. Megatron's
    ``vocab_parallel_cross_entropy`` (0.16) smooths *per partition*: it uses
    ``K = V/tp`` and the mean log-probability over this rank's shard only (so with tp > 1 its
    smoothed loss differs between ranks and is not the full-vocab loss), in the NeMo form
    ``(1 - eps*K/(K-1)) * nll - eps*K/(K-1) * mean_j log p_j``. cce_dist computes PyTorch's
    definition over the full vocabulary, ``(1 - eps) * nll + eps * (lse - mean_j z_j)`` with
    ``K = V`` (``F.cross_entropy(..., label_smoothing=eps)`` on the full logits). With
    ``label_smoothing=0`` (Megatron's default) the two agree exactly.

    Raises:
        ImportError: megatron-core is not installed.
        ValueError: a conflicting option (``reduction`` other than "none", ``shard``, ``bias``),
            no weight, a weight of the wrong shape, an expert layer.
        cce_dist.InputError: bad inputs on any rank of the group (raised on every rank).
    """
    _require_megatron()
    for key, why in _OWNED.items():
        if key in loss_options:
            raise ValueError(f"output_layer_loss: do not pass {key}=: {why}")
    reduction = loss_options.pop("reduction", "none")
    if reduction != "none":
        raise ValueError(
            f"output_layer_loss returns Megatron's per-token loss [b, s] (reduction='none'); got "
            f"reduction={reduction!r}: apply the loss mask and reduce the result yourself, or call "
            "cce_dist.linear_cross_entropy directly"
        )
    shard_kw = {k: loss_options.pop(k) for k in _SHARD_FIELDS if k in loss_options}

    if getattr(output_layer, "is_expert", False):
        raise ValueError("output_layer_loss: expert (MoE) ColumnParallelLinear layers are not LM heads")
    if weight is None:
        weight = getattr(output_layer, "weight", None)
        if weight is None:
            raise ValueError(
                "output_layer_loss: the layer has no weight (skip_weight_param_allocation=True, i.e. tied "
                "embeddings): pass weight=model.shared_embedding_or_output_weight()"
            )
    elif hasattr(output_layer, "output_size_per_partition") and hasattr(output_layer, "input_size"):
        expected = (output_layer.output_size_per_partition, output_layer.input_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"output_layer_loss: supplied weight's shape is {tuple(weight.shape)}, not "
                             f"{expected} as the layer expects")
    bias = None if getattr(output_layer, "skip_bias_add", False) else getattr(output_layer, "bias", None)

    group = _tp_group(output_layer)
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    if world == 1:
        group = None  # Megatron disables sequence parallelism at tp=1 too
    sequence_parallel = bool(getattr(output_layer, "sequence_parallel", False)) and world > 1
    # Megatron's layer all-reduces dH over the group (or reduce-scatters it under sequence
    # parallelism) unless disable_grad_reduce leaves that to the caller (LoRA); we bypass the
    # layer's forward, so cce_dist does exactly that reduction itself.
    reduce_hidden_grad = sequence_parallel or not getattr(output_layer, "disable_grad_reduce", False)
    v_local = int(weight.shape[0]) if weight.dim() >= 1 else 0
    shard = VocabShard(group, rank * v_local, (rank + 1) * v_local, sequence_parallel=sequence_parallel,
                       reduce_hidden_grad=reduce_hidden_grad, **shard_kw)

    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError(f"output_layer_loss: labels must be a [b, s] tensor, got "
                         f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    shift = loss_options.pop("shift", False)
    shift = int(shift) if isinstance(shift, (bool, int)) else shift
    if not isinstance(shift, int) or shift < 0:
        raise ValueError(f"shift must be a bool or a non-negative int, got {shift!r}")
    if shift:
        # the sequence is labels' last dim; cce_dist's shift would act on targets' last dim (batch)
        ignore_index = loss_options.get("ignore_index", -100)
        # int64 first: ignore_index (-100) does not fit a uint8/int8 label tensor
        shifted = torch.full(labels.shape, ignore_index, dtype=torch.int64, device=labels.device)
        if shift < labels.shape[1]:
            shifted[:, : labels.shape[1] - shift] = labels[:, shift:]
        labels = shifted

    out = linear_cross_entropy(hidden_states, weight, labels.transpose(0, 1), bias=bias, shard=shard,
                               reduction="none", **loss_options)
    if isinstance(out, tuple):
        return tuple(t.transpose(0, 1).contiguous() for t in out)
    return out.transpose(0, 1).contiguous()


__all__ = ["output_layer_loss"]
