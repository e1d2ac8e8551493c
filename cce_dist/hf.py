"""Hugging Face ``transformers`` integration: causal-LM training loss without materialized logits.

``patch(model)`` replaces the ``forward`` of one model *instance* (never the class, so other
instances and ``unpatch`` are unaffected). The patched forward runs the model's decoder, then
computes the loss with :func:`cce_dist.linear_cross_entropy` from the final hidden states and
``model.lm_head`` — the ``[batch, seq, vocab]`` logits are never formed. It reproduces
``ForCausalLMLoss`` (the default ``model.loss_function`` of causal LMs):

- labels are shifted by one position (position ``i`` predicts ``labels[..., i + 1]``) via the
  ``shift`` option, or taken as given when ``shift_labels=`` is passed;
- ``ignore_index`` (default -100) positions contribute nothing;
- with ``num_items_in_batch`` (what ``Trainer`` passes under gradient accumulation) the loss is
  the token *sum* divided by it, otherwise the mean over non-ignored tokens (0, not NaN, when a
  batch has no valid token — HF's own loss gives NaN there);
- Gemma 2/3's ``config.final_logit_softcapping`` is applied (inside the fused loss);
- tied embeddings need nothing special: ``lm_head.weight`` *is* the embedding matrix, and its
  gradient accumulates both contributions.

When the patched path runs (the model is in training mode and ``labels`` are given) the output's
``logits`` is ``None``. Otherwise the original forward runs unchanged and returns logits: no
labels, ``logits_to_keep`` other than 0, or eval mode with ``eval_logits=True`` (the default, so
``Trainer.evaluate`` / ``compute_metrics`` still see logits).

Supported families (tested): Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 (text). Other
models whose causal-LM head is exactly "decoder -> lm_head (-> final softcap)" can be patched
with ``allow_unlisted=True``; models that rescale logits otherwise (Cohere's ``logit_scale``,
Granite's ``logits_scaling``) or add auxiliary losses (MoE router losses) are refused.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any

import torch
from torch import nn

from .api import linear_cross_entropy
from .options import CrossEntropyOptions

__all__ = ["SUPPORTED_MODEL_TYPES", "is_patched", "patch", "unpatch"]

#: ``config.model_type`` values whose ``*ForCausalLM.forward`` the patched forward reproduces.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"})

#: Options of :func:`cce_dist.linear_cross_entropy` a caller may set through :func:`patch`.
#: The others follow from the model and the call (ignore_index, reduction, shift, softcap).
PATCH_OPTIONS = ("label_smoothing", "z_loss", "impl", "chunk_size", "grad_in_forward", "filter_eps", "deterministic")

# config fields that rescale the logits in ways this forward does not reproduce
_UNSUPPORTED_CONFIG_FIELDS = ("logit_scale", "logits_scaling", "output_router_logits")

_STATE_ATTR = "_cce_dist_patch"
_MISSING = object()


@dataclasses.dataclass
class _PatchState:
    previous: Any  # the instance's own ``forward`` attribute before patching, or _MISSING
    original: Any  # the forward that ran before patching (bound method)
    signature: inspect.Signature
    patched: Any  # the bound method installed by patch()
    options: dict
    eval_logits: bool


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch` is in effect on this model instance."""
    return _STATE_ATTR in vars(model)


