"""Module boundaries of cce_dist: the package grouped by layer, every import one way down the layers, no import cycle,
no private name across modules, backends that satisfy the protocol; and of the test suite: no test module imports
another (what they share lives in tests/helpers.py, tests/oracle.py and the other non-test modules of tests/).

The layers, lowest first (docs/design.md, "Layout and layering"); a module imports from its own layer or lower ones:

    core/     row statistics, formulas, options, row outputs, class weights, the shard, the backend protocol, runtime
    kernels/  the Triton kernels (cce_dist.kernels)
    impl/     the torch implementations and the Triton distillation's host side
    tp/       the handshake and the collectives of tensor parallelism, DTensor
    engine/   validation, the driver, the autograd Functions, the torch.compile custom ops
    (top)     the public modules and the integrations, plus re-export shims at documented old paths

Read from the source (``ast``), so every import counts, also those inside functions and under ``TYPE_CHECKING``
(lazy imports still make a cycle or an upward dependency for a reader and for refactoring tools). Nothing of cce_dist
is imported at module level here, so the structural tests run (and fail with a message) on any tree.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from pathlib import Path

import pytest

import cce_dist

PKG = Path(cce_dist.__file__).parent
TESTS = Path(__file__).parent

#: the layer folders, lowest first; the top level (the package itself) is above them all
LAYERS = ("core", "kernels", "impl", "tp", "engine")
TOP = "top"
#: the modules the top level holds: the public API and the integrations
PUBLIC = {"__init__", "api", "distill", "fsdp", "hf", "trl", "megatron", "testing"}
PUBLIC |= {"hf_heads"}  # cce_dist.hf's family knowledge (how models scale / cap their logits), split out of hf.py
#: documented old paths (README, docs/, benchmarks/README.md), kept as re-exports of where the code lives now
SHIMS = {"parallel": "tp", "options": "core", "backend": "core", "runtime": "core"}


def _module(path: Path) -> str:
    """``cce_dist.core.stats`` for cce_dist/core/stats.py, ``cce_dist.kernels`` for cce_dist/kernels/__init__.py."""
    parts = ("cce_dist",) + path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(path: Path):
    """``(line, module imported, [names])`` of every import of cce_dist in ``path``, relative or absolute, resolved
    to the module's dotted name (``from . import x`` of a submodule ``x`` imports that submodule, with no names)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    known = _modules()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "cce_dist" or a.name.startswith("cce_dist."):
                    yield node.lineno, a.name, []
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        elif node.module and (node.module == "cce_dist" or node.module.startswith("cce_dist.")):
            target = node.module
        else:
            continue
        names = [a.name for a in node.names]
        modules = [n for n in names if f"{target}.{n}" in known]
        for name in modules:
            yield node.lineno, f"{target}.{name}", []
        rest = [n for n in names if n not in modules]
        if rest or not modules:
            yield node.lineno, target, rest


def _graph() -> dict[str, dict[str, list[str]]]:
    """module -> {module it imports from: every name imported from it}."""
    graph: dict[str, dict[str, list[str]]] = {}
    for mod, path in _modules().items():
        deps = graph.setdefault(mod, {})
        for _line, dep, names in _imports(path):
            deps.setdefault(dep, []).extend(names)
    return graph


