"""The tiny TRL test problem shared by tests/test_trl.py and tests/test_trl_parallel.py: a Llama built from a config
(vocab ``V = 97``, no download) and a word-level tokenizer over its ids (``w0`` ... ``w94``, ``<pad>`` = 95,
``<eos>`` = 96)."""

from __future__ import annotations

import torch
import transformers

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
