"""Test-wide setup.

Triton kernels run on CPU tensors only in Triton's interpreter, which reads TRITON_INTERPRET when
triton is first imported: set it here, before any test module imports triton, unless a GPU is
present (then the kernels run for real and the GPU-marked tests are collected too). In the
interpreter, tests/interpreter_patch_memo.py skips its redundant re-patching of triton.language on
every helper call (bitwise the same results: tests/test_interpreter_patch_memo.py).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER") and not torch.cuda.is_available():
    # Under ``pytest -n auto`` every core already runs a worker: intra-op threads only oversubscribe the
    # cores (test_class_weight: 158 s -> 137 s on 2 cores with one thread). Subprocesses keep their default.
    torch.set_num_threads(1)

import pytest  # noqa: E402
from interpreter_patch_memo import install as _install_interpreter_memo  # noqa: E402

_install_interpreter_memo()


def pytest_collection_modifyitems(config, items):
    """Skip GPU tests without CUDA, and slow tests (inductor compiles, N*V > 2**31) unless CCE_SLOW=1."""
    slow_ok = bool(os.environ.get("CCE_SLOW"))
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_slow = pytest.mark.skip(reason="slow: set CCE_SLOW=1 to run")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        elif "slow" in item.keywords and not slow_ok:
            item.add_marker(no_slow)


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """One intra-op thread for a module of tiny shapes (``pytestmark = pytest.mark.usefixtures(...)``): there
    intra-op threads only add synchronization (10x slower measured on a loaded 2-core machine), and under
    ``-n 2`` the xdist workers already use both cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def rank_pool(tmp_path_factory):
    """``rank_pool(world)``: persistent gloo ranks that run one case per call (see dist_utils.RankPool).

    One pool lives at a time per test process; tests that use it should be ordered by world size
    (parametrize with the world outermost) so that it is spawned rarely.
    """
    from dist_utils import RankPools

    pools = RankPools(tmp_path_factory.mktemp("rank_pool"))
    yield pools
    pools.close()
