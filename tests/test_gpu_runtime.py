"""Code that only runs on CUDA, exercised on the CPU (issue 20): fake devices, monkeypatched torch.cuda functions.

- the float32-output GEMM of the gradient products: decided once per (device, dtype) by a probe, never by catching
  the real call's errors (an out-of-memory error must reach the caller) and logged when the slow upcast path is taken;
- the chunked backward's memory check counts what torch's caching allocator holds reserved but unused;
- ``DeviceProps.of`` on a torch without ``shared_memory_per_block_optin`` (before 2.7);
- a debug line naming the backward schedule, why, its blocks and GEMM path;
- no device-to-host read (``bool(tensor)``, ``.item()``, ``.tolist()``, ...) from the library's own code in the
  default forward and backward, which would stall the host on every call and rule out CUDA-graph capture;
- every Triton launch runs under ``torch.cuda.device(<the tensors' device>)``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from helpers import problem  # noqa: E402

import cce_dist  # noqa: E402
import cce_dist.kernels as K  # noqa: E402
from cce_dist.kernels import backward as KB  # noqa: E402
from cce_dist.kernels import config as KC  # noqa: E402

CUDA0 = torch.device("cuda", 0)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="runs the kernels on CPU tensors in the interpreter")


def _runtime():
    """cce_dist.core.runtime where it exists (the tests below also run, and fail, on the code before it)."""
    try:
        from cce_dist.core import runtime
    except ImportError:
        return None
    return runtime


@contextlib.contextmanager
def _pretend_cuda_tensors():
    """Every tensor answers ``is_cuda`` True (what the CUDA-only branches test), for the ``with`` block only."""
    saved = torch.Tensor.__dict__.get("is_cuda")
    torch.Tensor.is_cuda = property(lambda self: True)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if saved is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = saved  # type: ignore[method-assign]


# 20 tokens (every fifth ignored), D = 24, V = 70, bf16 by default: leaves that require grad
_problem = functools.partial(
    problem,
    20,
    24,
    70,
    dtype=torch.bfloat16,
    w_scale=24**-0.5,
    b_scale=0.1,
    ignore=(slice(None, None, 5),),
    seed=2,
    requires_grad=True,
)


def _operands(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 16, generator=g).to(dtype)
    b = torch.randn(16, 4, generator=g).to(dtype)
    out = torch.randn(8, 4, generator=g)
    return out, a, b


# ------------------------------------------------------------------------------------------------
# 1. the float32-output GEMM
# ------------------------------------------------------------------------------------------------


def _count_out_dtype_calls(monkeypatch, exc: BaseException):
    """torch.mm / torch.addmm raise ``exc`` when given ``out_dtype`` (and count those calls); plain calls run."""
    calls = []
    real_mm, real_addmm = torch.mm, torch.addmm

    def fake(real):
        def call(*args, **kwargs):
            if "out_dtype" in kwargs:
                calls.append(real.__name__)
                raise exc
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(torch, "mm", fake(real_mm))
    monkeypatch.setattr(torch, "addmm", fake(real_addmm))
    return calls


def test_gemm_out_of_memory_reaches_the_caller(monkeypatch):
    """The fp32-output GEMM runs out of memory: the error is raised, not hidden by a silent (and larger) fp32 GEMM."""
    rt = _runtime()
    if rt is not None:  # the device's build has the GEMM (decided before): the real call is made once, and fails
        monkeypatch.setitem(rt._F32_OUT, (torch.device("cpu"), torch.bfloat16), True)
    calls = _count_out_dtype_calls(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    out, a, b = _operands()
    with _pretend_cuda_tensors(), pytest.raises(torch.OutOfMemoryError):
        KB.mm_f32(out, a, b, accumulate=True)
    assert calls == ["addmm"]


def test_gemm_device_error_reaches_the_caller(monkeypatch):
    """An asynchronous device error surfacing at the GEMM is not taken for a missing kernel."""
    rt = _runtime()
    if rt is not None:
        monkeypatch.setitem(rt._F32_OUT, (torch.device("cpu"), torch.bfloat16), True)
    err = getattr(torch, "AcceleratorError", RuntimeError)
    try:
        exc = err("CUDA error: an illegal memory access was encountered")
    except TypeError:  # pragma: no cover - an error type with another constructor
        pytest.skip("cannot construct torch.AcceleratorError here")
    _count_out_dtype_calls(monkeypatch, exc)
    out, a, b = _operands()
    with _pretend_cuda_tensors(), pytest.raises(err):
        KB.mm_f32(out, a, b, accumulate=False)


def test_gemm_without_out_dtype_is_decided_once(monkeypatch):
    """An older torch without ``out_dtype``: every call upcasts (the right values), and the fp32-output GEMM is not
    attempted (and failed) again on every call."""
    calls = _count_out_dtype_calls(monkeypatch, TypeError("mm() got an unexpected keyword argument 'out_dtype'"))
    out, a, b = _operands()
    want_acc = out + a.float() @ b.float()
    with _pretend_cuda_tensors():
        for _ in range(3):
            got = out.clone()
            KB.mm_f32(got, a, b, accumulate=True)
            torch.testing.assert_close(got, want_acc, rtol=1e-6, atol=1e-6)
        got = torch.empty_like(out)
        KB.mm_f32(got, a, b, accumulate=False)
    torch.testing.assert_close(got, a.float() @ b.float(), rtol=1e-6, atol=1e-6)
    assert len(calls) <= 1, f"the fp32-output GEMM was attempted {len(calls)} times: {calls}"


def test_probe_is_cached_per_device_and_dtype_and_the_upcast_is_logged(monkeypatch, caplog):
    rt = _runtime()
    assert rt is not None, "cce_dist.core.runtime (the shared GEMM helper) is missing"
    probes = []

    def probe(device, dtype):
        probes.append((device, dtype))
        return dtype == torch.float16  # pretend: fp16 has the kernel, bf16 not

    monkeypatch.setattr(rt, "_probe", probe)
    monkeypatch.setattr(rt, "_F32_OUT", {})
    with caplog.at_level(logging.DEBUG, logger="cce_dist"):
        for _ in range(3):
            assert rt.f32_out_gemm(CUDA0, torch.bfloat16) is False
            assert rt.f32_out_gemm(CUDA0, torch.float16) is True
        assert rt.f32_out_gemm(torch.device("cuda", 1), torch.bfloat16) is False
        assert rt.f32_out_gemm(torch.device("cpu"), torch.bfloat16) is False  # CPU: upcast, no probe
        assert rt.f32_out_gemm(CUDA0, torch.float32) is False  # nothing to decide
    assert probes == [(CUDA0, torch.bfloat16), (CUDA0, torch.float16), (torch.device("cuda", 1), torch.bfloat16)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "cce_dist"]
    assert len(warnings) == 2 and all("upcast" in r.getMessage() for r in warnings)
    assert "cuda:0" in warnings[0].getMessage() and "bfloat16" in warnings[0].getMessage()


def test_probe_reraises_out_of_memory_and_says_no_on_a_missing_kernel(monkeypatch):
    rt = _runtime()
    assert rt is not None
    assert rt._probe(torch.device("cpu"), torch.bfloat16) is False  # the CPU build has no aten::mm.dtype kernel
    _count_out_dtype_calls(monkeypatch, torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        rt._probe(torch.device("cpu"), torch.bfloat16)


def test_torch_impl_uses_the_shared_decision(monkeypatch):
    """The torch implementation's dW GEMM goes through the same cached decision: no fp32-output GEMM attempted where
    it was decided against (and no error of it swallowed where it was decided for)."""
    from cce_dist.impl import torch_cross_entropy

    rt = _runtime()
    assert rt is not None
    out, a, b = _operands()
    monkeypatch.setitem(rt._F32_OUT, (torch.device("cpu"), torch.bfloat16), True)
    _count_out_dtype_calls(monkeypatch, torch.OutOfMemoryError("CUDA out of memory"))
    acc = torch_cross_entropy.GradAccumulator(b.T.contiguous(), a, False, True, False)
    with _pretend_cuda_tensors(), pytest.raises(torch.OutOfMemoryError):
        acc.add(torch.ones(8, 4), b.T.contiguous(), a, slice(0, 4))


# ------------------------------------------------------------------------------------------------
# 2. free memory of the chunked schedule
# ------------------------------------------------------------------------------------------------


def _fake_memory(monkeypatch, *, driver_free: int, reserved: int, allocated: int):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (driver_free, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated, raising=False)


def test_chunked_fits_counts_the_allocators_cache(monkeypatch):
    """A warmed-up loop: the driver reports 1 MB free, but torch's allocator holds 2 GB reserved and unused."""
    _fake_memory(monkeypatch, driver_free=1 << 20, reserved=30 << 30, allocated=28 << 30)
    assert KB._chunked_verdict(CUDA0, deterministic=False)[0]
    assert KB._chunked_verdict(CUDA0, deterministic=True)[0]


