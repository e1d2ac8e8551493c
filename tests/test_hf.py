"""cce_dist.hf.patch against the unpatched transformers models (tiny random configs, CPU, fp32)."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cce_dist.hf as cce_hf  # noqa: E402
from cce_dist import hf_heads  # noqa: E402

VOCAB = 301
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)

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
        # float32 sums of the same terms in another order differ by a few ulps of the terms, not of the result: an
        # entry that cancels (|g| << max |g|) gets an absolute tolerance on the tensor's scale (1e-5 of its max)
        atol = max(1e-6, 1e-5 * float(g.abs().max()))
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# every family once; tied and untied heads both for Llama and Gemma 2 (the others as usually shipped)
CASES = [
    ("llama", False),
    ("llama", True),
    ("qwen2", True),
    ("qwen3", False),
    ("mistral", False),
    ("gemma", True),
    ("gemma2", False),
    ("gemma2", True),
    ("gemma3_text", True),
]


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
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), shift_labels.reshape(-1), ignore_index=-1, label_smoothing=0.1
    )
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
    ids, labels, _ = batch()
    ref = phi(input_ids=ids, labels=labels).loss
    cce_hf.patch(phi, allow_unlisted=True)  # no longer needed (every causal LM is checked), still accepted
    torch.testing.assert_close(phi(input_ids=ids, labels=labels).loss, ref, rtol=1e-5, atol=1e-6)


def test_trainer_example_runs(capsys):
    """The example fine-tunes with the Trainer (in-process: transformers is already imported here)."""
    pytest.importorskip("accelerate")
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "hf_trainer_finetune", os.path.join(root, "examples", "hf_trainer_finetune.py")
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    last = example.main(["--max-steps", "3", "--check"])  # --check: matches the unpatched model, loss falls
    out = capsys.readouterr().out
    assert "patched loss matches" in out and "steps: 3" in out
    assert last < 5.3


# ----------------------------------------------------------------------------------------------
# wrappers (PEFT, others), torch.compile, pickling, tuple outputs
# ----------------------------------------------------------------------------------------------


#: the logits the patched head returns in place of [B, T, V] (cce_dist.hf_heads.probe)
PROBE = (1, 1, VOCAB)


def _count_head_calls(model):
    """The output shape of each call of ``model.lm_head``: [B, T, V] when the logits are built, :data:`PROBE` when
    the patched forward runs it."""
    calls = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: calls.append(tuple(out.shape)))
    return calls


def _count_loss_calls(monkeypatch):
    """A list that grows by one each time the patched forward calls cce_dist's fused loss."""
    calls = []
    real = cce_hf.linear_cross_entropy

    def spy(hidden, *args, **kwargs):
        calls.append(tuple(hidden.shape))
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(cce_hf, "linear_cross_entropy", spy)
    return calls


def _lora(model, **kw):
    peft = pytest.importorskip("peft")
    # init_lora_weights=False: B != 0, so the adapter changes the forward and both A and B get gradients
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=kw.pop("target_modules", ["q_proj", "v_proj"]), init_lora_weights=False, **kw
    )
    torch.manual_seed(7)  # the same adapter weights for the same model, whatever ran before
    return peft.get_peft_model(model, cfg)


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])
def test_peft_lora_model_computes_through_cce_dist(task_type, monkeypatch):
    """patch(PeftModel) patches the causal LM inside; the PEFT forward then runs cce_dist's loss."""
    peft_model = _lora(make_model("llama", tied=False), task_type=task_type)
    peft_model.train()
    ids, labels, mask = batch()
    ref, ref_g = loss_and_grads(peft_model, input_ids=ids, attention_mask=mask, labels=labels)
    assert ref.logits is not None
    assert any("lora_A" in n for n in ref_g) and all("lora_" in n for n in ref_g)  # only the adapter trains

    assert cce_hf.patch(peft_model) is peft_model
    assert cce_hf.is_patched(peft_model) and cce_hf.is_patched(peft_model.get_base_model())
    head_calls, loss_calls = _count_head_calls(peft_model.get_base_model()), _count_loss_calls(monkeypatch)
    got, got_g = loss_and_grads(peft_model, input_ids=ids, attention_mask=mask, labels=labels)
    assert got.logits is None and head_calls == [PROBE] and loss_calls == [(2, 9, 32)]  # hidden states, not logits
    assert_same(ref, got, ref_g, got_g)

    cce_hf.unpatch(peft_model)
    assert not cce_hf.is_patched(peft_model)
    assert peft_model(input_ids=ids, attention_mask=mask, labels=labels).logits.shape == (2, 9, VOCAB)


