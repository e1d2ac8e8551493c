"""DTensor heads (vocab-sharded Shard(0) over a 1-D mesh) against the fp32 oracle (tests/oracle.py), gloo world 2.

Each part (SECTIONS) is its own pytest item, run on the persistent 2-rank pool (``rank_pool``).
"""

import pytest
import torch
from helpers import leaf, problem
from oracle import oracle_cross_entropy, oracle_distill, oracle_logprobs

dt = pytest.importorskip("torch.distributed.tensor")
from torch.distributed.tensor import (  # noqa: E402
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module  # noqa: E402

import cce_dist  # noqa: E402


def _close(a, b, what, rtol=2e-5, atol=2e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _problem(vocab, d, n):
    """Identical full tensors on every rank: head W [V, D], bias [V], hidden [N, D], targets [N]."""
    H, W, B, T = problem(n, d, vocab, ignore=(1,), seed=0)
    T[0] = vocab - 1  # a target in the last (smaller, for uneven V) shard
    return W, B, H, T


def _setup(world, vocab, d, n):
    return (init_device_mesh("cpu", (world,)), *_problem(vocab, d, n))


def _sharded_weight_and_bias(rank, world, group, vocab, d, n):
    """Shard(0) weight and bias, plain hidden: loss and every gradient vs the oracle."""
    mesh, W, B, H, T = _setup(world, vocab, d, n)
    w_ref, b_ref, h_ref = leaf(W), leaf(B), leaf(H)
    ref = oracle_cross_entropy(h_ref, w_ref, T, b_ref, label_smoothing=0.1, softcap=2.5)
    ref.backward()
    wd = distribute_tensor(W, mesh, [Shard(0)]).requires_grad_(True)
    bd = distribute_tensor(B, mesh, [Shard(0)]).requires_grad_(True)
    h = leaf(H)
    local_rows = wd.to_local().shape[0]
    assert local_rows == torch.chunk(torch.arange(vocab), world)[rank].numel()
    loss = cce_dist.linear_cross_entropy(h, wd, T, bias=bd, label_smoothing=0.1, softcap=2.5, impl="torch")
    loss.backward()
    assert not isinstance(loss, DTensor)
    _close(loss, ref, "loss")
    assert isinstance(wd.grad, DTensor) and wd.grad.placements == (Shard(0),)
    _close(wd.grad.full_tensor(), w_ref.grad, "dW")
    _close(bd.grad.full_tensor(), b_ref.grad, "db")
    _close(h.grad, h_ref.grad, "dH")
    return local_rows


def _logprobs_replicate_and_token_sharded_hidden(rank, world, group, vocab, d, n):
    """logprobs + entropy, hidden a Replicate DTensor and, separately, token-sharded Shard(0)."""
    mesh, W, B, H, T = _setup(world, vocab, d, n)
    w_ref, h_ref = leaf(W), leaf(H)
    lp_ref, ent_ref = oracle_logprobs(h_ref, w_ref, T, temperature=0.8, return_entropy=True)
    gl, ge = torch.linspace(-1, 1, n), torch.linspace(0.5, -0.5, n)
    ((lp_ref * gl).sum() + (ent_ref * ge).sum()).backward()
    for placement in (Replicate(), Shard(0)):
        wd = distribute_tensor(W, mesh, [Shard(0)]).requires_grad_(True)
        hd = distribute_tensor(H, mesh, [placement]).requires_grad_(True)
        lp, ent = cce_dist.linear_logprobs(hd, wd, T, temperature=0.8, return_entropy=True, impl="torch")
        assert lp.shape == (n,) and not isinstance(lp, DTensor)
        _close(lp, lp_ref, f"logprob ({placement})")
        _close(ent, ent_ref, f"entropy ({placement})")
        ((lp * gl).sum() + (ent * ge).sum()).backward()
        _close(wd.grad.full_tensor(), w_ref.grad, f"dW logprob ({placement})", atol=1e-5)
        assert hd.grad.placements == (placement,)
        _close(hd.grad.full_tensor(), h_ref.grad, f"dH logprob ({placement})", atol=1e-5)
    return None


def _replicate_weight(rank, world, group, vocab, d, n):
    """Replicate weight: no shard, the single-device path on every rank."""
    mesh, W, B, H, T = _setup(world, vocab, d, n)
    wr = distribute_tensor(W, mesh, [Replicate()]).requires_grad_(True)
    loss = cce_dist.linear_cross_entropy(H, wr, T, reduction="sum", impl="torch")
    _close(loss, oracle_cross_entropy(H, W, T, reduction="sum"), "loss (Replicate weight)")
    return None


def _clear_errors(rank, world, group, vocab, d, n):
    """Clear errors naming the argument (raised on every rank, before any collective)."""
    mesh, W, B, H, T = _setup(world, vocab, d, n)
    w1 = distribute_tensor(W, mesh, [Shard(1)])
    with pytest.raises(ValueError, match="weight is a DTensor with placements"):
        cce_dist.linear_cross_entropy(H, w1, T)
    hp = DTensor.from_local(H, mesh, [Partial()])
    with pytest.raises(ValueError, match="hidden is a Partial DTensor"):
        cce_dist.linear_cross_entropy(hp, distribute_tensor(W, mesh, [Shard(0)]), T)
    ws = distribute_tensor(W, mesh, [Shard(0)])
    wrong = cce_dist.VocabShard(group, 0, vocab) if rank == 0 else cce_dist.VocabShard(group, 0, 0)
    with pytest.raises(ValueError, match="disagrees with the DTensor"):
        cce_dist.linear_cross_entropy(H, ws, T, shard=wrong)
    return None


def _colwise_parallel_output_layer(rank, world, group, vocab, d, n):
    """torchtitan style: ColwiseParallel output layer, the loss called on its weight."""
    mesh, W, B, H, T = _setup(world, vocab, d, n)
    torch.manual_seed(1)
    model = torch.nn.ModuleDict({"norm": torch.nn.LayerNorm(d), "output": torch.nn.Linear(d, vocab, bias=False)})
    with torch.no_grad():
        model["output"].weight.copy_(W)
    h_in = leaf(H)
    ref = oracle_cross_entropy(model["norm"](h_in), model["output"].weight, T)
    ref.backward()
    ref_dw = model["output"].weight.grad.clone()
    ref_dn = model["norm"].weight.grad.clone()
    model.zero_grad(set_to_none=True)
    parallelize_module(model, mesh, {"output": ColwiseParallel(use_local_output=False)})
    w_out = model["output"].weight
    assert isinstance(w_out, DTensor) and w_out.placements == (Shard(0),)
    loss = cce_dist.linear_cross_entropy(model["norm"](H), w_out, T, impl="torch")
    loss.backward()
    _close(loss, ref.detach(), "loss (ColwiseParallel)")
    _close(w_out.grad.full_tensor(), ref_dw, "dW (ColwiseParallel)")
    _close(model["norm"].weight.grad, ref_dn, "d norm (ColwiseParallel): dH reduced exactly once")
    return None


def _sharded_head_with_class_weights(rank, world, group, vocab, d, n):
    """Shard(0) weight and bias with a plain [V] class_weight (the whole vector on every rank): loss and every
    gradient vs the oracle's F.cross_entropy(weight=), with label smoothing and a softcap; a DTensor class_weight
    is refused with the remedy."""
    mesh, W, B, H, T = _setup(world, vocab, d, n)
    cw = torch.linspace(0.25, 2.0, vocab)
    w_ref, b_ref, h_ref = leaf(W), leaf(B), leaf(H)
    ref = oracle_cross_entropy(h_ref, w_ref, T, b_ref, label_smoothing=0.1, softcap=2.5, class_weight=cw)
    ref.backward()
    wd = distribute_tensor(W, mesh, [Shard(0)]).requires_grad_(True)
    bd = distribute_tensor(B, mesh, [Shard(0)]).requires_grad_(True)
    h = leaf(H)
    kw = dict(bias=bd, label_smoothing=0.1, softcap=2.5, impl="torch")
    loss = cce_dist.linear_cross_entropy(h, wd, T, class_weight=cw, **kw)
    loss.backward()
    _close(loss, ref, "loss")
    _close(wd.grad.full_tensor(), w_ref.grad, "dW")
    _close(bd.grad.full_tensor(), b_ref.grad, "db")
    _close(h.grad, h_ref.grad, "dH")
    with pytest.raises(TypeError, match=r"class_weight .* got a DTensor: pass class_weight.full_tensor\(\)"):
        cce_dist.linear_cross_entropy(h, wd, T, class_weight=distribute_tensor(cw, mesh, [Shard(0)]), **kw)


def _distillation_heads(rank, world, group, vocab, d, n):
    """linear_distillation with Shard(0) student and teacher heads (and biases), the hidden states plain and as a
    Replicate DTensor, each divergence: loss and every student gradient vs the two-head oracle; Replicate heads
    too."""
    mesh, W, B, H, T = _setup(world, vocab, d, n)
    g = torch.Generator().manual_seed(3)
    d_t = d + 3  # the teacher's own hidden size
    Wt, Bt, Ht = torch.randn(vocab, d_t, generator=g), torch.randn(vocab, generator=g), torch.randn(n, d_t, generator=g)
    for divergence, hidden_dtensor in (("kl", False), ("reverse_kl", True), ("jsd", False)):
        kw = dict(divergence=divergence, temperature=1.5, hard_label_weight=0.25, softcap=(3.0, 4.0))
        w_ref, b_ref, h_ref = leaf(W), leaf(B), leaf(H)
        ref = oracle_distill(h_ref, w_ref, Ht, Wt, T, student_bias=b_ref, teacher_bias=Bt, **kw)
        ref.backward()
        wd = distribute_tensor(W, mesh, [Shard(0)]).requires_grad_(True)
        bd = distribute_tensor(B, mesh, [Shard(0)]).requires_grad_(True)
        wt, bt = distribute_tensor(Wt, mesh, [Shard(0)]), distribute_tensor(Bt, mesh, [Shard(0)])
        h = distribute_tensor(H, mesh, [Replicate()]).requires_grad_(True) if hidden_dtensor else leaf(H)
        ht = distribute_tensor(Ht, mesh, [Replicate()]) if hidden_dtensor else Ht
        loss = cce_dist.linear_distillation(h, wd, ht, wt, T, student_bias=bd, teacher_bias=bt, impl="torch", **kw)
        loss.backward()
        what = f"{divergence}, hidden {'Replicate' if hidden_dtensor else 'plain'}"
        assert not isinstance(loss, DTensor)
        _close(loss, ref.float(), f"loss ({what})")
        assert isinstance(wd.grad, DTensor) and wd.grad.placements == (Shard(0),)
        _close(wd.grad.full_tensor(), w_ref.grad, f"dW ({what})")
        _close(bd.grad.full_tensor(), b_ref.grad, f"db ({what})")
        got_dh = h.grad.full_tensor() if hidden_dtensor else h.grad
        _close(got_dh, h_ref.grad, f"dH ({what})")
    wr = distribute_tensor(W, mesh, [Replicate()]).requires_grad_(True)
    loss = cce_dist.linear_distillation(H, wr, Ht, distribute_tensor(Wt, mesh, [Replicate()]), T, impl="torch")
    w_ref = leaf(W)
    ref = oracle_distill(H, w_ref, Ht, Wt, T)
    ref.backward()
    loss.backward()
    _close(loss, ref.float(), "loss (Replicate heads)")
    _close(wr.grad.full_tensor(), w_ref.grad, "dW (Replicate heads)")
    # data-parallel (FSDP2's placement): each rank its own tokens, here the same on both, so each rank's loss is the
    # oracle's and the weight gradient (the sum over ranks divided by the group size) too
    from cce_dist.tp.dtensor import data_parallel_shard

    wd = distribute_tensor(W, mesh, [Shard(0)]).requires_grad_(True)
    h = leaf(H)
    dp = data_parallel_shard(wd)
    loss = cce_dist.linear_distillation(h, wd, Ht, distribute_tensor(Wt, mesh, [Shard(0)]), T, shard=dp, impl="torch")
    loss.backward()
    _close(loss, ref.float(), "loss (data-parallel heads)")
    _close(wd.grad.full_tensor(), w_ref.grad, "dW (data-parallel heads)")
    h_ref = leaf(H)
    oracle_distill(h_ref, W, Ht, Wt, T).backward()
    _close(h.grad, h_ref.grad, "dH (data-parallel heads)")
    return None


def _distillation_errors(rank, world, group, vocab, d, n):
    """linear_distillation's DTensor errors name the argument (every rank, before any collective)."""
    mesh, W, B, H, T = _setup(world, vocab, d, n)
    ws = distribute_tensor(W, mesh, [Shard(0)])
    with pytest.raises(ValueError, match="student_weight is a DTensor but teacher_weight is not"):
        cce_dist.linear_distillation(H, ws, H, W, T)
    with pytest.raises(ValueError, match="teacher_weight is a DTensor but student_weight is not"):
        cce_dist.linear_distillation(H, W, H, ws, T)
    with pytest.raises(ValueError, match="teacher_weight is a DTensor placed"):
        cce_dist.linear_distillation(H, ws, H, distribute_tensor(W, mesh, [Replicate()]), T)
    w1 = distribute_tensor(W, mesh, [Shard(1)])
    with pytest.raises(ValueError, match="student_weight is a DTensor with placements"):
        cce_dist.linear_distillation(H, w1, H, w1, T)
    hp = DTensor.from_local(H, mesh, [Partial()])
    with pytest.raises(ValueError, match="teacher_hidden is a Partial DTensor"):
        cce_dist.linear_distillation(H, ws, hp, ws, T)
    with pytest.raises(ValueError, match="student_bias is a DTensor with placements"):
        cce_dist.linear_distillation(H, ws, H, ws, T, student_bias=distribute_tensor(B, mesh, [Replicate()]))
    return None


SECTIONS = [
    _sharded_weight_and_bias,
    _sharded_head_with_class_weights,
    _logprobs_replicate_and_token_sharded_hidden,
    _replicate_weight,
    _clear_errors,
    _colwise_parallel_output_layer,
    _distillation_heads,
    _distillation_errors,
]


@pytest.mark.parametrize("section", SECTIONS, ids=lambda f: f.__name__.lstrip("_"))
@pytest.mark.parametrize("vocab", [11])  # uneven: torch.chunk gives rows [0, 6) and [6, 11)
def test_dtensor_head_world2(rank_pool, vocab, section):
    res = rank_pool(2).run(section, vocab=vocab, d=8, n=7, timeout=400)
    if section is _sharded_weight_and_bias:
        assert res == {0: 6, 1: 5}


def test_from_dtensor_passes_plain_tensors_through():
    from cce_dist.core.options import CrossEntropyOptions
    from cce_dist.tp.dtensor import from_dtensor

    h, w, t = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    opts = CrossEntropyOptions()
    out = from_dtensor(h, w, t, None, opts)
    assert out[0] is h and out[1] is w and out[2] is t and out[3] is None and out[4] is opts
