"""torchrun entry point: train a small decoder LM whose output head is vocab-parallel, and compare
cce_dist's logits-free loss with the materialized Megatron-style loss step by step.

Run from the repository root, as a module:

    torchrun --standalone --nproc-per-node 2 -m launch.train            # tp=2, CPU, gloo
    torchrun --standalone --nproc-per-node 4 -m launch.train --tp 2     # tp=2 x dp=2
    torchrun --standalone --nproc-per-node 8 -m launch.train --device cuda --dtype bf16

Layout: world = tp * dp. TP groups are consecutive ranks; each TP rank holds rows [start, stop)
of the head weight; the rest of the model is replicated. DP groups take one rank of every TP
group; every gradient is averaged over its DP group. Both losses return the full hidden-state
gradient on every TP rank, so the replicated trunk gets identical gradients on all TP ranks.

With ``--loss both`` (default) two identical seeded models train side by side on the same batches,
one through ``cce_dist.linear_cross_entropy`` and one through ``launch/baseline.py``. Rank 0
prints a table, writes ``summary.json`` and ``curves.png`` to ``--out-dir`` and ends with a
one-line ``VERDICT``. Exit status 2 when the curves disagree beyond the tolerance.

Memory is the peak of tensor bytes allocated by the loss's forward + backward (including the
dH and dW it returns) above what existed before; see ``launch/memory.py``. On CUDA the caching
allocator's ``max_memory_allocated`` delta over the same region is recorded too.

The flags are the fields of :class:`launch.config.TrainConfig`; :func:`main` is the run's steps
in order: set up the process groups, load the tokens, build the two variants, train, report.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from launch import baseline, data
from launch.config import TrainConfig
from launch.memory import TensorMemory
from launch.model import ModelConfig, VocabParallelLM

# Agreement tolerances. The two variants are independent trainings from the same weights on the
# same batches; they differ only in floating-point summation order (chunked vs one block, the
# order of the fp32 statistics across ranks), and those last-bit differences in the gradients
# grow slowly through the optimizer. First step (identical weights): relative difference of the
# loss and of the hidden/head gradients. Curve: max |loss_cce - loss_materialized| over all steps
# in nats. Measured with the defaults (200 steps, fp32): <= 6e-5 on all but one step, 5.6e-4 at the
# worst (a batch with an outlier token whose loss is very sensitive to the weights); on that
# weight state both losses agree with a float64 reference to 1e-6. A wrong gradient (e.g. a dH
# not reduced over the group) shows up at step 0 and moves the curves by >1e-2 within a few steps.
TOL_FIRST = {"fp32": 1e-5, "bf16": 1e-2}
TOL_GRAD = {"fp32": 1e-4, "bf16": 5e-2}
TOL_CURVE = {"fp32": 5e-3, "bf16": 5e-2}

SERIES = ("step_s", "loss_s", "mem", "cuda_mem")  # per-step measurements, max over ranks
SHORT = {"cce": "cce", "materialized": "mat"}


def _silent(*args, **kwargs) -> None:
    pass


# --------------------------------------------------------------------------------------------
# process groups


@dataclass(frozen=True)
class Topology:
    """This process's place in the layout world = tp x dp, its two groups and its device."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str):
    """Init from torchrun's env (or as a single process); return rank, world, local rank/world."""
    if "RANK" not in os.environ:  # plain `python -m launch.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    # generous: local rank 0 may spend minutes building the tokenizer cache before a barrier
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    return rank, world, local_rank, local_world


def build_groups(rank: int, world: int, tp: int):
    """TP groups of consecutive ranks, DP groups across them. Every rank creates every group."""
    if world % tp:
        raise SystemExit(f"world size {world} is not divisible by --tp {tp}")
    dp = world // tp
    tp_group = dp_group = None
    for i in range(dp):
        g = dist.new_group(list(range(i * tp, (i + 1) * tp)))
        if rank // tp == i:
            tp_group = g
    for j in range(tp):
        g = dist.new_group(list(range(j, world, tp)))
        if rank % tp == j:
            dp_group = g
    return tp_group, dp_group, rank % tp, rank // tp, dp


