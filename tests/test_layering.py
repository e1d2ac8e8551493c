"""Module boundaries of cce_dist: one-way imports, no private name across modules, backends that satisfy the protocol;
and of the test suite: no test module imports another (what they share lives in tests/helpers.py, tests/oracle.py and
the other non-test modules of tests/).

Read from the source (``ast``), so every import counts, also those inside functions (lazy imports still make a
cycle for a reader and for refactoring tools).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import cce_dist
from cce_dist import torch_impl
from cce_dist.backend import Backend
from cce_dist.prepare import backend_kwargs

PKG = Path(cce_dist.__file__).parent
TESTS = Path(__file__).parent


def _imports(path: Path):
    """``(module imported from, [names])`` of every ``from .x import ...`` / ``from cce_dist.x import ...``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 1:
            mod = node.module
        elif node.level == 0 and node.module and node.module.startswith("cce_dist."):
            mod = node.module.split(".")[1]
        else:
            continue
        names = [a.name for a in node.names]
        if mod is None:  # from . import formulas: the names are modules
            for name in names:
                yield name, []
        else:
            yield mod.split(".")[0], names


def _graph() -> dict[str, dict[str, list[str]]]:
    """module -> {module it imports from: every name imported from it}."""
    graph: dict[str, dict[str, list[str]]] = {}
    for p in sorted(PKG.glob("*.py")):
        deps = graph.setdefault(p.stem, {})
        for mod, names in _imports(p):
            deps.setdefault(mod, []).extend(names)
    return graph


def test_no_private_name_imported_across_modules():
    bad = [
        f"{mod} imports {name} from {src}"
        for mod, deps in _graph().items()
        for src, names in deps.items()
        for name in names
        if name.startswith("_")
    ]
    assert not bad, "import the public name from cce_dist.prepare (or make it public where it lives): " + str(bad)


def test_imports_are_one_way():
    graph = {mod: set(deps) & set(_graph()) for mod, deps in _graph().items()}
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


def _backends():
    out = [torch_impl]
    try:
        from cce_dist import kernels
    except ImportError:
        return out
    return out + [kernels]


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.NAME)
def test_backend_satisfies_protocol_and_declares_what_it_accepts(backend):
    """Every declared option is a keyword of the function it is passed to, and backend_kwargs passes nothing else."""
    assert isinstance(backend, Backend)
    row_params = inspect.signature(backend.row_stats).parameters
    grads_params = inspect.signature(backend.grads).parameters
    assert set(backend.ROW_STATS_OPTIONS) <= set(row_params)
    assert set(backend.GRADS_OPTIONS) <= set(grads_params)
    kw = backend_kwargs(backend, chunk_size=64, need_entropy=False, need_sum=False, filter_eps=0.5, deterministic=True)
    assert set(kw["row_stats"]) == set(backend.ROW_STATS_OPTIONS)
    extra = {
        name
        for name, on in (("filter_eps", backend.SUPPORTS_FILTERING), ("deterministic", backend.DETERMINISTIC_OPTION))
        if on
    }
    assert set(kw["grads"]) == set(backend.GRADS_OPTIONS) | extra
