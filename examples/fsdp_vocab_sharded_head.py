"""FSDP2 training with the LM head kept vocab-sharded by cce_dist: the head is never all-gathered.

    torchrun --standalone --nproc-per-node 2 examples/fsdp_vocab_sharded_head.py            # CPU, gloo
    torchrun --standalone --nproc-per-node 4 examples/fsdp_vocab_sharded_head.py --steps 20
    torchrun --standalone --nproc-per-node 8 examples/fsdp_vocab_sharded_head.py --device cuda

Two copies of a small decoder LM start from the same weights and train on the same batches (every rank its own
batch, of a different length): one fully FSDP2-sharded with the materialized loss (FSDP gathers the head
``[V, D]`` before the forward and reduce-scatters its gradient), one with the head kept out of FSDP by
``cce_dist.fsdp.shard_lm_head`` and scored by ``cce_dist.fsdp.head_cross_entropy``. Rank 0 prints both losses per
step, the largest parameter difference at the end and the bytes each run's collectives moved per step (the rest of
the model's FSDP traffic included); the exit status is 2 when the runs disagree beyond float32 summation-order noise.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

import cce_dist.fsdp
from cce_dist.testing import CollectiveLog


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        y = self.n1(x)
        x = x + self.attn(y, y, y, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels, sharded_head: bool):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        h = self.norm(h)
        if sharded_head:  # each rank's own tokens, scored on the group's vocab shards
            return cce_dist.fsdp.head_cross_entropy(self.lm_head, h, labels, shift=True)
        logits = self.lm_head(h)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build(args, mesh, sharded_head: bool) -> nn.Module:
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim, args.layers).to(args.device)
    ignored = cce_dist.fsdp.shard_lm_head(model, mesh) if sharded_head else None  # the one line
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=8191)  # uneven Shard(0) rows on 2, 4 or 8 ranks
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        args.device = f"cuda:{torch.cuda.current_device()}"
    else:
        torch.set_num_threads(1)
    mesh = init_device_mesh(args.device.split(":")[0], (world,))
    models = {name: build(args, mesh, name == "cce") for name in ("fsdp", "cce")}
    # SGD: Adam's normalisation would turn float32 summation-order noise in near-zero gradients into lr-sized steps
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for name, m in models.items()}
    log = CollectiveLog().install()
    moved = {name: 0 for name in models}
    worst = 0.0
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        batch = 1 + (step + rank) % 3  # a different number of sequences (tokens) on every rank
        ids = torch.randint(0, args.vocab, (batch, args.seq), generator=g).to(args.device)
        losses = {}
        for name, model in models.items():
            with log.counting():
                loss = model(ids, ids, sharded_head=name == "cce")
                loss.backward()
            moved[name] = sum(c.in_bytes + c.out_bytes for c in log.calls)
            opts[name].step()
            opts[name].zero_grad()
            losses[name] = float(loss.detach())
        worst = max(worst, abs(losses["cce"] - losses["fsdp"]))
        if rank == 0:
            print(f"step {step:3d}  rank-0 loss fsdp {losses['fsdp']:.6f}  cce {losses['cce']:.6f}", flush=True)
    log.uninstall()
    diff = 0.0
    for p, q in zip(models["fsdp"].parameters(), models["cce"].parameters()):
        a = p.full_tensor() if isinstance(p, DTensor) else p
        b = q.full_tensor() if isinstance(q, DTensor) else q
        diff = max(diff, float((a - b).detach().abs().max()))
    head_mib = args.vocab * args.dim * 4 / 2**20
    if rank == 0:
        print(
            f"bytes moved by rank 0 in the last step: fsdp {moved['fsdp'] / 2**20:.2f} MiB, "
            f"cce {moved['cce'] / 2**20:.2f} MiB (the head is {head_mib:.2f} MiB)"
        )
        print(f"max |loss difference| {worst:.2e}, max |parameter difference| {diff:.2e}")
    ok = worst < 1e-4 and diff < 1e-4
    if rank == 0:
        print("VERDICT:", "the two runs agree" if ok else "the runs DISAGREE")
    dist.destroy_process_group()
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
