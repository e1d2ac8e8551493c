"""The tensor-parallel handshake and its check=False fallback, on 2 gloo ranks.

- Ranks whose targets differ by edits that cancel in a position-weighted linear sum (+2 at position 0, -1 at
  position 1) must raise ``InputError`` on every rank, not return wrong losses.
- Ranks whose ``impl`` resolves to different implementations (torch on one, triton on the other) issue different
  collective schedules (the torch one forms the scalar loss's gradients in forward, one statistics collective per
  token chunk): every rank must raise ``InputError`` naming it before any statistics collective, instead of hanging
  or mixing buffers.
- ``VocabShard(check=False)`` still rejects ids >= the global V (on that rank), as the README promises.
- An invalid option value on one rank (each loss) raises there and an ``InputError`` on the others, none waiting.

After each error the group must still be in step: the next correct call gives the oracle's loss (tests/oracle.py).
"""

from __future__ import annotations

import torch
from dist_utils import run_ranks
from helpers import problem
from oracle import oracle_cross_entropy

from cce_dist import InputError, VocabShard, linear_cross_entropy
from cce_dist.tp.collectives import targets_checksum

N, D, V = 12, 8, 16


def _problem():
    """Hidden states that require grad, a head without bias, targets in [2, V - 2) (the test moves two by +2 and -1)."""
    h, w, _, t = problem(N, D, V, bias=False, w_scale=D**-0.5, target_range=(2, V - 2), seed=21)
    return h.requires_grad_(), w, t


def _healthy(shard, h, w, t, sl):
    """A correct call after an error: the group is in step and the loss is the oracle's."""
    loss = linear_cross_entropy(h, w[sl], t, shard=shard, impl="torch")
    ref = oracle_cross_entropy(h, w, t)
    if not torch.allclose(loss, ref, rtol=1e-5, atol=1e-6):
        return f"healthy call after the error: loss {float(loss)} vs oracle {float(ref)}"
    return None


def _expect(fn, exc, pattern):
    import re

    try:
        out = fn()
    except exc as e:
        if not re.search(pattern, str(e)):
            return f"unclear {type(e).__name__}: {e}"
        return None
    except Exception as e:  # noqa: BLE001
        return f"wrong error {type(e).__name__}: {e}"
    return f"no error (returned {out!r})"


def _body(rank, world, group):
    h, w, t = _problem()
    shard = VocabShard.even(V, group)
    sl = slice(shard.start, shard.stop)
    report = {}

    # 1. targets that differ by cancelling edits on rank 1
    tt = t.clone()
    if rank == 1:
        tt[0] += 2
        tt[1] -= 1
    report["cancelling_edits"] = _expect(
        lambda: linear_cross_entropy(h, w[sl], tt, shard=shard, impl="torch"), InputError, r"disagree on the target ids"
    )
    report["after_cancelling_edits"] = _healthy(shard, h, w, t, sl)

    # 2. impl resolving to torch on rank 0 and to triton on rank 1 (several token chunks on the torch side)
    impl = "torch" if rank == 0 else "triton"
    report["different_implementations"] = _expect(
        lambda: linear_cross_entropy(h, w[sl], t, shard=shard, impl=impl, chunk_size=3 * (V // world)),
        InputError,
        r"disagree on the loss options.*implementation",
    )
    report["after_different_implementations"] = _healthy(shard, h, w, t, sl)

    # 3. check=False: an id >= the global V (but a valid row index of neither shard) is still rejected on each rank
    unchecked = VocabShard.even(V, group, check=False)
    bad = t.clone()
    bad[5] = V + 3
    report["check_false_id_too_large"] = _expect(
        lambda: linear_cross_entropy(h, w[sl], bad, shard=unchecked, impl="torch"),
        ValueError,
        rf"targets contain id {V + 3}, outside the vocabulary \[0, {V}\)",
    )
    report["after_check_false"] = _healthy(shard, h, w, t, sl)

    # ids in another rank's shard are fine without the handshake too
    loss = linear_cross_entropy(h, w[sl], t, shard=unchecked, impl="torch")
    ref = oracle_cross_entropy(h, w, t)
    report["check_false_valid"] = (
        None if torch.allclose(loss, ref, rtol=1e-5, atol=1e-6) else f"loss {float(loss)} vs oracle {float(ref)}"
    )

    # 4. an invalid option value on rank 1 only (options are checked as they are built, before the driver): rank 1
    # raises its own ValueError, rank 0 an InputError naming rank 1, neither waits; each loss, then a healthy call
    from cce_dist import linear_distillation, linear_logprobs

    bad_calls = {
        "label_smoothing": lambda x: linear_cross_entropy(h, w[sl], t, shard=shard, label_smoothing=x),
        "temperature": lambda x: linear_logprobs(h, w[sl], t, shard=shard, temperature=x),
        "beta": lambda x: linear_distillation(h, w[sl], h.detach(), w[sl], t, shard=shard, divergence="jsd", beta=x),
    }
    for name, call in bad_calls.items():
        good = 0.5 if name == "beta" else 0.1
        if rank == 1:
            value = 0.0 if name == "temperature" else 1.5
            report[f"bad_{name}"] = _expect(lambda call=call, value=value: call(value), ValueError, name)
        else:
            rejected = r"rank\(s\) \[1\] .*rejected"
            report[f"bad_{name}"] = _expect(lambda call=call, good=good: call(good), InputError, rejected)
        report[f"after_bad_{name}"] = _healthy(shard, h, w, t, sl)
    return report


def test_handshake_catches_disagreements_and_check_false_bounds(tmp_path):
    res = run_ranks(_body, 2, tmp_path, timeout=240, pg_timeout=30)
    fails = [f"rank {r} {k}: {v}" for r, rep in res.items() for k, v in rep.items() if v]
    assert not fails, "\n".join(fails)


def test_targets_checksum_is_not_fooled_by_cancelling_edits():
    """Single process: the checksum differs after edits that cancel in a linear position-weighted sum, and after
    swapping two ids; it is equal for equal ids in any integer dtype."""
    t = torch.arange(40) % 17
    base = targets_checksum(t)
    edits = []
    for i in range(5):
        for j in range(5):
            if i != j:
                e = t.clone()
                e[i] += j + 1
                e[j] -= i + 1  # (j+1)*(i+1) - (i+1)*(j+1) = 0 with weights i+1, j+1
                edits.append(e)
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    edits.append(swapped)
    for e in edits:
        assert targets_checksum(e) != base
    assert targets_checksum(t.to(torch.int16)) == base
    assert targets_checksum(t.reshape(5, 8)) == base
