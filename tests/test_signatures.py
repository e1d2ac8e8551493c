"""Parameter lists that must agree across modules and that no single definition derives: each test compares the two
sides (``inspect.signature``, or the source's ``ast`` where the lists are inside Triton kernels), so adding,
removing or reordering a parameter on one side only fails here.

What is derived instead needs no test: ``cce_dist.kernels.row_stats`` / ``grads`` are the kernels' own functions
(a module ``__getattr__``), ``LinearCrossEntropy(**options)`` passes its keywords to ``CrossEntropyOptions``, and
compile.py's custom ops take their options by keyword.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

import cce_dist
from cce_dist import api, distill
from cce_dist.core.backend import Backend, DistillForward, DistillGrads, Grads, RowStats
from cce_dist.core.options import CrossEntropyOptions, DistillationOptions, LogprobOptions
from cce_dist.engine import compile as _compile  # noqa: F401 - registers the cce_dist custom ops
from cce_dist.impl import backends
from cce_dist.tp import collectives

PKG = Path(cce_dist.__file__).parent
KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY


def _params(fn, *, drop_self=False):
    """``[(name, kind, default)]`` of ``fn``'s parameters (annotations left out: they are strings here, spelled
    differently for the same type)."""
    ps = list(inspect.signature(fn).parameters.values())
    if drop_self:
        ps = ps[1:]
    return [(p.name, p.kind, p.default) for p in ps]


def _names(fn, kind=None):
    return [p.name for p in inspect.signature(fn).parameters.values() if kind is None or p.kind == kind]


def _insert_after(params, after, extra):
    i = [p[0] for p in params].index(after) + 1
    return params[:i] + extra + params[i:]


# ---------------------------------------------------------------------------------------------------------------
# the public functions and their options dataclasses (issue 21)
# ---------------------------------------------------------------------------------------------------------------

# Keywords of the public functions that are not options: tensors passed by keyword.
NOT_OPTIONS = {
    "linear_cross_entropy": {"bias", "class_weight"},
    "linear_logprobs": {"bias"},
    "linear_distillation": {"student_bias", "teacher_bias"},
}


def _fields(options_cls):
    return {f.name: f.default for f in dataclasses.fields(options_cls)}


@pytest.mark.parametrize(
    "fn, options_cls",
    [
        (api.linear_cross_entropy, CrossEntropyOptions),
        (api.linear_logprobs, LogprobOptions),
        (distill.linear_distillation, DistillationOptions),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_public_keywords_are_the_options_fields(fn, options_cls):
    """Each keyword-only parameter (minus NOT_OPTIONS) is a field of the options dataclass with the same default,
    and every field is a keyword; the typing overloads list the same keywords."""
    sig = inspect.signature(fn)
    keywords = {
        p.name: p.default
        for p in sig.parameters.values()
        if p.kind == KEYWORD_ONLY and p.name not in NOT_OPTIONS[fn.__name__]
    }
    assert keywords == _fields(options_cls)
    for overload in typing.get_overloads(fn):
        assert _names(overload) == list(sig.parameters), overload


def test_module_takes_the_options_fields():
    """LinearCrossEntropy passes its keywords on to CrossEntropyOptions whole: every field is accepted, nothing else."""
    assert _names(api.LinearCrossEntropy.__init__) == ["self", "options"]
    fields = _fields(CrossEntropyOptions)
    assert api.LinearCrossEntropy(**fields).options == CrossEntropyOptions(**fields)
    with pytest.raises(TypeError):
        api.LinearCrossEntropy(not_an_option=1)


# ---------------------------------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------------------------------


def _backends():
    out = [backends.TORCH]
    try:
        return out + [backends.triton()]
    except ImportError:
        return out


CONTRACT = {"row_stats": RowStats, "grads": Grads}


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("fn", ["row_stats", "grads"])
def test_backend_signature_is_the_contracts_plus_declared_options(backend, fn):
    """The contract's parameters first, as declared (names, kinds, defaults), then only the declared options and
    private (``_``-prefixed, tests only) keywords, each with a default."""
    assert isinstance(backend, Backend)
    protocol = _params(CONTRACT[fn].__call__, drop_self=True)
    actual = _params(getattr(backend, fn))
    assert actual[: len(protocol)] == protocol
    extra = actual[len(protocol) :]
    assert all(kind == KEYWORD_ONLY and default is not inspect.Parameter.empty for _, kind, default in extra), extra
    public = {name for name, _, _ in extra if not name.startswith("_")}
    declared = set(getattr(backend, f"{fn}_options"))
    if fn == "grads":  # filter_eps / deterministic are the contract's own (declared by the supports_* flags)
        declared -= {"filter_eps", "deterministic"}
    assert public == declared


def test_kernels_row_stats_and_grads_are_the_kernel_functions():
    kernels = pytest.importorskip("cce_dist.kernels")
    pytest.importorskip("triton")
    from cce_dist.kernels import backward, forward

    assert kernels.row_stats is forward.row_stats
    assert kernels.grads is backward.grads


# ---------------------------------------------------------------------------------------------------------------
# planners and their launchers (cce_dist.kernels)
# ---------------------------------------------------------------------------------------------------------------

PLAN_EXTRA = [("props", KEYWORD_ONLY, None), ("allow_tf32", KEYWORD_ONLY, None)]


def test_backward_plan_grads_takes_grads_arguments():
    """kernels.backward.plan_grads: grads()'s parameters plus the device record and the TF32 switch, after the public
    keywords."""
    pytest.importorskip("triton")
    from cce_dist.kernels import backward

    assert _params(backward.plan_grads) == _insert_after(_params(backward.grads), "gamma_weights", PLAN_EXTRA)


@pytest.mark.parametrize(
    "plan, launcher, after",
    [("plan_stats", "stats", "cross"), ("plan_rows", "rows", "temperature"), ("plan_grads", "grads", "deterministic")],
)
def test_distill_plans_take_their_launchers_arguments(plan, launcher, after):
    pytest.importorskip("triton")
    from cce_dist.kernels import distill as kd

    expected = _insert_after(_params(getattr(kd, launcher)), after, PLAN_EXTRA)
    assert _params(getattr(kd, plan)) == expected


# ---------------------------------------------------------------------------------------------------------------
# the kernels' parameter lists (read from the source: the kernels are Triton JIT functions)
# ---------------------------------------------------------------------------------------------------------------


def _functions(module: str):
    tree = ast.parse((PKG / "kernels" / f"{module}.py").read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _arg_names(fn: ast.FunctionDef):
    return [a.arg for a in fn.args.args]


# Per family: the parameters every kernel of it takes, in this order (each kernel adds its own outputs, their
# strides and its flags between them).
KERNEL_FAMILIES = {
    "backward": (
        ["_grads_fused_kernel", "_dz_store_kernel", "_grads_dh_kernel", "_grads_dw_kernel"],
        "H W Bias Targets LSE Coef N V D vocab_start softcap temperature filter_eps stride_hn stride_hd stride_wv "
        "stride_wd stride_b stride_t stride_cn stride_ck HAS_BIAS HAS_SOFTCAP HAS_TEMP FILTER GAMMA_IN_TILE "
        "USE_LIBDEVICE DOT_PRECISION INTERP_BF16 BLOCK_N BLOCK_V BLOCK_D",
    ),
    "distill": (
        [
            "_distill_stats_kernel",
            "_distill_rows_kernel",
            "_distill_grads_kernel",
            "_distill_dh_kernel",
            "_distill_dw_kernel",
        ],
        "HS WS BS HT WT BT N V DS DT cap_s cap_t temperature stride_hsn stride_hsd stride_wsv stride_wsd "
        "stride_bs stride_htn stride_htd stride_wtv stride_wtd stride_bt HAS_BS HAS_BT HAS_CAP_S HAS_CAP_T "
        "HAS_TEMP USE_LIBDEVICE PREC_S PREC_T INTERP_S INTERP_T BLOCK_N BLOCK_V BLOCK_D",
    ),
}


@pytest.mark.parametrize("module", sorted(KERNEL_FAMILIES))
def test_kernel_parameter_lists_agree(module):
    """Every kernel of a family takes the shared parameters, and any two kernels order the parameters they both
    take alike (the launchers build their arguments from the same pieces)."""
    names, shared = KERNEL_FAMILIES[module]
    fns = _functions(module)
    assert sorted(name for name in fns if name.endswith("_kernel")) == sorted(names)
    lists = {name: _arg_names(fns[name]) for name in names}
    shared_list = shared.split()
    for name, params in lists.items():
        assert [p for p in params if p in shared_list] == shared_list, name
    for a, pa in lists.items():
        for b, pb in lists.items():
            common = set(pa) & set(pb)
            assert [p for p in pa if p in common] == [p for p in pb if p in common], (a, b)


# A caller's own names for logit_tile's parameters: distillation's student (S) and teacher (T) heads.
LOGIT_TILE_RENAMES = {
    **{head: "HEAD" for head in "ST"},
    **{f"PREC_{head}": "DOT_PRECISION" for head in "ST"},
    **{f"INTERP_{head}": "INTERP_BF16" for head in "ST"},
    **{f"HAS_B{head}": "HAS_BIAS" for head in "ST"},
}
# What every caller packs into logit_tile's HEAD tuple, in this order (distillation: HS, WS, BS, DS, stride_hsn, ...).
HEAD_FIELDS = ["H", "W", "Bias", "D", "stride_hn", "stride_hd", "stride_wv", "stride_wd", "stride_b"]


def test_logit_tile_calls_pass_its_parameters_in_order():
    """The forward, backward and distillation kernels form their logits with the same logit_tile call (bit-identical
    logits): each argument is the variable named after the parameter it fills, and the HEAD tuple each kernel builds
    holds the head's pointers, hidden size and strides in logit_tile's order."""
    tile = _functions("_common")["logit_tile"]
    params = _arg_names(tile)
    unpack = next(n for n in ast.walk(tile) if isinstance(n, ast.Assign) and ast.unparse(n.value) == "HEAD")
    assert [ast.unparse(e) for e in unpack.targets[0].elts] == HEAD_FIELDS
    callers, heads = [], 0
    for module in ("forward", "backward", "distill"):
        for fn in _functions(module).values():
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "logit_tile":
                    assert not node.keywords
                    args = [LOGIT_TILE_RENAMES.get(ast.unparse(a), ast.unparse(a)) for a in node.args]
                    assert args == params, (module, fn.name)
                    callers.append(fn.name)
                if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) in ("HEAD", "S", "T"):
                    suffix = {"HEAD": "", "S": "s", "T": "t"}[ast.unparse(node.targets[0])]
                    # distillation's names: HS / WS / BS / DS, stride_hsn, ...: the head's letter after the first one
                    want = [f if not suffix else _head_name(f, suffix) for f in HEAD_FIELDS]
                    assert [ast.unparse(e) for e in node.value.elts] == want, (module, fn.name)
                    heads += 1
    assert sorted(callers) == ["_dz_tile", "_row_stats_kernel", "_tiles", "_tiles"]
    assert heads >= 2 + 2 * 5  # forward, backward, and both heads of each distillation kernel


def _head_name(field: str, head: str) -> str:
    """Distillation's name of a HEAD field for head ``head`` ("s" student, "t" teacher)."""
    if field == "Bias":
        return "B" + head.upper()
    if field.startswith("stride_"):
        return f"stride_{field[7]}{head}{field[8:]}"
    return field + head.upper()


