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
are cached as JSON next to Triton's own cache, keyed by Triton's kernel hash (source, options,
target, Triton version), so an unchanged kernel is never recompiled or re-inspected.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
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

__all__ = ["Compiled", "backward_launches", "cache_dir", "compile_launch", "distill_launches", "forward_launches"]


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

    @property
    def spill(self) -> int:
        return self.stack + self.local


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resource_usage(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(path)
    vals = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    return {"registers": vals["REG"], "stack": vals["STACK"], "local": vals["LOCAL"], "static_shared": vals["SHARED"]}


def compile_launch(kernel, args: tuple, kwargs: dict, arch: int) -> Compiled:
    """Compile ``kernel[grid](*args, **kwargs)`` for ``sm_<arch>`` as the JIT launcher would."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs.setdefault("debug", bool(kernel.debug))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    # Same key Triton's own cache uses (source, backend, options, env): look before compiling.
    key = hashlib.sha256(get_cache_key(src, backend, options, get_cache_invalidating_env_vars()).encode()).hexdigest()
    name = kernel.fn.__name__
    meta_path = cache_dir() / f"{name}-sm{arch}-r2-{key[:40]}.json"  # r2: record format
    if meta_path.exists():
        return Compiled(**json.loads(meta_path.read_text()))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir() / "triton"))
    ck = triton.compile(src, target=target, options=options.__dict__)
    ptx = ck.asm["ptx"]
    ru = _resource_usage(ck.asm["cubin"])
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
        )
        out.append((_fwd._row_stats_kernel, (triton.cdiv(n, c.block_n), splits_of(c)), args, kw))
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
    need_bias=True,
    schedule="tiles",
    class_weights=False,
):
    """``[(kernel, grid, args, kwargs)]`` of one backward call on ``props`` (all gradients needed;
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
        need_hidden=True,
        need_weight=True,
        need_bias=need_bias,
        filter_eps=filter_eps,
        deterministic=deterministic,
        gamma_weights=torch.empty(v, dtype=torch.float32, device="meta") if class_weights else None,
        props=props,
        allow_tf32=tf32,
        _schedule="owner" if deterministic and schedule == "tiles" else schedule,
    )
    launches = [x for x in launches if isinstance(x[0], triton.runtime.JITFunction)]
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

_FLAGS = {
    "plain": dict(),
    "bias+softcap+temp": dict(bias=True, softcap=30.0, temperature=0.7),
    "filter": dict(filter_eps=2.0**-12),
    "filter+softcap+bias": dict(bias=True, softcap=30.0, filter_eps=2.0**-12),
    "class-weights+softcap+bias": dict(bias=True, softcap=30.0, class_weights=True),
}


def matrix(props: _config.DeviceProps):
    """The launches the AOT test compiles for ``props``: ``[(label, kernel, args, kwargs)]``.

    At the paper shape: every forward candidate and every backward config the library can select
    on ``props`` for each dtype mode (bf16, fp16, fp32 with TF32, fp32 IEEE); the flag sets are
    sampled so that each selectable config and each kernel appears (the forward with all five statistics; bf16
    also without SUM / ENTROPY, the plain cross-entropy's; bf16 and TF32 with the row outputs' ARGMAX and SUMSQ
    too); bf16 gets all five backward
    flag sets fused and three deterministic (plain, the heaviest, class weights), TF32 the plain, the heaviest and
    class weights, fp16 (bf16's configs) and IEEE fp32 one each; the chunked schedule's dz kernel for bf16 (plain,
    the heaviest flags, class weights) and once per other mode; plus the ragged shape once (no divisibility hints)
    and the chunked dz kernel at a token count split into row blocks, the last one ragged (bf16)."""
    n, d, v = PAPER_SHAPE
    out = []

    def add(label, launches):
        for kernel, _grid, args, kwargs in launches:
            out.append((f"{label}/{kernel.fn.__name__}", kernel, args, kwargs))

    heavy = "filter+softcap+bias"
    for name, dtype, tf32 in DTYPES:
        fwd = forward_launches(props, dtype, n, d, v, tf32=tf32)
        add(f"{name}/plain/fwd", fwd if name != "fp16" else fwd[:1])
        if name == "bf16":  # the cross-entropy without label smoothing: no SUM / ENTROPY statistics
            add(f"{name}/ce/fwd", forward_launches(props, dtype, n, d, v, need_sum=False, need_entropy=False))
        if name in ("bf16", "tf32"):  # every row output on top of every statistic: the longest epilogue
            rows = forward_launches(props, dtype, n, d, v, tf32=tf32, need_argmax=True, need_sumsq=True)
            add(f"{name}/row-outputs/fwd", rows)
        if name == "bf16":
            fl = _FLAGS["bias+softcap+temp"]
            add(
                f"{name}/bias+softcap+temp/fwd",
                forward_launches(
                    props, dtype, n, d, v, bias=True, softcap=fl["softcap"], temperature=fl["temperature"]
                )[:1],
            )
        weighted = "class-weights+softcap+bias"
        fused = {"bf16": list(_FLAGS), "tf32": ["plain", heavy, weighted], "fp16": ["plain"], "fp32": ["plain"]}[name]
        det = {"bf16": ["plain", heavy, weighted], "tf32": [heavy], "fp16": [], "fp32": [heavy]}[name]
        for fname in fused:
            add(f"{name}/{fname}/bwd", backward_launches(props, dtype, n, d, v, tf32=tf32, **_FLAGS[fname]))
        for fname in det:
            add(
                f"{name}/{fname}/bwd-det",
                backward_launches(props, dtype, n, d, v, tf32=tf32, deterministic=True, **_FLAGS[fname]),
            )
        chunked = {"bf16": ["plain", heavy, weighted], "tf32": ["plain"], "fp16": ["plain"], "fp32": ["plain"]}
        for fname in chunked[name]:
            add(
                f"{name}/{fname}/bwd-chunked",
                backward_launches(props, dtype, n, d, v, tf32=tf32, schedule="chunked", **_FLAGS[fname]),
            )
    n, d, v = RAGGED_SHAPE
    add("bf16/ragged/fwd", forward_launches(props, torch.bfloat16, n, d, v)[:1])
    add("bf16/ragged/bwd", backward_launches(props, torch.bfloat16, n, d, v, **_FLAGS["bias+softcap+temp"]))
    n, d, v = ROWS_SHAPE
    add("bf16/rows/bwd-chunked", backward_launches(props, torch.bfloat16, n, d, v, schedule="chunked"))
    return out


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
):
    """``[(kernel, grid, args, kwargs)]`` of one ``linear_distillation(impl="triton")`` call on
    ``props``: the statistics launch (for either KL with its cross sum), the JSD's per-row sums
    launch and the gradient launch of :mod:`.distill` (all student gradients), from its own
    ``plan_*`` on meta tensors. ``dtypes``: (student, teacher) compute dtypes."""
    hs, ws, bs, t = _meta_inputs(n, ds, v, dtypes[0], bias)
    ht, wt, bt, _t = _meta_inputs(n, dt, v, dtypes[1], bias)
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
    needs = dict(need_hidden=True, need_weight=True, need_bias=True, deterministic=deterministic)
    *_grads, grads = _kd.plan_grads(hs, ws, bs, ht, wt, bt, t, norm, aux, g, **coefs, **needs, **geo)
    return launches + grads


