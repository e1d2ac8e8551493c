"""Ahead-of-time compilation of the cce_dist kernels for GPU targets this machine does not have.

A launch on a real device goes: launcher (``forward.plan_row_stats`` / ``backward.plan_grads``) -> the
JITFunction's binder (``specialize_impl`` per argument: dtype, int/float type, the 16-byte
divisibility of pointers and ints, ints equal to 1 turned into constexprs) -> ``_pack_args`` ->
``triton.compile``. :func:`compile_launch` runs that same path with the backend of an explicit
``GPUTarget``, on the arguments the launcher builds for ``meta`` tensors of the target shape
(fresh allocations: a meta tensor's data_ptr is 0, i.e. aligned like any CUDA allocation).
So the compiled kernel is the one a launch would compile; no signature is written by hand.

Needs the real compiler: import this with ``TRITON_INTERPRET`` unset. Results (shared memory,
registers, spills from ``cuobjdump --dump-resource-usage``, which MMA instructions the PTX uses)
are cached as JSON (:func:`cache_dir`), keyed by Triton's kernel hash (source, options, target,
Triton version), so an unchanged kernel is never recompiled or re-inspected; Triton's own cache of
the compile is kept only where ``TRITON_CACHE_DIR`` names one.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import os
import random
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.cache import get_cache_key
from triton.runtime.jit import create_function_from_signature

from . import backward as _bwd
from . import config as _config
from . import distill as _kd
from . import forward as _fwd
from .resources import SPILL_BOUND, resource_usage

__all__ = [
    "SPILL_BOUND",
    "Compiled",
    "backward_launches",
    "cache_dir",
    "compile_launch",
    "distill_launches",
    "forward_launches",
]


def cache_dir() -> Path:
    """Where compiled kernels are cached: ``$CCE_DIST_AOT_CACHE`` or ``~/.cache/cce_dist/aot``."""
    d = os.environ.get("CCE_DIST_AOT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "cce_dist", "aot")
    Path(d).mkdir(parents=True, exist_ok=True)
    return Path(d)


@dataclass
class Compiled:
    """What the compiler made of one launch."""

    kernel: str
    arch: int  # 80, 86, 90, 100, 120
    hash: str  # Triton's kernel hash
    num_warps: int
    num_stages: int
    shared: int  # bytes of dynamic shared memory the launch requests
    registers: int  # per thread
    stack: int  # bytes of local stack per thread (spills and local arrays)
    local: int  # bytes of local memory per thread besides the stack
    mma: list[str]  # matrix instructions in the PTX: 'wgmma', 'tcgen05', 'mma'
    atomics: int  # atom/red instructions in the PTX (static count)
    constexprs: dict
    dtype: str = ""  # element type of the hidden states ('bf16', 'fp16', 'fp32')
    maxnreg: int | None = None  # the launch's register cap (None: ptxas's own)

    @property
    def spill(self) -> int:
        return self.stack + self.local


def _specialize(kernel, args: tuple, kwargs: dict, arch: int):
    """``(src, target, options, signature, key)`` of ``kernel[grid](*args, **kwargs)`` for ``sm_<arch>``: what the
    JIT launcher would compile, and the key Triton's own cache gives it (source, backend, options, env)."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs.setdefault("debug", bool(kernel.debug))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    key = hashlib.sha256(get_cache_key(src, backend, options, get_cache_invalidating_env_vars()).encode()).hexdigest()
    return src, target, options, signature, key


def launch_key(kernel, args: tuple, kwargs: dict, arch: int) -> str:
    """Triton's cache key of the launch (no compile): two launches with one key compile to one kernel, which is
    how the enumeration below counts distinct specializations."""
    return _specialize(kernel, args, kwargs, arch)[-1]