def setup(cfg: TrainConfig) -> Topology:
    """Join the world, build the TP and DP groups, pick the device and the CPU thread count."""
    rank, world, local_rank, local_world = init_distributed(cfg.device)
    tp = cfg.tp or world
    tp_group, dp_group, tp_rank, dp_rank, dp = build_groups(rank, world, tp)
    device = torch.device("cuda", local_rank) if cfg.device == "cuda" else torch.device("cpu")
    if cfg.device == "cpu":
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        torch.set_num_threads(cfg.threads or max(1, cores // local_world))
    return Topology(rank, world, local_rank, local_world, tp, dp, tp_rank, dp_rank, tp_group, dp_group, device)


def load_tokens(cfg: TrainConfig, topo: Topology):
    """The token ids and their metadata: local rank 0 of each node builds the cache, the others
    wait at a barrier and load it."""
    if topo.local_rank == 0:
        folder = data.prepare(cfg.vocab_size, cfg.max_files, progress=topo.is_main)
    dist.barrier()
    if topo.local_rank != 0:
        folder = data.prepare(cfg.vocab_size, cfg.max_files, progress=False)
    return data.load(folder)


@dataclass(frozen=True)
class HeadShard:
    """This TP rank's rows ``[start, stop)`` of the head; the vocabulary is padded to a multiple of
    tp so that it splits evenly (as Megatron does)."""

    vocab: int
    padded: int
    per_rank: int
    start: int
    stop: int

    @classmethod
    def split(cls, vocab: int, tp: int, tp_rank: int) -> HeadShard:
        padded = -(-vocab // tp) * tp
        per = padded // tp
        return cls(vocab, padded, per, tp_rank * per, (tp_rank + 1) * per)


# --------------------------------------------------------------------------------------------
# the two losses


def make_cce_loss(tp_group, start: int, stop: int, impl: str, chunk_size: int):
    """cce_dist's logits-free vocab-parallel loss, as ``f(hidden, weight_shard, targets)``."""
    import cce_dist

    shard = cce_dist.VocabShard(tp_group, start, stop)
    kw = {"chunk_size": chunk_size} if chunk_size > 0 else {}

    def loss_fn(hidden, weight_shard, targets):
        return cce_dist.linear_cross_entropy(
            hidden, weight_shard, targets, shard=shard, reduction="mean", impl=impl, **kw
        )

    return loss_fn


def make_materialized_loss(tp_group, start: int):
    def loss_fn(hidden, weight_shard, targets):
        return baseline.vocab_parallel_cross_entropy(hidden, weight_shard, targets, start, tp_group)

    return loss_fn


# --------------------------------------------------------------------------------------------
# one training step of one variant


def compute_dtype(cfg: TrainConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.dtype == "bf16" else torch.float32


class Variant:
    """One model with its loss, optimizer and schedule; :meth:`step` trains it on one batch."""

    def __init__(self, name: str, model: VocabParallelLM, loss_fn, cfg: TrainConfig, topo: Topology):
        self.name, self.model, self.loss_fn = name, model, loss_fn
        self.dp_group, self.dp, self.device = topo.dp_group, topo.dp, topo.device
        self.dtype = compute_dtype(cfg)
        self.opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        warm, total = max(1, cfg.warmup), cfg.steps

        def lr_lambda(s):  # linear warmup, cosine decay to 10%
            if s < warm:
                return (s + 1) / warm
            p = (s - warm) / max(1, total - warm)
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, p)))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda)
        self.hidden_grad = self.head_grad = None  # step-0 gradients, for the cross-check

    def autocast(self) -> AbstractContextManager:
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def step(self, x, y, keep_grads=False) -> dict:
        device = self.device
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with self.autocast():
            h = self.model(x)
        h_in = h.detach().requires_grad_()
        # The loss region: forward + backward of the head alone, memory-tracked.
        cuda_base = 0
        if device.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats()
            cuda_base = torch.cuda.memory_allocated()
        t1 = time.perf_counter()
        with TensorMemory() as mem:
            with self.autocast():
                loss = self.loss_fn(h_in, self.model.head_weight, y)
            loss.backward()
        sync()
        t2 = time.perf_counter()
        cuda_peak = torch.cuda.max_memory_allocated() - cuda_base if device.type == "cuda" else 0
        if keep_grads:
            self.hidden_grad = h_in.grad.detach().clone()
            self.head_grad = self.model.head_weight.grad.detach().clone()
        h.backward(h_in.grad)
        if self.dp > 1:
            for p in self.model.parameters():
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad.div_(self.dp)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        loss = loss.detach().float()
        if self.dp > 1:
            dist.all_reduce(loss, group=self.dp_group)
            loss /= self.dp
        sync()
        t3 = time.perf_counter()
        return {"loss": loss.item(), "step_s": t3 - t0, "loss_s": t2 - t1, "mem": mem.peak, "cuda_mem": cuda_peak}