def patch(model: nn.Module, *, eval_logits: bool = True, allow_unlisted: bool = False, **options) -> nn.Module:
    """Make ``model(..., labels=...)`` compute its causal-LM loss with cce_dist (in place).

    Args:
        model: a ``transformers`` ``*ForCausalLM`` instance (``model.model`` is the decoder,
            ``model.lm_head`` the output projection).
        eval_logits: in eval mode, run the original forward (logits returned, loss computed by
            transformers) even when labels are given. False: use cce_dist in eval too (no logits).
        allow_unlisted: patch a model type outside :data:`SUPPORTED_MODEL_TYPES` whose head is
            the standard "decoder -> lm_head -> optional final_logit_softcapping".
        **options: any of :data:`PATCH_OPTIONS`, passed to :func:`cce_dist.linear_cross_entropy`
            (e.g. ``label_smoothing=0.1`` — use this instead of ``TrainingArguments``'
            ``label_smoothing_factor``, which needs logits).

    Returns the same model. Patching a patched model replaces the previous options.
    Undo with :func:`unpatch`.
    """
    bad = sorted(set(options) - set(PATCH_OPTIONS))
    if bad:
        raise TypeError(
            f"cce_dist.hf.patch got unsupported option(s) {bad}; allowed: {list(PATCH_OPTIONS)} (ignore_index, "
            "reduction, shift and softcap follow from the model and the forward call)"
        )
    CrossEntropyOptions(**options)  # validate now, not at the first training step
    _check_model(model, allow_unlisted)
    if is_patched(model):
        unpatch(model)

    previous = vars(model).get("forward", _MISSING)
    original = model.forward
    signature = inspect.signature(original)
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()) \
            or "labels" not in signature.parameters:
        raise TypeError(f"{type(model).__name__}.forward must take labels= and **kwargs to be patched")

    def forward(self, *args, **kwargs):
        return _patched_forward(self, *args, **kwargs)

    # introspection (Trainer's loss-kwargs detection, generate's logits_to_keep check) sees the
    # original parameters
    forward.__signature__ = inspect.signature(type(model).forward)
    forward.__doc__ = (original.__doc__ or "") + "\n\n(patched by cce_dist.hf.patch: see cce_dist.hf)"
    forward.__name__ = "forward"
    patched = types.MethodType(forward, model)
    state = _PatchState(previous=previous, original=original, signature=signature, patched=patched,
                        options=dict(options), eval_logits=eval_logits)
    object.__setattr__(model, _STATE_ATTR, state)
    object.__setattr__(model, "forward", patched)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the forward that :func:`patch` replaced (exactly: the same attribute as before)."""
    state = vars(model).get(_STATE_ATTR)
    if state is None:
        raise ValueError(f"{type(model).__name__} instance is not patched by cce_dist.hf.patch")
    if vars(model).get("forward") is not state.patched:
        raise RuntimeError(
            "cce_dist.hf.unpatch: model.forward was replaced again after patching (e.g. by a wrapper that "
            "stores its own forward); undo that wrapper first, then unpatch"
        )
    if state.previous is _MISSING:
        del model.__dict__["forward"]
    else:
        object.__setattr__(model, "forward", state.previous)
    del model.__dict__[_STATE_ATTR]
    return model


# ----------------------------------------------------------------------------------------------


def _check_model(model: nn.Module, allow_unlisted: bool) -> None:
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"cce_dist.hf.patch expects a transformers model with a .config, got {name}")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise TypeError(f"cce_dist.hf.patch: {name}.lm_head must be an nn.Linear, got {type(head).__name__}")
    if not isinstance(getattr(model, "model", None), nn.Module):
        raise TypeError(f"cce_dist.hf.patch: {name} has no decoder at .model")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        if not allow_unlisted:
            raise ValueError(
                f"cce_dist.hf.patch: model_type {model_type!r} ({name}) is not in the tested families "
                f"{sorted(SUPPORTED_MODEL_TYPES)}; pass allow_unlisted=True if its forward is exactly "
                "decoder -> lm_head (-> final_logit_softcapping) -> ForCausalLMLoss"
            )
        for field in _UNSUPPORTED_CONFIG_FIELDS:
            if getattr(config, field, None) not in (None, False, 1, 1.0):
                raise ValueError(
                    f"cce_dist.hf.patch: {name} has config.{field}={getattr(config, field)!r}, which changes the "
                    "logits or the loss in a way the patched forward does not reproduce"
                )


def _patched_forward(model: nn.Module, *args, **kwargs):
    state: _PatchState = vars(model)[_STATE_ATTR]
    bound = state.signature.bind(*args, **kwargs)
    arguments = dict(bound.arguments)
    labels = arguments.get("labels")
    logits_to_keep = arguments.get("logits_to_keep", arguments.get("num_logits_to_keep", 0))
    use_original = (
        labels is None
        or (not model.training and state.eval_logits)
        or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
    )
    if use_original:
        return state.original(*args, **kwargs)

    # Everything else goes to the decoder, as the original forward passes it (loss kwargs included).
    decoder_kwargs: dict = {}
    for pname, value in arguments.items():
        kind = state.signature.parameters[pname].kind
        if kind == inspect.Parameter.VAR_KEYWORD:
            decoder_kwargs.update(value)
        elif kind == inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError("cce_dist.hf: unexpected extra positional arguments to forward")
        elif pname not in ("labels", "logits_to_keep", "num_logits_to_keep"):
            decoder_kwargs[pname] = value
    return_dict = decoder_kwargs.pop("return_dict", None)
    if return_dict is None:
        config = model.config
        return_dict = getattr(config, "return_dict", True)
    num_items_in_batch = decoder_kwargs.get("num_items_in_batch")
    ignore_index = decoder_kwargs.get("ignore_index", -100)
    shift_labels = decoder_kwargs.get("shift_labels")

    outputs = model.model(**decoder_kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    head = model.lm_head
    if shift_labels is not None:
        targets, shift = shift_labels, 0
    else:
        targets, shift = labels, 1
    loss = linear_cross_entropy(
        hidden, head.weight, targets.to(hidden.device), bias=head.bias, ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
        softcap=getattr(model.config, "final_logit_softcapping", None), shift=shift, **state.options,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return _output(outputs, loss, return_dict)


def _output(decoder_outputs, loss, return_dict: bool):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    extra = {}
    for name in ("cache", "past_key_values", "hidden_states", "attentions"):
        if name in fields and hasattr(decoder_outputs, name) and name in decoder_outputs.__dataclass_fields__:
            extra[name] = getattr(decoder_outputs, name)
    out = CausalLMOutputWithPast(loss=loss, logits=None, **extra)
    return out if return_dict else out.to_tuple()