def test_patch_then_peft_and_lora_on_lm_head_refused():
    """Patching before get_peft_model works too; an adapter on lm_head is refused with the fix."""
    model = make_model("llama", tied=False)
    ids, labels, _ = batch()
    ref_model = _lora(make_model("llama", tied=False))
    ref = ref_model(input_ids=ids, labels=labels).loss
    cce_hf.patch(model)
    peft_model = _lora(model)
    got = peft_model(input_ids=ids, labels=labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, ref, rtol=1e-5, atol=1e-6)

    with pytest.raises(TypeError, match="lm_head.*PEFT adapter.*target_modules"):
        cce_hf.patch(_lora(make_model("llama", tied=False), target_modules=["q_proj", "lm_head"]))
    # an adapter put on lm_head after patching: refused at the call, not a wrong loss
    late = cce_hf.patch(make_model("llama", tied=False))
    late = _lora(late, target_modules=["lm_head"])
    with pytest.raises(TypeError, match="lm_head.*PEFT adapter"):
        late(input_ids=ids, labels=labels)


def test_wrappers_whose_model_is_not_the_decoder_are_refused():
    model = make_model("llama", tied=False)

    class Wrapper(torch.nn.Module):  # looks like a causal LM (config, lm_head, .model) but .model is the whole LM
        def __init__(self, lm):
            super().__init__()
            self.model, self.lm_head, self.config = lm, lm.lm_head, lm.config

        def forward(self, input_ids=None, labels=None, **kw):
            return self.model(input_ids=input_ids, labels=labels, **kw)

    with pytest.raises(TypeError, match="patch the causal LM inside"):
        cce_hf.patch(Wrapper(model))

    class LMWrapper(transformers.PreTrainedModel):  # a transformers model whose .model is a *ForCausalLM
        config_class = type(model.config)
        base_model_prefix = "model"
        _supports_sdpa = True

        def __init__(self, lm):
            super().__init__(lm.config)
            self.model, self.lm_head = lm, lm.lm_head

        def forward(self, labels=None, **kw):
            return self.model(labels=labels, **kw)

    with pytest.raises(TypeError, match="LlamaForCausalLM, not the decoder"):
        cce_hf.patch(LMWrapper(model))
    assert not cce_hf.is_patched(model)


def test_patched_model_compiles_fullgraph():
    """torch.compile(patched model, fullgraph=True): same loss and gradients as the unpatched model, no logits."""
    torch._dynamo.reset()
    model = make_model("llama", tied=True)
    ids, labels, mask = batch()
    ref, ref_g = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    cce_hf.patch(model)
    # aot_eager traces forward and backward (dynamo + AOTAutograd) like inductor, without a C++ build
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got, got_g = loss_and_grads(compiled, input_ids=ids, attention_mask=mask, labels=labels)
    assert got.logits is None
    got_g = {n.removeprefix("_orig_mod."): g for n, g in got_g.items()}
    assert_same(ref, got, ref_g, got_g)
    torch._dynamo.reset()


def test_patch_survives_pickling_and_deepcopy(monkeypatch):
    """torch.save / torch.load (and deepcopy) keep the patch: the loaded model never builds the logits."""
    import copy
    import io

    model = make_model("gemma2", tied=True)
    ids, labels, mask = batch()
    ref, ref_g = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    cce_hf.patch(model, label_smoothing=0.0, chunk_size=64)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for clone in (loaded, copy.deepcopy(model)):
        assert cce_hf.is_patched(clone) and clone.forward.model is clone
        assert clone.forward.options == {"label_smoothing": 0.0, "chunk_size": 64}
        head_calls, loss_calls = _count_head_calls(clone), _count_loss_calls(monkeypatch)
        got, got_g = loss_and_grads(clone, input_ids=ids, attention_mask=mask, labels=labels)
        assert got.logits is None and head_calls == [PROBE] and loss_calls == [(2, 9, 32)]
        assert_same(ref, got, ref_g, got_g)
        cce_hf.unpatch(clone)
        assert not cce_hf.is_patched(clone) and "forward" not in vars(clone)
        assert clone(input_ids=ids, labels=labels).logits.shape == (2, 9, VOCAB)


