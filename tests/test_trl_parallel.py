"""cce_dist.trl with a vocab-sharded head: TRL's fused head on 2 gloo ranks equals one process, without a gather.

Every rank builds the same tiny Llama (tests/test_trl.py) and replaces its ``lm_head.weight`` by a ``Shard(0)``
DTensor on a 1-D tensor-parallel mesh; with ``cce_dist.trl.patch(tensor_parallel=True)`` the fused forward must
return TRL's fields and loss of one process (its own head, unsharded) and the same gradients (the head's as this
rank's rows of the full gradient), and no collective may move the head (no ``full_tensor`` gather: nothing of
``V * D`` elements or more).
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

pytest.importorskip("trl", minversion="1.16")

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _body(rank, world, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from trl.trainer.utils import add_fused_lm_head
    from trl_models import V, tiny_model

    import cce_dist.trl as ct
    from cce_dist.testing import CollectiveLog

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 95, (2, 9), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100
    ref = tiny_model(final_logit_softcapping=6.0)
    add_fused_lm_head(ref, temperature=0.8, outputs=OUTPUTS)
    want = ref(input_ids=ids, labels=labels, fused_lm_head=True)
    want.loss.backward()

    model = tiny_model(final_logit_softcapping=6.0)
    mesh = DeviceMesh("cpu", list(range(world)))
    head = model.lm_head
    head.weight = torch.nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))
    add_fused_lm_head(model, temperature=0.8, outputs=OUTPUTS)
    ct.patch(tensor_parallel=True)
    try:
        with CollectiveLog() as log:
            got = model(input_ids=ids, labels=labels, fused_lm_head=True)
            got.loss.backward()
    finally:
        ct.unpatch()
    failures = []
    for name in OUTPUTS:
        a, b = getattr(got, name), getattr(want, name)
        ok = torch.equal(a, b) if a.dtype == torch.bool else torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        if not ok:
            failures.append(f"rank {rank}: {name}")
    if not torch.allclose(got.loss, want.loss, rtol=1e-6, atol=1e-6):
        failures.append(f"rank {rank}: loss")
    rows = head.weight.to_local().shape[0]  # torch.chunk-style rows of Shard(0): 49 + 48 of 97
    start = 0 if rank == 0 else V - rows
    dw = head.weight.grad.to_local()
    if not torch.allclose(dw, ref.lm_head.weight.grad[start : start + rows], rtol=1e-4, atol=1e-6):
        failures.append(f"rank {rank}: the head's gradient rows")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if name != "lm_head.weight" and not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6):
            failures.append(f"rank {rank}: {name}.grad")
    big = [c for c in log.calls if max(c.in_bytes, c.out_bytes) >= V * 32 * 4]  # the head: V x 32 float32
    if big:
        failures.append(f"rank {rank}: {big[0].name} moved {big[0].out_bytes} bytes (a gather of the head?)")
    return failures


def test_vocab_sharded_head_on_two_ranks_equals_one_process(tmp_path):
    results = run_ranks(_body, 2, tmp_path, timeout=300)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------------------
# the trainers, their head vocab-sharded on 2 ranks
# ----------------------------------------------------------------------------------------------


def _trainer_body(rank, world, group, kinds, out_dir):
    """Each rank trains the same model on the same batches (a tensor-parallel group: no data parallelism, the
    Trainer is not told of the group) with its ``lm_head`` column-parallel (``parallelize_module``: the weight a
    ``Shard(0)`` DTensor parameter), which TRL's fused head hands to cce_dist, scored vocab-parallel. The logs must
    be one process's with TRL's own head, the parameters too (the head as this rank's rows)."""
    import math

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from trl_models import train

    mesh = DeviceMesh("cpu", list(range(world)))

    def shard_head(trainer):
        # as a tensor-parallel plan shards an output layer: the weight a Shard(0) DTensor, and the layer's own forward
        # (generation's logits) gathered
        parallelize_module(trainer.model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})

    failures = []
    for kind in kinds:
        want_logs, want_params = train(kind, f"{out_dir}/{kind}-trl-{rank}", None)
        got_logs, got_params = train(
            kind, f"{out_dir}/{kind}-cce-{rank}", "before", prepare=shard_head, tensor_parallel=True
        )
        if len(got_logs) != len(want_logs):
            failures.append(f"rank {rank} {kind}: {len(got_logs)} log entries, want {len(want_logs)}")
        for got, want in zip(got_logs, want_logs):
            for key in want:
                if key.endswith("accuracies") and abs(want.get(key.replace("accuracies", "margins"), 1.0)) < 1e-5:
                    # at the first step the policy is the reference: every reward is 0 up to rounding, and the
                    # sharded policy's rounding (not the unsharded reference's) decides "chosen > rejected"
                    continue
                if key not in got or not math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-5):
                    failures.append(f"rank {rank} {kind}: {key} {got.get(key)} != {want[key]}")
        for name, q in want_params.items():
            p = got_params[name]
            if name == "lm_head.weight":
                rows = p.to_local().shape[0]
                start = 0 if rank == 0 else q.shape[0] - rows
                p, q = p.to_local(), q[start : start + rows]
            if not torch.allclose(p, q, rtol=1e-5, atol=1e-5):
                failures.append(f"rank {rank} {kind}: parameter {name}")
    return failures


@pytest.mark.parametrize("kinds", [("sft", "dpo"), ("kto", "grpo")])
def test_trainers_with_a_vocab_sharded_head_equal_one_process(tmp_path, kinds):
    results = run_ranks(_trainer_body, 2, tmp_path, kw=dict(kinds=kinds, out_dir=str(tmp_path)), timeout=600)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures[:20])