def build_variants(cfg: TrainConfig, topo: Topology, head: HeadShard) -> list[Variant]:
    """The models that train side by side: identical seeded weights, one loss each."""
    model_cfg = ModelConfig(
        vocab_size=head.padded, d_model=cfg.d_model, n_layers=cfg.layers, n_heads=cfg.heads, seq_len=cfg.seq_len
    )
    torch.manual_seed(cfg.seed)
    losses = {}
    if cfg.loss in ("both", "cce"):
        losses["cce"] = make_cce_loss(topo.tp_group, head.start, head.stop, cfg.impl, cfg.chunk_size)
    if cfg.loss in ("both", "materialized"):
        losses["materialized"] = make_materialized_loss(topo.tp_group, head.start)
    return [
        Variant(
            name, VocabParallelLM(model_cfg, head.start, head.stop, seed=cfg.seed).to(topo.device), loss_fn, cfg, topo
        )
        for name, loss_fn in losses.items()
    ]


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


# --------------------------------------------------------------------------------------------
# sizes and the setup lines


@dataclass(frozen=True)
class Sizes:
    """Per-step token counts and the per-rank sizes printed at setup and kept in the summary."""

    params: int  # this rank's parameters of one model (trunk + head shard)
    tokens_local: int  # tokens per step on one DP rank
    tokens_global: int  # tokens per step over the DP group
    logits_mib: float  # the materialized logits block of one rank (analytic)
    grads_mib: float  # dW shard + dH, float32, which both variants hold

    @classmethod
    def of(cls, cfg: TrainConfig, topo: Topology, head: HeadShard, variants: list[Variant]) -> Sizes:
        tokens_local = cfg.batch_size * cfg.seq_len
        return cls(
            params=sum(p.numel() for p in variants[0].model.parameters()),
            tokens_local=tokens_local,
            tokens_global=tokens_local * topo.dp,
            logits_mib=baseline.logits_bytes(tokens_local, head.per_rank, compute_dtype(cfg)) / 2**20,
            grads_mib=(head.per_rank + tokens_local) * cfg.d_model * 4 / 2**20,
        )


def log_setup(
    cfg: TrainConfig, topo: Topology, meta: dict, head: HeadShard, sizes: Sizes, names: list[str], log: Callable
) -> None:
    n_head_full = head.padded * cfg.d_model
    log(
        f"[setup] world {topo.world} = tp {topo.tp} x dp {topo.dp} | backend {dist.get_backend()} | device "
        f"{cfg.device} | dtype {cfg.dtype} | torch threads/rank {torch.get_num_threads()}"
    )
    log(
        f"[setup] data: {meta['tokens']:,} stdlib tokens, vocab {head.vocab} (head padded to {head.padded}, "
        f"{head.per_rank} rows per TP rank) | model: d {cfg.d_model}, layers {cfg.layers}, heads "
        f"{cfg.heads}, params {sizes.params - head.per_rank * cfg.d_model + n_head_full:,} "
        f"(head {n_head_full:,}) | {sizes.tokens_global:,} tokens/step"
    )
    log(
        f"[setup] losses: {', '.join(names)} | cce impl {cfg.impl}, chunk_size "
        f"{cfg.chunk_size or 'default'} | per rank: materialized logits {sizes.logits_mib:.1f} MiB, "
        f"dW+dH (both variants) {sizes.grads_mib:.1f} MiB"
    )


# --------------------------------------------------------------------------------------------
# the training loop