@pytest.mark.parametrize(
    "extra", [{}, {"use_cache": False}, {"output_hidden_states": True}], ids=["cache", "no-cache", "hidden-states"]
)
def test_tuple_output_keeps_the_original_positions(extra):
    """return_dict=False: (loss, None, *rest) where the unpatched model gives (loss, logits, *rest)."""
    model = make_model("qwen2", tied=True)
    ids, labels, mask = batch()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False, **extra)
    cce_hf.patch(model)
    got = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False, **extra)
    assert isinstance(got, tuple) and len(got) == len(ref) >= 2
    assert ref[1].shape == (2, 9, VOCAB) and got[1] is None
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for r, g in zip(ref[2:], got[2:]):
        assert type(g) is type(r)
        if isinstance(r, tuple):  # hidden states: one per layer + embeddings, same values
            assert len(g) == len(r)
            for a, b in zip(g, r):
                torch.testing.assert_close(a, b)


def test_trainer_example_with_lora_trains_through_cce_dist(capsys, monkeypatch):
    """``--lora``: the Trainer fine-tunes a PEFT model whose loss comes from cce_dist (never from logits)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    import importlib.util
    import math

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "hf_trainer_finetune", os.path.join(root, "examples", "hf_trainer_finetune.py")
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    loss_calls = _count_loss_calls(monkeypatch)
    last = example.main(["--max-steps", "2", "--lora"])
    out = capsys.readouterr().out
    assert "LoRA:" in out and "steps: 2" in out and math.isfinite(last)
    assert len(loss_calls) == 2 * 2  # 2 optimizer steps x 2 accumulated micro-batches, all through cce_dist


# ----------------------------------------------------------------------------------------------
# any causal LM: families beyond the first list, logit multipliers, MoE router losses, VLM text heads
# ----------------------------------------------------------------------------------------------

#: token ids the VLMs reserve (image, video, vision start): the random text stays below them
IMAGE, VIDEO, VISION_START = VOCAB - 1, VOCAB - 2, VOCAB - 3
MOE = dict(output_router_logits=True, router_aux_loss_coef=0.5)
#: the CLIP / SigLIP tower of the tiny VLMs: 8x8 images in 4x4 patches
VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4
)


def _any_model(family):
    """A tiny ``family`` model (float32, training mode, a non-trivial head) and, for the VLMs, its image inputs."""
    t = transformers
    extra: dict = {}
    if family == "phi3":
        model = t.Phi3ForCausalLM(t.Phi3Config(**SMALL, pad_token_id=0))
    elif family == "cohere":  # logits * logit_scale (a module attribute from the config)
        model = t.CohereForCausalLM(t.CohereConfig(**SMALL, logit_scale=0.3, tie_word_embeddings=True))
    elif family == "granite":  # logits / logits_scaling
        model = t.GraniteForCausalLM(t.GraniteConfig(**SMALL, logits_scaling=3.0, tie_word_embeddings=False))
    elif family == "falcon_h1":  # logits * lm_head_multiplier, hybrid attention + mamba layers
        mamba = dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4)
        model = t.FalconH1ForCausalLM(t.FalconH1Config(**SMALL, lm_head_multiplier=2.5, head_dim=8, **mamba))
    elif family == "mixtral":
        model = t.MixtralForCausalLM(t.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2, **MOE))
    elif family == "qwen2_moe":
        experts = dict(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
        )
        model = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**SMALL, **experts, **MOE))
    elif family == "olmoe":
        model = t.OlmoeForCausalLM(t.OlmoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, **MOE))
    elif family == "llava":  # a Llama text head on a CLIP tower; each image is 4 tokens
        cfg = t.LlavaConfig(
            vision_config=t.CLIPVisionConfig(**VISION), text_config=t.LlamaConfig(**SMALL), image_token_id=IMAGE
        )
        model = t.LlavaForConditionalGeneration(cfg)
        extra = dict(pixel_values=torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(5)))
    elif family == "qwen2_vl":  # 3-D rope; one 2x2-patch image merged into 1 token, in the first row only
        text = dict(**SMALL, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, model_type="qwen2_vl_text")
        vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2)
        vision |= dict(spatial_merge_size=2, temporal_patch_size=1, in_channels=3)
        cfg = t.Qwen2VLConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_start_token_id=VISION_START,
        )
        model = t.Qwen2VLForConditionalGeneration(cfg)
        g = torch.Generator().manual_seed(5)
        extra = dict(pixel_values=torch.randn(4, 12, generator=g), image_grid_thw=torch.tensor([[1, 2, 2]]))
    elif family == "gemma3":  # the VLM: its head applies no softcap, though the text config has one
        text = dict(**SMALL, head_dim=8, final_logit_softcapping=0.7)
        cfg = t.Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4, image_token_id=IMAGE)
        model = t.Gemma3ForConditionalGeneration(cfg)
    else:
        raise ValueError(family)
    model = model.float()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0, 0.5)
    return model.train(), extra


def _any_inputs(family, extra):
    ids, labels, mask = batch()
    ids = ids % (VOCAB - 8)  # no VLM special token in the text
    labels = torch.where(labels == -100, labels, ids)
    if family == "llava":  # 4 image tokens in each row, not predicted
        ids[:, 1:5] = IMAGE
        labels[:, 1:5] = -100
    if family == "qwen2_vl":
        ids[0, 1:3] = torch.tensor([VISION_START, IMAGE])
        labels[0, 1:3] = -100
        extra = dict(extra, mm_token_type_ids=(ids == IMAGE).int())  # 1: image (the processor returns it)
    return dict(input_ids=ids, attention_mask=mask, labels=labels, **extra)


ANY_FAMILIES = [
    "phi3",
    "cohere",
    "granite",
    "falcon_h1",
    "mixtral",
    "qwen2_moe",
    "olmoe",
    "llava",
    "qwen2_vl",
    "gemma3",
]


@pytest.mark.parametrize("family", ANY_FAMILIES)
def test_any_causal_lm_matches_unpatched(family, monkeypatch):
    """Loss (router aux loss included), every parameter's gradient and the output fields other than the logits equal
    the unpatched model's; the [B, T, V] logits are never built; unpatch restores the model."""
    torch.manual_seed(0)
    model, extra = _any_model(family)
    assert model.config.model_type in cce_hf.TESTED_MODEL_TYPES
    inputs = _any_inputs(family, extra)
    ref, ref_g = loss_and_grads(model, **inputs)
    assert ref.logits.shape == (2, 9, VOCAB)
    nib = torch.tensor(19)
    ref_n, ref_ng = loss_and_grads(model, **inputs, num_items_in_batch=nib)

    cce_hf.patch(model)
    head_calls, loss_calls = _count_head_calls(model), _count_loss_calls(monkeypatch)
    got, got_g = loss_and_grads(model, **inputs)
    assert got.logits is None and head_calls == [PROBE] and loss_calls == [(2, 9, 32)]
    assert type(got) is type(ref) and set(got.keys()) == set(ref.keys()) - {"logits"}
    assert_same(ref, got, ref_g, got_g)
    got_n, got_ng = loss_and_grads(model, **inputs, num_items_in_batch=nib)
    assert_same(ref_n, got_n, ref_ng, got_ng)
    if family in ("mixtral", "qwen2_moe", "olmoe"):  # the aux loss is part of the loss, and far above the tolerance
        torch.testing.assert_close(got.aux_loss, ref.aux_loss, rtol=1e-5, atol=1e-6)
        assert MOE["router_aux_loss_coef"] * ref.aux_loss.item() > 0.1
    tup = model(**inputs, return_dict=False)
    assert tup[list(ref.keys()).index("logits")] is None and len(tup) == len(ref.to_tuple())

    cce_hf.unpatch(model)
    assert not cce_hf.is_patched(model) and "forward" not in vars(model.get_output_embeddings())
    assert "_loss_function" not in vars(model)
    torch.testing.assert_close(model(**inputs).loss, ref.loss)


