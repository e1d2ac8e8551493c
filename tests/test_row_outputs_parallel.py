"""row_outputs= on a vocab-parallel group (gloo ranks) equals one process.

The problem of tests/test_row_outputs.py (helpers.integer_problem: integer logits, ids 3 and 17 tied) split over 2
or 3 ranks, in layouts where the tie crosses ranks and where the rank holding the lower id is not rank 0, with an
empty shard; both statistics collectives (the all-gather, and the all-reduces where the argmax travels with the max
in one int64 MAX all-reduce), with and without sequence parallelism, for cross-entropy and logprobs. The predicted
token and is_top1 must be identical to one process; log sum p^2 and the mean logit equal to float32 rounding; the
losses and hidden gradients unchanged. The number of collectives must be the same as without row_outputs.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from helpers import integer_problem

from cce_dist import ROW_OUTPUTS as ALL
from cce_dist import VocabShard, linear_cross_entropy, linear_logprobs
from cce_dist.testing import CollectiveLog

LAYOUTS = {
    2: [[(0, 10), (10, 29)], [(10, 29), (0, 10)]],
    3: [[(0, 4), (4, 4), (4, 29)], [(18, 29), (0, 5), (5, 18)]],
}


def _calls(kind, h, w, t, **kw):
    if kind == "ce":
        return linear_cross_entropy(h, w, t, reduction="none", softcap=5.0, **kw)
    return linear_logprobs(h, w, t, temperature=0.8, return_entropy=True, **kw)


def _body(rank, world, group, layouts):
    failures = []
    h_full, w, t = integer_problem(n=24)
    for layout in layouts:
        start, stop = layout[rank]
        for kind in ("ce", "logprobs"):
            for collective in ("allreduce", "allgather"):
                for sp in (False, True):
                    name = f"layout={layout} {kind} {collective} sp={sp}"
                    sl = slice(rank * 24 // world, (rank + 1) * 24 // world) if sp else slice(None)
                    h = h_full[sl].clone().requires_grad_()
                    shard = VocabShard(group, start, stop, sequence_parallel=sp, stats_collective=collective)
                    with CollectiveLog() as log_rows:
                        out, got = _calls(kind, h, w[start:stop], t, shard=shard, row_outputs=ALL)
                    h2 = h_full[sl].clone().requires_grad_()
                    with CollectiveLog() as log_plain:
                        plain = _calls(kind, h2, w[start:stop], t, shard=shard)
                    ref_out, want = _calls(kind, h_full.clone(), w, t, row_outputs=ALL)
                    first = out[0] if isinstance(out, tuple) else out
                    first_plain = plain[0] if isinstance(plain, tuple) else plain
                    (gh,) = torch.autograd.grad(first.sum(), [h])
                    (gh2,) = torch.autograd.grad(first_plain.sum(), [h2])
                    checks = [
                        ("predicted", torch.equal(got.predicted, want.predicted)),
                        ("is_top1", torch.equal(got.is_top1, want.is_top1)),
                        ("log_sum_sq_probs", torch.allclose(got.log_sum_sq_probs, want.log_sum_sq_probs, 1e-5, 1e-5)),
                        ("mean_logit", torch.allclose(got.mean_logit, want.mean_logit, 1e-5, 1e-5)),
                        ("the output", torch.equal(first, first_plain)),
                        ("dH", torch.equal(gh, gh2)),
                        ("collectives", len(log_rows.calls) == len(log_plain.calls)),
                    ]
                    failures += [f"rank {rank} {name}: {what}" for what, ok in checks if not ok]
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_row_outputs_on_a_group_equal_one_process(tmp_path, world):
    results = run_ranks(_body, world, tmp_path, kw=dict(layouts=LAYOUTS[world]), timeout=300)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures[:20])
