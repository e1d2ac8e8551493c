"""FSDP2 with a vocab-sharded LM head that is never gathered: :func:`shard_lm_head`.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) the LM head's weight ``[V, D]`` is already split by vocabulary
rows (``Shard(0)`` on the data-parallel mesh), yet FSDP all-gathers the whole head before the forward and
reduce-scatters a ``V x D`` gradient after the backward. With::

    fully_shard(model, mesh=mesh, ignored_params=cce_dist.fsdp.shard_lm_head(model, mesh))

the head stays a ``Shard(0)`` DTensor that FSDP leaves alone (``ignored_params``), and the loss scores each rank's
tokens on the group's vocab shards instead (``VocabShard(data_parallel=True)``, docs/fsdp.md): the hidden states and
targets of the group are all-gathered (``N x D``), the row statistics combined, dH reduce-scattered back to the
owners; the weight gradient on each shard is the sum over the ranks of the gradient of each rank's own loss divided by
the group size, which is exactly FSDP2's reduce-scattered gradient. No ``V x D`` tensor moves.

The loss call (in a model's forward or a training step)::

    h = model.body(ids)                                             # the decoder's final hidden states [n_r, D]
    loss = cce_dist.fsdp.head_cross_entropy(model.lm_head, h, labels, shift=True)
    # the same as linear_cross_entropy(h, head.weight, labels, bias=head.bias, shard=head_shard(head), ...)

:func:`head_shard` is the hook an integration calls: the data-parallel :class:`~cce_dist.VocabShard` of a head
sharded here, None for any other head (then the call runs as before). A weight sharded here and passed without it
raises (it is never read as tensor-parallel, which would need identical tokens on every rank).

What else holds:

- Calling the head module itself (``model.lm_head(h)``: generation, eval logits) still works: it all-gathers the rows
  for that call, with FSDP2's gradient, moving ``V x D`` as FSDP would (``GatheredWeight``).
- Tied embeddings (``lm_head.weight`` is the input embedding's weight) are refused: the embedding lookup of each
  rank's own ids needs every vocab row. Untie them, or leave the head to FSDP.
- The head's gradient is divided by the group size, as FSDP2's mean does; if you change FSDP2's factor
  (``model.set_gradient_divide_factor(f)``), call :func:`set_gradient_divide_factor` with the same ``f``.
- FSDP2's ``MixedPrecisionPolicy`` does not reach an ignored parameter: the head computes in its own dtype (or the
  autocast dtype), the gradients accumulate in float32 and are rounded once to the weight's dtype.
- Every rank must run the loss, and its backward, at every step (as FSDP2 requires for its own collectives): a rank
  with no tokens passes empty tensors.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .api import linear_cross_entropy
from .core.shard import VocabShard
from .engine.data_parallel import GatheredWeight
from .tp.dtensor import DATA_PARALLEL_MARK, data_parallel_shard

__all__ = ["head_cross_entropy", "head_shard", "set_gradient_divide_factor", "shard_lm_head"]

_UNSET = object()


def _dtensor_types():
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    return DTensor, Shard, distribute_tensor


def _submodule(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as e:
        raise ValueError(f"cce_dist.fsdp: {type(model).__name__} has no submodule {path!r} (head=)") from e


def _rows_per_rank(vocab: int, world: int) -> list[int]:
    """DTensor's ``Shard(0)`` split of ``vocab`` rows (``torch.chunk``: ``ceil(V / P)`` per rank, the last ones
    smaller or empty)."""
    per = math.ceil(vocab / world) if vocab else 0
    return [max(0, min(per, vocab - r * per)) for r in range(world)]


class _GatheredLinear:
    """The ``forward`` :func:`shard_lm_head` installs on the head module: ``F.linear`` on the all-gathered rows,
    with FSDP2's gradient (the head module is called only outside the loss: generation, eval logits). A
    module-level class, so ``copy.deepcopy`` / pickling the model keep it."""

    __name__ = "forward"

    def __init__(self, head: nn.Linear):
        self.head = head

    def _full(self, t: Any) -> torch.Tensor | None:
        if t is None:
            return None
        DTensor = _dtensor_types()[0]
        if not isinstance(t, DTensor):
            return t
        mesh = t.device_mesh
        group = mesh.get_group()
        sizes = _rows_per_rank(t.shape[0], mesh.size())
        factor = getattr(t, DATA_PARALLEL_MARK, None)
        factor = float(mesh.size()) if factor is None else float(factor)
        return GatheredWeight.apply(t.to_local(), sizes, mesh.get_local_rank(), group, factor)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._full(self.head.weight)
        assert weight is not None
        return F.linear(x, weight, self._full(self.head.bias))


def shard_lm_head(
    model: nn.Module, mesh: Any, *, head: str = "lm_head", grad_divide_factor: float | None = None
) -> set[nn.Parameter]:
    """Distribute ``model.<head>`` (an ``nn.Linear [V, D]``) as ``Shard(0)`` DTensors on the 1-D data-parallel
    ``mesh`` and return its parameters, for ``fully_shard(model, ..., ignored_params=...)``.

    Call it before ``fully_shard`` of the module that holds the head (the root), with the same initial head on every
    rank (rank 0's rows are scattered). It also installs a ``forward`` on the head module that all-gathers the rows
    for a direct call (see the module docstring). ``grad_divide_factor``: as ``VocabShard.grad_divide_factor`` (None =
    the group size, FSDP2's default mean). Calling it again on a head it sharded returns the same parameters.

    Raises ValueError naming the argument: ``head`` not an ``nn.Linear``, a head FSDP manages already (call this
    first), tied embeddings, a mesh that is not 1-D.
    """
    DTensor, Shard, distribute_tensor = _dtensor_types()
    module = _submodule(model, head)
    if not isinstance(module, nn.Linear):
        raise ValueError(f"cce_dist.fsdp.shard_lm_head: model.{head} must be an nn.Linear, got {type(module).__name__}")
    params = _params(module)
    if isinstance(module.weight, DTensor):
        if hasattr(module.weight, DATA_PARALLEL_MARK):
            return params  # sharded here already
        raise ValueError(
            f"cce_dist.fsdp.shard_lm_head: model.{head}.weight is a DTensor already (placements "
            f"{tuple(module.weight.placements)}): call shard_lm_head before fully_shard(model) (FSDP manages it "
            "otherwise), on a model whose head is a plain nn.Linear"
        )
    if getattr(mesh, "ndim", None) != 1:
        raise ValueError(
            f"cce_dist.fsdp.shard_lm_head: mesh must be a 1-D DeviceMesh (the data-parallel dimension), got "
            f"{getattr(mesh, 'ndim', type(mesh).__name__)}-D; pass mesh['dp'] of a larger mesh"
        )
    tied = [
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if p is module.weight and name != f"{head}.weight"
    ]
    if tied:
        raise ValueError(
            f"cce_dist.fsdp.shard_lm_head: model.{head}.weight is tied to {', '.join(tied)} (tied embeddings): the "
            "embedding lookup of each rank's own token ids needs every vocab row, so the head cannot stay vocab-"
            "sharded. Untie it (e.g. config.tie_word_embeddings=False, or "
            f"model.{head}.weight = nn.Parameter(model.{head}.weight.detach().clone())) or leave the head to FSDP"
        )
    if grad_divide_factor is not None:  # the same checks as the shard's
        VocabShard(None, 0, 0, data_parallel=True, grad_divide_factor=grad_divide_factor)
    for name in ("weight", "bias"):
        p = getattr(module, name)
        if p is None:
            continue
        dt = distribute_tensor(p.detach(), mesh, [Shard(0)])
        new = nn.Parameter(dt, requires_grad=p.requires_grad)
        setattr(new, DATA_PARALLEL_MARK, grad_divide_factor)
        setattr(module, name, new)
    module.forward = _GatheredLinear(module)  # type: ignore[assignment]
    return _params(module)


def _params(module: nn.Linear) -> set[nn.Parameter]:
    """The head's weight and (if any) bias parameters."""
    return {cast(nn.Parameter, p) for p in (module.weight, module.bias) if p is not None}


def head_shard(head: nn.Module | torch.Tensor, **fields: Any) -> VocabShard | None:
    """The ``shard=`` for a loss on ``head`` (an ``nn.Linear`` or its weight): the data-parallel
    :class:`~cce_dist.VocabShard` of a head :func:`shard_lm_head` sharded (this rank's rows, the mesh's group, the
    divide factor), else None, so an integration can pass ``shard=head_shard(head)`` for every head. ``fields``:
    ``stats_collective`` / ``check``."""
    weight = head.weight if isinstance(head, nn.Module) else head
    factor = getattr(weight, DATA_PARALLEL_MARK, _UNSET)
    if factor is _UNSET:
        return None
    return data_parallel_shard(weight, grad_divide_factor=factor, **fields)  # type: ignore[arg-type]


def set_gradient_divide_factor(model: nn.Module, factor: float | None, *, head: str = "lm_head") -> None:
    """Divide the sharded head's gradients by ``factor`` (None = the group size), as
    ``FSDPModule.set_gradient_divide_factor(factor)`` does for the parameters FSDP manages: call both with the same
    value so the head's gradient stays FSDP's."""
    module = _submodule(model, head)
    if factor is not None:
        VocabShard(None, 0, 0, data_parallel=True, grad_divide_factor=factor)  # the same checks as the shard's
    for p in (module.weight, getattr(module, "bias", None)):
        if p is not None:
            if not hasattr(p, DATA_PARALLEL_MARK):
                raise ValueError(
                    f"cce_dist.fsdp.set_gradient_divide_factor: model.{head} was not sharded by shard_lm_head"
                )
            setattr(p, DATA_PARALLEL_MARK, None if factor is None else float(factor))


def head_cross_entropy(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, **options: Any):
    """:func:`cce_dist.linear_cross_entropy` of ``head`` (weight and bias) on this rank's ``hidden [..., D]`` /
    ``targets [...]``, with ``shard=head_shard(head)``: the loss over this rank's own tokens (``reduction`` as given;
    ``mean`` over its own counted tokens), its dH, and FSDP2's gradient for the head's shard. ``options``: the other
    keywords of :func:`cce_dist.linear_cross_entropy`."""
    if "shard" in options:
        raise ValueError("cce_dist.fsdp.head_cross_entropy: shard= comes from the head (head_shard(head)); omit it")
    return linear_cross_entropy(hidden, head.weight, targets, bias=head.bias, shard=head_shard(head), **options)
