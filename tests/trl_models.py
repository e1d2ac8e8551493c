"""The tiny TRL test problem shared by tests/test_trl.py and tests/test_trl_parallel.py: a Llama built from a config
(vocab ``V = 97``, no download), a word-level tokenizer over its ids (``w0`` ... ``w94``, ``<pad>`` = 95,
``<eos>`` = 96), the trainers' datasets and :func:`train` (a few SGD steps of one trainer)."""

from __future__ import annotations

import torch
import transformers
import trl

V = 97


def tiny_model(seed=0, **config):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=95,
        eos_token_id=96,
        bos_token_id=None,
    )
    for k, v in config.items():
        setattr(cfg, k, v)
    return transformers.LlamaForCausalLM(cfg)


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(95)} | {"<pad>": 95, "<eos>": 96}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")


def _words(g, n):
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 95, (n,), generator=g))


def _datasets():
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)
    lm = Dataset.from_dict(
        {"input_ids": [torch.randint(0, 95, (int(n),), generator=g).tolist() for n in torch.randint(5, 12, (8,))]}
    )
    pref = Dataset.from_dict(
        {
            "prompt": [_words(g, 4) for _ in range(8)],
            "chosen": [_words(g, 3) for _ in range(8)],
            "rejected": [_words(g, 3) for _ in range(8)],
        }
    )
    kto = Dataset.from_dict(
        {
            "prompt": [_words(g, 4) for _ in range(8)],
            "completion": [_words(g, 3) for _ in range(8)],
            "label": [bool(i % 2) for i in range(8)],
        }
    )
    prompts = Dataset.from_dict({"prompt": [_words(g, 4) for _ in range(8)]})
    return {"sft": lm, "dpo": pref, "kto": kto, "grpo": prompts}


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _trainer(kind, out_dir, bf16=False):
    common = dict(
        bf16=bf16,  # TRL's configs default to bf16 autocast on CPU
        output_dir=str(out_dir),
        max_steps=2,
        logging_steps=1,
        report_to=[],
        learning_rate=0.05,
        optim="sgd",
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    data = _datasets().get(kind)
    if kind == "sft":
        args = trl.SFTConfig(per_device_train_batch_size=4, **common)
        return trl.SFTTrainer(model=tiny_model(), args=args, train_dataset=data, processing_class=tokenizer())
    if kind == "dpo":
        args = trl.DPOConfig(per_device_train_batch_size=4, **common)
        return trl.DPOTrainer(
            model=tiny_model(), ref_model=tiny_model(), args=args, train_dataset=data, processing_class=tokenizer()
        )
    if kind == "kto":
        args = trl.KTOConfig(per_device_train_batch_size=4, **common)
        return trl.KTOTrainer(
            model=tiny_model(), ref_model=tiny_model(), args=args, train_dataset=data, processing_class=tokenizer()
        )
    if kind.startswith("distill"):  # "distill-<beta>": on-policy distillation from a second tiny model
        args = trl.DistillationConfig(
            per_device_train_batch_size=4,
            max_completion_length=4,
            temperature=0.9,
            beta=float(kind.split("-")[1]),
            **common,
        )
        return trl.DistillationTrainer(
            model=tiny_model(),
            teacher_model=tiny_model(seed=1),
            args=args,
            train_dataset=_datasets()["grpo"],
            processing_class=tokenizer(),
        )
    args = trl.GRPOConfig(
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        temperature=1.0,
        **common,
    )
    return trl.GRPOTrainer(
        model=tiny_model(), reward_funcs=_reward, args=args, train_dataset=data, processing_class=tokenizer()
    )


def train(kind, out_dir, patch_when, bf16=False, prepare=None, tensor_parallel=False):
    """``(logs, parameters)`` after training ``kind`` ("sft", "dpo", "kto", "grpo", "distill-<beta>"); TRL's own head
    when ``patch_when`` is None, else cce_dist's, patched "before" or "after" the trainer is built (with
    ``tensor_parallel``). ``prepare(trainer)`` runs just before training (e.g. to shard the head)."""
    import cce_dist.trl as ct

    torch.manual_seed(0)
    if patch_when == "before":
        ct.patch(tensor_parallel=tensor_parallel)
    trainer = _trainer(kind, out_dir, bf16)
    if patch_when == "after":
        ct.patch(tensor_parallel=tensor_parallel)
    if prepare is not None:
        prepare(trainer)
    try:
        trainer.train()
    finally:
        if ct.is_patched():
            ct.unpatch()
    timings = ("runtime", "time", "per_second", "total_flos")
    logs = [
        {k: v for k, v in h.items() if isinstance(v, float) and not any(t in k for t in timings)}
        for h in trainer.state.log_history
    ]
    return logs, {name: p.detach() for name, p in trainer.model.named_parameters()}