class History:
    """Per variant: the loss of every step (the same on every rank) and the series of
    :data:`SERIES` (max over ranks); this rank's own peak loss memory; the step-0 gradient check."""

    def __init__(self, names: list[str]):
        self.names = names
        self.series = {n: {"loss": [], **{k: [] for k in SERIES}} for n in names}
        self.rank_peak_mem = {n: 0 for n in names}
        self.grad_check: dict[str, float] = {}

    def record(self, res: dict, device: torch.device) -> None:
        """Append one step's results; times and memory become the max over all ranks."""
        t = torch.tensor([[res[n][k] for k in SERIES] for n in self.names], dtype=torch.float64, device=device)
        for n in self.names:
            self.rank_peak_mem[n] = max(self.rank_peak_mem[n], res[n]["mem"])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        for i, n in enumerate(self.names):
            self.series[n]["loss"].append(res[n]["loss"])
            for j, k in enumerate(SERIES):
                self.series[n][k].append(t[i, j].item())


def first_step_grad_check(variants: list[Variant], device: torch.device) -> dict[str, float]:
    """Max over ranks of the relative difference of the two variants' step-0 gradients."""
    a, b = variants
    check = {
        "hidden_grad_max_rel_diff": max_rel_diff(a.hidden_grad, b.hidden_grad),
        "head_grad_max_rel_diff": max_rel_diff(a.head_grad, b.head_grad),
    }
    t = torch.tensor(list(check.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    for v in variants:
        v.hidden_grad = v.head_grad = None
    return dict(zip(check, t.tolist()))


class ProgressTable:
    """The per-step table rank 0 prints (through tqdm's ``write`` while a progress bar is shown)."""

    def __init__(self, names: list[str], tokens_per_step: int, steps: int, show_bar: bool, log: Callable):
        self.names, self.tokens_per_step = names, tokens_per_step
        self.bar = None
        if show_bar:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout)
            except ImportError:
                pass
        self.out = self.bar.write if self.bar is not None else log
        header = f"{'step':>5} | " + " | ".join(f"{'loss ' + SHORT[n]:>10}" for n in names)
        if len(names) == 2:
            header += f" | {'|Δloss|':>9}"
        header += " | " + " | ".join(f"{'tok/s ' + SHORT[n]:>10}" for n in names)
        header += " | " + " | ".join(f"{'MiB ' + SHORT[n]:>9}" for n in names)
        self.out(
            "[table] loss: global mean over the step's tokens; tok/s: global tokens / step time; "
            "MiB: peak tensor memory of the loss fwd+bwd, max over ranks"
        )
        self.out(header)
        self.out("-" * len(header))

    def row(self, step: int, res: dict, history: History) -> None:
        names, series = self.names, history.series
        row = f"{step:>5} | " + " | ".join(f"{res[n]['loss']:>10.5f}" for n in names)
        if len(names) == 2:
            row += f" | {abs(res[names[0]]['loss'] - res[names[1]]['loss']):>9.2e}"
        row += " | " + " | ".join(f"{self.tokens_per_step / series[n]['step_s'][-1]:>10.0f}" for n in names)
        row += " | " + " | ".join(f"{series[n]['mem'][-1] / 2**20:>9.2f}" for n in names)
        self.out(row)

    def advance(self, res: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix({SHORT[n]: f"{res[n]['loss']:.3f}" for n in self.names})
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(
    cfg: TrainConfig,
    topo: Topology,
    variants: list[Variant],
    batches: data.Batches,
    tokens_per_step: int,
    log: Callable,
) -> History:
    """Train every variant on the same batches for ``cfg.steps`` steps; return what was measured."""
    names = [v.name for v in variants]
    compare = len(names) == 2
    history = History(names)
    show_bar = topo.is_main and not cfg.no_progress and sys.stdout.isatty()
    table = ProgressTable(names, tokens_per_step, cfg.steps, show_bar, log)
    for step in range(cfg.steps):
        x, y = batches.get(step)
        x, y = x.to(topo.device), y.to(topo.device)
        res = {v.name: v.step(x, y, keep_grads=(step == 0 and compare)) for v in variants}
        if step == 0 and compare:
            history.grad_check = first_step_grad_check(variants, topo.device)
        history.record(res, topo.device)
        if topo.is_main and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            table.row(step, res, history)
        table.advance(res)
    table.close()
    return history


# --------------------------------------------------------------------------------------------
# after training: per-rank peaks, trunk consistency


def gather_peak_memory(topo: Topology, history: History) -> list[list[float]]:
    """``[rank][variant]``: every rank's peak loss memory in bytes, on every rank."""
    peaks = torch.tensor([history.rank_peak_mem[n] for n in history.names], dtype=torch.float64, device=topo.device)
    all_peaks = [torch.zeros_like(peaks) for _ in range(topo.world)]
    dist.all_gather(all_peaks, peaks)
    return [p.tolist() for p in all_peaks]


def trunk_replicas_in_sync(topo: Topology, variants: list[Variant]) -> bool:
    """True when every variant's replicated trunk is bitwise identical across its TP group."""
    in_sync = True
    for v in variants:
        s = torch.stack([p.detach().double().sum() for n_, p in v.model.named_parameters() if n_ != "head_weight"]).to(
            topo.device
        )
        lo, hi = s.clone(), s.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=topo.tp_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=topo.tp_group)
        ok = torch.tensor([float(torch.equal(lo, hi))], device=topo.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        in_sync &= bool(ok.item())
    return in_sync


@dataclass(frozen=True)
class RunResults:
    """Everything :func:`report` needs; assembled on every rank, reported by rank 0."""

    cfg: TrainConfig
    topo: Topology
    head: HeadShard
    sizes: Sizes
    data_meta: dict
    history: History
    peak_mem_per_rank: list[list[float]]  # [rank][variant], bytes
    trunk_in_sync: bool
    wall_s: float

    @property
    def names(self) -> list[str]:
        return self.history.names


def finish(topo: Topology, status: int) -> int:
    """Every rank returns rank 0's exit status; the process group is torn down."""
    from cce_dist.parallel import released

    st = torch.tensor([float(status)], device=topo.device)
    # The run's last collective: returning only once gloo's worker thread has let go of `st` keeps that thread from
    # asking for the GIL while the interpreter shuts down (an abort at exit otherwise; docs/reliability.md, "A clean
    # exit").
    with released([st]):
        dist.broadcast(st, 0)
    dist.destroy_process_group()
    return int(st.item())


def main(argv: list[str] | None = None) -> int:
    cfg = TrainConfig.from_cli(argv, description=__doc__.split("\n\n")[0])
    t_start = time.perf_counter()
    topo = setup(cfg)
    log = print if topo.is_main else _silent
    tokens, meta = load_tokens(cfg, topo)
    head = HeadShard.split(meta["vocab_size"], topo.tp, topo.tp_rank)
    batches = data.Batches(tokens, cfg.batch_size, cfg.seq_len, cfg.seed, topo.dp_rank)
    variants = build_variants(cfg, topo, head)
    sizes = Sizes.of(cfg, topo, head, variants)
    log_setup(cfg, topo, meta, head, sizes, [v.name for v in variants], log)
    history = train(cfg, topo, variants, batches, sizes.tokens_global, log)
    results = RunResults(
        cfg,
        topo,
        head,
        sizes,
        meta,
        history,
        gather_peak_memory(topo, history),
        trunk_replicas_in_sync(topo, variants),
        wall_s=time.perf_counter() - t_start,
    )
    return finish(topo, report(results) if topo.is_main else 0)


# --------------------------------------------------------------------------------------------
# the report (rank 0)


def _median(xs):
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def summarize(r: RunResults) -> dict:
    """The ``summary.json`` content, without the verdict (see :func:`judge`)."""
    cfg, names, series = r.cfg, r.names, r.history.series
    warm = series[names[0]]["step_s"][1:] or series[names[0]]["step_s"]
    skip = 1 if len(warm) < len(series[names[0]]["step_s"]) else 0
    summary = {
        "config": cfg.to_json(),
        "world": r.topo.world,
        "tp": r.topo.tp,
        "dp": r.topo.dp,
        "vocab": r.data_meta["vocab_size"],
        "vocab_padded": r.head.padded,
        "vocab_per_rank": r.head.per_rank,
        "params": r.sizes.params,
        "tokens_per_step": r.sizes.tokens_global,
        "data": r.data_meta,
        "torch": torch.__version__,
        "materialized_logits_mib_per_rank": r.sizes.logits_mib,
        "grads_mib_per_rank": r.sizes.grads_mib,
        "memory_method": "peak bytes of tensors allocated by the loss forward+backward (incl. the "
        "dH/dW it returns) above what existed before, per rank (launch/memory.py)",
        "steps": list(range(cfg.steps)),
        "wall_s": r.wall_s,
    }
    for i, n in enumerate(names):
        h = series[n]
        summary[n] = {
            "loss": h["loss"],
            "step_s": h["step_s"],
            "loss_s": h["loss_s"],
            "loss_mem_mib": [m / 2**20 for m in h["mem"]],
            "cuda_loss_mem_mib": [m / 2**20 for m in h["cuda_mem"]] if cfg.device == "cuda" else None,
            "peak_loss_mem_mib_per_rank": [p[i] / 2**20 for p in r.peak_mem_per_rank],
            "median_tokens_per_s": r.sizes.tokens_global / _median(h["step_s"][skip:]),
            "median_loss_ms": 1e3 * _median(h["loss_s"][skip:]),
            "first_loss": h["loss"][0],
            "last_loss": h["loss"][-1],
            "finite": all(math.isfinite(x) for x in h["loss"]),
        }
    summary["trunk_replicas_in_sync"] = r.trunk_in_sync
    return summary


def judge(r: RunResults, summary: dict) -> int:
    """Add the agreement, memory and verdict entries to ``summary``; return the exit status."""
    cfg, names, in_sync = r.cfg, r.names, r.trunk_in_sync
    if len(names) != 2:
        s = summary[names[0]]
        summary["verdict"] = (
            f"VERDICT: {names[0]} only: loss {s['first_loss']:.3f} -> {s['last_loss']:.3f} "
            f"over {cfg.steps} steps, peak loss memory "
            f"{max(s['peak_loss_mem_mib_per_rank']):.1f} MiB per rank"
        )
        return 0 if s["finite"] and in_sync else 2
    a, b = (summary[n]["loss"] for n in names)
    diffs = [abs(x - y) for x, y in zip(a, b)]
    tol, tol0 = TOL_CURVE[cfg.dtype], TOL_FIRST[cfg.dtype]
    first_ok = diffs[0] <= tol0 * max(1.0, abs(b[0]))
    curve_ok = max(diffs) <= tol
    grad_ok = all(g <= TOL_GRAD[cfg.dtype] for g in r.history.grad_check.values())
    finite = summary["cce"]["finite"] and summary["materialized"]["finite"]
    agree = first_ok and curve_ok and grad_ok and finite and in_sync
    mc = max(summary["cce"]["peak_loss_mem_mib_per_rank"])
    mm = max(summary["materialized"]["peak_loss_mem_mib_per_rank"])
    summary["agreement"] = {
        "max_abs_diff": max(diffs),
        "first_step_abs_diff": diffs[0],
        "median_abs_diff": _median(diffs),
        "last_step_abs_diff": diffs[-1],
        "tol_curve": tol,
        "tol_first_step_rel": tol0,
        "tol_grad_rel": TOL_GRAD[cfg.dtype],
        **r.history.grad_check,
        "agree": agree,
    }
    summary["memory"] = {"cce_peak_mib": mc, "materialized_peak_mib": mm, "ratio": mm / mc if mc > 0 else float("inf")}
    verdict = (
        f"VERDICT: curves {'agree' if agree else 'DISAGREE'} (max |Δloss| = "
        f"{max(diffs):.1e} over {cfg.steps} steps, {cfg.dtype} tol {tol:g}; first step "
        f"{diffs[0]:.1e}); loss memory {mc:.1f} MiB vs {mm:.1f} MiB per rank "
        f"({summary['memory']['ratio']:.1f}x less; the materialized logits alone are "
        f"{r.sizes.logits_mib:.1f} MiB)"
    )
    if not in_sync:
        verdict += "; TRUNK REPLICAS DIVERGED across the TP group"
    summary["verdict"] = verdict
    return 0 if agree else 2


def report(r: RunResults) -> int:
    """Write ``summary.json`` and ``curves.png`` to ``--out-dir``, print the closing lines and the
    verdict; return the exit status (2 when the variants disagree or a replica diverged)."""
    out_dir = r.cfg.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(r)
    status = judge(r, summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        plot(summary, r.names, out_dir / "curves.png")
    except ImportError as e:  # matplotlib missing: keep the JSON, say so
        print(f"[plot] skipped ({e})")
    print()
    for n in r.names:
        s = summary[n]
        print(
            f"[{n}] loss {s['first_loss']:.4f} -> {s['last_loss']:.4f} | median "
            f"{s['median_tokens_per_s']:.0f} tok/s, loss fwd+bwd {s['median_loss_ms']:.1f} ms | "
            f"peak loss memory per rank (MiB): " + ", ".join(f"{m:.1f}" for m in s["peak_loss_mem_mib_per_rank"])
        )
    grad_check = r.history.grad_check
    if grad_check:
        print(
            f"[check] step-0 gradients, max relative difference: hidden "
            f"{grad_check['hidden_grad_max_rel_diff']:.1e}, head shard "
            f"{grad_check['head_grad_max_rel_diff']:.1e}"
        )
    print(f"[out] {out_dir / 'summary.json'}, {out_dir / 'curves.png'} ({r.wall_s:.0f} s total)")
    print(summary["verdict"], flush=True)
    return status


def plot(summary, names, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"cce": "tab:blue", "materialized": "tab:orange"}
    fig = plt.figure(figsize=(12, 5.5))
    gs = fig.add_gridspec(2, 2, width_ratios=[2, 1], height_ratios=[3, 1.3])
    ax1 = fig.add_subplot(gs[0, 0])
    ax2 = fig.add_subplot(gs[:, 1])
    steps = summary["steps"]
    for n in names:
        ls = "-" if n == "cce" else "--"
        ax1.plot(steps, summary[n]["loss"], ls, color=colors[n], label=n, lw=1.5)
    ax1.set_ylabel("training loss (nats)")
    ax1.set_title(
        f"tp={summary['tp']} dp={summary['dp']}, vocab {summary['vocab']}, "
        f"{summary['config']['dtype']}, {summary['tokens_per_step']} tokens/step"
    )
    ax1.legend(loc="upper right")
    if len(names) == 2:
        ax1.tick_params(labelbottom=False)
        ax3 = fig.add_subplot(gs[1, 0], sharex=ax1)
        floor = 1e-8
        d = [max(abs(x - y), floor) for x, y in zip(summary["cce"]["loss"], summary["materialized"]["loss"])]
        ax3.semilogy(steps, d, color="gray", lw=0.8)
        ax3.axhline(
            summary["agreement"]["tol_curve"],
            color="red",
            ls=":",
            lw=1,
            label=f"tolerance {summary['agreement']['tol_curve']:g}",
        )
        ax3.set_ylim(floor / 2, max(summary["agreement"]["tol_curve"], max(d)) * 5)
        ax3.set_ylabel("|Δloss|")
        ax3.set_xlabel(f"step (|Δloss| = 0 drawn at {floor:g})")
        ax3.legend(loc="lower right", fontsize=8)
    else:
        ax1.set_xlabel("step")
    world = len(summary[names[0]]["peak_loss_mem_mib_per_rank"])
    width = 0.8 / len(names)
    top = summary["materialized_logits_mib_per_rank"]
    for i, n in enumerate(names):
        xs = [r + (i - (len(names) - 1) / 2) * width for r in range(world)]
        ys = summary[n]["peak_loss_mem_mib_per_rank"]
        top = max(top, *ys)
        bars = ax2.bar(xs, ys, width, color=colors[n], label=n)
        ax2.bar_label(bars, fmt="%.1f", fontsize=8)
    ax2.axhline(
        summary["materialized_logits_mib_per_rank"], color="k", ls=":", lw=1, label="fp32 logits block (analytic)"
    )
    ax2.set_ylim(0, top * 1.35)
    ax2.set_xticks(range(world))
    ax2.set_xlabel("rank")
    ax2.set_ylabel("MiB")
    ax2.set_title("peak memory of loss forward+backward")
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
