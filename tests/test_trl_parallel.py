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