def test_chunked_does_not_fit_when_neither_has_room(monkeypatch):
    _fake_memory(monkeypatch, driver_free=4 << 20, reserved=30 << 30, allocated=(30 << 30) - (4 << 20))
    assert not KB._chunked_verdict(CUDA0, deterministic=False)[0]
    _fake_memory(monkeypatch, driver_free=8 << 20, reserved=30 << 30, allocated=(30 << 30) - (8 << 20))
    assert KB._chunked_verdict(CUDA0, deterministic=False)[0]  # 8 + 8 MB: exactly the 16 MB scratch


# ------------------------------------------------------------------------------------------------
# 3. DeviceProps.of on an older torch
# ------------------------------------------------------------------------------------------------


def _old_props(record: KC.DeviceProps, **extra):
    """What torch < 2.7 reports: no ``shared_memory_per_block_optin`` (``extra`` may add the 48 KB field)."""
    return SimpleNamespace(
        major=record.capability[0],
        minor=record.capability[1],
        multi_processor_count=record.sms,
        name=record.name,
        **extra,
    )


@pytest.mark.parametrize("arch", sorted(KC.KNOWN_DEVICES))
@pytest.mark.parametrize("with_default_smem", [False, True], ids=["no-smem-field", "48KB-field"])
def test_device_props_without_optin_field(monkeypatch, arch, with_default_smem):
    record = KC.KNOWN_DEVICES[arch]
    extra = {"shared_memory_per_block": 48 * 1024} if with_default_smem else {}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _old_props(record, **extra))
    props = KC.DeviceProps.of(CUDA0)
    assert props.smem_per_block == record.smem_per_block
    assert props.capability == record.capability and props.sms == record.sms
    # the config it leads to is the one the device gets (not the smallest tiles)
    for dtype in (torch.bfloat16, torch.float32):
        assert KC.backward_config(props, dtype) == KC.backward_config(record, dtype)
        assert KC.forward_candidates(props, dtype) == KC.forward_candidates(record, dtype)