def _layer(mod: str) -> str:
    """The layer of a module: its folder under cce_dist, or the top level."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else TOP


def _rank(layer: str) -> int:
    return LAYERS.index(layer) if layer in LAYERS else len(LAYERS)


def test_each_layer_is_a_package_folder():
    """The folder list shows the architecture: one subpackage per layer and nothing else below cce_dist."""
    missing = [name for name in LAYERS if not (PKG / name / "__init__.py").is_file()]
    assert not missing, f"cce_dist/ must have a package folder per layer {LAYERS}; missing: {missing}"
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS), f"cce_dist/ holds folders other than the layers {LAYERS}: {sorted(folders)}"


def test_top_level_holds_only_the_public_modules_and_the_shims():
    top = {p.stem for p in PKG.glob("*.py")}
    extra = sorted(top - PUBLIC - set(SHIMS))
    assert not extra, (
        f"cce_dist/ top level holds {extra}: move each into its layer's folder {LAYERS} (a documented old path keeps a "
        "re-export shim, listed in SHIMS here)"
    )
    assert PUBLIC <= top, f"public modules missing from the top level: {sorted(PUBLIC - top)}"


@pytest.mark.parametrize("shim", sorted(SHIMS))
def test_a_shim_only_re_exports(shim):
    """A shim at a documented old path: a docstring naming where the code lives, imports from its layer, ``__all__``
    listing exactly what it imports. Nothing defined there, so nothing can drift from the real module."""
    path = PKG / f"{shim}.py"
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree) or ""
    assert "stable public path" in doc and f"cce_dist.{SHIMS[shim]}." in doc, (
        f"cce_dist/{shim}.py's docstring must say it is the stable public path and where the code lives"
    )
    imported: list[str] = []
    exported: list[str] | None = None
    for node in tree.body[1:]:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and (node.module or "").split(".")[0] in LAYERS:
            imported += [a.asname or a.name for a in node.names]
        elif (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
            and isinstance(node.value, ast.List)
        ):
            exported = [ast.literal_eval(e) for e in node.value.elts]
        else:
            raise AssertionError(f"cce_dist/{shim}.py:{node.lineno}: a shim only imports from a layer and sets __all__")
    assert exported is not None and sorted(exported) == sorted(imported), (
        f"cce_dist/{shim}.py: __all__ must list exactly the names it re-exports: {exported} vs {sorted(imported)}"
    )
    module = importlib.import_module(f"cce_dist.{shim}")  # the old path imports, every name resolves
    assert all(getattr(module, name) is not None for name in exported)


def test_no_module_imports_a_shim():
    """The shims are for users: the package's own modules import the code where it lives."""
    shims = {f"cce_dist.{name}" for name in SHIMS}
    bad = [
        f"{path.relative_to(PKG.parent)}:{line} imports {dep}"
        for mod, path in _modules().items()
        for line, dep, _names in _imports(path)
        if dep in shims
    ]
    assert not bad, "import from the module that holds the code, not from its re-export shim: " + "; ".join(bad)


def test_imports_go_down_the_layers():
    """No module imports from a layer above its own: core < kernels < impl < tp < engine < the top level."""
    bad = []
    for mod, path in _modules().items():
        here = _layer(mod)
        for line, dep, _names in _imports(path):
            if _rank(_layer(dep)) > _rank(here):
                bad.append(f"{path.relative_to(PKG.parent)}:{line} ({here}) imports {dep} ({_layer(dep)})")
    order = " < ".join(LAYERS + (TOP,))
    assert not bad, f"imports must go down the layers {order}: " + "; ".join(bad)


def test_no_private_name_imported_across_modules():
    bad = [
        f"{mod} imports {name} from {src}"
        for mod, deps in _graph().items()
        for src, names in deps.items()
        for name in names
        if name.startswith("_")
    ]
    assert not bad, "import the public name from cce_dist.engine.prepare (or make it public where it lives): " + str(
        bad
    )


def test_imports_are_one_way():
    modules = set(_modules())
    graph = {mod: set(deps) & modules for mod, deps in _graph().items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(dep) :] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])


def test_no_test_module_imports_another():
    """A test module imports shared code from a non-test module (helpers, oracle, fuzz_common, ...), never from
    another ``test_*`` module: importing one runs its module-level setup (skips, marks) in the importer, and a test
    function imported by name is collected twice."""
    bad = []
    for p in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            bad += [f"{p.name}:{node.lineno} imports {m}" for m in mods if m.split(".")[0].startswith("test_")]
    assert not bad, "move what is shared into a non-test module of tests/ (helpers.py, oracle.py, ...): " + str(bad)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_backend_declares_what_it_accepts(name):
    """Every declared option is a keyword of the function it is passed to, and backend_kwargs passes nothing else."""
    from cce_dist.core.backend import Backend
    from cce_dist.engine.prepare import backend_kwargs
    from cce_dist.impl import backends

    try:
        backend = backends.by_name(name)
    except ImportError as e:  # triton missing
        pytest.skip(f"the {name} backend does not import: {e}")
    assert backend.name == name
    assert isinstance(backend, Backend)
    row_params = inspect.signature(backend.row_stats).parameters
    grads_params = inspect.signature(backend.grads).parameters
    assert set(backend.row_stats_options) <= set(row_params)
    assert set(backend.grads_options) <= set(grads_params)
    kw = backend_kwargs(backend, chunk_size=64, need_entropy=False, need_sum=False, filter_eps=0.5, deterministic=True)
    assert set(kw["row_stats"]) == set(backend.row_stats_options)
    extra = {
        name
        for name, on in (("filter_eps", backend.supports_filtering), ("deterministic", backend.deterministic_option))
        if on
    }
    assert set(kw["grads"]) == set(backend.grads_options) | extra