#: the families whose head output is post-processed (or, gemma3, whose config has a softcap its head does not apply),
#: each with a transform that is wrong for it
WRONG = {
    "cohere": hf_heads.LogitTransform(),  # logit_scale dropped
    "granite": hf_heads.LogitTransform(scale=3.0),  # multiplied instead of divided
    "falcon_h1": hf_heads.LogitTransform(),
    "gemma3": hf_heads.LogitTransform(softcap=0.7),  # the text config's softcap, which this head does not apply
}


@pytest.mark.parametrize("family", sorted(WRONG))
def test_a_wrong_logit_transform_fails_and_is_never_used(family, monkeypatch):
    """The transform matters at this scale (the wrong one gives another loss), and a model whose post-processing none
    of the config's candidates reproduces raises at the call instead of returning that loss."""
    torch.manual_seed(0)
    model, extra = _any_model(family)
    inputs = _any_inputs(family, extra)
    ref = model(**inputs).loss
    cce_hf.patch(model)
    with monkeypatch.context() as m:
        m.setattr(hf_heads, "resolve", lambda *args: WRONG[family])
        wrong = model(**inputs).loss
    assert abs(wrong.item() - ref.item()) > 1e-2
    torch.testing.assert_close(model(**inputs).loss, ref, rtol=1e-5, atol=1e-6)
    model.forward.candidates = (WRONG[family],)
    with pytest.raises(RuntimeError, match="post-processes its logits in a way"):
        model(**inputs)


