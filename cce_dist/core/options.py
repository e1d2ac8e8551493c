"""The options of every public entry point, in one place.

``linear_cross_entropy``, ``linear_logprobs`` and ``LinearCrossEntropy`` all build one of these
frozen dataclasses from their keywords, so validation, defaults and documentation cannot drift
between the function and the module forms.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from .outputs import RowOutput, check_row_outputs
from .shard import VocabShard

Reduction = Literal["mean", "sum", "none"]
Impl = Literal["auto", "torch", "triton"]
FilterEps = float | Literal["auto"] | None  # a threshold, "auto" or None (exact)
REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("auto", "torch", "triton")

#: ``chunk_size=None`` (the default) sizes the torch implementation's token chunks to hold
#: ``max(DEFAULT_CHUNK_SIZE, MIN_CHUNK_TOKENS * V_local)`` logits: 2**24 float32 logits = 64 MiB,
#: and never fewer than 256 tokens, because thinner chunks make thin, slow GEMMs: on CPU, fewer
#: logits per chunk at V=64k and fewer tokens per chunk at V=256k each took longer
#: (benchmarks/results/cpu_single.md has the V=64k sweep; docs/design.md, "torch
#: (cce_dist/impl/torch_cross_entropy.py)", the ratios of both).
#: The floor keeps the block at ``256 / D`` of the float32 weight gradient: never larger than the
#: gradient for a head dimension >= 256. An explicit int is a hard cap (at least one token).
DEFAULT_CHUNK_SIZE = 1 << 24
MIN_CHUNK_TOKENS = 256


try:  # numpy's integer and real floating scalar types (torch imports numpy when it is installed)
    import numpy as _np

    _NUMPY_INTS: tuple[type, ...] = (_np.int8, _np.int16, _np.int32, _np.int64, _np.uint8, _np.uint16, _np.uint32)
    _NUMPY_INTS += (_np.uint64, _np.intc, _np.uintc, _np.longlong, _np.ulonglong, _np.intp, _np.uintp)
    _NUMPY_FLOATS: tuple[type, ...] = (_np.float16, _np.float32, _np.float64, _np.longdouble)
except ImportError:  # pragma: no cover
    _NUMPY_INTS = _NUMPY_FLOATS = ()


def real_scalar(name: str, x):
    """An option's value as a plain Python number where it is a real-number scalar of another kind; anything else
    unchanged (the option's own check then accepts or rejects it).

    - numpy scalars: ``np.float32(0.1)`` -> ``0.1`` (float), ``np.int64(3)`` -> ``3`` (int); numpy bools stay.
    - 0-dim CPU tensors that do not require grad: ``float()`` / ``int()`` of a floating / integer tensor.
    - tensors refused with a TypeError naming the option and the type: one that requires grad (an option is a
      constant; no gradient reaches it), one on another device (reading it would wait for that device), and one
      with more than one element; under torch.compile, numpy values and tensors (Dynamo traces them as data, which
      the checks cannot read): convert them outside the compiled region (or let the call graph-break).

    Called once per numeric option while the options are validated (:func:`coerce_numbers`), so every entry point
    agrees, and the (fingerprinted) options hold plain numbers, identical across ranks."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int) and type(x) is not int:  # e.g. an IntEnum: its value
        return int(x)
    if isinstance(x, (int, float)) and type(x) in (int, float):
        return x
    if type(x).__module__ == "numpy":  # a numpy scalar type (under torch.compile: a traced array)
        if type(x) in _NUMPY_INTS:
            return int(x)
        if type(x) in _NUMPY_FLOATS:
            return float(x)
        import torch

        if torch.compiler.is_compiling():
            # Dynamo traces a numpy scalar as a 0-dim array whose value is data (a guard on it would fail)
            raise TypeError(
                f"{name} must be a Python number under torch.compile, got a numpy value; convert it outside the "
                f"compiled region, e.g. {name}=float(value)"
            )
        if getattr(x, "ndim", None) == 0 and x.dtype.kind in "iuf":  # a 0-dim array
            return int(x) if x.dtype.kind in "iu" else float(x)
        return x  # a numpy bool, complex, array, ...: the option's own check decides
    import torch

    if isinstance(x, torch.Tensor):
        if torch.compiler.is_compiling():  # float() of a traced tensor is data, which the checks cannot guard on
            raise TypeError(
                f"{name} must be a Python number under torch.compile, got a torch.Tensor; convert it outside the "
                f"compiled region, e.g. {name}=float(value)"
            )
        what = f"a torch.Tensor (dtype {x.dtype}, shape {tuple(x.shape)}, device {x.device})"
        if x.numel() != 1 or x.dim() != 0:
            raise TypeError(f"{name} must be a number, got {what}; pass a Python number")
        if x.requires_grad:
            raise TypeError(
                f"{name} must be a number, got {what} that requires grad: an option is a constant and receives no "
                f"gradient; pass float({name}.detach()) if that is intended"
            )
        if x.device.type != "cpu":
            raise TypeError(
                f"{name} must be a number, got {what}: reading it would synchronize with the device on every call; "
                "pass a Python number (e.g. computed once with .item())"
            )
        if x.dtype == torch.bool or x.is_complex():
            return x  # the option's own check rejects it
        return float(x) if x.is_floating_point() else int(x)
    if isinstance(x, float) and type(x) is not float:  # a float subclass (e.g. np.float64 is handled above)
        return float(x)
    return x


def coerce_numbers(options, names: tuple[str, ...]) -> None:
    """Replace each named field of the frozen ``options`` by :func:`real_scalar` of it (tuples element-wise)."""
    for name in names:
        value = getattr(options, name)
        if isinstance(value, tuple):
            value = tuple(real_scalar(name, v) for v in value)
        else:
            value = real_scalar(name, value)
        object.__setattr__(options, name, value)


#: fields the tensor-parallel handshake does not compare: the shard (exchanged as the layout), and options that change
#: only this rank's local arithmetic, never which collectives run or their sizes (``impl`` is compared as the
#: implementation it resolved to, ``grad_in_forward`` as whether the gradients are formed in forward)
HANDSHAKE_EXCLUDED = frozenset({"shard", "impl", "filter_eps", "deterministic", "grad_in_forward"})


def handshake_options(options) -> tuple[tuple[str, object], ...]:
    """``(field name, value)`` of every field of the options dataclass ``options`` that all ranks of a
    tensor-parallel group must agree on, named as the keyword the caller passed."""
    return tuple(
        (f.name, getattr(options, f.name)) for f in dataclasses.fields(options) if f.name not in HANDSHAKE_EXCLUDED
    )


def _check_shift(shift: bool | int) -> int:
    if isinstance(shift, bool):
        return int(shift)
    if not isinstance(shift, int) or shift < 0:
        raise ValueError(f"shift must be a bool or a non-negative int, got {shift!r}")
    return shift


def rebuilt_by_dynamo(opts: object) -> bool:
    """Whether ``opts`` is Dynamo's rebuild of an options object from graph proxies (torch 2.10 / 2.11 rebuild a
    frozen dataclass passed to an autograd Function's ``apply`` field by field as ``torch.fx.Proxy`` values, under
    ``dynamic=True``): its values were validated when the caller's object was built, and a proxy is no number."""
    return any(isinstance(getattr(opts, f, None), torch.fx.Proxy) for f in getattr(opts, "__dataclass_fields__", ()))


def _finite(x: float) -> bool:
    """``math.isfinite`` that torch.compile can trace when ``x`` is a symbolic float (dynamic=True)."""
    return abs(x) < math.inf


def _check_number(name: str, x, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
    """``x`` as a float in the interval from ``lo`` to ``hi`` (open ends where asked), else a ValueError."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and _finite(x)
    if ok:
        ok = (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {x!r}")
    return float(x)


def _check_softcap(softcap: float | None) -> float | None:
    if softcap is None:
        return None
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not softcap > 0 or not _finite(softcap):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    return float(softcap)


def _check_int_option(name: str, x) -> None:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"{name} must be an int, got {x!r}")


def _check_flag(name: str, x, *, optional: bool = False) -> None:
    if not (isinstance(x, bool) or (optional and x is None)):
        raise TypeError(f"{name} must be {'None or ' if optional else ''}a bool, got {x!r}")


def _check_reduction(reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


@dataclass(frozen=True)
class LossOptions:
    """The fields every loss has, and their checks (each field documented on :class:`CrossEntropyOptions`):
    :mod:`cce_dist.engine.driver` reads these of any loss's options."""

    ignore_index: int = -100
    shard: VocabShard | None = None
    impl: Impl = "auto"
    chunk_size: int | None = None
    deterministic: bool = False

    #: the fields holding numbers (:func:`coerce_numbers`); subclasses extend it
    NUMBER_FIELDS: ClassVar[tuple[str, ...]] = ("ignore_index", "chunk_size")

    def __post_init__(self) -> None:
        if rebuilt_by_dynamo(self):
            return
        coerce_numbers(self, self.NUMBER_FIELDS)
        _check_int_option("ignore_index", self.ignore_index)
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.chunk_size is not None and (
            not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size <= 0
        ):
            raise ValueError(f"chunk_size must be None (auto) or a positive int, got {self.chunk_size!r}")
        _check_flag("deterministic", self.deterministic)
        if self.shard is not None:
            if not isinstance(self.shard, VocabShard):
                raise TypeError(f"shard must be a cce_dist.VocabShard or None, got {type(self.shard).__name__}")

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    #: each options class's field names (set below, after the dataclasses are made): read by :meth:`from_keywords`
    #: as a plain tuple, which torch.compile traces (``dataclasses.fields`` of a class it does not)
    FIELD_NAMES: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_keywords(cls, **keywords: Any):
        """The options from an entry point's keywords, each passed as ``name=name``: exactly the fields, or a
        TypeError naming the missing / unknown ones, so an entry point cannot leave a field at its default by
        forgetting it (tests/test_signatures.py checks that its keywords are the fields, and
        tests/test_compile_regressions.py that it passes each under its own name). Not ``locals()``: Dynamo of
        torch 2.10 / 2.11 cannot trace it."""
        if len(keywords) != len(cls.FIELD_NAMES) or any(name not in keywords for name in cls.FIELD_NAMES):
            missing = [name for name in cls.FIELD_NAMES if name not in keywords]
            unknown = [name for name in keywords if name not in cls.FIELD_NAMES]
            raise TypeError(f"{cls.__name__}.from_keywords: missing {missing}, unknown {unknown}")
        return cls(**keywords)


@dataclass(frozen=True)
class CommonOptions(LossOptions):
    """The fields the one-head losses (cross-entropy, logprobs) share (documented on :class:`CrossEntropyOptions`)."""

    softcap: float | None = None
    shift: bool | int = False
    filter_eps: FilterEps = None
    row_outputs: tuple[RowOutput, ...] = ()

    NUMBER_FIELDS: ClassVar[tuple[str, ...]] = LossOptions.NUMBER_FIELDS + ("softcap", "shift", "filter_eps")

    def __post_init__(self) -> None:
        super().__post_init__()
        if rebuilt_by_dynamo(self):
            return
        object.__setattr__(self, "row_outputs", check_row_outputs(self.row_outputs))
        object.__setattr__(self, "softcap", _check_softcap(self.softcap))
        object.__setattr__(self, "shift", _check_shift(self.shift))
        if self.filter_eps is not None and not (isinstance(self.filter_eps, str) and self.filter_eps == "auto"):
            # a threshold relative to each row's coefficients (p <= 1): at 1 or more every tile would be skipped
            try:
                _check_number("filter_eps", self.filter_eps, 0.0, 1.0, hi_open=True)
            except ValueError:
                raise ValueError(
                    f"filter_eps must be None, 'auto' or a finite number in [0, 1) (a threshold relative to each "
                    f"row's softmax coefficients), got {self.filter_eps!r}"
                ) from None


#: the former name, kept for code that imported it
_CommonOptions = CommonOptions


@dataclass(frozen=True)
class CrossEntropyOptions(CommonOptions):
    """Options of :func:`cce_dist.linear_cross_entropy` and :class:`cce_dist.LinearCrossEntropy`.

    ignore_index     targets equal to it contribute 0 loss and no gradient (default -100)
    reduction        "mean" (over non-ignored tokens; 0 if there are none), "sum" or "none"
    label_smoothing  eps in [0, 1]: PyTorch's definition over the full (global) vocabulary
    z_loss           coefficient of ``lse**2`` added per valid token (PaLM's z-loss), >= 0
    softcap          Gemma-style ``softcap * tanh(z / softcap)`` on the logits, or None
    shift            position i predicts target i + shift (True = 1), without copying hidden
    shard            a :class:`cce_dist.VocabShard` for vocab-parallel heads, or None
    impl             "auto" (triton for CUDA tensors when it imports, else torch), "torch", "triton"
    return_lse       also return the per-token log-sum-exp (float32, targets' shape)
    chunk_size       logits held at once by the torch implementation (tokens x vocab entries);
                     None = max(2**24, 256 * V_local)
    grad_in_forward  torch impl: form gradients during forward when the loss is a scalar
                     (3 matmuls instead of 4); None = whenever it applies
    filter_eps       triton impl: skip backward tiles whose softmax gradient is below this
                     (None = exact, "auto" = the compute dtype's resolution)
    deterministic    triton impl: no float atomics (bitwise reproducible); also on under
                     torch.use_deterministic_algorithms(True); the torch impl always is
    row_outputs      any of "predicted", "is_top1", "log_sum_sq_probs", "mean_logit": also return a
                     :class:`cce_dist.RowOutputs` of them (from the same statistics; not differentiable)
    """

    reduction: Reduction = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    return_lse: bool = False
    grad_in_forward: bool | None = None

    NUMBER_FIELDS: ClassVar[tuple[str, ...]] = CommonOptions.NUMBER_FIELDS + ("label_smoothing", "z_loss")

    def __post_init__(self) -> None:
        super().__post_init__()
        if rebuilt_by_dynamo(self):
            return
        _check_reduction(self.reduction)
        _check_flag("return_lse", self.return_lse)
        _check_flag("grad_in_forward", self.grad_in_forward, optional=True)
        _check_number("label_smoothing", self.label_smoothing, 0.0, 1.0)
        _check_number("z_loss", self.z_loss, 0.0, math.inf, hi_open=True)


@dataclass(frozen=True)
class LogprobOptions(CommonOptions):
    """Options of :func:`cce_dist.linear_logprobs`.

    temperature     logits are divided by it (after the softcap), > 0
    return_entropy  also return the (differentiable) entropy of each token's distribution
    The other fields mean what they mean in :class:`CrossEntropyOptions`.
    """

    temperature: float = 1.0
    return_entropy: bool = False

    NUMBER_FIELDS: ClassVar[tuple[str, ...]] = CommonOptions.NUMBER_FIELDS + ("temperature",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if rebuilt_by_dynamo(self):
            return
        _check_number("temperature", self.temperature, 0.0, math.inf, lo_open=True, hi_open=True)
        _check_flag("return_entropy", self.return_entropy)


Divergence = Literal["kl", "reverse_kl", "jsd"]
DIVERGENCES = ("kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DistillationOptions(LossOptions):
    """Options of :func:`cce_dist.linear_distillation` (knowledge distillation from two heads).

    divergence        "kl" = KL(p_teacher || p_student) (forward, Hinton et al.), "reverse_kl" =
                      KL(p_student || p_teacher), "jsd" = generalized Jensen-Shannon with ``beta``
    beta              jsd only, in (0, 1): ``M = beta*p_t + (1-beta)*p_s`` and
                      ``JSD = beta*KL(p_t || M) + (1-beta)*KL(p_s || M)`` (Liger's fused linear JSD
                      and the GKD paper; beta -> 0 / 1 tends to (beta times) the forward / reverse KL)
    temperature       both heads' logits are divided by it (after the softcap), > 0
    scale_by_temperature_squared
                      multiply the divergence by ``temperature**2`` (Hinton et al.: keeps the soft
                      gradients' scale independent of T); False gives Liger's convention (no factor)
    hard_label_weight w in [0, 1]: ``loss = (1-w) * soft + w * CE(student logits at T=1, targets)``;
                      w > 0 needs targets
    ignore_index      rows whose target equals it contribute 0 loss and no gradient (with targets)
    reduction         "mean" (over non-ignored rows; 0 if there are none), "sum" or "none"
    softcap           None, one number for both heads, or a pair ``(student, teacher)`` (each None
                      or > 0): ``softcap * tanh(z / softcap)`` on that head's logits
    shard             a :class:`cce_dist.VocabShard` (both heads hold the same vocab rows), or None
    impl              "auto" or "torch": the torch implementation (any device); "triton": the Triton
                      kernels (CUDA, or CPU under TRITON_INTERPRET=1; all tokens in one pass, so
                      chunk_size does not apply). "auto" stays torch until the kernels have been
                      timed on a GPU
    chunk_size        logits of one head per token chunk (tokens x vocab entries), None = the
                      cross-entropy's default (``DEFAULT_CHUNK_SIZE``, at least ``MIN_CHUNK_TOKENS``
                      tokens); a chunk holds 3 (forward KL) or 4 float32 blocks of that size
    grad_in_forward   form the student's gradients during forward when the loss is a scalar (the
                      teacher's logits are computed once instead of twice); None = whenever it applies
    deterministic     triton impl: no float atomics in the gradients (bitwise repeatable); also on
                      under torch.use_deterministic_algorithms(True); the torch impl always is
    """

    divergence: Divergence = "kl"
    beta: float = 0.5
    temperature: float = 1.0
    scale_by_temperature_squared: bool = True
    hard_label_weight: float = 0.0
    reduction: Reduction = "mean"
    softcap: float | tuple | None = None
    grad_in_forward: bool | None = None

    NUMBER_FIELDS: ClassVar[tuple[str, ...]] = LossOptions.NUMBER_FIELDS + (
        "beta",
        "temperature",
        "hard_label_weight",
        "softcap",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if rebuilt_by_dynamo(self):
            return
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        object.__setattr__(self, "beta", _check_number("beta", self.beta, 0.0, 1.0, lo_open=True, hi_open=True))
        object.__setattr__(
            self,
            "temperature",
            _check_number("temperature", self.temperature, 0.0, math.inf, lo_open=True, hi_open=True),
        )
        object.__setattr__(
            self, "hard_label_weight", _check_number("hard_label_weight", self.hard_label_weight, 0.0, 1.0)
        )
        _check_flag("scale_by_temperature_squared", self.scale_by_temperature_squared)
        _check_reduction(self.reduction)
        caps = self.softcap if isinstance(self.softcap, tuple) else (self.softcap, self.softcap)
        if len(caps) != 2:
            raise ValueError(f"softcap must be None, a number or a pair (student, teacher), got {self.softcap!r}")
        try:
            caps = tuple(_check_softcap(c) for c in caps)
        except ValueError:
            raise ValueError(
                f"softcap must be None, a finite number > 0 or a pair (student, teacher) of those, got {self.softcap!r}"
            ) from None
        object.__setattr__(self, "softcap", caps)
        _check_flag("grad_in_forward", self.grad_in_forward, optional=True)

    @property
    def student_softcap(self) -> float | None:
        assert isinstance(self.softcap, tuple)  # normalized to (student, teacher) by __post_init__
        return self.softcap[0]

    @property
    def teacher_softcap(self) -> float | None:
        assert isinstance(self.softcap, tuple)  # normalized to (student, teacher) by __post_init__
        return self.softcap[1]

    @property
    def soft_scale(self) -> float:
        """The factor of the divergence in the loss: ``(1 - w) * (T**2 if scaled else 1)``."""
        t2 = self.temperature**2 if self.scale_by_temperature_squared else 1.0
        return (1.0 - self.hard_label_weight) * t2


for _cls in (LossOptions, CommonOptions, CrossEntropyOptions, LogprobOptions, DistillationOptions):
    _cls.FIELD_NAMES = tuple(f.name for f in dataclasses.fields(_cls))
del _cls
