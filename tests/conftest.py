"""Test-wide setup.

Triton kernels run on CPU tensors only in Triton's interpreter, which reads TRITON_INTERPRET when
triton is first imported: set it here, before any test module imports triton, unless a GPU is
present (then the kernels run for real and the GPU-marked tests are collected too).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
