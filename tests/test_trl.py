"""cce_dist.trl: TRL 1.16's trainers on cce_dist's head give TRL's own numbers.

A tiny Llama (vocab 97, built from a config: no download) and a word-level tokenizer. TRL's fused head
(``add_fused_lm_head``) is compared field by field with the same head patched by ``cce_dist.trl.patch()``:
``log_probs``, ``entropy``, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``, ``label_mask``, the loss and every
parameter's gradient, with temperature, a softcap and a logit scale read from the config as TRL reads them. Then a
few SGD steps of the SFT, DPO, KTO and GRPO trainers (patched before and after the trainer is built) must log the
same losses and metrics (``mean_token_accuracy``, ``entropy``, the DPO / KTO logits and rewards) and end with the
same parameters. float32 on CPU: TRL's kernel and cce_dist's sum in different orders, so the per-token values agree
to a few float32 ulps of their scale (1e-5 relative) and the parameters after a few steps to 1e-5.
tests/test_trl_parallel.py runs the head vocab-parallel on 2 ranks.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.16")
transformers = pytest.importorskip("transformers")

from trl_models import tiny_model, train  # noqa: E402

import cce_dist.trl as ct  # noqa: E402

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.fixture(autouse=True)
def _unpatched():
    yield
    if ct.is_patched():
        ct.unpatch()


@pytest.mark.parametrize(
    "config,temperature",
    [({}, 1.0), ({"final_logit_softcapping": 7.0}, 0.7), ({"final_logit_softcapping": 5.0, "logit_scale": 0.8}, 1.3)],
)
def test_fused_head_fields_and_gradients_equal_trls(config, temperature):
    from trl.trainer.utils import add_fused_lm_head

    trl_model = tiny_model(**config)
    cce_model = copy.deepcopy(trl_model)
    for m in (trl_model, cce_model):
        add_fused_lm_head(m, temperature=temperature, outputs=OUTPUTS)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 95, (3, 11), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    want = trl_model(input_ids=ids, labels=labels, fused_lm_head=True)
    ct.patch()
    got = cce_model(input_ids=ids, labels=labels, fused_lm_head=True)
    for name in OUTPUTS + ("label_mask",):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.dtype == torch.bool:
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.detach().abs().max())))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    (got.loss + got.entropy.sum()).backward()
    (want.loss + want.entropy.sum()).backward()
    for (name, p), q in zip(cce_model.named_parameters(), trl_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_only_the_requested_fields_are_formed():
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model()
    add_fused_lm_head(model, outputs=("log_probs", "is_top1"))
    ct.patch()
    ids = torch.randint(0, 95, (2, 7))
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert out.entropy is None and out.mean_logits is None and out.log_sum_sq_probs is None
    assert out.is_top1.dtype == torch.bool


def test_patch_and_unpatch_restore_trls_kernel():
    import trl.trainer.utils as utils

    original = utils._ChunkedLogProbFunction
    import trl.trainer.distillation_trainer as distillation

    original_divergence = distillation.ChunkedDivergenceFunction
    original_loss, original_dtensor = distillation._chunked_divergence_loss, utils.DTensor
    ct.patch()
    assert utils._ChunkedLogProbFunction is ct.CceLogProbs and ct.is_patched()
    assert distillation.ChunkedDivergenceFunction is ct.CceDivergence
    assert distillation._chunked_divergence_loss is not original_loss
    assert not isinstance(torch.zeros(2), utils.DTensor)  # TRL's isinstance check still works (DTensors: 2 ranks)
    ct.patch(tensor_parallel=True)  # again: replaces the setting
    ct.unpatch()
    assert utils._ChunkedLogProbFunction is original and not ct.is_patched()
    assert distillation.ChunkedDivergenceFunction is original_divergence
    assert distillation._chunked_divergence_loss is original_loss and utils.DTensor is original_dtensor
    with pytest.raises(ValueError, match="not patched"):
        ct.unpatch()


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize(
    "scales, caps", [((1.0, 1.0), (None, None)), ((0.8, 1.3), (5.0, 4.0)), ((1.0, 0.5), (None, 6.0))]
)
@pytest.mark.parametrize("bias", [False, True])
def test_divergence_and_entropy_equal_trls(beta, scales, caps, bias):
    """The DistillationTrainer's head: cce_dist's per-token divergence, student entropy and student gradients against
    TRL's ChunkedDivergenceFunction, student and teacher of different widths, with each head's logit scale and softcap
    (folded into one temperature and the teacher's hidden states)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    g = torch.Generator().manual_seed(4)
    n, ds, dt, v = 13, 8, 12, 50
    hs, ws, ht, wt = (torch.randn(*s, generator=g) for s in ((n, ds), (v, ds), (n, dt), (v, dt)))
    bs, bt = (torch.randn(v, generator=g) if bias else None for _ in range(2))
    args = (beta, 0.7, scales[0], caps[0], scales[1], caps[1])
    results = []
    for fn in (ChunkedDivergenceFunction, ct.CceDivergence):
        leaves = [hs.clone().requires_grad_(), ws.clone().requires_grad_()] + (
            [bs.clone().requires_grad_()] if bias else []
        )
        d, e = fn.apply(leaves[0], leaves[1], leaves[2] if bias else None, ht, wt, bt, *args)
        assert not e.requires_grad
        results.append((d, e, torch.autograd.grad(d.sum(), leaves)))
    (d, e, grads), (d_want, e_want, grads_want) = results[1], results[0]
    for a, b in zip((d, e) + grads, (d_want, e_want) + grads_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_a_non_positive_logit_scale_is_refused():
    with pytest.raises(ValueError, match="logit scale"):
        ct.CceLogProbs.apply(torch.randn(2, 4), torch.randn(5, 4), None, torch.tensor([0, 1]), 1.0, 8, None, 0.0)


# ----------------------------------------------------------------------------------------------
# the trainers: a few SGD steps, TRL's head against cce_dist's
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,patch_when,bf16",
    [
        ("sft", "before", False),
        ("sft", "after", False),
        ("dpo", "before", False),
        ("kto", "after", False),
        ("grpo", "before", False),
        ("distill-0.0", "before", False),
        ("distill-0.5", "after", False),
        ("distill-1.0", "before", False),
        ("sft", "before", True),
    ],
)
def test_trainer_logs_and_parameters_equal_trls_head(kind, patch_when, bf16, tmp_path):
    """float32: the same numbers to float32 rounding. bf16 autocast (TRL's default on CPU): both round the logits and
    the logit gradients to bf16, in different orders, so the metrics agree to bf16's resolution (2**-8)."""
    rel, params_tol = (2e-3, 2e-3) if bf16 else (1e-4, 1e-5)
    want_logs, want_params = train(kind, tmp_path / "trl", None, bf16)
    got_logs, got_params = train(kind, tmp_path / "cce", patch_when, bf16)
    assert len(got_logs) == len(want_logs)
    for got, want in zip(got_logs, want_logs):
        assert got.keys() == want.keys()
        for key in want:
            assert math.isclose(got[key], want[key], rel_tol=rel, abs_tol=rel * 0.1), (key, got[key], want[key])
    if kind == "sft":  # the metrics the fused head feeds
        assert any("mean_token_accuracy" in h and "entropy" in h for h in got_logs)
    assert got_params.keys() == want_params.keys()
    for name, q in want_params.items():
        torch.testing.assert_close(got_params[name], q, rtol=params_tol, atol=params_tol, msg=name)


# ----------------------------------------------------------------------------------------------
# cce_dist.hf.patch on a model that carries TRL's fused head
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["hf-after-trl", "trl-after-hf"])
def test_hf_patch_on_a_trainers_model_scores_through_cce_trl(order, tmp_path, monkeypatch):
    """``cce_dist.hf.patch(trainer.model)`` once the trainer installed its fused head, with ``cce_dist.trl.patch()``
    before or after it: the fused calls go to TRL's head scored by cce_dist (they used to reach the hf patch and crash
    with ``'CausalLMOutputWithPast' object has no attribute 'log_probs'``), so training logs what cce_dist.trl alone
    logs."""
    import cce_dist.hf as cce_hf

    def prepare(trainer):
        cce_hf.patch(trainer.model)
        assert cce_hf.is_patched(trainer.model)
        if order == "trl-after-hf":
            ct.patch()

    want_logs, want_params = train("sft", tmp_path / "trl", "before")
    scored = []
    real = ct.linear_logprobs
    monkeypatch.setattr(ct, "linear_logprobs", lambda *a, **k: scored.append(1) or real(*a, **k))
    when = "before" if order == "hf-after-trl" else None
    got_logs, got_params = train("sft", tmp_path / "both", when, prepare=prepare)
    assert scored  # cce_dist.trl's head scored the tokens
    assert len(got_logs) == len(want_logs)
    for got, want in zip(got_logs, want_logs):
        assert got.keys() == want.keys()
        for key in want:
            assert math.isclose(got[key], want[key], rel_tol=1e-6, abs_tol=1e-7), (key, got[key], want[key])
    for name, q in want_params.items():
        torch.testing.assert_close(got_params[name], q, rtol=0, atol=0, msg=name)


def test_hf_patch_on_a_trainers_model_without_cce_trl_names_it(tmp_path):
    """Without ``cce_dist.trl.patch()`` the fused calls would not score with cce_dist: the first raises, naming it."""
    import cce_dist.hf as cce_hf

    with pytest.raises(RuntimeError, match=r"fused_lm_head=True.*cce_dist\.trl\.patch\(\)"):
        train("sft", tmp_path, None, prepare=lambda trainer: cce_hf.patch(trainer.model))
