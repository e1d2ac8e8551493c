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

:func:`patch` does that on one ``GPTModel`` instance without editing Megatron (its multi-token
prediction heads included); :func:`output_layer_loss` is the building block for other models.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import sys
import types
from typing import Any

import torch
import torch.distributed as dist

from .api import linear_cross_entropy
from .core.shard import VocabShard
from .engine.driver import refuse_on_group

Tensor = torch.Tensor

_EXTRA_HINT = "pip install 'cce_dist[megatron]' (or pip install megatron-core)"

# options that output_layer_loss sets itself, from the layer
_OWNED = {
    "shard": "it is built from the layer (its tp group, sequence_parallel and weight shard)",
    "bias": "the layer's own bias is used (unless the layer has skip_bias_add=True)",
    "row_outputs": "the outputs are Megatron's [b, s] loss (and lse); call cce_dist.linear_cross_entropy for them",
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


def _tp_group(layer) -> dist.ProcessGroup | None:
    """The layer's tensor-parallel group: its ``tp_group`` attribute (megatron-core >= 0.13),
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


def output_layer_loss(
    output_layer, hidden_states: Tensor, labels: Tensor, *, weight: Tensor | None = None, **loss_options
):
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
            ``tp_group`` (falls back to ``parallel_state``'s TP group when the layer has none, as on
            megatron-core 0.12),
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
            no weight, a weight of the wrong shape, labels not ``[b, s]``, an expert layer.
        cce_dist.InputError: bad inputs on another rank of the group: every rank raises, the one with the bad
            input its own error (its labels or weight included: the group is told before it raises).
    """
    _require_megatron()
    shard_kw = _split_loss_options(loss_options)  # options: every rank raises alike
    shift = loss_options.pop("shift", False)
    try:  # this rank's own weight and labels: an error is raised on every rank of the group (refuse_on_group)
        weight = _head_weight(output_layer, weight)
        labels = _shifted_labels(labels, shift, loss_options.get("ignore_index", -100))
    except (TypeError, ValueError) as e:
        refuse_on_group(_layer_shard(output_layer, None, shard_kw), e, hidden_states)
    bias = None if getattr(output_layer, "skip_bias_add", False) else getattr(output_layer, "bias", None)
    shard = _layer_shard(output_layer, weight, shard_kw)
    out = linear_cross_entropy(
        hidden_states, weight, labels.transpose(0, 1), bias=bias, shard=shard, reduction="none", **loss_options
    )
    if isinstance(out, tuple):
        return tuple(t.transpose(0, 1).contiguous() for t in out)
    return out.transpose(0, 1).contiguous()


def _split_loss_options(loss_options: dict) -> dict:
    """Refuse the options the layer owns and any reduction but "none"; pop and return the VocabShard fields (the
    rest stays in ``loss_options`` for :func:`cce_dist.linear_cross_entropy`)."""
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
    return {k: loss_options.pop(k) for k in _SHARD_FIELDS if k in loss_options}


def _head_weight(output_layer, weight: Tensor | None) -> Tensor:
    """The head's weight shard: ``weight`` (checked against the layer's shape) or the layer's own."""
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
            raise ValueError(
                f"output_layer_loss: supplied weight's shape is {tuple(weight.shape)}, not "
                f"{expected} as the layer expects"
            )
    return weight


def _layer_shard(output_layer, weight: Tensor | None, shard_kw: dict) -> VocabShard:
    """The :class:`VocabShard` of the layer: Megatron's even split over its tensor-parallel group, its sequence
    parallelism, and its hidden-gradient reduction (``weight`` None: no rows, the shard of a call refused on this
    rank)."""
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
    v_local = int(weight.shape[0]) if weight is not None and weight.dim() >= 1 else 0
    return VocabShard(
        group,
        rank * v_local,
        (rank + 1) * v_local,
        sequence_parallel=sequence_parallel,
        reduce_hidden_grad=reduce_hidden_grad,
        **shard_kw,
    )


def _shifted_labels(labels: Any, shift: Any, ignore_index: int) -> Tensor:
    """``labels [b, s]`` shifted along the sequence (their last dim; cce_dist's ``shift`` would act on the
    transposed targets' last dim, the batch)."""
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        raise ValueError(
            f"output_layer_loss: labels must be a [b, s] tensor, got "
            f"{tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__}"
        )
    shift = int(shift) if isinstance(shift, (bool, int)) else shift
    if not isinstance(shift, int) or shift < 0:
        raise ValueError(f"shift must be a bool or a non-negative int, got {shift!r}")
    if not shift:
        return labels
    # int64 first: ignore_index (-100) does not fit a uint8/int8 label tensor
    shifted = torch.full(labels.shape, ignore_index, dtype=torch.int64, device=labels.device)
    if shift < labels.shape[1]:
        shifted[:, : labels.shape[1] - shift] = labels[:, shift:]
    return shifted


# ----------------------------------------------------------------------------------------------
# patch(gpt_model): GPTModel's loss through output_layer_loss, without editing Megatron

#: Options a caller may pass to :func:`patch` (forwarded to :func:`output_layer_loss`). The rest
#: follow from the model: tp group, sequence parallelism, weight (tied or not) and bias from its
#: output layer; ``deterministic`` defaults to ``config.deterministic_mode``; ``reduction="none"``,
#: no ``shift`` (Megatron's labels already are the next tokens; MTP rolls its own) and no
#: ``return_lse`` (Megatron expects one ``[b, s]`` tensor).
PATCH_OPTIONS = (
    "ignore_index",
    "label_smoothing",
    "z_loss",
    "softcap",
    "impl",
    "chunk_size",
    "filter_eps",
    "deterministic",
    "stats_collective",
    "check",
)

#: The oldest megatron-core release whose GPTModel has the seams :func:`patch` wraps.
MIN_MEGATRON_VERSION = (0, 12)

_STATE_ATTR = "_cce_dist_patch"
_MISSING = object()


class _DeferredLogits:
    """Returned by the patched output layer instead of its ``[s, b, V/tp]`` logits while the model
    computes a loss: the layer's input ``[s(/tp), b, h]`` and weight, which the patched
    ``compute_language_model_loss`` turns into the per-token loss ``[b, s]``. Megatron's
    ``_postprocess`` only hands logits from the one to the other on that path; any other use is an
    error naming the cause rather than a silently wrong tensor."""

    __slots__ = ("hidden", "layer", "weight")

    def __init__(self, layer, hidden: Tensor, weight: Tensor | None):
        self.layer = layer
        self.hidden = hidden
        self.weight = weight

    def __getattr__(self, name):
        raise RuntimeError(
            f"cce_dist.megatron.patch: this model's logits are not materialized while it computes a loss (cce_dist "
            f"computes the loss from the output layer's input), but code between the output layer and "
            f"compute_language_model_loss used them (.{name}); cce_dist.megatron.unpatch(model) for this use"
        )

    def __repr__(self) -> str:
        return f"_DeferredLogits(hidden={tuple(self.hidden.shape)})"


@dataclasses.dataclass
class _PatchState:
    options: dict
    gate_name: str  # "_postprocess" (megatron-core >= 0.13) or "forward" (0.12)
    gate_signature: inspect.Signature
    layer: Any  # the output layer whose forward is patched
    previous: dict  # (owner id, attribute) -> the instance attribute before patching, or _MISSING
    installed: dict  # (owner id, attribute) -> the bound method patch() installed
    deferring: int = 0  # > 0 while a patched gate runs a loss forward


def is_patched(model: torch.nn.Module) -> bool:
    """Whether :func:`patch` is in effect on this ``GPTModel`` instance."""
    return _STATE_ATTR in vars(model)


def patch(gpt_model: torch.nn.Module, **loss_options: Any) -> torch.nn.Module:
    """Make ``gpt_model(..., labels=labels)`` compute its per-token loss with cce_dist (in place).

    Patches one megatron-core ``GPTModel`` *instance* (never the class): with ``labels`` given, the
    output layer no longer forms the ``[s, b, V/tp]`` logits; the loss ``[b, s]`` (float32, what
    ``compute_language_model_loss`` returns, before Megatron's loss mask) and the gradients of every
    parameter are those of the unpatched model. This covers the main head and every multi-token
    prediction head (``config.mtp_num_layers``: Megatron's roll of labels and loss mask, its loss
    scaling, ``calculate_per_token_loss`` and MTP loss logging run unchanged around it), tied
    embeddings (``share_embeddings_and_output_weights``: the ``output_weight`` Megatron passes),
    ``sequence_parallel``, the output layer's bias and tensor parallelism.

    Without labels, with an inference context (or megatron-core's ``InferenceMode`` active), with
    an ``output_processor``, with gathered logits at tp > 1 (``runtime_gather_output=True`` or
    ``parallel_output=False``) or with the config logger on (it logs the logits), the original code
    runs unchanged and returns logits. Evaluation with labels (``model.eval()``, ``torch.no_grad()``)
    uses cce_dist too.

    How (three instance methods wrapped; megatron-core 0.12 through 0.17, checked by feature at patch time) and what
    differs by design (``ignore_index`` labels get loss 0; the loss-fusion flags have no effect; label smoothing
    over the full vocabulary): docs/integrations.md, "Megatron-core models".

    Args:
        gpt_model: a ``megatron.core.models.gpt.GPTModel`` on the last pipeline stage
            (``post_process=True``); unwrap DDP / Float16Module first
            (``megatron.core.utils.unwrap_model``).
        **loss_options: any of :data:`PATCH_OPTIONS`: ``label_smoothing``, ``z_loss``, ``softcap``
            (no Megatron config field expresses them), ``ignore_index``, ``impl``, ``chunk_size``,
            ``filter_eps``, ``deterministic`` (default ``config.deterministic_mode``),
            ``stats_collective``, ``check``.

    Returns the same model. Patching a patched model replaces its options. Undo with :func:`unpatch`.

    Raises:
        ImportError: megatron-core is not installed.
        TypeError: not a GPTModel, an unknown option, or a megatron-core whose GPTModel lacks a seam.
        ValueError: a configuration the patch cannot reproduce (no output layer on this stage,
            MuP output scaling, deferred embedding wgrad compute) or a bad option value.
    """
    _require_megatron()
    model = gpt_model
    _check_version()
    _check_model(model)
    options = _check_options(model, loss_options)
    if is_patched(model):
        unpatch(model)
    gate_name, gate_original = _loss_gate(model)
    state = _PatchState(
        options=options,
        gate_name=gate_name,
        gate_signature=inspect.signature(gate_original),
        layer=model.output_layer,
        previous={},
        installed={},
    )
    for owner, name, fn in _replacements(model, state, gate_original):
        _install(state, owner, name, fn)
    object.__setattr__(model, _STATE_ATTR, state)
    return model


def _loss_gate(model) -> tuple[str, Any]:
    """``(name, bound method)`` of the method that knows whether a forward computes a loss: ``_postprocess``
    (megatron-core >= 0.13), else ``forward`` (0.12); it must take ``labels=``."""
    gate_name = "_postprocess" if callable(getattr(type(model), "_postprocess", None)) else "forward"
    gate_original = getattr(model, gate_name)
    if "labels" not in inspect.signature(gate_original).parameters:
        raise TypeError(
            f"cce_dist.megatron.patch: {type(model).__name__}.{gate_name} takes no labels=; this "
            "megatron-core version is not supported"
        )
    return gate_name, gate_original


def _replacements(model, state: _PatchState, gate_original) -> list[tuple[Any, str, Any]]:
    """``(owner, attribute, function)`` of the three seams: the gate marks a loss forward (``state.deferring``),
    during which the output layer returns a :class:`_DeferredLogits` record, which ``compute_language_model_loss``
    turns into the loss; any other call runs the original."""
    layer = state.layer
    gate_signature = state.gate_signature
    loss_original: Any = model.compute_language_model_loss
    loss_signature = inspect.signature(loss_original)
    layer_original = layer.forward
    layer_signature = inspect.signature(layer_original)

    def gate(self, *args, **kwargs):
        try:
            arguments = gate_signature.bind(*args, **kwargs).arguments
        except TypeError:
            return gate_original(*args, **kwargs)  # raises what the original raises
        if not _is_loss_forward(self, layer, arguments):
            return gate_original(*args, **kwargs)
        state.deferring += 1
        try:
            return gate_original(*args, **kwargs)
        finally:
            state.deferring -= 1

    def output_layer_forward(self, *args, **kwargs):
        if state.deferring <= 0:
            return layer_original(*args, **kwargs)
        arguments = layer_signature.bind(*args, **kwargs).arguments
        hidden = next(iter(arguments.values()))  # input_
        weight = arguments.get("weight")
        if weight is None:
            weight = self.weight
        output_bias = self.bias if getattr(self, "skip_bias_add", False) else None
        return _DeferredLogits(self, hidden, weight), output_bias

    def compute_language_model_loss(self, *args, **kwargs):
        arguments = loss_signature.bind(*args, **kwargs).arguments
        logits = arguments.get("logits")
        if not isinstance(logits, _DeferredLogits):
            return loss_original(*args, **kwargs)
        return output_layer_loss(
            logits.layer, logits.hidden, arguments["labels"], weight=logits.weight, **state.options
        )

    return [
        (model, state.gate_name, gate),
        (layer, "forward", output_layer_forward),
        (model, "compute_language_model_loss", compute_language_model_loss),
    ]


def _install(state: _PatchState, owner, name: str, fn) -> None:
    """Bind ``fn`` to this instance ``owner`` as ``name`` (the original's signature and docstring), recording what
    was there for :func:`unpatch`."""
    original = getattr(owner, name)
    sig = inspect.signature(original)  # bound: without self; the installed method shows the same
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    setattr(fn, "__signature__", sig.replace(parameters=[self_param, *sig.parameters.values()]))  # noqa: B010
    fn.__doc__ = (original.__doc__ or "") + "\n\n(patched by cce_dist.megatron.patch)"
    fn.__name__ = name
    bound = types.MethodType(fn, owner)
    state.previous[(id(owner), name)] = vars(owner).get(name, _MISSING)
    state.installed[(id(owner), name)] = bound
    object.__setattr__(owner, name, bound)


def unpatch(gpt_model: torch.nn.Module) -> torch.nn.Module:
    """Restore exactly what :func:`patch` replaced on this instance (and its output layer)."""
    model = gpt_model
    state: _PatchState | None = vars(model).get(_STATE_ATTR)
    if state is None:
        raise ValueError(f"{type(model).__name__} instance is not patched by cce_dist.megatron.patch")
    owners = [(model, state.gate_name), (state.layer, "forward"), (model, "compute_language_model_loss")]
    for owner, name in owners:
        if vars(owner).get(name) is not state.installed[(id(owner), name)]:
            raise RuntimeError(
                f"cce_dist.megatron.unpatch: {type(owner).__name__}.{name} was replaced again after patching; undo "
                "that first, then unpatch"
            )
    for owner, name in owners:
        previous = state.previous[(id(owner), name)]
        if previous is _MISSING:
            del owner.__dict__[name]
        else:
            object.__setattr__(owner, name, previous)
    del model.__dict__[_STATE_ATTR]
    return model


def _megatron_version() -> tuple | None:
    try:
        from megatron.core import package_info

        text = str(package_info.__version__)
    except (ImportError, AttributeError):
        text = str(getattr(_require_megatron(), "__version__", ""))
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _check_version() -> None:
    version = _megatron_version()
    if version is not None and version < MIN_MEGATRON_VERSION:
        raise TypeError(
            f"cce_dist.megatron.patch supports megatron-core >= {'.'.join(map(str, MIN_MEGATRON_VERSION))} (found "
            f"{'.'.join(map(str, version))}); upgrade megatron-core, or call output_layer_loss from your model's "
            "loss code"
        )


def _check_model(model) -> None:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear

    name = type(model).__name__
    if not isinstance(model, GPTModel):
        if isinstance(getattr(model, "module", None), torch.nn.Module):
            raise TypeError(
                f"cce_dist.megatron.patch: pass the GPTModel itself, not its {name} wrapper "
                "(megatron.core.utils.unwrap_model(model))"
            )
        raise TypeError(
            f"cce_dist.megatron.patch patches megatron-core GPTModel instances, got {name}; for another "
            "model's ColumnParallelLinear head call cce_dist.megatron.output_layer_loss"
        )
    layer = getattr(model, "output_layer", None)
    if not getattr(model, "post_process", True) or layer is None:
        raise ValueError(
            f"cce_dist.megatron.patch: this {name} has no output layer (post_process=False: not the "
            "last pipeline stage); patch the last stage's model chunk, the others compute no loss"
        )
    if not isinstance(layer, ColumnParallelLinear):
        raise TypeError(
            f"cce_dist.megatron.patch: {name}.output_layer is a {type(layer).__name__}, not a "
            "megatron-core ColumnParallelLinear"
        )
    params = inspect.signature(layer.forward).parameters
    if "weight" not in params or "runtime_gather_output" not in params:
        raise TypeError(
            "cce_dist.megatron.patch: ColumnParallelLinear.forward(input_, weight=, runtime_gather_output=) "
            "not found; this megatron-core version is not supported"
        )
    loss_fn = getattr(model, "compute_language_model_loss", None)
    if not callable(loss_fn) or not {"labels", "logits"} <= set(inspect.signature(loss_fn).parameters):
        raise TypeError(
            f"cce_dist.megatron.patch: {name}.compute_language_model_loss(labels, logits) not found; this "
            "megatron-core version is not supported"
        )
    config = model.config
    if getattr(config, "use_mup", False):
        raise ValueError(
            "cce_dist.megatron.patch: config.use_mup scales the logits before the loss "
            "(mup_output_mult), which the patched loss does not reproduce"
        )
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError(
            "cce_dist.megatron.patch: config.defer_embedding_wgrad_compute defers the output layer's "
            "weight gradient to the pipeline schedule, which needs the layer's own backward; turn it "
            "off to use cce_dist"
        )


def _check_options(model, loss_options: dict) -> dict:
    from .core.options import CrossEntropyOptions

    bad = sorted(set(loss_options) - set(PATCH_OPTIONS))
    if bad:
        raise TypeError(
            f"cce_dist.megatron.patch got unsupported option(s) {bad}; allowed: {list(PATCH_OPTIONS)} "
            "(the head, tp group, sequence parallelism, reduction and label shift follow from the model)"
        )
    options = dict(loss_options)
    options.setdefault("deterministic", bool(getattr(model.config, "deterministic_mode", False)))
    shard_kw = {k: options[k] for k in _SHARD_FIELDS if k in options}
    # validate now, not at the first training step
    CrossEntropyOptions(reduction="none", **{k: v for k, v in options.items() if k not in shard_kw})
    VocabShard(None, 0, 0, **shard_kw)
    return options


def _is_loss_forward(model, layer, arguments: dict) -> bool:
    """Whether this _postprocess (forward on 0.12) call computes a loss from logits that nothing
    else sees: labels given and none of the paths that use the logits themselves."""
    if arguments.get("labels") is None:
        return False
    for name in ("inference_context", "inference_params", "output_processor"):
        if arguments.get(name) is not None:
            return False
    # megatron-core >= 0.18 marks inference engines process-wide; the module is imported if it is used
    utils = sys.modules.get("megatron.core.inference.utils")
    inference_mode = getattr(utils, "InferenceMode", None)
    if inference_mode is not None and inference_mode.is_active():
        return False
    try:
        from megatron.core.config_logger import has_config_logger_enabled
    except ImportError:  # pragma: no cover - present in every supported version
        pass
    else:
        if has_config_logger_enabled(model.config):
            return False
    gather = arguments.get("runtime_gather_output")
    if gather is None:
        gather = getattr(layer, "gather_output", False)
    if gather:
        group = _tp_group(layer)
        if group is not None and dist.get_world_size(group) > 1:
            return False  # the caller asked for full-vocab logits on every rank
    return True


__all__ = ["MIN_MEGATRON_VERSION", "PATCH_OPTIONS", "is_patched", "output_layer_loss", "patch", "unpatch"]
