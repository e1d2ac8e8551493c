"""Where the oldest supported Triton lives beside the installed one, for the tests that compile and
interpret the kernels with both ends of ``cce_dist.kernels.TRITON_RANGE``.

``bash tests/install_oldest_triton.sh`` installs it (``pip install --target``, no effect on the
environment's own Triton) into ``$CCE_TRITON_OLDEST`` or ``~/.cache/cce_dist/triton-<version>``;
tests put that folder first on ``PYTHONPATH`` of a subprocess. Without it those tests skip, except
under CI (``CI`` set), where they fail: CI must test both ends.
"""

from __future__ import annotations

import os
import pathlib

import pytest

#: The oldest Triton the kernels support (torch 2.10 and 2.11 pin it).
OLDEST = "3.6.0"


def oldest_dir() -> pathlib.Path:
    """The folder the oldest Triton is (to be) installed in."""
    default = pathlib.Path.home() / ".cache" / "cce_dist" / f"triton-{OLDEST}"
    return pathlib.Path(os.environ.get("CCE_TRITON_OLDEST") or default)


def require_oldest() -> pathlib.Path:
    """The folder holding the oldest Triton; skips (fails under CI) when it is not installed."""
    d = oldest_dir()
    if not (d / "triton" / "__init__.py").exists():
        msg = f"Triton {OLDEST} is not installed in {d}: run bash tests/install_oldest_triton.sh"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return d


def env_with(path: pathlib.Path | None) -> dict[str, str]:
    """The environment of a subprocess that imports the Triton in ``path`` (None: the installed one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env
