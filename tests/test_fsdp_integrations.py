"""``cce_dist.hf.patch`` and ``cce_dist.trl.patch`` with a head sharded by ``cce_dist.fsdp.shard_lm_head`` under real
FSDP2 (``fully_shard``) on 2 gloo ranks: scored in place, never gathered.

- HF: a tiny ``LlamaForCausalLM`` (untied) trained a few SGD steps, each rank on its own batches, with the head
  sharded and the model patched, equals the plain FSDP2 run (FSDP manages the head, transformers' materialized loss):
  every rank's losses and every final parameter (float32). No collective of the patched run moves the head's bytes,
  while the plain run's do.
- TRL: TRL's own fused LM head (``add_fused_lm_head``, patched by ``cce_dist.trl.patch()``) on a ``fully_shard``-ed
  model, and the DistillationTrainer's ``_chunked_divergence_loss`` (and ``CceDivergence`` called directly) on a
  sharded student and teacher head, equal one process over the concatenated batch (TRL's own kernels): each rank's
  per-token fields and loss, the head's gradient rows (FSDP2's mean over the ranks), the other gradients; no
  collective moves a head.

The embedding is frozen and left out of FSDP (``ignored_params``) in every run, so that the only ``V x D`` parameter
FSDP could gather is the head (the embedding has the head's shape).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("transformers")

V = 389  # the head [V, 32] outweighs a decoder layer's FSDP group (9280 parameters); uneven rows: 195 / 194
HIDDEN = 32
STEPS = 3
#: each rank's batch shape per step (rank 1 has fewer, shorter rows)
SHAPES = {0: ((2, 7), (3, 5), (1, 9)), 1: ((1, 6), (2, 4), (2, 8))}
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _llama(seed=0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=V - 2,
        eos_token_id=V - 1,
        bos_token_id=None,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, V - 2, SHAPES[rank][step], generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.2] = -100
    return ids, labels


def _fully_shard(model, mesh, head_sharded):
    from torch.distributed.fsdp import fully_shard

    import cce_dist.fsdp

    ignored = {model.model.embed_tokens.weight}
    if head_sharded:
        ignored |= cce_dist.fsdp.shard_lm_head(model, mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored)


def _big(log):
    """The recorded collectives that move as many bytes as the head (``V x D`` float32) or more."""
    return [(c.name, c.shape) for c in log.calls if max(c.in_bytes, c.out_bytes) >= V * HIDDEN * 4]


@contextlib.contextmanager
def _full_tensor_calls():
    """The shapes of the DTensors gathered with ``full_tensor()`` in the block (DTensor's functional collectives,
    which :class:`~cce_dist.testing.CollectiveLog` does not see): TRL gathers a head this way."""
    from torch.distributed.tensor import DTensor

    calls: list[tuple[int, ...]] = []
    original = DTensor.full_tensor

    def recording(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return original(self, *args, **kwargs)

    DTensor.full_tensor = recording
    try:
        yield calls
    finally:
        DTensor.full_tensor = original


def _hf_train(rank, world, group, mode):
    """``mode``: "plain" (FSDP manages the head, transformers' loss) or "cce" (shard_lm_head + cce_dist.hf.patch)."""
    from torch.distributed.tensor import DTensor, init_device_mesh

    import cce_dist.hf
    from cce_dist.testing import CollectiveLog

    model = _llama()
    model.train()
    mesh = init_device_mesh("cpu", (world,))
    _fully_shard(model, mesh, head_sharded=mode == "cce")
    if mode == "cce":
        cce_dist.hf.patch(model, impl="torch")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3, momentum=0.9)
    losses, big = [], []
    log = CollectiveLog().install()
    try:
        for step in range(STEPS):
            ids, labels = _batch(step, rank)
            with log.counting():
                out = model(input_ids=ids, labels=labels)
                out.loss.backward()
            big += _big(log)
            opt.step()
            opt.zero_grad()
            losses.append(float(out.loss.detach()))
    finally:
        log.uninstall()
    params = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
    }
    return {"losses": losses, "params": params, "big": big, "logits": out.logits is None}


