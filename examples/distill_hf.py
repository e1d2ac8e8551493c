"""Distil a tiny Hugging Face Llama teacher into a smaller student with cce_dist.linear_distillation.

Everything is local (no hub downloads): a byte-level "tokenizer" (ids 0..255, 256 = padding),
a few sentences of text, two randomly initialised ``LlamaForCausalLM`` built from ``LlamaConfig``.
The teacher (hidden 96) is first trained briefly on the text with ``cce_dist.linear_cross_entropy``;
then the student (hidden 48, a different hidden size and dtype are fine) learns from the
teacher's next-token distributions plus the hard labels. Neither model's ``[batch, seq, vocab]``
logits are ever formed: the losses come straight from the last hidden states and the LM heads.
Runs on a laptop CPU in well under a minute::

    pip install -e ".[hf]"
    python examples/distill_hf.py --teacher-steps 40 --student-steps 40

Both curves are printed: the teacher's training loss, then per student step its distillation
loss (``(1-w) * T**2 * KL(p_teacher || p_student) + w * CE``) and its plain cross-entropy on the
labels.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import cce_dist

TEXT = """\
A vocabulary-parallel head splits the output projection across ranks; each rank scores only its
own slice of the vocabulary, and a handful of numbers per token is all the ranks need to share.
A teacher's distribution over the next token says more than the one token that came next: which
other words were nearly as likely, and how sure the model was. A student that matches it learns
faster than one that only sees the labels.
"""
PAD = 256
VOCAB = 257
SEQ = 48


def batches(text: str, batch: int, seed: int):
    """Random byte windows of ``text``: (input ids [batch, SEQ], next-token labels [batch, SEQ])."""
    data = torch.tensor(list(text.encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - SEQ - 1, (batch,), generator=g)
        ids = torch.stack([data[s : s + SEQ] for s in starts.tolist()])
        labels = torch.stack([data[s + 1 : s + SEQ + 1] for s in starts.tolist()])
        labels[1::2, -4:] = -100  # some ignored positions, as padding would give
        yield ids, labels


def tiny_llama(hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def last_hidden(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model.model(input_ids=ids).last_hidden_state  # [batch, seq, hidden]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher-steps", type=int, default=40)
    ap.add_argument("--student-steps", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--hard-label-weight", type=float, default=0.3)
    ap.add_argument("--divergence", default="kl", choices=["kl", "reverse_kl", "jsd"])
    args = ap.parse_args()
    torch.set_num_threads(min(4, torch.get_num_threads()))

    teacher = tiny_llama(hidden=96, layers=2, seed=0)
    opt = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    data = batches(TEXT, batch=8, seed=0)
    print("teacher training (cce_dist.linear_cross_entropy):")
    for step in range(args.teacher_steps):
        ids, labels = next(data)
        loss = cce_dist.linear_cross_entropy(last_hidden(teacher, ids), teacher.lm_head.weight, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == args.teacher_steps - 1:
            print(f"  teacher step {step:3d}  CE {loss.item():.3f}")
    teacher.eval().requires_grad_(False)

    student = tiny_llama(hidden=48, layers=1, seed=1)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)
    data = batches(TEXT, batch=8, seed=1)
    print(
        f"student distillation (cce_dist.linear_distillation, {args.divergence}, T={args.temperature}, "
        f"hard_label_weight={args.hard_label_weight}):"
    )
    for step in range(args.student_steps):
        ids, labels = next(data)
        with torch.no_grad():
            t_hidden = last_hidden(teacher, ids)
        s_hidden = last_hidden(student, ids)
        loss = cce_dist.linear_distillation(
            s_hidden,
            student.lm_head.weight,
            t_hidden,
            teacher.lm_head.weight,
            labels,
            divergence=args.divergence,
            temperature=args.temperature,
            hard_label_weight=args.hard_label_weight,
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == args.student_steps - 1:
            with torch.no_grad():
                ce = cce_dist.linear_cross_entropy(s_hidden.detach(), student.lm_head.weight, labels)
            print(f"  student step {step:3d}  distillation loss {loss.item():.3f}  CE on labels {ce.item():.3f}")


if __name__ == "__main__":
    main()