#: A distillation shape: tokens, the student's and the teacher's hidden sizes, vocab (Llama 3's).
DISTILL_SHAPE = (8192, 2048, 4096, 128256)


def distill_matrix(props: _config.DeviceProps):
    """The distillation launches the AOT test compiles for ``props``: ``[(label, kernel, args, kwargs)]``.

    At :data:`DISTILL_SHAPE`: bf16 heads plain (forward KL, no hard label) and with everything on
    (bias, softcap per head, temperature, hard label) for reverse KL and JSD (every kernel and every
    epilogue); a bf16 student with an fp32 (TF32) teacher; fp32 IEEE once (the small config); the
    deterministic gradient kernels for bf16 and the TF32 teacher."""
    n, ds, dt, v = DISTILL_SHAPE
    bf, f32 = torch.bfloat16, torch.float32
    full = dict(hard=True, bias=True, softcap=(30.0, 50.0), temperature=2.0)
    cases = [
        ("bf16/plain/kl", (bf, bf), True, dict(divergence="kl")),
        ("bf16/full/reverse_kl", (bf, bf), True, dict(divergence="reverse_kl", **full)),
        ("bf16/full/jsd", (bf, bf), True, dict(divergence="jsd", **full)),
        ("bf16+tf32/full/kl", (bf, f32), True, dict(divergence="kl", **full)),
        ("fp32/full/jsd", (f32, f32), False, dict(divergence="jsd", **full)),
        ("bf16/full/jsd/det", (bf, bf), True, dict(divergence="jsd", deterministic=True, **full)),
        ("bf16+tf32/full/reverse_kl/det", (bf, f32), True, dict(divergence="reverse_kl", deterministic=True, **full)),
    ]
    out = []
    for label, dtypes, tf32, kw in cases:
        assert isinstance(kw, dict)
        for kernel, _grid, args, kwargs in distill_launches(props, dtypes, n, ds, dt, v, tf32=tf32, **kw):
            out.append((f"{label}/{kernel.fn.__name__}", kernel, args, kwargs))
    return out


def main(argv=None) -> None:
    """``python -m cce_dist.kernels.aot --target sm_90 --json out.json [--matrix distill]``: compile the
    matrix for one target and write ``[{label, ok, error, **Compiled}]``."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--target", required=True, choices=sorted(_config.KNOWN_DEVICES))
    ap.add_argument("--json", required=True)
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    ap.add_argument("--matrix", default="main", choices=sorted(_MATRICES), help="which launches to compile")
    a = ap.parse_args(argv)
    props = _config.KNOWN_DEVICES[a.target]
    arch = props.capability[0] * 10 + props.capability[1]
    cases = _MATRICES[a.matrix](props)
    if a.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(_compile_row, [(a.target, a.matrix, i) for i in range(len(cases))]))
    else:
        rows = [_compile_case(c, arch) for c in cases]
    Path(a.json).write_text(json.dumps(rows, indent=1))


#: ``--matrix`` names: the cross-entropy kernels and the distillation kernels.
_MATRICES = {"main": matrix, "distill": distill_matrix}


def _compile_row(job) -> dict:
    target, which, i = job
    props = _config.KNOWN_DEVICES[target]
    return _compile_case(_MATRICES[which](props)[i], props.capability[0] * 10 + props.capability[1])


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