def test_device_props_reads_the_optin_field_when_present(monkeypatch):
    p = _old_props(KC.KNOWN_DEVICES["sm_90"], shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=200_000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: p)
    assert KC.DeviceProps.of(CUDA0).smem_per_block == 200_000


def test_device_props_table_by_capability():
    assert KC.optin_smem_of((8, 9)) == 101_376
    assert KC.optin_smem_of((10, 3)) == 232_448  # an unlisted minor version: its major's nearest below
    assert KC.optin_smem_of((7, 5)) == 48 * 1024  # unknown: what needs no opt-in


# ------------------------------------------------------------------------------------------------
# 4. which schedule ran
# ------------------------------------------------------------------------------------------------


def _small_grads(dtype=torch.bfloat16, **kw):
    g = torch.Generator().manual_seed(1)
    n, d, v = 20, 24, 70
    h = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(v, d, generator=g) / d**0.5).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    lse = torch.full((n,), 5.0)
    coef = torch.randn(n, 4, generator=g) * 0.1
    return K.grads(
        h,
        w,
        None,
        t,
        lse,
        coef,
        vocab_start=0,
        softcap=None,
        temperature=1.0,
        need_hidden=True,
        need_weight=True,
        need_bias=False,
        **kw,
    )


def _schedule_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "cce_dist" and "schedule=" in r.getMessage()]


@needs_interpreter
def test_the_chosen_schedule_is_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="cce_dist"):
        _small_grads()
    (line,) = _schedule_lines(caplog)
    assert "schedule=chunked" in line
    c = KC.INTERPRET_BWD
    assert f"blocks (N, V, D, D_out)={(c.block_n, c.block_v, c.block_d, c.block_d_out)}" in line
    assert "upcast GEMMs" in line  # bf16 on the CPU: no float32-output GEMM


@needs_interpreter
def test_the_fallback_and_its_reason_are_logged(monkeypatch, caplog):
    """Too little memory for the chunked scratch: the atomic schedule runs, and the log says why."""
    reason = "chunked scratch did not fit: 1048576 bytes free"
    monkeypatch.setattr(KB, "_chunked_verdict", lambda device, det: (False, reason))
    with caplog.at_level(logging.DEBUG, logger="cce_dist"):
        _small_grads()
        _small_grads(deterministic=True)
    lines = _schedule_lines(caplog)
    assert len(lines) == 2
    assert "schedule=tiles" in lines[0] and reason in lines[0]
    assert "schedule=owner" in lines[1] and reason in lines[1]