# ---------------------------------------------------------------------------------------------------------------
# distillation: the torch and Triton modules satisfy one protocol
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("fn", ["forward", "grads"])
def test_distill_passes_take_the_contracts_arguments(backend, fn):
    """Every backend's distillation pass takes exactly the DistillPass contract's arguments (mypy checks the types
    where cce_dist.impl.backends builds them), and declares only options it takes."""
    protocol = _params({"forward": DistillForward, "grads": DistillGrads}[fn].__call__, drop_self=True)
    assert _params(getattr(backend.distill, fn)) == protocol
    assert backend.distill.grads_options <= {name for name, _, _ in protocol}


# ---------------------------------------------------------------------------------------------------------------
# the tensor-parallel handshake
# ---------------------------------------------------------------------------------------------------------------


def _calls(path: Path, name: str):
    tree = ast.parse(path.read_text())
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


def _enclosing_functions(path: Path, name: str) -> list[str]:
    """The names of the functions of ``path`` whose bodies call ``name`` (once per call)."""
    tree = ast.parse(path.read_text())
    return [
        fn.name
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
    ]


def test_every_loss_reaches_the_handshake_through_the_driver():
    """tp.collectives.handshake is called in engine/driver.py only: by ``_exchange`` (every loss runs the driver) and
    by ``refuse_on_group`` (a wrapper's check of its own rank's inputs, raised through the handshake), each with every
    keyword by name; the keywords have no defaults, so mypy also reports a missing one."""
    sig = inspect.signature(collectives.handshake)
    keywords = [p.name for p in sig.parameters.values() if p.kind == KEYWORD_ONLY]
    assert all(sig.parameters[k].default is inspect.Parameter.empty for k in keywords)
    sites = {p: _calls(p, "handshake") for p in PKG.rglob("*.py")}
    sites = {p: calls for p, calls in sites.items() if calls}
    assert [p.name for p in sites] == ["driver.py"], sites
    ((driver_path, calls),) = sites.items()
    assert sorted(_enclosing_functions(driver_path, "handshake")) == ["_exchange", "refuse_on_group"]
    for call in calls:
        assert [k.arg for k in call.keywords] == keywords
        assert len(call.args) == len(sig.parameters) - len(keywords)


