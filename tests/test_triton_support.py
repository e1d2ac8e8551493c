"""The supported-Triton gate: the kernels run only with a Triton in ``cce_dist.kernels.TRITON_RANGE``.

Each torch CUDA build pins its own Triton (torch 2.10 / 2.11 -> 3.6, 2.12 -> 3.7, ...). A Triton the
kernels were never compiled with can reject them at the first backward (Triton 3.6 and 3.7 refused
code that 3.8 accepts), so outside the range ``impl="auto"`` takes the torch path with one warning
naming the version and the range, and ``impl="triton"`` raises before any collective. The version is
faked here by setting ``triton.__version__``; tests/test_aot_compile.py compiles every launch with
both ends of the range for real.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")

from cce_dist import kernels as K  # noqa: E402  # type: ignore[attr-defined]
from cce_dist import linear_cross_entropy, linear_distillation  # noqa: E402
from cce_dist.engine import prepare  # noqa: E402
from cce_dist.impl import backends  # noqa: E402
from cce_dist.kernels import config as C  # noqa: E402


@pytest.fixture
def fake_triton(monkeypatch):
    """``fake_triton("3.5.0")``: the imported Triton reports that version; the warn-once memory is fresh."""
    monkeypatch.setattr(prepare, "_WARNED", set())

    def set_version(v: str) -> None:
        monkeypatch.setattr(triton, "__version__", v)

    return set_version


def test_range_is_what_ci_compiles():
    """The oldest end of the gate is the Triton the AOT and interpreter tests install beside the newest,
    and the installed (newest) Triton is inside it."""
    from triton_oldest import OLDEST

    assert K.TRITON_RANGE[0] == C.parse_version(OLDEST)
    assert K.TRITON_RANGE[0] <= C.triton_version() <= K.TRITON_RANGE[1]


@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.8.0", "3.9.0", "3.9.0+git1a2b3c"])
def test_supported_versions_pass_the_gate(fake_triton, version):
    fake_triton(version)
    assert K.unsupported() is None
    assert K.available()  # TRITON_INTERPRET=1 here (conftest)


@pytest.mark.parametrize("version", ["3.5.1", "3.10.0", "4.0.0", "2.3.1", "unknown"])
def test_unsupported_versions_are_named(fake_triton, version):
    fake_triton(version)
    reason = K.unsupported()
    assert reason is not None and version in reason and "3.6 to 3.9" in reason
    assert not K.available()


def test_auto_takes_the_torch_path_with_one_warning(fake_triton):
    """On a CUDA device ``impl="auto"`` would pick the kernels: with an untested Triton it takes the torch
    implementation instead, warning once per process (the loss runs every step), naming version and range."""
    fake_triton("3.10.0")
    cuda = torch.device("cuda")  # only its type is read
    with pytest.warns(RuntimeWarning, match=r"Triton 3\.10\.0 .*3\.6 to 3\.9.*torch implementation"):
        assert prepare.resolve_backend("auto", cuda, 64) is backends.TORCH
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prepare.resolve_backend("auto", cuda, 64) is backends.TORCH
    fake_triton("3.9.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prepare.resolve_backend("auto", cuda, 64) is backends.triton()


def test_cpu_auto_never_warns(fake_triton):
    """CPU tensors take the torch path with ``impl="auto"`` anyway: no warning about Triton there."""
    fake_triton("3.10.0")
    h, w, t = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = linear_cross_entropy(h, w, t)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(h @ w.T, t))


@pytest.mark.parametrize("entry", ["cross_entropy", "distillation"])
def test_triton_impl_raises_naming_version(fake_triton, entry):
    """``impl="triton"`` with an untested Triton: a RuntimeError naming ``impl``, the version and the range,
    before anything is computed (the same error path that reaches every rank before the handshake)."""
    fake_triton("3.5.0")
    h, w, t = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with pytest.raises(RuntimeError, match=r"impl='triton'.*Triton 3\.5\.0.*3\.6 to 3\.9"):
        if entry == "cross_entropy":
            linear_cross_entropy(h, w, t, impl="triton")
        else:
            linear_distillation(h, w, torch.randn(4, 8), torch.randn(16, 8), t, impl="triton")


def test_parse_version():
    assert C.parse_version("3.6.0") == (3, 6)
    assert C.parse_version("3.10.1+gitabc") == (3, 10)
    with pytest.raises(ValueError, match="not a version"):
        C.parse_version("nightly")


def test_filtering_config_on_blackwell_follows_the_compiler():
    """Triton before 3.8 spills the filter test's registers on tcgen05 with 64x128 tiles (248 B on sm_100 with
    Triton 3.6, none with 3.9): the config is chosen for the Triton that will compile it."""
    p100 = C.KNOWN_DEVICES["sm_100"]
    old = C.backward_config(p100, torch.bfloat16, filtering=True, compiler=(3, 6))
    new = C.backward_config(p100, torch.bfloat16, filtering=True, compiler=(3, 9))
    assert (old.block_n, old.block_v) == (64, 64)
    assert (new.block_n, new.block_v) == (64, 128)
    # unfiltered configs depend on the compiler only where the enumerated AOT matrix found Triton 3.6 spilling
    # (benchmarks/results/aot_spills.md): the per-tile bf16 / fp16 backward on mma.sync (sm_80 / 86 / 120) with
    # 32-wide gradient chunks; nothing else, and never fp32
    for name, props in C.KNOWN_DEVICES.items():
        for dtype in (torch.bfloat16, torch.float32):
            old, new = (C.backward_config(props, dtype, compiler=v) for v in ((3, 6), (3, 9)))
            if props.mma == "mma" and dtype == torch.bfloat16:
                assert (old.block_d_out, new.block_d_out) == (32, 64), name
                assert dataclasses.replace(old, block_d_out=64) == new, name
            else:
                assert old == new, (name, dtype)
