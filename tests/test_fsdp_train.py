"""Real FSDP2 (``fully_shard``) training of a tiny LM with the head kept vocab-sharded by ``cce_dist.fsdp``, against
the plain FSDP2 run (the head managed by FSDP, the materialized loss), on 2 and 4 gloo ranks.

Per step every rank draws its own batch (different token counts; one rank with none at some step; ignored targets),
the loss is each rank's own (class weights, label smoothing), SGD with momentum steps. Compared: every rank's loss at
every step and every parameter at the end (float32). The collectives of the cce run are recorded: none moves as many
bytes as the head (``V x D`` float32), while the plain run's do (so the check can fail).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cce_dist
import cce_dist.fsdp
from cce_dist.testing import CollectiveLog

pytest.importorskip("torch.distributed.fsdp")
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, init_device_mesh  # noqa: E402

V, E, D = 91, 16, 32  # uneven Shard(0) rows: 46 / 45 on 2 ranks, 23 / 23 / 23 / 22 on 4
STEPS = 3
#: tokens per rank per step (rank 1 has none at step 0 and 2)
COUNTS = {2: ((9, 0), (6, 11), (13, 0)), 4: ((5, 0, 9, 3), (7, 4, 2, 6), (0, 8, 1, 4))}


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + F.gelu(self.fc(self.norm(x)))


class TinyLM(nn.Module):
    """embedding [V, E] (E < D: its FSDP all-gather is smaller than the head's) -> proj -> blocks -> norm -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, E)
        self.proj = nn.Linear(E, D)
        self.blocks = nn.ModuleList([Block(D) for _ in range(2)])
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V)

    def forward(self, ids, targets, loss_fn):
        h = self.proj(self.embed(ids))
        for b in self.blocks:
            h = b(h)
        return loss_fn(self, self.norm(h), targets)


CW = torch.linspace(0.5, 1.5, V)
SMOOTH = 0.1


def materialized_loss(model, h, t):
    """Each rank's own weighted, smoothed mean, as F.cross_entropy (0 instead of NaN without counted tokens)."""
    logits = model.lm_head(h)
    rows = F.cross_entropy(logits, t, weight=CW, reduction="none", label_smoothing=SMOOTH)
    valid = t != -100
    den = torch.where(valid, CW[torch.where(valid, t, 0)], 0.0).sum()
    return rows.sum() / den if bool(den > 0) else rows.sum() * 0.0


def cce_loss(model, h, t):
    return cce_dist.fsdp.head_cross_entropy(model.lm_head, h, t, class_weight=CW, label_smoothing=SMOOTH, impl="torch")


def _batch(world, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = COUNTS[world][step][rank]
    ids = torch.randint(0, V, (n,), generator=g)
    t = torch.randint(0, V, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.25] = -100
    return ids, t


def _train(rank, world, group, mode):
    """``mode``: "plain" (FSDP manages the head, materialized loss), "cce" (shard_lm_head + the vocab-sharded loss),
    "gathered" (shard_lm_head, the materialized loss through the head module: its all-gather fallback)."""
    torch.manual_seed(0)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,))
    ignored = cce_dist.fsdp.shard_lm_head(model, mesh) if mode != "plain" else None
    fully_shard(model.embed, mesh=mesh)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loss_fn = cce_loss if mode == "cce" else materialized_loss
    losses, big = [], []
    log = CollectiveLog().install()
    try:
        for step in range(STEPS):
            ids, t = _batch(world, step, rank)
            with log.counting():
                loss = model(ids, t, loss_fn)
                loss.backward()
            big += [
                (c.name, c.shape, c.in_bytes, c.out_bytes)
                for c in log.calls
                if max(c.in_bytes, c.out_bytes) >= V * D * 4
            ]
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    finally:
        log.uninstall()
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
    }
    head_is_dtensor = isinstance(model.lm_head.weight, DTensor)
    return {"losses": losses, "params": params, "big": big, "head_dtensor": head_is_dtensor}


@pytest.mark.parametrize("world", [2, 4])
def test_steps_equal_the_materialized_fsdp_run(rank_pool, world):
    pool = rank_pool(world)
    runs = {mode: pool.run(_train, mode=mode, timeout=400) for mode in ("plain", "cce", "gathered")}
    plain = runs["plain"]
    for mode in ("cce", "gathered"):
        for rank in range(world):
            got, want = runs[mode][rank], plain[rank]
            torch.testing.assert_close(
                torch.tensor(got["losses"]),
                torch.tensor(want["losses"]),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, mode=mode, rank=rank: f"{mode} rank {rank} losses: {m}",
            )
            assert got["params"].keys() == want["params"].keys()
            for name, p in got["params"].items():
                where = f"{mode} rank {rank} {name}"
                torch.testing.assert_close(
                    p,
                    want["params"][name],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, where=where: f"{where}: {m}",
                )
    for rank in range(world):
        assert runs["cce"][rank]["head_dtensor"]
        # the head is never gathered by the cce run; the plain FSDP run does move it (else this check proves nothing)
        assert runs["cce"][rank]["big"] == [], runs["cce"][rank]["big"]
        assert plain[rank]["big"], "the plain FSDP run moved nothing of the head's size"
        assert runs["gathered"][rank]["big"], "the head module's own call gathers the rows"


def _misuse(rank, world, group):
    """Clear errors: a head sharded here passed without its data-parallel shard, tied embeddings, after fully_shard."""
    out = []
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TinyLM()
    cce_dist.fsdp.shard_lm_head(model, mesh)
    h, t = torch.randn(3 + rank, D), torch.randint(0, V, (3 + rank,))
    for call, match in (
        (lambda: cce_dist.linear_cross_entropy(h, model.lm_head.weight, t), "shard=cce_dist.fsdp.head_shard(head)"),
        (
            lambda: cce_dist.linear_cross_entropy(
                DTensor.from_local(h, mesh), model.lm_head.weight, t, shard=cce_dist.fsdp.head_shard(model.lm_head)
            ),
            "hidden is a DTensor but shard.data_parallel=True",
        ),
    ):
        try:
            call()
            out.append(f"no error ({match})")
        except ValueError as e:
            if match not in str(e):
                out.append(f"{match!r} not in {e}")
    assert cce_dist.fsdp.head_shard(TinyLM().lm_head) is None
    tied = TinyLM()
    tied.embed = nn.Embedding(V, D)
    tied.lm_head.weight = tied.embed.weight
    with pytest.raises(ValueError, match="tied to embed.weight"):
        cce_dist.fsdp.shard_lm_head(tied, mesh)
    managed = TinyLM()
    fully_shard(managed, mesh=mesh)
    with pytest.raises(ValueError, match="call shard_lm_head before fully_shard"):
        cce_dist.fsdp.shard_lm_head(managed, mesh)
    # the divide factor reaches the shard
    cce_dist.fsdp.set_gradient_divide_factor(model, 1.0)
    assert cce_dist.fsdp.head_shard(model.lm_head).divide_factor == 1.0
    return out


def test_misuse_raises_clearly(rank_pool):
    res = rank_pool(2).run(_misuse, timeout=300)
    problems = [p for r in res.values() for p in r]
    assert not problems, problems
