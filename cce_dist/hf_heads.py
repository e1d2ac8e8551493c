"""How causal LMs post-process their head's output, for :mod:`cce_dist.hf`: the only family knowledge it has.

A transformers causal LM computes ``logits = post(lm_head(hidden))`` and passes them to ``self.loss_function``. The
post-processing ``post`` of every family cce_dist reproduces is one :class:`LogitTransform`: a multiplier, then
optionally Gemma's final softcap, ``softcap * tanh(scale * z / softcap)``. A multiplier applied *after* the softcap is
the same family (``s * c * tanh(z / c) = (s c) * tanh(s z / (s c))``), so both orders are expressible.

Which transform a model applies is read from its config (:func:`candidate_transforms`: every multiplier field a
family is known to use, multiplying or dividing, with or without the softcap field) and decided by the model itself:
the patched head returns :func:`probe` logits, the model's own forward post-processes them, and :func:`identify` picks
the candidate that reproduces what the model did to every probe value, or reports that none does (then the model
post-processes its logits in some other way, e.g. masks entries or slices the vocabulary, and cce_dist refuses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LogitTransform", "candidate_transforms", "describe_observed", "identify", "matches", "probe", "resolve"]

#: config fields holding a multiplier of the logits (multiplied by it or divided by it, depending on the family):
#: Cohere / Aya ``logit_scale``, Granite / HyperCLOVA X ``logits_scaling``, Falcon-H1 ``lm_head_multiplier``,
#: MuseGlimmer / MuseSpark ``output_multiplier`` (the fields TRL's fused head reads, and the ones found by grepping
#: transformers' modeling files for what follows ``self.lm_head(...)``)
SCALE_FIELDS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")
#: the field of Gemma-style final softcapping ``softcap * tanh(z / softcap)``
SOFTCAP_FIELDS = ("final_logit_softcapping",)
#: fields whose value divides the logits in the families that define them (the rest multiply), and the exceptions
_DIVIDING_FIELDS = ("logits_scaling",)
_MULTIPLYING_TYPES = ("hyperclovax",)

#: the values the probe logits cycle through: exact in bfloat16 and float16, spanning 2**-10 .. 2**13 of both signs
#: (small ones pin a multiplier, large ones a softcap, and any entry the model masks or replaces stands out)
_PROBE_VALUES: tuple[float, ...] = (0.0, 2.0**-10, -(2.0**-6), 0.25, -0.5, 1.0, -1.5, 3.0, -6.0, 12.0, -24.0, 48.0)
_PROBE_VALUES += (-96.0, 384.0, -1536.0, 8192.0)


@dataclass(frozen=True)
class LogitTransform:
    """``logits = softcap * tanh(scale * z / softcap)`` (``scale * z`` when ``softcap`` is None) of the head's output
    ``z``. ``scale`` and ``softcap`` are finite numbers > 0 (Python floats); ``source`` says which config fields
    they come from (for messages)."""

    scale: float = 1.0
    softcap: float | None = None
    source: str = "none"

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """The transform of ``z`` (any shape, floating), computed as the families do: scale, then the softcap."""
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def describe(self) -> str:
        parts = [] if self.scale == 1.0 else [f"x {self.scale:g}"]
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}")
        return f"{', '.join(parts) or 'none'} ({self.source})"


def _positive(config: Any, name: str) -> float | None:
    """``config.<name>`` as a float when it is set (None, False and 0-sized mean unset); a ValueError naming the field
    when it is not a finite number > 0 (cce_dist cannot reproduce a zero, negative or infinite multiplier)."""
    value = getattr(config, name, None)
    if value is None or value is False:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = float(value.detach())
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(
            f"cce_dist.hf.patch: config.{name}={value!r} ({type(config).__name__}) is not a finite number > 0; the "
            "patched loss cannot reproduce logits scaled or capped by it"
        )
    return float(value)


def candidate_transforms(config: Any) -> tuple[LogitTransform, ...]:
    """The transforms a model with this config may apply to its head's output, the family's usual one first.

    Reads the config and its text config (vision-language models keep the language model's fields there): each
    multiplier of :data:`SCALE_FIELDS` both multiplying and dividing, each softcap of :data:`SOFTCAP_FIELDS` after
    the multiplier or before it, and the identity. Raises ValueError naming a field whose value is not a finite
    number > 0."""
    configs = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        configs.append(text)
    model_type = getattr(text, "model_type", getattr(config, "model_type", None))
    scales: list[tuple[float, str]] = []  # (multiplier, where it comes from), the family's direction first
    caps: list[tuple[float, str]] = []
    for cfg in configs:
        prefix = "config." if cfg is config else "config.text_config."
        for name in SCALE_FIELDS:
            v = _positive(cfg, name)
            if v is not None:
                mul, div = (v, f"x {prefix}{name}"), (1.0 / v, f"/ {prefix}{name}")
                divides = name in _DIVIDING_FIELDS and model_type not in _MULTIPLYING_TYPES
                scales += [div, mul] if divides else [mul, div]
        for name in SOFTCAP_FIELDS:
            v = _positive(cfg, name)
            if v is not None:
                caps.append((v, f"{prefix}{name}"))

    def make(scale: tuple[float, str], cap: tuple[float, str] | None, cap_first: bool) -> LogitTransform:
        if cap is None:
            return LogitTransform(scale[0], None, scale[1] or "none")
        if cap_first:  # s * softcap_c(z) = softcap_(s c)(s z)
            return LogitTransform(scale[0], cap[0] * scale[0], f"{cap[1]}, then {scale[1]}" if scale[1] else cap[1])
        return LogitTransform(scale[0], cap[0], f"{scale[1]}, then {cap[1]}" if scale[1] else cap[1])

    identity = (1.0, "")
    # the family's usual transform first (the one used under torch.compile before an eager step identified it)
    out = [make(scales[0] if scales else identity, caps[0] if caps else None, False)]
    for scale in [identity] + scales:
        for cap in [None, *caps]:
            for cap_first in (False, True) if cap is not None and scale is not identity else (False,):
                t = make(scale, cap, cap_first)
                if all((t.scale, t.softcap) != (o.scale, o.softcap) for o in out):
                    out.append(t)
    return tuple(out)


def probe(vocab: int, ndim: int, device: torch.device | str) -> torch.Tensor:
    """The logits the patched head returns in place of ``[..., vocab]``: float32, shape ``[1] * (ndim - 1) + [vocab]``
    (broadcastable to the real logits' shape), cycling through :data:`_PROBE_VALUES`."""
    values = torch.tensor(_PROBE_VALUES, dtype=torch.float32, device=device)
    reps = -(-vocab // len(_PROBE_VALUES))
    return values.repeat(reps)[:vocab].reshape((1,) * (ndim - 1) + (vocab,))


def _tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance between the model's and our transform of the probe: a few roundings of the model's dtype
    (float32 at least, where the model computes ``x / s`` and we ``x * (1 / s)``)."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(4 * eps, 16 * torch.finfo(torch.float32).eps)


def matches(observed: torch.Tensor, probe_logits: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """A 0-dim bool tensor: whether ``observed`` is ``transform`` of ``probe_logits`` within the observed dtype's
    rounding (traceable by torch.compile: no ``.item()``)."""
    want = transform.apply(probe_logits)
    got = observed.to(torch.float32)
    return ((got - want).abs() <= _tolerance(observed.dtype) * want.abs()).all()


def identify(
    observed: torch.Tensor, probe_logits: torch.Tensor, candidates: tuple[LogitTransform, ...]
) -> LogitTransform | None:
    """The candidate whose transform of ``probe_logits`` is ``observed`` (what the model's forward made of them),
    the closest one where several are within rounding; None when none is (eager only: reads the values)."""
    if observed.shape != probe_logits.shape or not observed.is_floating_point():
        return None
    got = observed.detach().to(torch.float32)
    best, best_err = None, math.inf
    tol = _tolerance(observed.dtype)
    for t in candidates:
        want = t.apply(probe_logits)
        err = float(((got - want).abs() / want.abs().clamp_min(torch.finfo(torch.float32).tiny)).max())
        if bool(((got - want).abs() <= tol * want.abs()).all()) and err < best_err:
            best, best_err = t, err
    return best


def describe_observed(
    observed: torch.Tensor, probe_logits: torch.Tensor, expected: LogitTransform | None = None
) -> str:
    """A few ``probe -> observed`` pairs, for the error when no candidate matches, and the first vocabulary entry
    where ``observed`` is not ``expected`` of the probe (e.g. an entry the model masks)."""
    if observed.shape != probe_logits.shape:
        return f"logits of shape {tuple(observed.shape)} from the head's {tuple(probe_logits.shape)}"
    z, o = probe_logits.reshape(-1), observed.detach().reshape(-1).float()
    text = ", ".join(f"{a:g} -> {b:.6g}" for a, b in zip(z[: len(_PROBE_VALUES)].tolist(), o.tolist()))
    if expected is not None:
        want = expected.apply(z)
        bad = ((o - want).abs() > _tolerance(observed.dtype) * want.abs()).nonzero()
        if len(bad):
            i = int(bad[0])
            text += f"; entry {i}: {float(z[i]):g} -> {float(o[i]):.6g}"
            text += f", where {expected.describe()} gives {float(want[i]):.6g}"
    return text


def resolve(
    name: str,
    observed: torch.Tensor,
    probe_logits: torch.Tensor,
    candidates: tuple[LogitTransform, ...],
    identified: LogitTransform | None = None,
) -> LogitTransform:
    """What model ``name``'s forward did to its head's output, from what it made of the probe (``observed``, the
    logits it passed to its loss function): eagerly, the candidate :func:`identify` finds, or a RuntimeError naming
    what it did; under torch.compile (no ``.item()`` in a graph) ``identified`` (what an eager call found) or the
    family's usual candidate, checked on the device with ``torch._assert_async``."""
    if tuple(observed.shape) != tuple(probe_logits.shape) or not observed.is_floating_point():
        raise RuntimeError(
            f"cce_dist.hf: {name} post-processes its logits into {describe_observed(observed, probe_logits)}: not an "
            "elementwise scale or softcap, which is all the patched loss reproduces; unpatch this model"
        )
    if torch.compiler.is_compiling():
        transform = identified or candidates[0]
        torch._assert_async(
            matches(observed, probe_logits, transform),
            f"cce_dist.hf: {name} does not post-process its logits as {transform.describe()}",
        )
        return transform
    found = identify(observed, probe_logits, candidates)
    if found is None:
        raise RuntimeError(
            f"cce_dist.hf: {name} post-processes its logits in a way the patched loss does not reproduce: "
            f"{describe_observed(observed, probe_logits, candidates[0])} (head output -> logits); the config allows "
            f"{[t.describe() for t in candidates]}. Unpatch this model (cce_dist.hf.unpatch) or report it"
        )
    return found