def test_every_loss_runs_the_driver():
    """linear_cross_entropy, linear_logprobs and linear_distillation all plan through driver.plan_call (spied), and
    no other module builds a Plan."""
    import torch

    from cce_dist import linear_cross_entropy, linear_distillation, linear_logprobs
    from cce_dist.engine import driver

    forms = []
    real = driver.plan_call

    def spy(call):
        forms.append(call.form)
        return real(call)

    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    for mod in (api, distill):
        assert mod.plan_call is real
    try:
        api.plan_call = distill.plan_call = spy
        linear_cross_entropy(h, w, t)
        linear_logprobs(h, w, t)
        linear_distillation(h, w, h, w, t)
    finally:
        api.plan_call = distill.plan_call = real
    assert forms == ["cross-entropy", "logprobs", "distillation"]
    builders = sorted(p.name for p in PKG.rglob("*.py") if _calls(p, "Plan"))
    assert builders == ["driver.py"], builders


# ---------------------------------------------------------------------------------------------------------------
# compile.py's custom ops: the protocol's two primitives
# ---------------------------------------------------------------------------------------------------------------

#: what an op takes beyond the protocol's parameters and the implementations' options
OP_EXTRA = {"row_stats": {"impl", "ignore_index"}, "grads": {"impl"}}


