"""Fine-tune a tiny random Llama with the Hugging Face Trainer, its loss computed by cce_dist.

Everything is local: a byte-level "tokenizer" (ids 0..255, 256 = padding), a few paragraphs of
text below, and a randomly initialised model, so it runs on a laptop CPU in well under a minute::

    pip install -e ".[hf]" accelerate
    python examples/hf_trainer_finetune.py --max-steps 40

``--lora`` trains LoRA adapters (peft) instead of the whole model: ``cce_dist.hf.patch`` takes the
PEFT model as it is and patches the causal LM inside it.

The one line that matters is ``cce_dist.hf.patch(model)``: from then on ``model(..., labels=...)``
in training mode returns the loss without ever forming the [batch, seq, vocab] logits (the
output's ``logits`` is None). Gradient accumulation works as usual: the Trainer passes
``num_items_in_batch`` and the patched loss divides its token sum by it, as transformers does.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import cce_dist.hf

TEXT = """\
A vocabulary-parallel head splits the output projection across ranks; each rank scores only its
own slice of the vocabulary, and a handful of numbers per token is all the ranks need to share.
The loss of a language model is the log of a sum of exponentials minus one logit, so the logits
themselves never have to be written down: the running maximum, the running sum and the target
logit are enough, and the gradient can be rebuilt one block at a time from the log-sum-exp.
Small models learn the spelling of frequent words first, then the rhythm of the sentences.
"""
PAD = 256
SEQ = 48


class ByteBlocks(torch.utils.data.Dataset):
    """Overlapping byte windows of TEXT; the last few positions of every other sample are padding."""

    def __init__(self, text: str, seq: int = SEQ, stride: int = 7):
        data = torch.tensor(list(text.encode()), dtype=torch.long)
        self.items = []
        for k, start in enumerate(range(0, len(data) - seq, stride)):
            ids = data[start : start + seq].clone()
            mask = torch.ones(seq, dtype=torch.long)
            if k % 2:
                ids[-5:], mask[-5:] = PAD, 0
            labels = ids.masked_fill(mask == 0, -100)
            self.items.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=PAD + 1,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config)


def check_against_unpatched(model, dataset) -> None:
    """One batch, loss and lm_head gradient, patched vs not (exits non-zero on a mismatch)."""
    batch = {k: torch.stack([dataset[i][k] for i in range(4)]) for k in dataset[0]}
    model.train()
    results = []
    for patched in (False, True):
        if patched:
            cce_dist.hf.patch(model)
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        results.append((out.loss.detach(), model.lm_head.weight.grad.clone(), out.logits is None))
        if patched:
            cce_dist.hf.unpatch(model)
    model.zero_grad(set_to_none=True)
    (ref, ref_g, _), (got, got_g, no_logits) = results
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_g, ref_g, rtol=1e-4, atol=1e-6)
    assert no_logits
    print(f"patched loss matches the unpatched model: {float(got):.6f} vs {float(ref):.6f}")


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--check", action="store_true", help="compare with the unpatched model first; assert learning")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters on the attention projections (peft)")
    args = p.parse_args(argv)

    dataset = ByteBlocks(TEXT)
    model = tiny_llama()
    if args.check:
        check_against_unpatched(model, dataset)

    if args.lora:
        import peft

        lora = peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
        )  # lm_head stays a plain nn.Linear
        model = peft.get_peft_model(model, lora)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"LoRA: {trainable} trainable parameters")

    cce_dist.hf.patch(model)  # <- the integration (a PEFT model: the causal LM inside is patched)

    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=args.output_dir or tmp,
            max_steps=args.max_steps,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            warmup_steps=0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=dataset)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"steps: {len(losses)}  first loss: {losses[0]:.4f}  last loss: {losses[-1]:.4f}")
    if args.check:
        assert losses[-1] < losses[0], "the loss did not decrease"
    return losses[-1]


if __name__ == "__main__":
    main()
