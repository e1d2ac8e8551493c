"""Hugging Face ``transformers`` integration: causal-LM training loss without materialized logits.

``patch(model)`` changes one model *instance* (never the class, so other instances and ``unpatch`` are unaffected).
In the patched path (training mode, ``labels`` given) the model's own forward runs unchanged except at two points:

- its output embeddings (``model.get_output_embeddings()``, an ``nn.Linear``) keep their input, the final hidden
  states ``[batch, seq, hidden]``, and return small *probe* logits ``[1, 1, vocab]`` float32 instead of the
  ``[batch, seq, vocab]`` ones;
- its ``loss_function`` (transformers' ``ForCausalLMLoss``) computes the loss with
  :func:`cce_dist.linear_cross_entropy` from those hidden states and the head's weight (and bias).

Whatever the forward does around them stays the model's: vision towers and multimodal embeddings of
vision-language models, MoE router auxiliary losses (``output_router_logits``: the forward adds
``router_aux_loss_coef * aux_loss`` to the returned loss itself), scaling of the hidden states before the head.
What the forward does to the logits between the head and the loss is read from the probe: the multiplier and
final softcap of the family (Cohere's ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's
``lm_head_multiplier``, Gemma's ``final_logit_softcapping``, ...; :mod:`cce_dist.hf_heads`) are matched against
what the model made of the probe and applied exactly (the multiplier to the hidden states and bias, the softcap
inside the fused loss). A model that does anything else to its logits, computes its loss without
``self.loss_function``, or calls its head more than once raises at its first patched call, naming what it did:
never a silently different loss. The loss reproduces ``ForCausalLMLoss``:

- labels are shifted by one position (position ``i`` predicts ``labels[..., i + 1]``) via the ``shift`` option, or
  taken as given when ``shift_labels=`` is passed; ``ignore_index`` (default -100) positions contribute nothing;
- with ``num_items_in_batch`` (what ``Trainer`` passes under gradient accumulation) the loss is the token *sum*
  divided by it, otherwise the mean over non-ignored tokens (0, not NaN, when a batch has no valid token);
- tied embeddings need nothing special: the head's weight *is* the embedding matrix.

A head that :func:`cce_dist.fsdp.shard_lm_head` distributed over FSDP2's data-parallel mesh is scored in place
(``shard=cce_dist.fsdp.head_shard(head)``: each rank's own tokens on the group's vocab shards, FSDP2's gradient for
the head's rows, no ``V x D`` gather; docs/fsdp.md); every other head runs as before.

When the patched path runs the output's ``logits`` is ``None``. Otherwise the original forward runs unchanged and
returns logits: no labels, ``logits_to_keep`` other than 0, or eval mode with ``eval_logits=True`` (the default, so
``Trainer.evaluate`` / ``compute_metrics`` still see logits). ``fused_lm_head=True`` calls (TRL's fused head,
installed by its trainers) go to TRL's head, which :func:`cce_dist.trl.patch` makes score with cce_dist; without
that patch they raise, naming it.

PEFT models (``get_peft_model(...)``) are patched through the causal LM inside them; other wrappers, and models
holding another causal LM that owns the head, are refused. The patch is picklable (``torch.save(model)`` /
``torch.load`` and ``copy.deepcopy`` keep it) and compiles with ``torch.compile(model, fullgraph=True)`` (compiled,
the family's usual transform is used and checked against the probe with ``torch._assert_async``; eager steps
identify it). With ``return_dict=False`` the output is the original's tuple layout with ``None`` for the logits.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import torch
from torch import nn

from . import hf_heads
from .api import linear_cross_entropy
from .core.options import CrossEntropyOptions
from .fsdp import head_shard

__all__ = ["SUPPORTED_MODEL_TYPES", "TESTED_MODEL_TYPES", "is_patched", "patch", "unpatch"]

#: ``config.model_type`` values the tests compare with the unpatched model (any causal LM that passes the checks of
#: :func:`patch` is supported; these are the ones tested).
TESTED_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "cohere", "granite"}
    | {"falcon_h1", "mixtral", "qwen2_moe", "olmoe", "qwen2_vl", "llava", "gemma3"}
)
#: the former name of :data:`TESTED_MODEL_TYPES` (it was a gate; it no longer is)
SUPPORTED_MODEL_TYPES = TESTED_MODEL_TYPES

#: Options of :func:`cce_dist.linear_cross_entropy` a caller may set through :func:`patch`.
#: The others follow from the model and the call (ignore_index, reduction, shift, softcap).
PATCH_OPTIONS = ("label_smoothing", "z_loss", "impl", "chunk_size", "grad_in_forward", "filter_eps", "deterministic")

_STATE_ATTR = "_cce_dist_patch"


class _PatchedForward:
    """The ``forward`` that :func:`patch` installs on one model instance, and the state of one patched call.

    A plain picklable object (module-level class; its state is the model, the options, the original forward's
    positional parameter names and the call's captures), so ``torch.save(model)`` / ``torch.load`` and
    ``copy.deepcopy`` keep the patch, and a straight-line ``__call__`` that ``torch.compile(fullgraph=True)`` traces.
    """

    __name__ = "forward"

    def __init__(
        self,
        model: nn.Module,
        previous: Any,
        had_previous: bool,
        param_names: tuple,
        options: dict,
        eval_logits: bool,
        candidates: tuple[hf_heads.LogitTransform, ...],
    ):
        self.model = model
        self.previous = previous  # the instance's own ``forward`` attribute before patching (if had_previous)
        self.had_previous = had_previous
        self.param_names = param_names  # positional parameters of the original forward, in order
        self.options = options
        self.eval_logits = eval_logits
        self.candidates = candidates  # the logit transforms the config allows, the family's usual one first
        self.transform: hf_heads.LogitTransform | None = None  # the one the last eager call identified
        self.head: _CaptureHead | None = None
        self.loss_fn: _CceLoss | None = None
        self._reset(active=False)

    def _reset(self, active: bool) -> None:
        self.active = active
        self.hidden: torch.Tensor | None = None  # the head's input in this call
        self.probe: torch.Tensor | None = None  # the logits the head returned in its place
        self.observed: torch.Tensor | None = None  # what the forward passed to loss_function as logits
        self.head_calls = 0
        self.loss_calls = 0

    def original(self):
        """The forward that ran before patching (a bound method or the previous instance attribute)."""
        return self.previous if self.had_previous else types.MethodType(type(self.model).forward, self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        # introspection (Trainer's loss-kwargs and column detection, generate's logits_to_keep check) sees the
        # original parameters
        return inspect.signature(self.original())

    @property
    def __doc__(self) -> str:  # type: ignore[override]
        return (self.original().__doc__ or "") + "\n\n(patched by cce_dist.hf.patch: see cce_dist.hf)"

    def call_original(self, *args, **kwargs):
        """Run the original forward (no ``types.MethodType``: torch.compile traces this)."""
        if self.had_previous:
            return self.previous(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return _patched_forward(self, args, kwargs)


class _CaptureHead:
    """The output embeddings' ``forward`` while patched: ``z = x @ W.T + b`` outside a patched call; inside one, keeps
    ``x`` (``[..., hidden]``) and returns :func:`cce_dist.hf_heads.probe` logits ``[1, ..., 1, vocab]``."""

    def __init__(self, head: nn.Linear, state: _PatchedForward, previous: Any, had_previous: bool):
        self.module = head
        self.state = state
        self.previous = previous
        self.had_previous = had_previous

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        state = self.state
        if not state.active:
            if self.had_previous:
                return self.previous(x)
            return nn.functional.linear(x, self.module.weight, self.module.bias)
        state.head_calls += 1
        state.hidden = x
        state.probe = hf_heads.probe(self.module.weight.shape[0], x.dim(), x.device)
        return state.probe


class _CceLoss:
    """The model's ``loss_function`` while patched: ``ForCausalLMLoss``'s signature; inside a patched call, the loss
    of the kept hidden states with :func:`cce_dist.linear_cross_entropy` (a float32 scalar), else the original."""

    def __init__(self, state: _PatchedForward, previous: Any, had_previous: bool):
        self.state = state
        self.previous = previous  # the loss function the model used (ForCausalLMLoss)
        self.had_previous = had_previous  # whether it was the instance's own ``_loss_function``

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        state = self.state
        if not state.active:
            return self.previous(
                logits,
                labels,
                vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        state.loss_calls += 1
        state.observed = logits
        hidden, probe = state.hidden, state.probe
        name = type(state.model).__name__
        if hidden is None or probe is None:
            raise RuntimeError(
                f"cce_dist.hf: {name} called its loss_function before its output embeddings: the patched loss has "
                "no hidden states to score"
            )
        if state.head_calls != 1:
            raise RuntimeError(_calls_message(state))
        transform = hf_heads.resolve(type(state.model).__name__, logits, probe, state.candidates, state.transform)
        state.transform = transform
        head = _check_head(state.model)
        weight: torch.Tensor = head.weight
        bias: torch.Tensor | None = head.bias
        hidden = hidden.to(weight.device)
        if transform.scale != 1.0:  # (s h) W^T + s b = s (h W^T + b)
            hidden = hidden * transform.scale
            bias = None if bias is None else bias * transform.scale
        targets, shift = (labels, 1) if shift_labels is None else (shift_labels, 0)
        loss = linear_cross_entropy(
            hidden,
            weight,
            targets.to(hidden.device),
            bias=bias,
            ignore_index=ignore_index,
            reduction="mean" if num_items_in_batch is None else "sum",
            softcap=transform.softcap,
            shift=shift,
            shard=head_shard(weight),  # a head cce_dist.fsdp.shard_lm_head sharded: scored where it lies (else None)
            **state.options,
        )
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def _find_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM to patch: ``model`` itself, or the one inside a PEFT wrapper.

    A ``peft.PeftModel`` (any task type) or a PEFT tuner (``LoraModel``, ...) calls the causal LM it wraps, whose
    instance ``forward`` is the patched one; so patching the inner model makes the wrapper's forward compute through
    cce_dist too, whether ``patch`` runs before or after ``get_peft_model``.
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


def patch(model: nn.Module, *, eval_logits: bool = True, allow_unlisted: bool = False, **options: Any) -> nn.Module:
    """Make ``model(..., labels=...)`` compute its causal-LM loss with cce_dist (in place).

    Args:
        model: a ``transformers`` causal LM (``*ForCausalLM``, or a vision-language ``*ForConditionalGeneration``)
            whose ``get_output_embeddings()`` is an ``nn.Linear`` (bias allowed) and whose forward passes the head's
            (post-processed) output to ``self.loss_function`` (transformers' ``ForCausalLMLoss``); or a PEFT model
            wrapping one (any adapter that leaves the head a plain ``nn.Linear``): then the causal LM inside is
            patched and the PEFT model's forward goes through it.
        eval_logits: in eval mode, run the original forward (logits returned, loss computed by transformers) even
            when labels are given. False: use cce_dist in eval too (no logits).
        allow_unlisted: ignored (every causal LM that passes the checks is patched; kept for compatibility).
        **options: any of :data:`PATCH_OPTIONS`, passed to :func:`cce_dist.linear_cross_entropy` (e.g.
            ``label_smoothing=0.1`` — use this instead of ``TrainingArguments``' ``label_smoothing_factor``, which
            needs logits).

    Returns the model passed in. Patching a patched model replaces the previous options. Raises TypeError for a
    model that is not such a causal LM (naming what is missing: a ``PreTrainedModel``, an ``nn.Linear`` head, a
    forward taking ``labels=`` and ``**kwargs``, a loss through ``self.loss_function``), ValueError for a config
    field that scales or caps the logits by a non-positive or infinite value. The patch survives
    ``torch.save(model)`` / ``torch.load`` and ``copy.deepcopy``; the patched forward compiles with
    ``torch.compile(model, fullgraph=True)``. Undo with :func:`unpatch`.
    """
    del allow_unlisted
    bad = sorted(set(options) - set(PATCH_OPTIONS))
    if bad:
        raise TypeError(
            f"cce_dist.hf.patch got unsupported option(s) {bad}; allowed: {list(PATCH_OPTIONS)} (ignore_index, "
            "reduction, shift and softcap follow from the model and the forward call)"
        )
    CrossEntropyOptions(**options)  # validate now, not at the first training step
    outer = model
    model = _find_causal_lm(model)
    if is_patched(model):
        unpatch(model)
    head = _check_model(model, wrapper=None if outer is model else type(outer).__name__)
    candidates = hf_heads.candidate_transforms(model.config)

    had_previous = "forward" in vars(model)
    original = model.forward
    signature = inspect.signature(original)
    if (
        not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        or "labels" not in signature.parameters
    ):
        raise TypeError(f"cce_dist.hf.patch: {type(model).__name__}.forward must take labels= and **kwargs")
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    param_names = []
    for p in signature.parameters.values():
        if p.kind not in positional:
            break
        param_names.append(p.name)
    state = _PatchedForward(
        model, vars(model).get("forward"), had_previous, tuple(param_names), dict(options), eval_logits, candidates
    )
    state.head = _CaptureHead(head, state, vars(head).get("forward"), "forward" in vars(head))
    state.loss_fn = _CceLoss(state, model.loss_function, "_loss_function" in vars(model))
    object.__setattr__(head, "forward", state.head)
    object.__setattr__(model, "_loss_function", state.loss_fn)
    object.__setattr__(model, _STATE_ATTR, state)
    object.__setattr__(model, "forward", state)
    return outer


def unpatch(model: nn.Module) -> nn.Module:
    """Restore what :func:`patch` replaced (exactly: the forward, the head's forward and the loss function)."""
    outer = model
    model = _find_causal_lm(model)
    state = vars(model).get(_STATE_ATTR)
    if not isinstance(state, _PatchedForward):
        raise ValueError(f"{type(model).__name__} instance is not patched by cce_dist.hf.patch")
    forward: object = vars(model).get("forward")
    if forward is not state:
        raise RuntimeError(
            "cce_dist.hf.unpatch: model.forward was replaced again after patching (e.g. by a wrapper that "
            "stores its own forward); undo that wrapper first, then unpatch"
        )
    _restore(model, "forward", state.had_previous, state.previous)
    loss_fn, capture = state.loss_fn, state.head
    installed: object = vars(model).get("_loss_function")
    if loss_fn is not None and installed is loss_fn:
        _restore(model, "_loss_function", loss_fn.had_previous, loss_fn.previous)
    head_forward: object = None if capture is None else vars(capture.module).get("forward")
    if capture is not None and head_forward is capture:
        _restore(capture.module, "forward", capture.had_previous, capture.previous)
    del model.__dict__[_STATE_ATTR]
    return outer


def _restore(obj: Any, name: str, had_previous: bool, previous: Any) -> None:
    if had_previous:
        object.__setattr__(obj, name, previous)
    else:
        del obj.__dict__[name]


# ----------------------------------------------------------------------------------------------


def _check_model(model: nn.Module, wrapper: str | None = None) -> nn.Linear:
    """The model's head, after checking that :func:`patch` can reproduce the model's loss (see its Raises)."""
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(model).__name__ if wrapper is None else f"{type(model).__name__} (inside {wrapper})"
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"cce_dist.hf.patch expects a transformers causal LM or a PEFT model wrapping one, got {name}; "
            "for another wrapper (DistributedDataParallel, FSDP, torch.compile's OptimizedModule, a custom module) "
            "patch the causal LM inside it, e.g. cce_dist.hf.patch(wrapper.module), preferably before wrapping"
        )
    head = _check_head(model)
    for sub_name, sub in model.named_modules():
        if sub is not model and isinstance(sub, PreTrainedModel) and getattr(sub, "lm_head", None) is head:
            raise TypeError(
                f"cce_dist.hf.patch: {name}.{sub_name} is a {type(sub).__name__}, not the decoder: it owns the "
                "output embeddings and computes its own loss; patch that causal LM instead"
            )
    loss_function = model.loss_function
    if loss_function is not ForCausalLMLoss:
        raise TypeError(
            f"cce_dist.hf.patch: {name}.loss_function is {getattr(loss_function, '__name__', loss_function)!r}, "
            "not transformers' ForCausalLMLoss (config.loss_type or a custom model.loss_function): the patched loss "
            "reproduces ForCausalLMLoss only"
        )
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):  # no source: the first patched call checks that loss_function runs
        source = "self.loss_function("
    if "self.loss_function(" not in source:
        raise TypeError(
            f"cce_dist.hf.patch: {name}.forward does not compute its loss through self.loss_function (it builds its "
            "own loss from the logits), so the patched loss cannot stand in for it"
        )
    return head


def _check_head(model: nn.Module) -> nn.Linear:
    """``model.get_output_embeddings()``, which must be a plain ``nn.Linear`` (its weight is what the loss reads)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        hint = ""
        if hasattr(head, "base_layer") or hasattr(head, "original_module"):
            hint = (
                " (it is wrapped by a PEFT adapter: leave lm_head out of the adapter's target_modules and "
                "modules_to_save, e.g. LoraConfig(target_modules=[...attention/MLP projections only...]))"
            )
        raise TypeError(
            f"cce_dist.hf.patch: {type(model).__name__}.get_output_embeddings() (lm_head) must be an nn.Linear, got "
            f"{type(head).__name__}{hint}"
        )
    return head


def _trl_patched() -> bool:
    trl_integration = sys.modules.get("cce_dist.trl")
    return trl_integration is not None and trl_integration.is_patched()


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
    if arguments.get("fused_lm_head"):  # TRL's fused head (trl.trainer.utils.add_fused_lm_head): its own path
        if not _trl_patched():
            raise RuntimeError(
                f"cce_dist.hf: {type(model).__name__} was called with fused_lm_head=True (TRL's fused LM head, which "
                "its trainers install): that head scores the tokens itself, not through cce_dist.hf.patch; call "
                "cce_dist.trl.patch() (before or after building the trainer) to make it score with cce_dist"
            )
        return patched.call_original(*args, **kwargs)
    labels = arguments.get("labels")
    logits_to_keep = arguments.get("logits_to_keep", arguments.get("num_logits_to_keep", 0))
    if (
        labels is None
        or (not model.training and patched.eval_logits)
        or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
    ):
        return patched.call_original(*args, **kwargs)

    head = _check_head(model)  # again: an adapter may have wrapped the head after patching
    if vars(head).get("forward") is not patched.head:
        raise RuntimeError(
            f"cce_dist.hf: {type(model).__name__}'s output embeddings were replaced after patching (e.g. by "
            "resize_token_embeddings); call cce_dist.hf.patch(model) again"
        )
    return_dict = arguments.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    patched._reset(active=True)
    try:
        outputs = patched.call_original(**arguments, return_dict=True)
        head_calls, loss_calls, observed = patched.head_calls, patched.loss_calls, patched.observed
    finally:
        patched._reset(active=False)
    if head_calls != 1 or loss_calls != 1:
        raise RuntimeError(_calls_message(patched, head_calls, loss_calls))
    return _output(outputs, observed, return_dict)


def _calls_message(state: _PatchedForward, head_calls: int | None = None, loss_calls: int | None = None) -> str:
    head_calls = state.head_calls if head_calls is None else head_calls
    loss_calls = state.loss_calls if loss_calls is None else loss_calls
    return (
        f"cce_dist.hf: {type(state.model).__name__}.forward called its output embeddings {head_calls} time(s) and "
        f"self.loss_function {loss_calls} time(s) (so far); the patched loss reproduces a forward that calls each "
        "once, the loss function on the head's (scaled / capped) output"
    )


def _output(outputs: Any, logits: Any, return_dict: bool):
    """The original forward's output with ``logits=None``: the same output class, or with ``return_dict=False`` the
    original's tuple layout (``ModelOutput.to_tuple``) with ``None`` in the logits position."""
    if isinstance(outputs, tuple):  # a forward that ignores return_dict: drop the logits by identity
        return tuple(None if x is logits else x for x in outputs)
    if not return_dict:
        return tuple(None if k == "logits" else v for k, v in outputs.items())
    return type(outputs)(**{k: v for k, v in outputs.items() if k != "logits"})