def _schema(op: str):
    """``[(name, kwarg_only)]`` of the registered op's arguments (read from its annotated signature)."""
    import torch

    return [(a.name, a.kwarg_only) for a in getattr(torch.ops.cce_dist, op).default._schema.arguments]


def _all_options(fn: str) -> set[str]:
    """Every implementation's declared options of ``fn`` (``grads``: with the protocol's filter_eps / deterministic)."""
    return set().union(*(getattr(b, f"{fn}_options") for b in _backends()))


@pytest.mark.parametrize("fn", ["row_stats", "grads"])
def test_compile_ops_take_the_protocols_arguments(fn):
    """Each op: the protocol's tensors in order (``grads``: then ``gamma_weights``), then by keyword the protocol's
    options, every implementation's declared options (each with a default: an implementation that does not declare
    it is not passed it) and OP_EXTRA; ops_backend's primitive binds OP_EXTRA and passes on whatever the driver built
    for either implementation."""
    import torch

    from cce_dist.engine.compile import ops_backend

    protocol = _params(CONTRACT[fn].__call__, drop_self=True)
    positional = [n for n, kind, _ in protocol if kind != KEYWORD_ONLY]
    keywords = {n for n, kind, _ in protocol if kind == KEYWORD_ONLY}
    schema = _schema(fn)
    tensors = positional + (["gamma_weights"] if fn == "grads" else [])
    assert [(n, False) for n in tensors] == schema[: len(tensors)]
    rest = schema[len(tensors) :]
    assert all(kw_only for _, kw_only in rest), rest
    assert {n for n, _ in rest} == (keywords - {"gamma_weights"}) | _all_options(fn) | OP_EXTRA[fn]
    defaulted = {a.name for a in getattr(torch.ops.cce_dist, fn).default._schema.arguments if a.has_default_value()}
    assert _all_options(fn) - keywords <= defaulted
    primitive = getattr(ops_backend("torch", torch.empty(1, 4), -100), fn)
    assert set(primitive.keywords) == OP_EXTRA[fn]  # bound by ops_backend: the driver passes the rest
