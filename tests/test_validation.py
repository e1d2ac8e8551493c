"""Input validation: bad shapes, dtypes, ids and options raise a clear error (the type and a message naming the
argument), non-tensor arguments are a TypeError, integer target dtypes, inputs untouched by a refused call, and
``impl='triton'`` on CPU without the interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch
from single_device import assert_unchanged, make_inputs, snapshot

from cce_dist import LinearCrossEntropy, linear_cross_entropy, linear_logprobs

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # tiny shapes: see tests/conftest.py


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def _good():
    h, w, b, t = make_inputs(n=6, v=11, d=4, seed=27, ignore_frac=0.0)
    return h, w, b, t


def _bad_cases():
    h, w, b, t = _good()
    cases = [
        # (id, exception, regex, callable)
        (
            "hidden_dim",
            ValueError,
            r"hidden.*weight|weight.*hidden",
            lambda: linear_cross_entropy(torch.randn(6, 5), w, t),
        ),
        ("bias_len", ValueError, r"bias", lambda: linear_cross_entropy(h, w, t, bias=torch.randn(10))),
        ("bias_2d", ValueError, r"bias", lambda: linear_cross_entropy(h, w, t, bias=torch.randn(11, 1))),
        ("targets_float", TypeError, r"targets", lambda: linear_cross_entropy(h, w, t.float())),
        ("targets_bool", TypeError, r"targets", lambda: linear_cross_entropy(h, w, t > 3)),
        ("targets_too_big", ValueError, r"targets", lambda: linear_cross_entropy(h, w, t.clone().fill_(11))),
        ("targets_negative", ValueError, r"targets", lambda: linear_cross_entropy(h, w, t.clone().fill_(-1))),
        (
            "targets_other_ignore",
            ValueError,
            r"targets",
            lambda: linear_cross_entropy(h, w, t.clone().fill_(-100), ignore_index=-1),
        ),
        ("targets_shape", ValueError, r"targets", lambda: linear_cross_entropy(h, w, t[:5])),
        ("targets_shape_2d", ValueError, r"targets", lambda: linear_cross_entropy(h, w, t.reshape(2, 3))),
        ("reduction", ValueError, r"reduction", lambda: linear_cross_entropy(h, w, t, reduction="avg")),
        ("impl", ValueError, r"impl", lambda: linear_cross_entropy(h, w, t, impl="cuda")),
        ("impl_lp", ValueError, r"impl", lambda: linear_logprobs(h, w, t, impl="fast")),
        ("ls_neg", ValueError, r"label_smoothing", lambda: linear_cross_entropy(h, w, t, label_smoothing=-0.1)),
        ("ls_big", ValueError, r"label_smoothing", lambda: linear_cross_entropy(h, w, t, label_smoothing=1.5)),
        ("ls_nan", ValueError, r"label_smoothing", lambda: linear_cross_entropy(h, w, t, label_smoothing=math.nan)),
        ("zl_neg", ValueError, r"z_loss", lambda: linear_cross_entropy(h, w, t, z_loss=-1e-4)),
        ("zl_nan", ValueError, r"z_loss", lambda: linear_cross_entropy(h, w, t, z_loss=math.nan)),
        ("softcap_0", ValueError, r"softcap", lambda: linear_cross_entropy(h, w, t, softcap=0.0)),
        ("softcap_neg", ValueError, r"softcap", lambda: linear_cross_entropy(h, w, t, softcap=-3.0)),
        ("softcap_lp", ValueError, r"softcap", lambda: linear_logprobs(h, w, t, softcap=0)),
        ("temp_0", ValueError, r"temperature", lambda: linear_logprobs(h, w, t, temperature=0.0)),
        ("temp_neg", ValueError, r"temperature", lambda: linear_logprobs(h, w, t, temperature=-1.0)),
        ("temp_nan", ValueError, r"temperature", lambda: linear_logprobs(h, w, t, temperature=math.nan)),
        ("hidden_int", TypeError, r"hidden", lambda: linear_cross_entropy(h.long(), w, t)),
        ("weight_int", TypeError, r"weight", lambda: linear_cross_entropy(h, w.to(torch.int32), t)),
        ("bias_int", TypeError, r"bias", lambda: linear_cross_entropy(h, w, t, bias=b.long())),
        ("targets_not_tensor", TypeError, r"targets", lambda: linear_cross_entropy(h, w, t.tolist())),
        ("weight_1d", ValueError, r"weight", lambda: linear_cross_entropy(h, w[0], t)),
        ("chunk_size", ValueError, r"chunk_size", lambda: linear_cross_entropy(h, w, t, chunk_size=0)),
        ("chunk_size_bool", ValueError, r"chunk_size", lambda: linear_cross_entropy(h, w, t, chunk_size=True)),
        ("chunk_size_float", ValueError, r"chunk_size", lambda: linear_logprobs(h, w, t, chunk_size=2.0**20)),
        ("shift_neg", ValueError, r"shift", lambda: linear_cross_entropy(h, w, t, shift=-1)),
        ("lp_targets_too_big", ValueError, r"targets", lambda: linear_logprobs(h, w, t.clone().fill_(11))),
        ("lp_hidden_int", TypeError, r"hidden", lambda: linear_logprobs(h.long(), w, t)),
        ("lp_targets_float", TypeError, r"targets", lambda: linear_logprobs(h, w, t.double())),
        ("module_reduction", ValueError, r"reduction", lambda: LinearCrossEntropy(reduction="avg")),
        ("module_label_smoothing", ValueError, r"label_smoothing", lambda: LinearCrossEntropy(label_smoothing=2)),
        ("module_targets", ValueError, r"targets", lambda: LinearCrossEntropy()(h, w, t.clone().fill_(99))),
    ]
    return cases


_BAD = _bad_cases()


@pytest.mark.parametrize("exc,pattern,call", [c[1:] for c in _BAD], ids=[c[0] for c in _BAD])
def test_bad_input_raises_clear_error(exc, pattern, call):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("arg", ["hidden", "weight", "bias"])
@pytest.mark.parametrize("fn", ["ce", "lp"])
def test_non_tensor_argument_is_a_type_error(arg, fn):
    h, w, b, t = _good()
    kw = {"hidden": h, "weight": w, "bias": b}
    kw[arg] = kw[arg].tolist()
    f = linear_cross_entropy if fn == "ce" else linear_logprobs
    with pytest.raises(TypeError, match=arg):
        f(kw["hidden"], kw["weight"], t, bias=kw["bias"])


@pytest.mark.parametrize("tdtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8], ids=str)
@pytest.mark.parametrize("form", ["ce", "lp"])
def test_integer_target_dtypes(tdtype, form):
    """Any integer dtype holding valid ids works like int64, or is refused with a TypeError naming targets."""
    h, w, b, t = _good()
    f = (
        (lambda tt: linear_cross_entropy(h, w, tt, bias=b, reduction="none"))
        if form == "ce"
        else (lambda tt: linear_logprobs(h, w, tt, bias=b))
    )
    ref = f(t)
    try:
        got = f(t.to(tdtype))
    except TypeError as e:
        assert "targets" in str(e)
        return
    assert torch.equal(got, ref)


#: numeric options where a bool means something documented: ``shift=True`` is ``shift=1``
_BOOL_MEANS_SOMETHING = {"shift"}


def _number_fields():
    from cce_dist.core.options import CrossEntropyOptions, DistillationOptions, LogprobOptions

    return [
        (cls, name) for cls in (CrossEntropyOptions, LogprobOptions, DistillationOptions) for name in cls.NUMBER_FIELDS
    ]


@pytest.mark.parametrize("value", [True, False, math.inf, -math.inf, math.nan], ids=repr)
@pytest.mark.parametrize("cls,field", _number_fields(), ids=lambda x: getattr(x, "__name__", x))
def test_every_numeric_option_refuses_bools_and_non_finite_values(cls, field, value):
    """Each options class's numeric fields (``NUMBER_FIELDS``, so a new one is checked without being listed here)
    refuse a bool (``filter_eps=True`` had been read as a threshold of 1.0, dropping most of the gradient;
    ``label_smoothing=True`` as full smoothing, ``z_loss=True`` as a coefficient of 1) and a non-finite value
    (``filter_eps=inf`` had been accepted), with an error naming the field."""
    if isinstance(value, bool) and field in _BOOL_MEANS_SOMETHING:
        assert getattr(cls(**{field: value}), field) == int(value)  # documented: the bool's int
        return
    with pytest.raises((TypeError, ValueError), match=rf"\b{field}\b"):
        cls(**{field: value})


@pytest.mark.parametrize("value", [1.0, 1, 2.5])
def test_filter_eps_of_one_or_more_is_refused(value):
    """``filter_eps`` is relative to each row's softmax coefficients (probabilities <= 1): at 1 or more every tile
    would be skipped, so it is refused; just below 1 and "auto" are accepted."""
    from cce_dist.core.options import CrossEntropyOptions

    with pytest.raises(ValueError, match=r"filter_eps.*\[0, 1\)"):
        CrossEntropyOptions(filter_eps=value)
    assert CrossEntropyOptions(filter_eps=0.999).filter_eps == 0.999
    assert CrossEntropyOptions(filter_eps="auto").filter_eps == "auto"


def test_bad_input_leaves_inputs_untouched():
    h, w, b, t = _good()
    t_bad = t.clone()
    t_bad[2] = 11
    before = snapshot(h, w, b, t_bad)
    with pytest.raises(ValueError):
        linear_cross_entropy(h, w, t_bad, bias=b)
    assert_unchanged(before, h, w, b, t_bad)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    h, w, b, t = _good()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"impl='triton'"):
        linear_cross_entropy(h, w, t, impl="triton")
    with pytest.raises(RuntimeError, match=r"impl='triton'"):
        linear_logprobs(h, w, t, impl="triton")
