"""One rank of tests/test_clean_exit.py's scenario, run as its own interpreter (so its exit is a real one):

    python tests/exit_scenario.py RANK WORLD INIT_FILE CASE

Joins a gloo group through a file:// rendezvous, scores a vocab-parallel head (forward and backward) the way a
user's script does, checks the loss and the gradients against the full head computed locally, destroys the process
group and returns from the script normally: no ``os._exit``. Prints ``ok`` when every result was right; the exit
status is the interpreter's own (SIGABRT at teardown shows as -6 to the parent).

CASE: ``cross_entropy`` (VocabShard, the statistics' collective picked by "auto": all-gather at this size),
``allreduce`` (the same with the two all-reduces), ``logprobs`` (linear_logprobs), ``dtensor`` (a Shard(0) DTensor
weight), ``nocheck`` (VocabShard(check=False): no handshake).
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main(rank: int, world: int, init_file: str, case: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    import cce_dist

    n, d, v = 24, 16, 8 * world
    g = torch.Generator().manual_seed(0)  # the same tensors on every rank
    hidden, weight = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    start, stop = rank * v // world, (rank + 1) * v // world

    h = hidden.clone().requires_grad_()
    if case == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        w = distribute_tensor(weight.clone(), mesh, [Shard(0)]).detach().requires_grad_()
        loss = cce_dist.linear_cross_entropy(h, w, targets)
        loss.backward()
        w_grad = w.grad.to_local()
    else:
        shard = cce_dist.VocabShard(
            dist.group.WORLD,
            start,
            stop,
            check=case != "nocheck",
            stats_collective="allreduce" if case == "allreduce" else "auto",
        )
        w = weight[start:stop].clone().requires_grad_()
        if case == "logprobs":
            loss = cce_dist.linear_logprobs(h, w, targets, shard=shard).sum()
        else:
            loss = cce_dist.linear_cross_entropy(h, w, targets, shard=shard)
        loss.backward()
        w_grad = w.grad

    # the reference: the full head, materialized, on this rank alone
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logits = h_ref @ w_ref.T
    ref = -logits.log_softmax(-1).gather(1, targets[:, None]).sum() if case == "logprobs" else None
    ref = F.cross_entropy(logits, targets) if ref is None else -ref
    ref.backward()
    right = (
        torch.allclose(loss.detach(), ref.detach(), rtol=1e-5, atol=1e-5)
        and torch.allclose(h.grad, h_ref.grad, rtol=1e-4, atol=1e-5)
        and torch.allclose(w_grad, w_ref.grad[start:stop], rtol=1e-4, atol=1e-5)
    )
    dist.destroy_process_group()
    print("ok" if right else f"wrong: loss {loss.item()} vs {ref.item()}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