@needs_interpreter
def test_no_schedule_line_unless_debug(caplog):
    with caplog.at_level(logging.INFO, logger="cce_dist"):
        _small_grads(dtype=torch.float32)
    assert not _schedule_lines(caplog)


# ------------------------------------------------------------------------------------------------
# 5. no device-to-host reads in the default forward and backward
# ------------------------------------------------------------------------------------------------

_OURS = tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (cce_dist, K))
_SYNCS = ("__bool__", "item", "tolist", "__float__", "__int__", "__index__", "cpu", "numpy")


@contextlib.contextmanager
def _count_syncs():
    """Record ``(file:function, method)`` of every call of a reading-back Tensor method made from cce_dist's own code
    (the package and its kernels; not torch's, triton's interpreter's or the test's)."""
    seen: list[tuple[str, str]] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in _SYNCS}

    def wrap(name):
        real = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            f = sys._getframe(1)
            path = str(Path(f.f_code.co_filename).resolve())
            if path.startswith(_OURS):
                seen.append((f"{Path(path).parent.name}/{Path(path).name}:{f.f_code.co_name}", name))
            return real(self, *args, **kwargs)

        return method

    for name in _SYNCS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield seen
    finally:
        for name, old in saved.items():
            if old is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)


#: The one documented read-back of an eager call: the target ids are checked against the vocabulary before any
#: launch, so that an id out of range raises a clear ValueError (on a GPU a kernel cannot raise).
TARGET_CHECK = ("engine/prepare.py:valid_id_range", "tolist")


@needs_interpreter
@pytest.mark.parametrize(
    "form",
    ["mean", "sum", "none+lse", "smoothing+zloss+softcap", "deterministic", "filter", "logprobs+entropy"],
)
def test_default_triton_forward_and_backward_do_not_read_back(form):
    h, w, b, t = _problem()
    with _count_syncs() as seen:
        if form == "logprobs+entropy":
            lp, ent = cce_dist.linear_logprobs(h, w, t, bias=b, impl="triton", temperature=0.7, return_entropy=True)
            fwd = list(seen)
            (lp.sum() + ent.sum()).backward()
        else:
            kw: dict = dict(bias=b, impl="triton")
            if form == "none+lse":
                kw.update(reduction="none", return_lse=True)
            elif form == "sum":
                kw.update(reduction="sum")
            elif form == "smoothing+zloss+softcap":
                kw.update(label_smoothing=0.1, z_loss=1e-3, softcap=5.0)
            elif form == "deterministic":
                kw.update(deterministic=True)
            elif form == "filter":
                kw.update(filter_eps="auto", label_smoothing=0.1)
            out = cce_dist.linear_cross_entropy(h, w, t, **kw)
            fwd = list(seen)
            loss = out[0].sum() + out[1].sum() if isinstance(out, tuple) else out
            loss.backward()
        bwd = seen[len(fwd) :]
    assert all(s == TARGET_CHECK for s in fwd), f"the forward read device values back: {fwd}"
    assert not bwd, f"the backward read device values back: {bwd}"
    assert h.grad is not None and torch.isfinite(h.grad.float()).all()