def _compile(src, target, options):
    """``triton.compile`` into the caller's Triton cache when ``TRITON_CACHE_DIR`` is set (the GPU suite's tests scan
    it), else into a scratch one removed afterwards: the record below is this module's cache, and Triton's
    intermediates (about 0.6 MB a kernel) would otherwise pile up by the tens of GB over a whole flag product."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return triton.compile(src, target=target, options=options.__dict__)
    with tempfile.TemporaryDirectory(prefix="cce_dist_aot_") as scratch:
        os.environ["TRITON_CACHE_DIR"] = scratch
        try:
            return triton.compile(src, target=target, options=options.__dict__)
        finally:
            del os.environ["TRITON_CACHE_DIR"]


def compile_launch(kernel, args: tuple, kwargs: dict, arch: int) -> Compiled:
    """Compile ``kernel[grid](*args, **kwargs)`` for ``sm_<arch>`` as the JIT launcher would."""
    src, target, options, signature, key = _specialize(kernel, args, kwargs, arch)
    name = kernel.fn.__name__
    meta_path = cache_dir() / f"{name}-sm{arch}-r2-{key[:40]}.json"  # r2: record format
    if meta_path.exists():
        return Compiled(**json.loads(meta_path.read_text()))
    ck = _compile(src, target, options)
    ptx = ck.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
    try:
        ru = resource_usage(f.name)
    finally:
        os.unlink(f.name)
    mma = [
        m
        for m, pat in (("wgmma", r"\bwgmma\."), ("tcgen05", r"\btcgen05\.mma"), ("mma", r"\bmma\.sync"))
        if re.search(pat, ptx)
    ]
    res = Compiled(
        kernel=name,
        arch=arch,
        hash=ck.hash,
        num_warps=ck.metadata.num_warps,
        num_stages=ck.metadata.num_stages,
        shared=int(ck.metadata.shared),
        registers=ru["registers"],
        stack=ru["stack"],
        local=ru["local"],
        mma=mma,
        atomics=len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:atom|red)\.", ptx, flags=re.MULTILINE)),
        constexprs={
            str(k): (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in kwargs.items() if k.isupper()
        },
        dtype=str(signature.get("H", "")).lstrip("*"),
        maxnreg=kwargs.get("maxnreg"),
    )
    # Atomically (temp file, then rename): concurrent compiles of the same kernel may share the cache.
    tmp = meta_path.with_name(f"{meta_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(res)))
    os.replace(tmp, meta_path)
    return res


def _meta_inputs(n: int, d: int, v: int, dtype: torch.dtype, bias: bool):
    meta = torch.device("meta")
    h = torch.empty(n, d, dtype=dtype, device=meta)
    w = torch.empty(v, d, dtype=dtype, device=meta)
    b = torch.empty(v, dtype=dtype, device=meta) if bias else None
    t = torch.empty(n, dtype=torch.int64, device=meta)
    return h, w, b, t


# forward_launches and backward_launches take one shape and option list (the kernels' own), hence the alike
# signatures.
def forward_launches(
    props: _config.DeviceProps,
    dtype: torch.dtype,
    n: int,
    d: int,
    v: int,
    *,
    bias=False,
    softcap=None,
    temperature=None,
    tf32=True,
    need_sum=True,
    need_entropy=True,
    need_argmax=False,
    need_sumsq=False,
):
    """``[(kernel, grid, args, kwargs)]``: one per forward config the autotuner may pick on ``props``."""
    h, w, b, t = _meta_inputs(n, d, v, dtype, bias)
    args, flags, configs, splits_of, _out = _fwd.plan_row_stats(
        h,
        w,
        b,
        t,
        vocab_start=0,
        softcap=softcap,
        temperature=temperature,
        props=props,
        allow_tf32=tf32,
        need_sum=need_sum,
        need_entropy=need_entropy,
        need_argmax=need_argmax,
        need_sumsq=need_sumsq,
    )
    out = []
    for c in configs:
        kw = dict(
            flags,
            BLOCK_N=c.block_n,
            BLOCK_V=c.block_v,
            BLOCK_D=c.block_d,
            num_warps=c.num_warps,
            num_stages=c.num_stages,
            **_config.register_cap(c),
        )
        out.append((_fwd._row_stats_kernel, (_config.cdiv(n, c.block_n), splits_of(c)), args, kw))
    return out


def backward_launches(
    props: _config.DeviceProps,
    dtype: torch.dtype,
    n: int,
    d: int,
    v: int,
    *,
    bias=False,
    softcap=None,
    temperature=None,
    filter_eps=None,
    deterministic=False,
    tf32=True,
    need_hidden=True,
    need_weight=True,
    need_bias=True,
    schedule="tiles",
    class_weights=False,
):
    """``[(kernel, grid, args, kwargs)]`` of one backward call on ``props`` (``need_*``: the gradients wanted;
    ``class_weights``: the GAMMA term weighed per vocab row, ``gamma_weights``).

    ``schedule``: the backward's ``_schedule`` ("tiles", "chunked", "owner"; the
    deterministic calls use "owner" unless told otherwise). Only the Triton launches are returned: the
    chunked schedule's torch GEMMs are dropped, and of its dz launches per (vocab chunk, row block)
    (identical but for the chunk and the rows) the first and the last, whose chunk and row block may
    be ragged."""
    h, w, b, t = _meta_inputs(n, d, v, dtype, bias)
    lse = torch.empty(n, dtype=torch.float32, device="meta")
    coef = torch.empty(n, 4, dtype=torch.float32, device="meta")
    *_outs, launches = _bwd.plan_grads(
        h,
        w,
        b,
        t,
        lse,
        coef,
        vocab_start=0,
        softcap=softcap,
        temperature=temperature,
        need_hidden=need_hidden,
        need_weight=need_weight,
        need_bias=need_bias,
        filter_eps=filter_eps,
        deterministic=deterministic,
        gamma_weights=torch.empty(v, dtype=torch.float32, device="meta") if class_weights else None,
        props=props,
        allow_tf32=tf32,
        _schedule="owner" if deterministic and schedule == "tiles" else schedule,
    )
    launches = [x for x in launches if not isinstance(x[0], _bwd._HostStep)]  # the torch GEMMs
    return launches if len(launches) <= 2 or schedule != "chunked" else [launches[0], launches[-1]]


#: The CCE paper's shape (Gemma 2 2B head): tokens, hidden size, vocab.
PAPER_SHAPE = (8192, 2304, 256000)
#: A shape with nothing divisible by 16 (the launcher then specializes without alignment hints).
RAGGED_SHAPE = (8191, 2303, 32001)
#: More tokens than one row block of the chunked backward holds (9 row blocks in bf16, the last one
#: of 7169 rows: its dz launch has an N not divisible by 16).
ROWS_SHAPE = (65537, 2304, 256000)

#: (name, dtype, tf32) of the compute modes: fp32 runs with TF32 matmuls or exactly (IEEE).
DTYPES = [
    ("bf16", torch.bfloat16, True),
    ("fp16", torch.float16, True),
    ("tf32", torch.float32, True),
    ("fp32", torch.float32, False),
]


def distill_launches(
    props: _config.DeviceProps,
    dtypes: tuple[torch.dtype, torch.dtype],
    n: int,
    ds: int,
    dt: int,
    v: int,
    *,
    divergence="kl",
    hard=False,
    bias=False,
    softcap=(None, None),
    temperature=None,
    tf32=True,
    deterministic=False,
    teacher_bias=None,
    need_hidden=True,
    need_weight=True,
    need_bias=True,
):
    """``[(kernel, grid, args, kwargs)]`` of one ``linear_distillation(impl="triton")`` call on
    ``props``: the statistics launch (for either KL with its cross sum), the JSD's per-row sums
    launch and the gradient launch of :mod:`.distill` (all student gradients), from its own
    ``plan_*`` on meta tensors, in the order of ``cce_dist.impl.triton_distill.forward`` (a KL's cross sums come
    from the statistics pass, the JSD's from ``plan_rows``; the hard-label statistics when ``hard``).
    ``dtypes``: (student, teacher) compute dtypes. ``bias``: the student's; ``teacher_bias``: the teacher's
    (default: as the student). ``need_*``: the student gradients wanted (none: no gradient launch)."""
    hs, ws, bs, t = _meta_inputs(n, ds, v, dtypes[0], bias)
    ht, wt, bt, _t = _meta_inputs(n, dt, v, dtypes[1], bias if teacher_bias is None else teacher_bias)
    k = 3 if hard else 2
    f32, meta = torch.float32, torch.device("meta")
    norm = torch.empty(n, k, 2, dtype=f32, device=meta)
    aux, g = torch.empty(n, dtype=f32, device=meta), torch.empty(n, dtype=f32, device=meta)
    geo = dict(softcap=softcap, temperature=temperature, props=props, allow_tf32=tf32)
    cross = None if divergence == "jsd" else divergence
    heads = (hs, ws, bs, ht, wt, bt)
    stats, _out = _kd.plan_stats(*heads, t, vocab_start=0, hard=hard, cross=cross, **geo)
    launches = [stats]
    if cross is None:
        launches.append(_kd.plan_rows(*heads, norm, divergence=divergence, beta=0.5, **geo)[0])
    coefs = dict(vocab_start=0, divergence=divergence, beta=0.5, soft_coef=0.5, hard_coef=0.5 if hard else 0.0)
    needs = dict(need_hidden=need_hidden, need_weight=need_weight, need_bias=need_bias, deterministic=deterministic)
    *_grads, grads = _kd.plan_grads(hs, ws, bs, ht, wt, bt, t, norm, aux, g, **coefs, **needs, **geo)
    return launches + grads


#: A distillation shape: tokens, the student's and the teacher's hidden sizes, vocab (Llama 3's).
DISTILL_SHAPE = (8192, 2048, 4096, 128256)


#: A distillation shape with nothing divisible by 16 (no alignment hints for either head).
DISTILL_RAGGED_SHAPE = (8191, 2047, 4095, 32001)

# ------------------------------------------------------------------------------------------------------------------
# The matrix: every flag set the launchers can produce, enumerated from the planners' own signatures.
#
# A flag set is one value per *axis*: the compute mode (dtype and TF32), the shape, and every planner parameter that
# changes what is compiled. The axes come from ``inspect.signature`` of the planners, so a parameter added to a
# planner is enumerated without being listed here: a keyword parameter with a bool default takes False and True; any
# other must be named in AXIS_VALUES (its values), NOT_FLAGS (not a flag) or DERIVED (set from other axes), else
# planner_axes raises and the AOT test fails until it is. Each flag set is handed to the planners on meta tensors;
# flag sets the planners refuse (``deterministic`` with the atomic ``"tiles"`` schedule) or that launch nothing (no
# gradient wanted) are dropped; the launches are then reduced to distinct specializations (Triton's cache key).

#: Values of the planner parameters that are flags (besides bool-defaulted keywords: False and True). The first value
#: is the lightest (``plain`` seed), the last the heaviest (``heavy`` seed; the gradients wanted excepted, see
#: OUTPUT_AXES). Optional tensors among the positional arguments are present (True) or None (False).
AXIS_VALUES: dict[str, tuple] = {
    "bias": (False, True),
    "bs": (False, True),
    "bt": (False, True),
    "softcap": (None, 30.0),
    "temperature": (None, 0.7),
    "filter_eps": (None, "auto"),  # "auto": engine.prepare.resolve_filter_eps of the compute dtype (a float)
    "gamma_weights": (False, True),  # class weights: a float32 [V] tensor, or None
    "_schedule": _bwd.SCHEDULES,
    "divergence": _kd.DIVERGENCES,
    "hard": (False, True),
    "need_hidden": (True, False),
    "need_weight": (True, False),
    "need_bias": (True, False),
}
#: Axes whose first value is the heavier one (a gradient wanted): the ``heavy`` seed keeps it.
OUTPUT_AXES = frozenset({"need_hidden", "need_weight", "need_bias"})
#: The distillation's softcap is a pair (student, teacher): either, both or neither.
DISTILL_SOFTCAPS = ((None, None), (30.0, None), (None, 50.0), (30.0, 50.0))
#: Planner parameters that are not flags: tensors built from the shape, positions and runtime scalars (nothing is
#: specialized on them beyond divisibility, which the shapes cover), the device record (the target), the TF32
#: switch (part of the compute mode) and the tests-only overrides.
NOT_FLAGS = frozenset(
    {"hidden", "weight", "targets", "lse", "coef", "hs", "ws", "ht", "wt", "norm", "aux", "g"}
    | {"vocab_start", "beta", "soft_coef", "props", "allow_tf32", "_splits", "_blocks", "_chunk_rows"}
)
#: Parameters the distillation driver (``impl.triton_distill.forward``) sets from other axes: ``cross`` is the
#: divergence unless JSD, ``hard_coef`` is non-zero with a hard label.
DERIVED = frozenset({"cross", "hard_coef"})


def planner_axes(*planners, values: dict | None = None) -> dict[str, tuple]:
    """``{parameter: values}`` of every flag among the planners' parameters, in signature order (see above).
    ``values``: overrides of AXIS_VALUES. Raises LookupError for a parameter with no known values."""
    table = {**AXIS_VALUES, **(values or {})}
    axes: dict[str, tuple] = {}
    for planner in planners:
        for name, p in inspect.signature(planner).parameters.items():
            if name in NOT_FLAGS or name in DERIVED or name in axes:
                continue
            if name in table:
                axes[name] = tuple(table[name])
            elif p.kind is p.KEYWORD_ONLY and isinstance(p.default, bool):
                axes[name] = (False, True)
            else:
                raise LookupError(
                    f"{planner.__module__}.{planner.__qualname__}: no values for parameter {name!r}; name them in "
                    "cce_dist.kernels.aot.AXIS_VALUES (or NOT_FLAGS / DERIVED)"
                )
    return axes


#: Compute modes of the cross-entropy: (dtype, TF32). ``fp32`` is IEEE fp32 (no tensor cores).
MODES = {
    "bf16": (torch.bfloat16, True),
    "fp16": (torch.float16, True),
    "tf32": (torch.float32, True),
    "fp32": (torch.float32, False),
}
#: Compute modes of the distillation: ((student, teacher) dtypes, TF32).
DISTILL_MODES = {
    "bf16": ((torch.bfloat16, torch.bfloat16), True),
    "fp16": ((torch.float16, torch.float16), True),
    "bf16+tf32": ((torch.bfloat16, torch.float32), True),
    "tf32": ((torch.float32, torch.float32), True),
    "fp32": ((torch.float32, torch.float32), False),
}
SHAPES = {"paper": PAPER_SHAPE, "ragged": RAGGED_SHAPE, "rows": ROWS_SHAPE}
DISTILL_SHAPES = {"paper": DISTILL_SHAPE, "ragged": DISTILL_RAGGED_SHAPE}
#: The shapes :func:`flag_sets` scans the product at (not an axis): the paper shapes with a narrow vocab, so that
#: the chunked schedule plans a few chunks instead of 250. Configs and constexprs do not depend on V.
#: ``"rows"`` (a token count not a multiple of 16) and ``"ragged"`` (that, and rows not 16-byte aligned) are scanned
#: too: they select configs of their own (the register-pressure rules of ``config.backward_config`` halve the vocab
#: tile per source of pressure, and some halvings happen only at the ragged shape).
_SCAN = {
    "_scan": (PAPER_SHAPE[0], PAPER_SHAPE[1], 4096),
    "_scan_rows": (ROWS_SHAPE[0], ROWS_SHAPE[1], 4096),
    "_scan_ragged": (RAGGED_SHAPE[0], RAGGED_SHAPE[1], 4096),
}
_DISTILL_SCAN = {"_scan": (*DISTILL_SHAPE[:3], 4096), "_scan_ragged": (*DISTILL_RAGGED_SHAPE[:3], 4096)}
#: The shape each scan shape stands for.
_SCANNED = {"_scan": "paper", "_scan_rows": "rows", "_scan_ragged": "ragged"}


def _fwd_row(props: _config.DeviceProps, row: dict) -> list:
    dtype, tf32 = MODES[row["mode"]]
    flags = {k: row[k] for k in ("softcap", "temperature", "need_sum", "need_entropy", "need_argmax", "need_sumsq")}
    return forward_launches(props, dtype, *{**SHAPES, **_SCAN}[row["shape"]], bias=row["bias"], tf32=tf32, **flags)


def _bwd_row(props: _config.DeviceProps, row: dict) -> list:
    dtype, tf32 = MODES[row["mode"]]
    n, d, v = {**SHAPES, **_SCAN}[row["shape"]]
    if row["deterministic"] and row["_schedule"] == "tiles":
        raise ValueError("deterministic with the tiles schedule: plan_grads refuses it")
    flags = {k: row[k] for k in ("softcap", "temperature", "deterministic", "need_hidden", "need_weight", "need_bias")}
    # resolve_filter_eps's "auto" (engine.prepare), without importing the engine: eps(dtype) * 2**-5
    eps = torch.finfo(dtype).eps * 2.0**-5 if row["filter_eps"] == "auto" else row["filter_eps"]
    return backward_launches(
        props,
        dtype,
        n,
        d,
        v,
        bias=row["bias"],
        tf32=tf32,
        filter_eps=eps,
        schedule=row["_schedule"],
        class_weights=row["gamma_weights"],
        **flags,
    )


def _distill_row(props: _config.DeviceProps, row: dict) -> list:
    dtypes, tf32 = DISTILL_MODES[row["mode"]]
    flags = {k: row[k] for k in ("divergence", "hard", "softcap", "temperature", "deterministic")}
    needs = {k: row[k] for k in ("need_hidden", "need_weight", "need_bias")}
    n, ds, dt, v = {**DISTILL_SHAPES, **_DISTILL_SCAN}[row["shape"]]
    return distill_launches(
        props, dtypes, n, ds, dt, v, bias=row["bs"], teacher_bias=row["bt"], tf32=tf32, **flags, **needs
    )


@dataclass(frozen=True)
class Family:
    """One group of launches enumerated together: its planners (whose signatures give the axes), its compute modes
    and shapes, and ``launch(props, row)``: the launches of one flag set (raises ValueError where the planners
    refuse it)."""

    name: str
    planners: tuple
    modes: tuple
    shapes: tuple
    launch: Callable[[_config.DeviceProps, dict], list]
    values: tuple = ()  # (parameter, values) overriding AXIS_VALUES
    #: ``each`` level: every constexpr value in every kernel (the cross-entropy: each schedule's kernels with every
    #: flag on and off), or in some kernel (the distillation, whose kernels share their flags: CI's budget)
    per_kernel: bool = True

    def axes(self) -> dict[str, tuple]:
        return {"mode": self.modes, "shape": self.shapes, **planner_axes(*self.planners, values=dict(self.values))}


FAMILIES = {
    "fwd": Family("fwd", (_fwd.plan_row_stats,), tuple(MODES), tuple(SHAPES), _fwd_row),
    "bwd": Family("bwd", (_bwd.plan_grads,), tuple(MODES), tuple(SHAPES), _bwd_row),
    "distill": Family(
        "distill",
        (_kd.plan_stats, _kd.plan_rows, _kd.plan_grads),
        tuple(DISTILL_MODES),
        tuple(DISTILL_SHAPES),
        _distill_row,
        (("softcap", DISTILL_SOFTCAPS),),
        per_kernel=False,
    ),
}
#: ``--matrix`` names: which families.
MATRICES = {
    "main": ("fwd", "bwd"),
    "distill": ("distill",),
    "all": ("fwd", "bwd", "distill"),
    **{name: (name,) for name in ("fwd", "bwd")},
}
#: ``--level``: how the flag sets are chosen. ``full``: the whole product of the axes. ``triples``: a covering set
#: in which every triple of (axis, value) that some launch can have occurs together (strength 3). ``pairs``: every
#: pair (strength 2). ``each``: every (axis, value) occurs (strength 1). All but ``full`` also hold seeds
#: (:func:`_seeds`: the ``heavy`` flag set, every feature on, of the first mode; for ``pairs`` of each mode, the
#: ``plain`` one too, and both per schedule and per divergence; for ``triples`` those at every shape) and one flag
#: set for each config the product selects that they do not already reach.
LEVELS = ("each", "pairs", "triples", "full")
#: The covering strength of each covering level (``each`` is a subset of ``pairs``: :func:`flag_sets`).
_STRENGTH = {"pairs": 2, "triples": 3}


def _seeds(family: Family, axes: dict[str, tuple], level: str) -> list[dict]:
    """``pairs``: the ``plain`` and ``heavy`` flag sets of each mode at the paper shape, per schedule (backward) and
    per divergence (distillation); ``triples``: those at every shape; ``each``: the ``heavy`` one of the first mode
    (bf16) at the paper shape."""
    per = {"bwd": "_schedule", "distill": "divergence"}.get(family.name) if level != "each" else None
    shapes = axes["shape"] if level == "triples" else axes["shape"][:1]
    out = []
    for mode in axes["mode"] if level != "each" else axes["mode"][:1]:
        for shape in shapes:
            for kind in ("plain", "heavy") if level != "each" else ("heavy",):
                for extra in axes[per] if per else (None,):
                    row = {
                        n: (vals[0] if kind == "plain" or n in OUTPUT_AXES else vals[-1]) for n, vals in axes.items()
                    }
                    row.update(mode=mode, shape=shape)
                    if per:
                        row[per] = extra
                    out.append(row)
    return out


def _key(axes: dict[str, tuple], t: tuple) -> tuple:
    names = list(axes)
    return tuple((names.index(n), axes[n].index(v)) for n, v in t)


def cover(axes: dict[str, tuple], strength: int, valid: Callable[[dict], bool], seeds: list[dict]) -> list[dict]:
    """A deterministic covering set of flag sets (rows): ``seeds`` (those ``valid``), then greedily rows until every
    ``strength``-tuple of (axis, value) occurs in some valid row or none can hold it (tried with the greedy fill and
    up to 32 pseudo-random fills of the other axes, seeded: the same set every run)."""
    names = list(axes)
    need = set()
    for combo in itertools.combinations(names, strength):
        for vals in itertools.product(*(axes[n] for n in combo)):
            need.add(tuple(zip(combo, vals)))

    def tuples(row: dict) -> set:
        return {tuple((n, row[n]) for n in combo) for combo in itertools.combinations(names, strength)}

    rows: list[dict] = []
    for r in seeds:
        if valid(r):
            rows.append(r)
            need -= tuples(r)
    rng = random.Random(0)
    while need:
        t = min(need, key=lambda x: _key(axes, x))
        row = dict(t)
        for n in names:  # greedy: the value completing the most uncovered tuples with the axes already set
            if n in row:
                continue

            def gain(v, n=n, row=row, need=need):
                trial = {**row, n: v}
                done = [m for m in names if m in trial]
                return sum(
                    1
                    for combo in itertools.combinations(done, strength)
                    if n in combo and tuple((m, trial[m]) for m in combo) in need
                )

            row[n] = max(axes[n], key=gain)  # ties: the first value (max keeps the first maximum)
        tries = 0
        while not valid(row) and tries < 32:
            row = {n: (row[n] if (n, row[n]) in t else rng.choice(axes[n])) for n in names}
            tries += 1
        if tries == 32 and not valid(row):
            need.discard(t)  # no launch has it (e.g. deterministic with the tiles schedule)
            continue
        rows.append(row)
        need -= tuples(row)
    return rows


def _label(family: Family, axes: dict[str, tuple], row: dict) -> str:
    on = []
    for n, vals in axes.items():
        if n in ("mode", "shape") or row[n] == vals[0]:
            continue
        v = row[n]
        on.append(
            n.strip("_") if v is True else f"{n.strip('_')}={v if not isinstance(v, tuple) else ','.join(map(str, v))}"
        )
        if n in OUTPUT_AXES:
            on[-1] = "no_" + n[len("need_") :]
    return f"{row['mode']}/{row['shape']}/{family.name}:{'+'.join(on) or 'plain'}"


def _config_of(kernel, kwargs: dict) -> tuple:
    c = {k: kwargs.get(k) for k in ("BLOCK_N", "BLOCK_V", "BLOCK_D", "BLOCK_D_OUT")}
    return (kernel.fn.__name__, *c.values(), kwargs.get("num_warps"), kwargs.get("num_stages"), kwargs.get("maxnreg"))


def _traits(launches: list) -> set:
    """What a flag set's launches reach: each kernel's config and each (kernel, constexpr, value)."""
    out: set = set()
    for kernel, _grid, _args, kwargs in launches:
        out.add(("config", *_config_of(kernel, kwargs)))
        out |= {(kernel.fn.__name__, k, v) for k, v in kwargs.items() if k.isupper() and not k.startswith("BLOCK")}
    return out


def _launcher(family: Family, props: _config.DeviceProps, memo: dict) -> Callable[[dict], list]:
    """``launches(row)``: ``family.launch(props, row)``, ``[]`` where the planners refuse the flag set, memoized in
    ``memo`` (planning is most of an uncompiled level's time: the chunked backward plans a launch per chunk)."""
    names = tuple(family.axes())

    def launches(row: dict) -> list:
        k = tuple(row[n] for n in names)
        if k not in memo:
            try:
                memo[k] = family.launch(props, row)
            except ValueError:
                memo[k] = []
        return memo[k]

    return launches


def flag_sets(family: Family, props: _config.DeviceProps, level: str, memo: dict | None = None) -> list[dict]:
    """The flag sets (rows) of ``family`` at ``level`` on ``props`` (see LEVELS).

    ``pairs`` (``triples``): the strength-2 (3) cover with its seeds, then a scan of the product at the paper,
    rows and ragged shapes adding the first flag set that reaches a config or a (kernel, constexpr, value) not
    reached yet.
    ``each``: a subset of the ``pairs`` rows, chosen greedily, that still reaches every (axis, value), every config
    and every (kernel, constexpr, value) they reach (``Family.per_kernel`` False: every (constexpr, value) in some
    kernel), with the ``heavy`` seed first.

    ``memo``: where the launches of each flag set planned on the way are kept (see :func:`_launcher`)."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    axes = family.axes()
    launches = _launcher(family, props, {} if memo is None else memo)
    product = [dict(zip(axes, vals)) for vals in itertools.product(*axes.values())]
    if level == "full":
        return [r for r in product if launches(r)]
    covering = level if level in _STRENGTH else "pairs"
    rows = cover(axes, _STRENGTH[covering], lambda r: bool(launches(r)), _seeds(family, axes, covering))
    seen = set().union(*(_traits(launches(r)) for r in rows))
    for scan, shape in _SCANNED.items():
        if shape not in axes["shape"]:
            continue
        for r in product:
            if r["shape"] == shape:
                new = _traits(launches({**r, "shape": scan})) - seen
                if new:
                    rows.append(r)
                    seen |= _traits(launches(r))
    if level in _STRENGTH:
        return rows

    def reach(row: dict) -> set:
        traits = _traits(launches(row))
        if not family.per_kernel:  # each constexpr value in some kernel, rather than in each kernel
            traits = {t if t[0] == "config" else ("kernel", t[0]) for t in traits}
            traits |= {("constexpr", *t[1:]) for t in _traits(launches(row)) if t[0] != "config"}
        return traits | {("axis", n, v) for n, v in row.items()}

    heavy = _seeds(family, axes, "each")
    chosen = [r for r in heavy if launches(r)]
    todo = set().union(*(reach(r) for r in rows)) - set().union(set(), *(reach(r) for r in chosen))
    while todo:  # greedy set cover; ties: the earlier row
        best = max(rows, key=lambda r: len(reach(r) & todo))
        chosen.append(best)
        todo -= reach(best)
    return chosen


def _launch_inputs(kernel, args: tuple, kwargs: dict) -> tuple | None:
    """Everything :func:`launch_key` can depend on in ``kernel[grid](*args, **kwargs)``, as a hashable tuple, more
    than Triton specializes on (a tensor's dtype, address, shape and strides; a scalar's exact value; every keyword):
    two launches with equal inputs have one key, without the ~10 ms of binding and hashing a key costs. None when an
    argument is of another kind (then the key is computed)."""
    parts: list = [kernel]
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((a.dtype, a.device.type, a.data_ptr(), a.shape, a.stride()))
        elif a is None or isinstance(a, (bool, int, float, str)):
            parts.append((type(a), a))
        else:
            return None
    for k in sorted(kwargs):
        v = kwargs[k]
        if not (v is None or isinstance(v, (bool, int, float, str))):
            return None
        parts.append((k, type(v), v))
    return tuple(parts)


def plan(props: _config.DeviceProps, families=("fwd", "bwd"), level: str = "each") -> list[tuple]:
    """The launches to compile for ``props`` as picklable jobs ``[(label, family, row, i)]``: launch ``i`` of
    ``FAMILIES[family].launch(props, row)``, one per distinct specialization (Triton's cache key: two flag sets that
    launch the same kernel with the same constexprs and argument specializations compile once; the label names the
    first flag set that reached it)."""
    arch = props.capability[0] * 10 + props.capability[1]
    out, keys = [], set()
    known: dict[tuple, str] = {}  # _launch_inputs -> launch_key: most flag sets repeat some other set's launch
    for name in families:
        family = FAMILIES[name]
        axes = family.axes()
        memo: dict[tuple, list] = {}
        launches = _launcher(family, props, memo)
        for row in flag_sets(family, props, level, memo):
            for i, (kernel, _grid, args, kwargs) in enumerate(launches(row)):
                inputs = _launch_inputs(kernel, args, kwargs)
                key = known.get(inputs) if inputs is not None else None
                if key is None:
                    key = launch_key(kernel, args, kwargs, arch)
                    if inputs is not None:
                        known[inputs] = key
                if key not in keys:
                    keys.add(key)
                    out.append((f"{_label(family, axes, row)}/{kernel.fn.__name__}", name, row, i))
    return out


def _resolve(props: _config.DeviceProps, job: tuple) -> tuple:
    label, family, row, i = job
    kernel, _grid, args, kwargs = FAMILIES[family].launch(props, row)[i]
    return label, kernel, args, kwargs


def matrix(props: _config.DeviceProps, families=("fwd", "bwd"), level: str = "each") -> list:
    """:func:`plan` as ``[(label, kernel, args, kwargs)]``."""
    return [_resolve(props, job) for job in plan(props, families, level)]


def distill_matrix(props: _config.DeviceProps, level: str = "each") -> list:
    """:func:`matrix` of the distillation launches."""
    return matrix(props, ("distill",), level)


def main(argv=None) -> None:
    """``python -m cce_dist.kernels.aot --target sm_90 --json out.json [--matrix main|distill|all] [--level
    each|pairs|full] [--jobs 2]``: compile the enumerated launches for one target and write ``[{label, ok, error,
    **Compiled}]``. ``--count``: print how many flag sets and distinct specializations each level has, compile
    nothing."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--target", required=True, choices=sorted(_config.KNOWN_DEVICES))
    ap.add_argument("--json")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    ap.add_argument("--matrix", default="main", choices=sorted(MATRICES), help="which launches to compile")
    ap.add_argument("--level", default="each", choices=LEVELS, help="which flag sets (see LEVELS)")
    ap.add_argument("--count", action="store_true", help="only count flag sets and specializations")
    a = ap.parse_args(argv)
    props = _config.KNOWN_DEVICES[a.target]
    arch = props.capability[0] * 10 + props.capability[1]
    if a.count:
        for fam in MATRICES[a.matrix]:
            rows = flag_sets(FAMILIES[fam], props, a.level)
            print(f"{a.target} {fam} {a.level}: {len(rows)} flag sets, {len(matrix(props, (fam,), a.level))} kernels")
        return
    if not a.json:
        ap.error("--json is required unless --count")
    jobs = plan(props, MATRICES[a.matrix], a.level)
    if a.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(_compile_row, [(a.target, j) for j in jobs]))
    else:
        rows = [_compile_case(_resolve(props, j), arch) for j in jobs]
    Path(a.json).write_text(json.dumps(rows, indent=1))


def _compile_row(job) -> dict:
    target, j = job
    props = _config.KNOWN_DEVICES[target]
    return _compile_case(_resolve(props, j), props.capability[0] * 10 + props.capability[1])


def _compile_case(case, arch: int) -> dict:
    label, kernel, args, kwargs = case
    try:
        return dict(label=label, ok=True, error="", **asdict(compile_launch(kernel, args, kwargs, arch)))
    except Exception as e:  # noqa: BLE001 - reported (and failed) by the test
        return dict(
            label=label,
            ok=False,
            error=f"{type(e).__name__}: {e}"[:2000],
            kernel=kernel.fn.__name__,
            arch=arch,
            constexprs={k: str(v) for k, v in kwargs.items() if k.isupper()},
        )


if __name__ == "__main__":
    main()
