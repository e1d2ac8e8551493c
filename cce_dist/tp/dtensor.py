"""DTensor inputs: a vocab-sharded head weight is turned into (local shard, :class:`VocabShard`).

:func:`cce_dist.linear_cross_entropy` / :func:`cce_dist.linear_logprobs` call
:func:`from_dtensor` when the weight or the hidden states are ``torch.distributed.tensor.DTensor``
(e.g. the output layer of a torchtitan model parallelized with
``ColwiseParallel(use_local_output=False)``, whose weight is ``Shard(0)`` over the TP mesh);
:func:`cce_dist.linear_distillation` calls :func:`distillation_from_dtensor` (both heads, placed alike).

Accepted layouts, on a 1-D device mesh:

- ``weight``: ``Shard(0)`` -> its local rows with ``shard=VocabShard(mesh group, start, stop)``,
  ``start``/``stop`` taken from DTensor's own (``torch.chunk``-style, possibly uneven) split;
  ``Replicate()`` -> the local (full) tensor, no shard. Gradients flow back into the DTensor
  parameter through ``to_local`` (``weight.grad`` is a ``Shard(0)`` DTensor).
- ``bias``: the same placement as the weight (or a plain tensor of the local shape).
- ``hidden``: a plain tensor (identical on every rank), or a DTensor on the same mesh: replicated
  -> ``to_local``; sharded on any dimension -> all-gathered first (``redistribute`` to
  ``Replicate``; its backward hands each rank its slice of the full, already-reduced gradient).
- ``targets``: a plain tensor, or a DTensor (gathered with ``full_tensor``).

Anything else (``Partial``, ``Shard(1)`` weights, multi-dimensional meshes, meshes that differ
between arguments) raises a ``ValueError`` naming the argument. A ``shard=`` passed together with
a sharded DTensor weight must describe the same rows; its other fields (``stats_collective``,
``check``, ...) are kept, so they can still be tuned.

**Data-parallel heads (FSDP2).** Read without ``shard=``, a ``Shard(0)`` weight is tensor-parallel: every rank of its
mesh scores the same tokens. A head sharded over a *data-parallel* mesh, whose ranks score their own tokens, is
passed with ``shard=data_parallel_shard(weight)`` (a :class:`VocabShard` with ``data_parallel=True`` describing the
weight's rows and mesh, :func:`data_parallel_shard`); then ``hidden`` and ``targets`` must be plain tensors (this
rank's own tokens). A weight that :func:`cce_dist.fsdp.shard_lm_head` distributed is marked as data-parallel
(:data:`DATA_PARALLEL_MARK`): passed without such a shard, it raises instead of being read as tensor-parallel.
"""

from __future__ import annotations

from typing import Any

from ..core.options import LossOptions
from ..core.shard import VocabShard

__all__ = ["DATA_PARALLEL_MARK", "data_parallel_shard", "distillation_from_dtensor", "from_dtensor"]

#: the attribute :func:`cce_dist.fsdp.shard_lm_head` sets on a head's ``Shard(0)`` weight (and bias) parameter: its
#: ``grad_divide_factor`` (None = the group size). Such a weight is data-parallel: read without a data-parallel
#: ``shard=`` it raises, never silently as tensor-parallel.
DATA_PARALLEL_MARK = "_cce_dist_data_parallel"


def _types():
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    return DTensor, Partial, Replicate, Shard


def _mesh_1d(name: str, t) -> Any:
    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"cce_dist: {name} is a DTensor on a {mesh.ndim}-D device mesh {tuple(mesh.shape)}; only 1-D meshes "
            f"(the tensor-parallel dimension) are supported: pass {name}.to_local() of the TP sub-mesh instead"
        )
    return mesh


def _placement_str(t) -> str:
    return "(" + ", ".join(str(p) for p in t.placements) + ")"


def _weight_shard(weight, name: str = "weight"):
    """``(local weight, (group, start, stop) or None, mesh)`` of a DTensor weight (the argument ``name``): its rows
    under ``Shard(0)``, None under ``Replicate()``."""
    DTensor, Partial, Replicate, Shard = _types()
    mesh = _mesh_1d(name, weight)
    (pl,) = weight.placements
    if isinstance(pl, Replicate):
        return weight.to_local(), None, mesh
    if isinstance(pl, Shard) and pl.dim % weight.dim() == 0:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local_shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
        start, stop = int(offset[0]), int(offset[0]) + int(local_shape[0])
        return weight.to_local(), (mesh.get_group(), start, stop), mesh
    raise ValueError(
        f"cce_dist: {name} is a DTensor with placements {_placement_str(weight)}; supported are Shard(0) "
        "(vocab-parallel, e.g. ColwiseParallel) and Replicate()"
    )


