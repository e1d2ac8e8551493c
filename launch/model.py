"""A small decoder-only LM in plain PyTorch whose output head is vocab-parallel.

Everything except the head (token + position embeddings, pre-LN transformer blocks, final
LayerNorm) is replicated on every rank.  The head weight ``[V_pad, D]`` is split by rows over the
tensor-parallel (TP) group: TP rank ``r`` owns rows ``[start, stop)``.  All parameters, the head
included, are drawn from seeded generators in a fixed order *before* slicing, so a model with
``tp=1`` and one with ``tp=4`` start from the same function, and two models built with the same
seed are bit-identical.

The model returns hidden states; the loss (vocab-parallel, materialized or not) is the caller's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # padded vocab (a multiple of the TP size); the head has this many rows
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class VocabParallelLM(nn.Module):
    """Replicated trunk + the rows ``[start, stop)`` of a seeded head weight."""

    def __init__(self, cfg: ModelConfig, start: int, stop: int, seed: int = 0):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        if not 0 <= start < stop <= cfg.vocab_size:
            raise ValueError(f"bad head shard [{start}, {stop}) of {cfg.vocab_size}")
        self.cfg, self.start, self.stop = cfg, start, stop
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d)
        self.pos_emb = nn.Embedding(cfg.seq_len, d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head_weight = nn.Parameter(torch.empty(stop - start, d))
        self._init(seed)

    @torch.no_grad()
    def _init(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        # Residual projections scaled down with depth (GPT-2).
        res_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name == "head_weight":
                continue
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                s = res_std if name.endswith(("proj.weight", "out.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * s)
        full = torch.randn(self.cfg.vocab_size, self.cfg.d_model, generator=g) * std
        self.head_weight.copy_(full[self.start : self.stop])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, S]`` -> final hidden states ``[B, S, D]`` (input of the head)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)