def test_head_bias_is_scaled_with_the_logits():
    """A head with a bias under a logit multiplier: ``s * (h W^T + b)`` (the bias scaled too, and its gradient)."""
    torch.manual_seed(0)
    model, extra = _any_model("cohere")
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    torch.nn.init.normal_(model.lm_head.bias, 0, 2.0)
    inputs = _any_inputs("cohere", extra)
    ref, ref_g = loss_and_grads(model, **inputs)
    assert "lm_head.bias" in ref_g
    cce_hf.patch(model)
    got, got_g = loss_and_grads(model, **inputs)
    assert_same(ref, got, ref_g, got_g)


class _Custom(transformers.LlamaForCausalLM):
    """A causal LM whose forward post-processes the head's output as ``how`` says."""

    how = "mask"

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden)
        if self.how == "mask":  # forbids token 7: an entry of the vocabulary, not an elementwise transform
            logits = logits.masked_fill(torch.arange(logits.shape[-1]) == 7, -1e4)
        elif self.how == "twice":  # a second head call (e.g. a multi-token-prediction head sharing lm_head)
            logits = logits + self.lm_head(hidden)
        loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class _InlineLoss(transformers.LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids).last_hidden_state)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("how", ["mask", "twice"])
def test_unknown_logit_post_processing_raises_at_the_call(how):
    model = _Custom(transformers.LlamaConfig(**SMALL)).float().train()
    model.how = how
    ids, labels, _ = batch()
    model(input_ids=ids, labels=labels)  # the unpatched model runs
    cce_hf.patch(model)
    match = "post-processes its logits in a way" if how == "mask" else "output embeddings 2 time"
    with pytest.raises(RuntimeError, match=match):
        model(input_ids=ids, labels=labels)
    cce_hf.unpatch(model)
    assert model(input_ids=ids, labels=labels).logits.shape == (2, 9, VOCAB)


def test_patch_time_refusals_name_what_is_unsupported():
    ids, labels, _ = batch()
    inline = _InlineLoss(transformers.LlamaConfig(**SMALL)).float()
    with pytest.raises(TypeError, match="does not compute its loss through self.loss_function"):
        cce_hf.patch(inline)
    custom = make_model("llama", tied=False)
    custom.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    with pytest.raises(TypeError, match="not transformers' ForCausalLMLoss"):
        cce_hf.patch(custom)
    cohere, _ = _any_model("cohere")
    cohere.config.logit_scale = -1.0
    with pytest.raises(ValueError, match=r"config.logit_scale=-1.0 .* not a finite number > 0"):
        cce_hf.patch(cohere)
    for model in (inline, custom, cohere):
        assert not cce_hf.is_patched(model) and "forward" not in vars(model.lm_head)


def test_compiled_scaled_model_uses_and_checks_its_transform():
    """Compiled (no eager step first), a Granite model divides by logits_scaling (the family's usual transform); a
    transform the model does not apply fails the device-side check instead of returning its loss."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, extra = _any_model("granite")
    inputs = _any_inputs("granite", extra)
    ref = model(**inputs).loss
    cce_hf.patch(model)
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs)
    assert got.logits is None
    torch.testing.assert_close(got.loss, ref, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    model.forward.candidates, model.forward.transform = (WRONG["granite"],), None
    with pytest.raises(RuntimeError, match="does not post-process its logits as x 3"):
        torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs)
    torch._dynamo.reset()
