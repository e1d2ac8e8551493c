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

PEFT models (``get_peft_model(...)``) are patched through the causal LM inside them, so their
forward computes through cce_dist; other wrappers, and models whose ``.model`` is not the decoder,
are refused. The patched forward is a picklable object (``torch.save(model)`` / ``torch.load`` and
``copy.deepcopy`` keep the patch) and compiles with ``torch.compile(model, fullgraph=True)``. With
``return_dict=False`` it returns the original's tuple layout with ``None`` in the logits position.

Supported families (tested): Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 (text). Other
models whose causal-LM head is exactly "decoder -> lm_head (-> final softcap)" can be patched
with ``allow_unlisted=True``; models that rescale logits otherwise (Cohere's ``logit_scale``,
Granite's ``logits_scaling``) or add auxiliary losses (MoE router losses) are refused.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from .api import linear_cross_entropy
from .core.options import CrossEntropyOptions

__all__ = ["SUPPORTED_MODEL_TYPES", "is_patched", "patch", "unpatch"]

#: ``config.model_type`` values whose ``*ForCausalLM.forward`` the patched forward reproduces.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"})

#: Options of :func:`cce_dist.linear_cross_entropy` a caller may set through :func:`patch`.
#: The others follow from the model and the call (ignore_index, reduction, shift, softcap).
PATCH_OPTIONS = ("label_smoothing", "z_loss", "impl", "chunk_size", "grad_in_forward", "filter_eps", "deterministic")

# config fields that rescale the logits in ways this forward does not reproduce
_UNSUPPORTED_CONFIG_FIELDS = ("logit_scale", "logits_scaling", "output_router_logits")

_STATE_ATTR = "_cce_dist_patch"
_LOSS_ONLY_ARGS = ("labels", "logits_to_keep", "num_logits_to_keep", "return_dict")


class _PatchedForward:
    """The ``forward`` that :func:`patch` installs on one model instance.

    A plain picklable object (module-level class; its state is the model, the options and the
    original forward's positional parameter names), so ``torch.save(model)`` / ``torch.load`` and
    ``copy.deepcopy`` keep the patch, and a straight-line ``__call__`` without ``inspect`` or
    dataclass introspection, so ``torch.compile(model, fullgraph=True)`` traces it.
    """

    __name__ = "forward"

    def __init__(
        self, model: nn.Module, previous: Any, had_previous: bool, param_names: tuple, options: dict, eval_logits: bool
    ):
        self.model = model
        self.previous = previous  # the instance's own ``forward`` attribute before patching (if had_previous)
        self.had_previous = had_previous
        self.param_names = param_names  # positional parameters of the original forward, in order
        self.options = options
        self.eval_logits = eval_logits

    def original(self):
        """The forward that ran before patching (a bound method or the previous instance attribute)."""
        return self.previous if self.had_previous else types.MethodType(type(self.model).forward, self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        # introspection (Trainer's loss-kwargs and column detection, generate's logits_to_keep
        # check) sees the original parameters
        return inspect.signature(self.original())

    @property
    def __doc__(self) -> str:  # type: ignore[override]
        return (self.original().__doc__ or "") + "\n\n(patched by cce_dist.hf.patch: see cce_dist.hf)"

    def __call__(self, *args, **kwargs):
        return _patched_forward(self, args, kwargs)


def _find_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM to patch: ``model`` itself, or the one inside a PEFT wrapper.

    A ``peft.PeftModel`` (any task type) or a PEFT tuner (``LoraModel``, ...) calls the causal LM it
    wraps, whose instance ``forward`` is the patched one; so patching the inner model makes the
    wrapper's forward compute through cce_dist too, whether ``patch`` runs before or after
    ``get_peft_model``.
    """
    try:
        import peft
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:
        return model
    if isinstance(model, peft.PeftModel):
        return _find_causal_lm(model.get_base_model())
    if isinstance(model, BaseTuner):
        return _find_causal_lm(model.model)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether :func:`patch` is in effect on this model instance (or on the causal LM inside a PEFT model)."""
    return isinstance(vars(_find_causal_lm(model)).get(_STATE_ATTR), _PatchedForward)


def patch(model: nn.Module, *, eval_logits: bool = True, allow_unlisted: bool = False, **options) -> nn.Module:
    """Make ``model(..., labels=...)`` compute its causal-LM loss with cce_dist (in place).

    Args:
        model: a ``transformers`` ``*ForCausalLM`` instance (``model.model`` is the decoder,
            ``model.lm_head`` the output projection), or a PEFT model wrapping one
            (``get_peft_model(...)``, any adapter that leaves ``lm_head`` a plain ``nn.Linear``):
            then the causal LM inside is patched and the PEFT model's forward goes through it.
        eval_logits: in eval mode, run the original forward (logits returned, loss computed by
            transformers) even when labels are given. False: use cce_dist in eval too (no logits).
        allow_unlisted: patch a model type outside :data:`SUPPORTED_MODEL_TYPES` whose head is
            the standard "decoder -> lm_head -> optional final_logit_softcapping".
        **options: any of :data:`PATCH_OPTIONS`, passed to :func:`cce_dist.linear_cross_entropy`
            (e.g. ``label_smoothing=0.1`` — use this instead of ``TrainingArguments``'
            ``label_smoothing_factor``, which needs logits).

    Returns the model passed in. Patching a patched model replaces the previous options. The patch
    survives ``torch.save(model)`` / ``torch.load`` and ``copy.deepcopy``; the patched forward
    compiles with ``torch.compile(model, fullgraph=True)``. Undo with :func:`unpatch`.
    """
    bad = sorted(set(options) - set(PATCH_OPTIONS))
    if bad:
        raise TypeError(
            f"cce_dist.hf.patch got unsupported option(s) {bad}; allowed: {list(PATCH_OPTIONS)} (ignore_index, "
            "reduction, shift and softcap follow from the model and the forward call)"
        )
    CrossEntropyOptions(**options)  # validate now, not at the first training step
    outer = model
    model = _find_causal_lm(model)
    _check_model(model, allow_unlisted, wrapper=None if outer is model else type(outer).__name__)
    if is_patched(model):
        unpatch(model)

    had_previous = "forward" in vars(model)
    original = model.forward
    signature = inspect.signature(original)
    if (
        not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        or "labels" not in signature.parameters
    ):
        raise TypeError(f"{type(model).__name__}.forward must take labels= and **kwargs to be patched")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    param_names = []
    for p in signature.parameters.values():
        if p.kind not in positional:
            break
        param_names.append(p.name)
    patched = _PatchedForward(
        model, vars(model).get("forward"), had_previous, tuple(param_names), dict(options), eval_logits
    )
    object.__setattr__(model, _STATE_ATTR, patched)
    object.__setattr__(model, "forward", patched)
    return outer


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the forward that :func:`patch` replaced (exactly: the same attribute as before)."""
    outer = model
    model = _find_causal_lm(model)
    state: _PatchedForward | None = vars(model).get(_STATE_ATTR)
    if state is None:
        raise ValueError(f"{type(model).__name__} instance is not patched by cce_dist.hf.patch")
    had_previous, previous = state.had_previous, state.previous
    if vars(model).get("forward") is not state:
        raise RuntimeError(
            "cce_dist.hf.unpatch: model.forward was replaced again after patching (e.g. by a wrapper that "
            "stores its own forward); undo that wrapper first, then unpatch"
        )
    if had_previous:
        object.__setattr__(model, "forward", previous)
    else:
        del model.__dict__["forward"]
    del model.__dict__[_STATE_ATTR]
    return outer


# ----------------------------------------------------------------------------------------------


def _check_model(model: nn.Module, allow_unlisted: bool, wrapper: str | None = None) -> None:
    from transformers import PreTrainedModel

    name = type(model).__name__ if wrapper is None else f"{type(model).__name__} (inside {wrapper})"
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"cce_dist.hf.patch expects a transformers *ForCausalLM model or a PEFT model wrapping one, got {name}; "
            "for another wrapper (DistributedDataParallel, FSDP, torch.compile's OptimizedModule, a custom module) "
            "patch the causal LM inside it, e.g. cce_dist.hf.patch(wrapper.module), preferably before wrapping"
        )
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"cce_dist.hf.patch expects a transformers model with a .config, got {name}")
    _check_head(model)
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, nn.Module):
        raise TypeError(f"cce_dist.hf.patch: {name} has no decoder at .model")
    if decoder is not getattr(model, "base_model", decoder) or hasattr(decoder, "lm_head"):
        raise TypeError(
            f"cce_dist.hf.patch: {name}.model is a {type(decoder).__name__}, not the decoder that returns the final "
            "hidden states (it has its own lm_head or is not the model's base_model); patch the *ForCausalLM model "
            "whose .model is the decoder (for PEFT models pass the PeftModel or get_base_model())"
        )
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


def _check_head(model: nn.Module) -> nn.Linear:
    """``model.lm_head``, which must be a plain ``nn.Linear`` (its weight is what the loss reads)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        hint = ""
        if hasattr(head, "base_layer") or hasattr(head, "original_module"):
            hint = (
                " (it is wrapped by a PEFT adapter: leave lm_head out of the adapter's target_modules and "
                "modules_to_save, e.g. LoraConfig(target_modules=[...attention/MLP projections only...]))"
            )
        raise TypeError(
            f"cce_dist.hf.patch: {type(model).__name__}.lm_head must be an nn.Linear, got {type(head).__name__}{hint}"
        )
    return head


def _patched_forward(patched: _PatchedForward, args: tuple, kwargs: dict):
    """The patched forward's body (straight-line: torch.compile(fullgraph=True) traces it)."""
    model = patched.model
    if len(args) > len(patched.param_names):
        raise TypeError(
            f"{type(model).__name__}.forward takes at most {len(patched.param_names)} positional "
            f"arguments ({len(args)} given)"
        )
    arguments = dict(kwargs)
    for pname, value in zip(patched.param_names, args):
        if pname in arguments:
            raise TypeError(f"{type(model).__name__}.forward got multiple values for argument {pname!r}")
        arguments[pname] = value
    labels = arguments.get("labels")
    logits_to_keep = arguments.get("logits_to_keep", arguments.get("num_logits_to_keep", 0))
    use_original = (
        labels is None
        or (not model.training and patched.eval_logits)
        or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
    )
    if use_original:
        if patched.had_previous:
            return patched.previous(*args, **kwargs)
        return type(model).forward(model, *args, **kwargs)

    # Everything else goes to the decoder, as the original forward passes it (loss kwargs included).
    decoder_kwargs = {k: v for k, v in arguments.items() if k not in _LOSS_ONLY_ARGS}
    return_dict = arguments.get("return_dict")
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    num_items_in_batch = decoder_kwargs.get("num_items_in_batch")
    ignore_index = decoder_kwargs.get("ignore_index", -100)
    shift_labels = decoder_kwargs.get("shift_labels")

    head = _check_head(model)  # again: an adapter may have wrapped lm_head after patching
    decoder: Any = model.model
    outputs = decoder(**decoder_kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    if shift_labels is not None:
        targets, shift = shift_labels, 0
    else:
        targets, shift = labels, 1
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        targets.to(hidden.device),
        bias=head.bias,
        ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum",
        softcap=getattr(model.config, "final_logit_softcapping", None),
        shift=shift,
        **patched.options,
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return _output(outputs, loss, return_dict)


def _output(decoder_outputs, loss, return_dict: bool):
    """The original forward's output with ``logits=None``.

    ``return_dict=False``: the original's tuple layout, ``(loss, logits, *rest)`` where rest is the
    non-None of past_key_values, hidden_states, attentions (``ModelOutput.to_tuple``), with
    ``None`` in the logits position, so ``out[1]`` is never silently the cache.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    past = getattr(decoder_outputs, "past_key_values", None)
    hidden_states = getattr(decoder_outputs, "hidden_states", None)
    attentions = getattr(decoder_outputs, "attentions", None)
    if not return_dict:
        return (loss, None) + tuple(x for x in (past, hidden_states, attentions) if x is not None)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=past,  # type: ignore[call-arg]
        hidden_states=hidden_states,
        attentions=attentions,
    )
