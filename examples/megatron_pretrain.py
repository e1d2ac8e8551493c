"""A few pretraining steps of a megatron-core GPTModel at tp=2, its loss computed by cce_dist.

Two identical GPTModels (same seed, same data, same optimizer) train side by side: one as
megatron-core builds it, one patched with ``cce_dist.megatron.patch(model)``. Each step prints
both losses and the memory each model's loss path used:

- ``saved``: bytes the output layer + loss saved for backward (tensors saved after the decoder
  ran, parameters excluded): Megatron keeps the ``[s, b, V/tp]`` logits' softmax; cce_dist keeps
  the hidden states and two floats per token;
- ``peak`` (CUDA only): the step's peak allocated memory above what was allocated before it.

Run::

    python examples/megatron_pretrain.py                          # spawns 2 ranks (gloo on CPU, NCCL on GPUs)
    torchrun --nproc_per_node 2 examples/megatron_pretrain.py     # or under torchrun

Options: --steps, --seq, --batch, --vocab, --hidden, --mtp (multi-token prediction layers), --tied.

On CPU, megatron-core 0.16 still allocates a few buffers on ``torch.cuda.current_device()``; this
script points that at the CPU and uses megatron's no-op (inference) RNG tracker (dropout is 0). The
layer spec is megatron-core's local (non-Transformer-Engine) spec, without sequence parallelism
(its torch LayerNorm refuses it; use the Transformer Engine spec on GPUs for that).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import math
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TP = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32003, help="real vocab; padded to a multiple of 128 * tp")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--mtp", type=int, default=0, help="multi-token prediction layers (0: none)")
    p.add_argument("--tied", action="store_true", help="share the embedding and output weights")
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def build_model(args, device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=TP,
        use_cpu_initialization=device.type == "cpu",
        mtp_num_layers=args.mtp or None,
        params_dtype=torch.float32,
    )
    spec = get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if args.mtp else None
    padded = math.ceil(args.vocab / (128 * TP)) * 128 * TP  # Megatron's make_vocab_size_divisible_by=128
    torch.manual_seed(1234)
    model = GPTModel(
        config,
        spec,
        vocab_size=padded,
        max_sequence_length=args.seq,
        share_embeddings_and_output_weights=args.tied,
        mtp_block_spec=mtp_spec,
    )
    return model.to(device), padded


class LossPathMemory:
    """Bytes saved for backward after the decoder ran (the output layer and the loss), parameters
    excluded; on CUDA also the step's peak allocated memory above its start."""

    def __init__(self, model):
        self.model = model
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.after_decoder = False
        model.decoder.register_forward_hook(self._decoder_done)

    def _decoder_done(self, *_):
        self.after_decoder = True

    def _pack(self, t):
        if self.after_decoder:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.params and storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                self.saved += storage.nbytes()
        return t

    def __enter__(self):
        self.after_decoder, self.saved, self.seen, self.peak = False, 0, set(), None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def forward_done(self):
        self.hooks.__exit__(None, None, None)

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        self.seen = set()


def train_step(model, optimizer, batch, memory):
    """One step; returns the loss and Megatron's logged MTP losses (one per MTP layer)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tokens, labels, loss_mask, positions, attention_mask = batch
    optimizer.zero_grad(set_to_none=True)
    MTPLossLoggingHelper.tracker.clear()  # shared by both models: read after each model's step
    with memory:
        per_token = model(tokens, positions, attention_mask, labels=labels, loss_mask=loss_mask)  # [b, s]
        memory.forward_done()
        loss = (per_token * loss_mask).sum() / loss_mask.sum()  # Megatron's loss_func
        loss.backward()
    optimizer.step()
    mtp = MTPLossLoggingHelper.tracker.get("values")
    return loss.item(), [] if mtp is None else mtp.tolist()


def main(rank, world, init, args):
    if world != TP:
        raise SystemExit(f"run with {TP} processes (tensor parallelism only), got WORLD_SIZE={world}")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.cuda.current_device = lambda: device  # megatron-core allocates a few buffers there
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=init,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker, model_parallel_cuda_manual_seed

    import cce_dist.megatron

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    if cuda:
        model_parallel_cuda_manual_seed(1234)
    else:
        reset = {"force_reset": True} if "force_reset" in inspect.signature(initialize_rng_tracker).parameters else {}
        initialize_rng_tracker(inference_rng_tracker=True, **reset)  # force_reset: megatron-core >= 0.13

    reference, padded = build_model(args, device)
    patched, _ = build_model(args, device)
    patched.load_state_dict(reference.state_dict())
    cce_dist.megatron.patch(patched)
    models = {"megatron": reference, "cce_dist": patched}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=args.lr) for k, m in models.items()}
    memories = {k: LossPathMemory(m) for k, m in models.items()}

    # a fixed batch of a repeating random sequence: learnable, so the loss falls within a few steps
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(0, args.vocab, (args.batch, 17), generator=g)
    stream = motif.repeat(1, args.seq // 17 + 2)[:, : args.seq + 1]
    tokens, labels = stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
    loss_mask = torch.ones(args.batch, args.seq)
    positions = torch.arange(args.seq).expand(args.batch, args.seq)
    attention_mask = torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool).triu(1)
    batch = tuple(t.to(device) for t in (tokens, labels, loss_mask, positions, attention_mask))

    if rank == 0:
        print(
            f"GPTModel: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} (padded {padded}, "
            f"{padded // TP} rows per rank), tp={TP}, seq {args.seq}, batch {args.batch}, mtp {args.mtp}, "
            f"tied {args.tied}, {'NCCL on CUDA' if cuda else 'gloo on CPU'}"
        )
        peak = "  peak MiB megatron / cce_dist" if cuda else ""
        print(f"step  loss megatron  loss cce_dist   |diff|    saved MiB megatron / cce_dist{peak}")
    for step in range(1, args.steps + 1):
        results = {k: train_step(m, optimizers[k], batch, memories[k]) for k, m in models.items()}
        losses = {k: r[0] for k, r in results.items()}
        if rank == 0:
            mib = {k: memories[k].saved / 2**20 for k in models}
            line = (
                f"{step:4d}  {losses['megatron']:13.6f}  {losses['cce_dist']:13.6f}  "
                f"{abs(losses['megatron'] - losses['cce_dist']):8.2e}  {mib['megatron']:12.2f} / {mib['cce_dist']:.2f}"
            )
            if cuda:
                line += f"  {memories['megatron'].peak / 2**20:12.2f} / {memories['cce_dist'].peak / 2**20:.2f}"
            for i, (want, got) in enumerate(zip(results["megatron"][1], results["cce_dist"][1])):
                line += f"\n  mtp{i + 1}  {want:13.6f}  {got:13.6f}  {abs(want - got):8.2e}"
            print(line, flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _spawned(rank, init, args):
    main(rank, TP, init, args)


if __name__ == "__main__":
    args = parse_args()
    if "RANK" in os.environ:  # torchrun
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_spawned, args=(f"file://{os.path.join(tmp, 'rendezvous')}", args), nprocs=TP)