@needs_interpreter
@pytest.mark.parametrize("form", ["kl-mean", "jsd-sum+hard", "reverse_kl-none", "kl-mean-two-pass", "kl-deterministic"])
def test_triton_distillation_does_not_read_back(form):
    """linear_distillation(impl="triton"): the scalar-loss schedule (gradients in forward) and the two-pass one."""
    from cce_dist import linear_distillation

    h, w, b, t = _problem(dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    th = torch.randn(h.shape[0], 16, generator=g)
    tw = torch.randn(w.shape[0], 16, generator=g) / 4
    div, red = form.split("-")[:2]
    kw: dict = dict(divergence=div, reduction=red if red in ("mean", "sum", "none") else "mean", student_bias=b)
    if "hard" in form:
        kw["hard_label_weight"] = 0.5
    if "two-pass" in form:
        kw["grad_in_forward"] = False
    if "deterministic" in form:
        kw["deterministic"] = True
    with _count_syncs() as seen:
        out = linear_distillation(h, w, th, tw, t, impl="triton", temperature=2.0, **kw)
        fwd = list(seen)
        out.sum().backward()
        bwd = seen[len(fwd) :]
    assert all(s == TARGET_CHECK for s in fwd), f"the forward read device values back: {fwd}"
    assert not bwd, f"the backward read device values back: {bwd}"
    assert w.grad is not None and torch.isfinite(w.grad).all()


@needs_interpreter
def test_kernel_launchers_do_not_read_back():
    """Below the driver (which checks the target ids once): forward and backward launchers read nothing back."""
    h, w, b, t = (x.detach() for x in _problem())
    coef = torch.randn(h.shape[0], 4) * 0.1
    coef[::3] = 0.0  # idle rows, the chunked schedule's H copy
    with _count_syncs() as seen:
        st = K.row_stats(h, w, b, t, vocab_start=0, softcap=None, temperature=1.0)
        lse = st[:, 0] + st[:, 1].log()
        for schedule in KB.SCHEDULES:
            for filt in (None, 0.01):
                K.grads(
                    h,
                    w,
                    b,
                    t,
                    lse,
                    coef,
                    vocab_start=0,
                    softcap=None,
                    temperature=1.0,
                    need_hidden=True,
                    need_weight=True,
                    need_bias=True,
                    filter_eps=filt,
                    _schedule=schedule,
                )
    assert not seen, f"read device values back: {seen}"


# ------------------------------------------------------------------------------------------------
# 6. launches run on the tensors' device
# ------------------------------------------------------------------------------------------------


def test_device_guard_picks_the_tensors_cuda_device(monkeypatch):
    rt = _runtime()
    assert rt is not None
    entered = []

    class FakeGuard:
        def __init__(self, device):
            entered.append(device)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", FakeGuard)
    assert isinstance(rt.device_guard(torch.device("cuda", 1)), FakeGuard)
    assert entered == [torch.device("cuda", 1)]
    with rt.device_guard(torch.device("cpu")):  # a no-op elsewhere
        pass
    assert entered == [torch.device("cuda", 1)]


@needs_interpreter
def test_every_launch_runs_under_the_guard_of_its_tensors_device(monkeypatch):
    """Each Triton launch (forward, backward, distillation) happens inside ``device_guard(<the tensors' device>)``."""
    rt = _runtime()
    assert rt is not None
    from cce_dist.kernels import distill as KD
    from cce_dist.kernels import forward as KF

    active: list[torch.device] = []
    launched: list[tuple[str, list]] = []

    @contextlib.contextmanager
    def guard(device):
        active.append(device)
        try:
            yield
        finally:
            active.pop()

    for mod in (KF, KB, KD):
        monkeypatch.setattr(mod, "device_guard", guard)

    def spy(kernel):
        class Spy:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    launched.append((kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), list(active)))
                    return kernel[grid](*args, **kwargs)

                return run

        return Spy()

    for mod in (KF, KB, KD):
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.endswith("_kernel") and hasattr(obj, "__getitem__") and not isinstance(obj, type):
                monkeypatch.setattr(mod, name, spy(obj))

    h, w, b, t = (x.detach() for x in _problem(dtype=torch.float32))
    st = K.row_stats(h, w, b, t, vocab_start=0, softcap=None, temperature=1.0)
    coef = torch.randn(h.shape[0], 4) * 0.1
    lse = st[:, 0] + st[:, 1].log()
    for schedule in ("chunked", "tiles", "owner"):
        K.grads(h, w, b, t, lse, coef, vocab_start=0, softcap=None, temperature=1.0, need_hidden=True,
                need_weight=True, need_bias=True, _schedule=schedule)  # fmt: skip
    ht, wt = h * 0.5, w.flip(0).contiguous()
    kd_stats, _ = KD.stats(h, w, b, ht, wt, None, t, vocab_start=0, softcap=(None, None), temperature=1.0, hard=True)
    norm = KD.norms(kd_stats.transpose(0, 1))
    KD.rows(h, w, b, ht, wt, None, norm, divergence="jsd", beta=0.5, softcap=(None, None), temperature=1.0)
    KD.grads(h, w, b, ht, wt, None, t, norm, torch.zeros(h.shape[0]), torch.ones(h.shape[0]), vocab_start=0,
             divergence="kl", beta=0.5, softcap=(None, None), temperature=1.0, soft_coef=1.0, hard_coef=0.5,
             need_hidden=True, need_weight=True, need_bias=True)  # fmt: skip
    names = {name for name, _ in launched}
    assert {"_row_stats_kernel", "_dz_store_kernel", "_grads_fused_kernel", "_grads_dh_kernel"} <= names, names
    assert any("distill" in name for name in names), names
    unguarded = [name for name, guards in launched if guards != [h.device]]
    assert not unguarded, f"launched outside device_guard({h.device}): {unguarded}"
