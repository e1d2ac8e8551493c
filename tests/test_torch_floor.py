"""The torch floor in pyproject.toml has evidence behind it: every torch API the package calls that is
not decades-old core is listed in :data:`APIS` with where it lives in a torch installation, and
``python tests/test_torch_floor.py WHEEL_OR_DIR`` checks each one in the files of another torch build
(a wheel: only the files named below are read). That check was run against torch 2.10.0's wheel
(the floor; README, "Support matrix"). CI cannot install that wheel (about 1 GB with its CUDA
libraries), so here the same patterns are checked against the installed torch, and the package's
sources are scanned so that a new API use cannot slip past the list.
"""

from __future__ import annotations

import pathlib
import re
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The floor pyproject.toml declares (``torch>=...``).
FLOOR = "2.10"

#: (the API as the sources spell it, file inside the torch package, pattern that shows it there).
APIS: list[tuple[str, str, str]] = [
    ("torch.library.custom_op", "torch/library.py", r"\bcustom_op,"),
    ("torch.library.register_fake", "torch/library.py", r"^def register_fake\("),
    ("torch.library.register_autograd", "torch/library.py", r"^def register_autograd\("),
    ("torch.compiler.is_compiling", "torch/compiler/__init__.py", r"^def is_compiling\("),
    ("torch.compiler.disable", "torch/compiler/__init__.py", r"^def disable\("),
    # cce_dist.core.runtime.constant_result sets the mark assume_constant_result sets (without importing Dynamo);
    # Dynamo reads it when it meets the function
    (
        "_dynamo_marked_constant",
        "torch/_dynamo/variables/functions.py",
        r"getattr\(fn, \"_dynamo_marked_constant\", False\)",
    ),
    (
        "torch._guards.TracingContext",
        "torch/_guards.py",
        r"^class TracingContext\b(?s:.*)def try_get\(\) -> TracingContext",
    ),
    (
        "torch.mm(out_dtype=)",
        "torch/_C/_VariableFunctions.pyi",
        r"def mm\(\s*input: Tensor,\s*mat2: Tensor,\s*out_dtype: _dtype",
    ),
    (
        "torch.addmm(out_dtype=)",
        "torch/_C/_VariableFunctions.pyi",
        r"def addmm\(\s*input: Tensor,\s*mat1: Tensor,\s*mat2: Tensor,\s*out_dtype: _dtype",
    ),
    ("torch.get_autocast_dtype", "torch/_C/__init__.pyi", r"^def get_autocast_dtype\(device_type"),
    ("torch.is_autocast_enabled(device)", "torch/_C/__init__.pyi", r"^def is_autocast_enabled\(device_type"),
    ("torch.distributed.tensor.DTensor", "torch/distributed/tensor/__init__.py", r"\bDTensor\b"),
    (
        "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
        "torch/distributed/tensor/_utils.py",
        r"^def compute_local_shape_and_global_offset\(",
    ),
    ("torch.ops.mkldnn._is_mkldnn_bf16_supported", "torch/lib/libtorch_cpu.so", r"_is_mkldnn_bf16_supported"),
    ("torch.ops.mkldnn._is_mkldnn_fp16_supported", "torch/lib/libtorch_cpu.so", r"_is_mkldnn_fp16_supported"),
    # CUDA builds only (kernels.config.DeviceProps falls back to a table by capability without it)
    ("shared_memory_per_block_optin", "torch/lib/libtorch_python.so", r"shared_memory_per_block_optin"),
]
#: Entries a CPU build of torch does not have.
CUDA_ONLY = {"shared_memory_per_block_optin"}

#: Namespaces whose members change between releases: every use in the sources must be listed above.
WATCHED = re.compile(r"torch\.(?:library|compiler|_guards|distributed\.tensor\._utils|ops\.mkldnn)\.[A-Za-z_0-9]+")


def _read(root, member: str) -> str:
    if isinstance(root, zipfile.ZipFile):
        data = root.read(member)
    else:
        data = (root / member).read_bytes()
    return data.decode("utf-8", "replace") if not member.endswith(".so") else data.decode("latin-1")


def missing_in(location: pathlib.Path, cuda: bool = True) -> list[str]:
    """The APIs whose pattern is not found in the torch at ``location`` (a wheel, or the folder holding
    the ``torch`` package); ``cuda``: a CUDA build (else :data:`CUDA_ONLY` is not looked for)."""
    root = zipfile.ZipFile(location) if location.is_file() else location
    out = []
    for api, member, pattern in APIS:
        if not cuda and api in CUDA_ONLY:
            continue
        try:
            text = _read(root, member)
        except (KeyError, FileNotFoundError):
            out.append(f"{api}: no {member}")
            continue
        if not re.search(pattern, text, flags=re.MULTILINE):
            out.append(f"{api}: {pattern!r} not in {member}")
    return out


def test_patterns_hold_in_the_installed_torch():
    import torch

    assert missing_in(pathlib.Path(torch.__file__).parents[1], cuda=torch.version.cuda is not None) == []


def test_every_watched_api_use_is_listed():
    listed = {api.split("(")[0] for api, _m, _p in APIS}
    used = set()
    for path in sorted((ROOT / "cce_dist").rglob("*.py")):  # every layer's folder, kernels included
        text = path.read_text()
        used |= set(WATCHED.findall(text))
        used |= {f"torch._guards.{name}" for name in re.findall(r"from torch\._guards import (\w+)", text)}
        used |= {f"torch.distributed.tensor._utils.{n}" for n in re.findall(r"tensor\._utils import (\w+)", text)}
        used |= set(re.findall(r"\b_dynamo_marked_constant\b", text))
    assert used, "the scan found nothing: the pattern is wrong"
    assert used <= listed, f"torch APIs used but not checked against the floor: {sorted(used - listed)}"


def test_pyproject_declares_the_floor():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'dependencies = ["torch>={FLOOR}"]' in text


if __name__ == "__main__":  # python tests/test_torch_floor.py torch-2.10.0-...whl
    problems = missing_in(pathlib.Path(sys.argv[1]))
    print("\n".join(problems) or f"all {len(APIS)} APIs present")
    sys.exit(1 if problems else 0)
