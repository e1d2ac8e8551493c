"""Packaging: the wheel and an editable install both ship ``cce_dist.kernels`` (``cce_dist/kernels/``).

A mistake in the package list shows up only in an installed copy, never in the source tree. The
checkout itself holds no top-level ``kernels`` package: run from the repository root (``python -m``
and pytest put it on ``sys.path``), one would shadow Hugging Face's ``kernels`` package, which
transformers imports. Each test copies the files a build reads into ``tmp_path`` (the checkout gets no
``build/`` or egg-info, and no stale ``build/lib`` can leak into the wheel), installs the copy into
a fresh virtual environment and imports the package there, outside the checkout.

The build runs without build isolation when setuptools >= 68 and wheel are installed (the
``test`` extra brings them), so it needs no network; otherwise pip fetches them as usual.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ["pyproject.toml", "README.md", "cce_dist"]
PIP_TIMEOUT = 300

# What the installed copy reports; runs in the fresh environment with -I (no cwd, no PYTHONPATH).
PROBE = """
import importlib.metadata, importlib.resources, json
import cce_dist, cce_dist.kernels as K
print(json.dumps({
    "cce_dist": cce_dist.__file__,
    "kernels": K.__file__,
    "kernels_api": sorted(K.__all__),
    "version": cce_dist.__version__,
    "dist_version": importlib.metadata.version("cce_dist"),
    "py_typed": importlib.resources.files("cce_dist").joinpath("py.typed").is_file(),
}))
"""


def _offline_build_tools() -> bool:
    """True when this interpreter has setuptools >= 68 and wheel, so pip needs no build isolation."""
    try:
        setuptools_major = int(importlib.metadata.version("setuptools").split(".")[0])
        importlib.metadata.version("wheel")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return setuptools_major >= 68


def _pip(*args: str, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--no-deps", "--disable-pip-version-check"]
    if _offline_build_tools():
        cmd.append("--no-build-isolation")
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=PIP_TIMEOUT)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def _fresh_venv(path: Path) -> Path:
    """A venv without pip that sees torch: the base interpreter's site-packages, plus this
    interpreter's when the tests themselves run in a virtual environment."""
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=os.name != "nt").create(path)
    python = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    if sys.prefix != sys.base_prefix:
        purelib = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        # Appended after the venv's own site-packages, so the installed cce_dist wins.
        Path(purelib, "outer_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _install_and_probe(python: Path, *pip_args: str, cwd: Path) -> dict:
    _pip("--python", str(python), "install", *pip_args, cwd=cwd)
    p = subprocess.run([python, "-I", "-c", PROBE], cwd=cwd.parent, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture()
def source(tmp_path: Path) -> Path:
    """A copy of what the build reads, without caches."""
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    return src


def test_wheel_ships_kernels_as_cce_dist_kernels(source: Path, tmp_path: Path):
    _pip("wheel", ".", "-w", str(tmp_path / "dist"), cwd=source)
    (wheel,) = (tmp_path / "dist").glob("cce_dist-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    # every module of every subpackage (core/, impl/, kernels/, tp/, engine/: docs/design.md, "Layout")
    want = {p.relative_to(ROOT).as_posix() for p in (ROOT / "cce_dist").rglob("*.py")} | {"cce_dist/py.typed"}
    assert want <= names, sorted(want - names)
    # a top-level `kernels` would shadow Hugging Face's `kernels` package (transformers imports it)
    assert not any(n.startswith("kernels/") for n in names), "kernels/ must not ship as a top-level package"

    got = _install_and_probe(_fresh_venv(tmp_path / "venv"), str(wheel), cwd=source)
    site_dir = (tmp_path / "venv").resolve()
    assert Path(got["kernels"]).resolve().is_relative_to(site_dir), got  # imported from the wheel
    assert Path(got["kernels"]).parent.parent == Path(got["cce_dist"]).parent, got
    assert {"TRITON_RANGE", "available", "grads", "row_stats", "unsupported"} <= set(got["kernels_api"]), got
    assert got["version"] == got["dist_version"], got  # one version source
    assert got["py_typed"] is True


def test_checkout_does_not_shadow_a_top_level_kernels_package():
    """transformers (5.x) imports Hugging Face's ``kernels`` package when it finds one: from the repository root
    (on ``sys.path`` under pytest and ``python -m``) a top-level ``kernels/`` folder was found instead, and every
    transformers model failed to import (``cannot import name 'CUDAProperties' from 'kernels'``)."""
    import importlib.util

    assert not (ROOT / "kernels").exists()
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not Path(spec.origin or "").resolve().is_relative_to(ROOT), spec


def test_editable_install_maps_kernels_directory(source: Path, tmp_path: Path):
    got = _install_and_probe(_fresh_venv(tmp_path / "venv"), "-e", ".", cwd=source)
    # Edits to cce_dist/kernels/ in the checkout are what `import cce_dist.kernels` runs.
    assert Path(got["kernels"]).resolve() == (source / "cce_dist" / "kernels" / "__init__.py").resolve(), got
    assert Path(got["cce_dist"]).resolve() == (source / "cce_dist" / "__init__.py").resolve(), got
    assert got["version"] == got["dist_version"], got