def _same_mesh(name: str, t, mesh, weight_name: str = "weight") -> None:
    if t.device_mesh != mesh:
        raise ValueError(f"cce_dist: {name} is a DTensor on a different device mesh than {weight_name}")


def data_parallel_shard(
    weight: Any, *, grad_divide_factor: float | None = None, stats_collective: Any = "auto", check: bool = True
) -> VocabShard:
    """The :class:`VocabShard` (``data_parallel=True``) of a ``Shard(0)`` DTensor weight on a 1-D data-parallel
    mesh (FSDP2's placement of a ``[V, D]`` head): its mesh's group and this rank's rows ``[start, stop)`` (DTensor's
    ``torch.chunk`` split, possibly uneven or empty). Pass it as ``shard=`` beside the DTensor weight, each rank with
    its own tokens; the other fields as in :class:`VocabShard`. Raises ValueError naming ``weight`` for anything
    else."""
    DTensor = _types()[0]
    if not isinstance(weight, DTensor):
        raise ValueError(
            f"cce_dist: data_parallel_shard(weight) needs a Shard(0) DTensor weight, got {type(weight).__name__}; for "
            "a plain local shard build VocabShard(group, start, stop, data_parallel=True)"
        )
    _, info, _ = _weight_shard(weight)
    if info is None:
        raise ValueError(
            f"cce_dist: data_parallel_shard(weight): weight has placements {_placement_str(weight)}; a "
            "data-parallel vocab shard needs Shard(0)"
        )
    group, start, stop = info
    return VocabShard(
        group,
        start,
        stop,
        stats_collective=stats_collective,
        check=check,
        data_parallel=True,
        grad_divide_factor=grad_divide_factor,
    )


def _check_data_parallel(
    hidden,
    targets,
    marked: bool,
    given: VocabShard | None,
    group,
    names: tuple[str, str, str] = ("hidden", "weight", "bias"),
) -> None:
    """What a data-parallel shard needs of the DTensor arguments (local checks, the same on every rank); ``marked``:
    the weight carries :data:`DATA_PARALLEL_MARK`; ``names``: the arguments' names (hidden, weight, bias)."""
    DTensor = _types()[0]
    if given is None or not given.data_parallel:
        if marked:
            raise ValueError(
                f"cce_dist: {names[1]} is a head that cce_dist.fsdp.shard_lm_head sharded over a data-parallel mesh "
                "(each rank scores its own tokens); pass shard=cce_dist.fsdp.head_shard(head) (data_parallel=True), "
                f"not {'no shard' if given is None else 'a tensor-parallel shard'}: read as tensor-parallel it would "
                "need identical tokens on every rank"
            )
        return
    for name, t in ((names[0], hidden), ("targets", targets)):
        if isinstance(t, DTensor):
            raise ValueError(
                f"cce_dist: {name} is a DTensor but shard.data_parallel=True: pass this rank's own tokens as a plain "
                f"tensor ({name}.to_local())"
            )
    import torch.distributed as dist

    if given.group is None or dist.get_process_group_ranks(given.group) != dist.get_process_group_ranks(group):
        raise ValueError(
            f"cce_dist: shard=VocabShard(data_parallel=True) names another process group than the DTensor {names[1]}'s "
            "mesh; build it with cce_dist.fsdp.head_shard(head) or data_parallel_shard(weight)"
        )