def test_hf_patch_trains_like_plain_fsdp_without_gathering_the_head(rank_pool):
    pool = rank_pool(2)
    plain = pool.run(_hf_train, mode="plain", timeout=300)
    cce = pool.run(_hf_train, mode="cce", timeout=300)
    for rank in range(2):
        got, want = cce[rank], plain[rank]
        assert got["logits"], "the patched path ran (no logits)"
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6, msg=f"rank {rank} losses"
        )
        assert got["params"].keys() == want["params"].keys()
        for name, p in got["params"].items():
            torch.testing.assert_close(p, want["params"][name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        assert got["big"] == [], got["big"]  # the head is never gathered
        assert want["big"], "the plain FSDP run moved nothing of the head's size (the check would prove nothing)"
    # the ranks had different batches: their losses differ
    assert cce[0]["losses"] != cce[1]["losses"]


# ----------------------------------------------------------------------------------------------
# TRL
# ----------------------------------------------------------------------------------------------


def _rows(rank, world, n):
    """This rank's ``[start, stop)`` of ``n`` rows under DTensor's Shard(0) split."""
    per = -(-n // world)
    return min(rank * per, n), min((rank + 1) * per, n)


def _trl_fused_body(rank, world, group):
    from torch.distributed.tensor import DTensor, init_device_mesh
    from trl.trainer.utils import add_fused_lm_head

    import cce_dist.trl as ct
    from cce_dist.testing import CollectiveLog

    failures = []
    batches = [_batch(0, r) for r in range(world)]
    # one process, TRL's own kernel, every rank's batch: each rank's loss, the gradient of their mean
    ref = _llama()
    add_fused_lm_head(ref, temperature=0.8, outputs=OUTPUTS)
    want = [ref(input_ids=ids, labels=labels, fused_lm_head=True) for ids, labels in batches]
    (sum(w.loss for w in want) / world).backward()

    model = _llama()
    mesh = init_device_mesh("cpu", (world,))
    _fully_shard(model, mesh, head_sharded=True)
    add_fused_lm_head(model, temperature=0.8, outputs=OUTPUTS)
    ct.patch()  # tensor_parallel=False: TRL gathers other DTensor heads, never this one
    try:
        ids, labels = batches[rank]
        with CollectiveLog() as log, _full_tensor_calls() as gathered:
            got = model(input_ids=ids, labels=labels, fused_lm_head=True)
            got.loss.backward()
    finally:
        ct.unpatch()
    for name in (*OUTPUTS, "loss"):
        a, b = getattr(got, name), getattr(want[rank], name)
        ok = torch.equal(a, b) if a.dtype == torch.bool else torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        if not ok:
            failures.append(f"rank {rank}: fused head {name}")
    if _big(log) or gathered:
        failures.append(f"rank {rank}: fused head moved the head's bytes: {_big(log)}, full_tensor {gathered}")
    start, stop = _rows(rank, world, V)
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    dw = grads.pop("lm_head.weight")
    if not (isinstance(dw, DTensor) and torch.allclose(dw.to_local(), ref.lm_head.weight.grad[start:stop], atol=1e-6)):
        failures.append(f"rank {rank}: the head's gradient rows")
    ref_params = dict(ref.named_parameters())
    for name, g in grads.items():
        full = g.full_tensor() if isinstance(g, DTensor) else g
        if not torch.allclose(full, ref_params[name].grad, rtol=1e-4, atol=1e-6):
            failures.append(f"rank {rank}: {name}.grad")
    return failures


def _heads(mesh, seed, width, bias):
    """A module holding an ``lm_head [V, width]`` (the same on every rank) and, with ``mesh``, sharded by
    shard_lm_head."""
    import cce_dist.fsdp

    torch.manual_seed(seed)
    holder = torch.nn.Module()
    holder.lm_head = torch.nn.Linear(width, V, bias=bias)
    if mesh is not None:
        cce_dist.fsdp.shard_lm_head(holder, mesh)
    return holder.lm_head


def _trl_divergence_body(rank, world, group, beta):
    import trl.trainer.distillation_trainer as distillation
    from torch.distributed.tensor import init_device_mesh

    import cce_dist.trl as ct
    from cce_dist.testing import CollectiveLog

    failures = []
    ds, dt = HIDDEN, 24  # the teacher narrower than the student
    counts = (5, 3)
    g = torch.Generator().manual_seed(7)
    data = [
        (torch.randn(1, n, ds, generator=g), torch.randn(1, n, dt, generator=g), (torch.rand(1, n, generator=g) > 0.2))
        for n in counts
    ]
    kw = dict(student_logit_scale=1.5, teacher_final_logit_softcapping=9.0, temperature=0.9)
    # one process, TRL's own loss: each rank's loss, the student head's gradient of their mean
    student, teacher = _heads(None, 0, ds, True), _heads(None, 1, dt, True)
    want, want_dh = [], []
    for sh, th, mask in data:
        sh = sh.clone().requires_grad_()
        loss, ent, n = distillation._chunked_divergence_loss(
            sh, th, student.weight, teacher.weight, mask.long(), beta,
            student_lm_head_bias=student.bias, teacher_lm_head_bias=teacher.bias, **kw,
        )  # fmt: skip
        (loss / world).backward()
        want.append((loss.detach(), ent.detach()))
        want_dh.append(sh.grad * world)

    mesh = init_device_mesh("cpu", (world,))
    s_head, t_head = _heads(mesh, 0, ds, True), _heads(mesh, 1, dt, True)
    sh, th, mask = data[rank]
    sh = sh.clone().requires_grad_()
    ct.patch()
    try:
        with CollectiveLog() as log, _full_tensor_calls() as gathered:
            loss, ent, n = distillation._chunked_divergence_loss(
                sh, th, s_head.weight, t_head.weight, mask.long(), beta,
                student_lm_head_bias=s_head.bias, teacher_lm_head_bias=t_head.bias, **kw,
            )  # fmt: skip
            loss.backward()
        # CceDivergence on the DTensor heads directly equals the same per-token values
        h_s, h_t = sh.detach().reshape(-1, ds), th.reshape(-1, dt)
        direct, _ = ct.CceDivergence.apply(
            h_s, s_head.weight, s_head.bias, h_t, t_head.weight, t_head.bias, beta, 0.9, 1.5, None, 1.0, 9.0
        )
        direct = (direct * mask.reshape(-1)).sum() / mask.sum()
        # a teacher not sharded the same way is refused, naming it
        try:
            ct.CceDivergence.apply(h_s, s_head.weight, None, h_t, _heads(None, 1, dt, False).weight, None, beta)
            failures.append(f"rank {rank}: an unsharded teacher was accepted")
        except ValueError as e:
            if "teacher" not in str(e) or "shard_lm_head" not in str(e):
                failures.append(f"rank {rank}: unclear error {e}")
    finally:
        ct.unpatch()
    w_loss, w_ent = want[rank]
    if not torch.allclose(loss, w_loss, rtol=1e-5, atol=1e-6) or not torch.allclose(direct, w_loss, rtol=1e-5):
        failures.append(f"rank {rank}: divergence {loss} / {direct} != {w_loss}")
    if not torch.allclose(ent, w_ent, rtol=1e-5, atol=1e-5):
        failures.append(f"rank {rank}: entropy {ent} != {w_ent}")
    if not torch.allclose(sh.grad, want_dh[rank], rtol=1e-4, atol=1e-6):
        failures.append(f"rank {rank}: the student's hidden-state gradient")
    start, stop = _rows(rank, world, V)
    for name in ("weight", "bias"):
        got_g = getattr(s_head, name).grad.to_local()
        if not torch.allclose(got_g, getattr(student, name).grad[start:stop], rtol=1e-4, atol=1e-6):
            failures.append(f"rank {rank}: the student head's {name} gradient rows")
    if t_head.weight.grad is not None:
        failures.append(f"rank {rank}: the teacher got a gradient")
    if _big(log) or gathered:
        failures.append(f"rank {rank}: the divergence moved a head's bytes: {_big(log)}, full_tensor {gathered}")
    return failures


def test_trl_fused_head_on_a_sharded_head_equals_one_process(rank_pool):
    pytest.importorskip("trl", minversion="1.16")
    results = rank_pool(2).run(_trl_fused_body, timeout=300)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_trl_distillation_on_sharded_heads_equals_one_process(rank_pool, beta):
    pytest.importorskip("trl", minversion="1.16")
    results = rank_pool(2).run(_trl_divergence_body, beta=beta, timeout=300)
    failures = [f for r in sorted(results) for f in results[r]]
    assert not failures, "\n".join(failures)
