"""cce_dist.hf.patch against the unpatched transformers models (tiny random configs, CPU, fp32)."""

import os
import pytest
import torch

transformers = pytest.importorskip("transformers")

import cce_dist.hf as cce_hf  # noqa: E402

VOCAB = 301
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 8}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
    # a small softcap so that dropping it would change the loss well beyond the tolerance
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "final_logit_softcapping": 0.7}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "final_logit_softcapping": 0.7}),
}


def make_model(family, tied, seed=0, **extra):
    cfg_name, cls_name, kw = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**SMALL, **kw, tie_word_embeddings=tied, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).float()
    with torch.no_grad():  # non-trivial head (and a tied head distinct from a fresh init)
        model.lm_head.weight.normal_(0, 0.5)
    model.train()
    return model


def batch(seed=1, b=2, t=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a masked prompt
    labels[1, -2:] = -100
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, -2:] = 0  # right padding
    return ids, labels, mask


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(ref, got, ref_grads, got_grads):
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert set(got_grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


# every family once; tied and untied heads both for Llama and Gemma 2 (the others as usually shipped)
CASES = [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False), ("mistral", False), ("gemma", True),
         ("gemma2", False), ("gemma2", True), ("gemma3_text", True)]


@pytest.mark.parametrize("family,tied", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_patch_matches_unpatched(family, tied):
    model = make_model(family, tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids, labels, mask = batch()
    ref, ref_g = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert ref.logits is not None
    # gradient accumulation: the loss is a sum over tokens divided by num_items_in_batch
    nib = torch.tensor(23)
    ref_n, ref_ng = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=nib)

    cce_hf.patch(model)
    assert cce_hf.is_patched(model)
    got, got_g = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert got.logits is None
    assert_same(ref, got, ref_g, got_g)
    got_n, got_ng = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=nib)
    assert_same(ref_n, got_n, ref_ng, got_ng)
    assert not torch.allclose(got_n.loss, got.loss)

    cce_hf.unpatch(model)
    assert "forward" not in vars(model) and not cce_hf.is_patched(model)
    again = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert again.logits is not None and again.logits.shape == (2, 9, VOCAB)
    torch.testing.assert_close(again.loss, ref.loss)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_softcap_carries_over(family):
    """The final logit softcap matters at this scale, and the patch reproduces it."""
    model = make_model(family, tied=True)
    ids, labels, _ = batch()
    ref = model(input_ids=ids, labels=labels).loss
    model.config.final_logit_softcapping = None
    no_cap = model(input_ids=ids, labels=labels).loss
    model.config.final_logit_softcapping = 0.7
    assert abs(ref.item() - no_cap.item()) > 1e-2
    cce_hf.patch(model)
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, ref, rtol=1e-5, atol=1e-6)


def test_ignore_index_shift_labels_label_smoothing_and_tuple_output():
    model = make_model("llama", tied=False)
    ids, labels, _ = batch(t=8)
    logits = model(input_ids=ids).logits
    cce_hf.patch(model, label_smoothing=0.1)
    # pre-shifted labels (context parallel style) and a custom ignore_index
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    shift_labels = shift_labels.masked_fill(shift_labels == -100, -1)
    out = model(input_ids=ids, labels=labels, shift_labels=shift_labels, ignore_index=-1)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=-1,
                                             label_smoothing=0.1)
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    tup = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and tup[0].dim() == 0
    # every label ignored: 0, not NaN
    assert model(input_ids=ids, labels=torch.full_like(labels, -100)).loss.item() == 0.0


def test_eval_and_no_labels_fall_back_to_logits():
    model = make_model("qwen2", tied=True)
    ids, labels, _ = batch()
    cce_hf.patch(model)
    out = model(input_ids=ids)  # no labels: logits
    assert out.logits.shape == (2, 9, VOCAB) and out.loss is None
    model.eval()
    with torch.no_grad():
        ev = model(input_ids=ids, labels=labels)
    assert ev.logits is not None  # eval_logits=True (default): Trainer.evaluate still gets logits
    cce_hf.patch(model, eval_logits=False)
    with torch.no_grad():
        ev2 = model(input_ids=ids, labels=labels)
    assert ev2.logits is None
    torch.testing.assert_close(ev2.loss, ev.loss, rtol=1e-5, atol=1e-6)
    # generate() runs the original forward
    gen = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    assert gen.shape == (2, 7)


def test_patch_refuses_bad_inputs_and_double_unpatch():
    model = make_model("llama", tied=False)
    with pytest.raises(TypeError, match="unsupported option"):
        cce_hf.patch(model, reduction="sum")
    with pytest.raises(ValueError, match="label_smoothing"):
        cce_hf.patch(model, label_smoothing=2.0)
    assert not cce_hf.is_patched(model)
    with pytest.raises(ValueError, match="not patched"):
        cce_hf.unpatch(model)
    phi = transformers.Phi3ForCausalLM(transformers.Phi3Config(**SMALL, pad_token_id=0)).float().train()
    with pytest.raises(ValueError, match="phi3"):
        cce_hf.patch(phi)
    ids, labels, _ = batch()
    ref = phi(input_ids=ids, labels=labels).loss
    cce_hf.patch(phi, allow_unlisted=True)
    torch.testing.assert_close(phi(input_ids=ids, labels=labels).loss, ref, rtol=1e-5, atol=1e-6)


def test_trainer_example_runs(capsys):
    """The example fine-tunes with the Trainer (in-process: transformers is already imported here)."""
    pytest.importorskip("accelerate")
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("hf_trainer_finetune",
                                                  os.path.join(root, "examples", "hf_trainer_finetune.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    last = example.main(["--max-steps", "3", "--check"])  # --check: matches the unpatched model, loss falls
    out = capsys.readouterr().out
    assert "patched loss matches" in out and "steps: 3" in out
    assert last < 5.3