def from_dtensor(
    hidden, weight, targets, bias, opts: LossOptions, names: tuple[str, str, str] = ("hidden", "weight", "bias")
):
    """Translate DTensor arguments into local tensors and options with the derived ``shard``.

    Returns ``(hidden, weight_local, targets, bias_local, opts)`` ready for the regular path. ``opts``: any loss's
    options (their ``shard`` is read and replaced); ``names``: the arguments' names in the errors (hidden, weight,
    bias).
    """
    hidden_name, weight_name, bias_name = names
    DTensor, Partial, Replicate, Shard = _types()
    mesh = None
    shard_info = None
    if isinstance(weight, DTensor):
        marked = hasattr(weight, DATA_PARALLEL_MARK)
        weight, shard_info, mesh = _weight_shard(weight, weight_name)
        _check_data_parallel(hidden, targets, marked, opts.shard, mesh.get_group(), names)

    if isinstance(bias, DTensor):
        _mesh_1d(bias_name, bias)
        if mesh is None:
            raise ValueError(
                f"cce_dist: {bias_name} is a DTensor but {weight_name} is not; pass both as DTensors or neither"
            )
        _same_mesh(bias_name, bias, mesh, weight_name)
        (pl,) = bias.placements
        want = Replicate if shard_info is None else Shard
        if not isinstance(pl, want) or (isinstance(pl, Shard) and pl.dim % max(bias.dim(), 1) != 0):
            raise ValueError(
                f"cce_dist: {bias_name} is a DTensor with placements {_placement_str(bias)}; it must be placed like "
                f"{weight_name} ({'Replicate()' if shard_info is None else 'Shard(0)'})"
            )
        bias = bias.to_local()

    if isinstance(hidden, DTensor):
        hmesh = _mesh_1d(hidden_name, hidden)
        if mesh is not None:
            _same_mesh(hidden_name, hidden, mesh, weight_name)
        (pl,) = hidden.placements
        if isinstance(pl, Partial):
            raise ValueError(
                f"cce_dist: {hidden_name} is a Partial DTensor (pending reduction); reduce it first "
                f"({hidden_name}.redistribute(placements=[Replicate()]))"
            )
        if not isinstance(pl, Replicate):
            hidden = hidden.redistribute(hmesh, [Replicate()])
        hidden = hidden.to_local()

    if isinstance(targets, DTensor):
        targets = targets.full_tensor()

    if shard_info is not None:
        group, start, stop = shard_info
        given: VocabShard | None = opts.shard
        if given is None:
            shard = VocabShard(group, start, stop)
        else:
            if (given.start, given.stop) != (start, stop):
                raise ValueError(
                    f"cce_dist: shard=VocabShard(start={given.start}, stop={given.stop}) disagrees with the DTensor "
                    f"{weight_name}'s local rows [{start}, {stop}); omit shard= to derive it from the placement"
                )
            shard = given
        opts = opts.replace(shard=shard)
    return hidden, weight, targets, bias, opts


def distillation_from_dtensor(sh, sw, th, tw, targets, sb, tb, opts: LossOptions):
    """:func:`from_dtensor` for :func:`cce_dist.linear_distillation`'s two heads: the student's arguments as a loss's,
    the teacher's the same way, and both heads' weights placed alike (``Shard(0)`` on the same mesh, so the same vocab
    rows, or ``Replicate()``) or neither a DTensor; the shard derived from the student's, checked against the
    teacher's. Returns ``(sh, sw, th, tw, targets, sb, tb, opts)`` local. Raises ValueError naming the argument
    (local checks: every rank raises alike, before any collective)."""
    DTensor = _types()[0]
    if isinstance(sw, DTensor) != isinstance(tw, DTensor):
        dt, plain = (
            ("student_weight", "teacher_weight") if isinstance(sw, DTensor) else ("teacher_weight", "student_weight")
        )
        raise ValueError(
            f"cce_dist: {dt} is a DTensor but {plain} is not; both heads must hold the same vocab rows: pass both "
            "as DTensors placed alike, or both local (.to_local()) with shard="
        )
    if isinstance(sw, DTensor) and (sw.device_mesh != tw.device_mesh or sw.placements != tw.placements):
        raise ValueError(
            f"cce_dist: teacher_weight is a DTensor placed {_placement_str(tw)} on mesh {tw.device_mesh}, "
            f"student_weight {_placement_str(sw)} on {sw.device_mesh}: both heads must hold the same vocab rows"
        )
    given = opts
    sh, sw, targets, sb, opts = from_dtensor(
        sh, sw, targets, sb, opts, ("student_hidden", "student_weight", "student_bias")
    )
    th, tw, _, tb, teacher_opts = from_dtensor(
        th, tw, None, tb, given, ("teacher_hidden", "teacher_weight", "teacher_bias")
    )
    if opts.shard != teacher_opts.shard:
        raise ValueError(
            "cce_dist: teacher_weight's vocab rows differ from student_weight's (their shards: "
            f"{_rows(teacher_opts.shard)} and {_rows(opts.shard)}): both heads must hold the same vocab rows"
        )
    return sh, sw, th, tw, targets, sb, tb, opts


def _rows(shard: VocabShard | None) -> str:
    return "all rows" if shard is None else f"rows [{shard.start}, {shard.stop})"
