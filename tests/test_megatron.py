"""cce_dist.megatron.output_layer_loss against the real megatron-core, on CPU gloo at tp=2.

Reference: ``vocab_parallel_cross_entropy(ColumnParallelLinear(hidden)[0], labels.T).T`` (what
GPTModel.compute_language_model_loss returns). megatron-core's sequence-parallel all-gather
allocates on CUDA, so the sequence-parallel reference is a non-sequence-parallel layer (same
weights) on the gathered sequence; its hidden gradient, sliced to this rank's tokens, is what the
sequence-parallel layer's reduce-scatter returns.

All cases run in ONE spawn of two ranks (each spawn imports torch + megatron-core, ~15-40 s).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from dist_utils import run_ranks  # noqa: E402

S, B, H, V, TP = 8, 3, 16, 48, 2  # V is the padded vocab; each rank holds V / TP rows
IGNORE = -100
ATOL, RTOL = 2e-5, 1e-5


def _close(name, got, want, atol=ATOL, rtol=RTOL):
    assert got is not None, f"{name}: no gradient"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert torch.allclose(got, want, atol=atol, rtol=rtol), f"{name}: max abs err {err:.3g}"


def _inputs(seed):
    """Identical on every rank: full hidden [s, b, h], labels [b, s] with ignored positions,
    a per-token upstream gradient [b, s] that is 0 there (Megatron's loss mask), full W and b.

    Local, not helpers.problem: Megatron's layouts (hidden [s, b, h], labels [b, s]) and its loss mask."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    ignored = torch.rand(B, S, generator=g) < 0.25
    ignored[0, 0] = True
    labels_ign = labels.masked_fill(ignored, IGNORE)
    grad_up = torch.randn(B, S, generator=g).masked_fill(ignored, 0.0)
    w_full = torch.randn(V, H, generator=g) * 0.5
    b_full = torch.randn(V, generator=g) * 0.5
    return hidden, labels, labels_ign, ignored, grad_up, w_full, b_full


def _megatron_body(rank, world, group):
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy

    from cce_dist.megatron import output_layer_loss

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, create_gloo_process_groups=False)
    try:
        tp_group = parallel_state.get_tensor_model_parallel_group()
        assert parallel_state.get_tensor_model_parallel_rank() == rank
        lo, hi = rank * V // TP, (rank + 1) * V // TP
        rows = slice(lo, hi)
        tok = slice(rank * S // TP, (rank + 1) * S // TP)  # this rank's sequence slice under SP

        def config(sp, dtype=torch.float32):
            return ModelParallelConfig(
                tensor_model_parallel_size=TP,
                sequence_parallel=sp,
                use_cpu_initialization=True,
                perform_initialization=True,
                gradient_accumulation_fusion=False,
                params_dtype=dtype,
            )

        def layer(sp, bias, tied, w_full, b_full, dtype=torch.float32, **extra):
            torch.manual_seed(0)  # _initialize_affine_weight_cpu draws the master weight on every rank
            lyr = ColumnParallelLinear(
                H,
                V,
                config=config(sp, dtype),
                init_method=torch.nn.init.xavier_normal_,
                bias=bias,
                gather_output=False,
                skip_weight_param_allocation=tied,
                **extra,
            )
            assert lyr.sequence_parallel == sp
            with torch.no_grad():
                if not tied:
                    assert lyr.weight.shape == (V // TP, H)
                    lyr.weight.copy_(w_full[rows])
                if bias:
                    lyr.bias.copy_(b_full[rows])  # Megatron zero-initialises it; make it matter
            return lyr

        def reference(ref, hidden, labels, grad_up, tied_w):
            """Megatron's own path, non-sequence-parallel, on the full sequence."""
            h = hidden.clone().requires_grad_(True)
            logits, _ = ref(h, weight=tied_w)
            loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous()).transpose(0, 1)
            (loss * grad_up).sum().backward()
            w = tied_w if tied_w is not None else ref.weight
            return loss.detach(), h.grad, w.grad, None if ref.bias is None else ref.bias.grad

        cases = 0
        for tied in (False, True):
            for bias in (False, True):
                for sp in (False, True):
                    seed = 100 + 4 * tied + 2 * bias + sp
                    hidden, labels, labels_ign, ignored, grad_up, w_full, b_full = _inputs(seed)
                    ref = layer(False, bias, tied, w_full, b_full)
                    ref_w = torch.nn.Parameter(w_full[rows].clone()) if tied else None
                    want_loss, want_dh, want_dw, want_db = reference(ref, hidden, labels, grad_up, ref_w)

                    lyr = layer(sp, bias, tied, w_full, b_full)
                    emb_w = torch.nn.Parameter(w_full[rows].clone()) if tied else None
                    h = (hidden[tok] if sp else hidden).clone().requires_grad_(True)
                    kw = dict(chunk_size=40) if seed % 2 else {}
                    loss = output_layer_loss(lyr, h, labels_ign, weight=emb_w, ignore_index=IGNORE, **kw)
                    what = f"[tied={tied} bias={bias} sp={sp}]"
                    assert loss.shape == (B, S) and loss.dtype == torch.float32, what
                    _close(f"{what} loss", loss[~ignored], want_loss[~ignored])
                    assert torch.all(loss[ignored] == 0), what
                    (loss * grad_up).sum().backward()
                    _close(f"{what} dH", h.grad, want_dh[tok] if sp else want_dh)
                    w = emb_w if tied else lyr.weight
                    _close(f"{what} dW", w.grad, want_dw)
                    if bias:
                        _close(f"{what} db", lyr.bias.grad, want_db)
                    cases += 1

        # label smoothing (and z-loss): exact full-vocab oracle, since Megatron smooths per partition
        for sp in (False, True):
            hidden, labels, labels_ign, ignored, grad_up, w_full, b_full = _inputs(200 + sp)
            lyr = layer(sp, True, False, w_full, b_full)
            h = (hidden[tok] if sp else hidden).clone().requires_grad_(True)
            loss = output_layer_loss(lyr, h, labels_ign, label_smoothing=0.1, z_loss=1e-3)
            (loss * grad_up).sum().backward()

            hf = hidden.clone().requires_grad_(True)
            wf = w_full.clone().requires_grad_(True)
            bf = b_full.clone().requires_grad_(True)
            z = F.linear(hf, wf, bf)  # [s, b, V]
            t = labels_ign.transpose(0, 1)
            oracle = F.cross_entropy(
                z.reshape(-1, V), t.reshape(-1), ignore_index=IGNORE, reduction="none", label_smoothing=0.1
            ).reshape(S, B)
            lse = torch.logsumexp(z, dim=-1)
            oracle = (oracle + 1e-3 * lse.square() * (t != IGNORE)).transpose(0, 1)
            (oracle * grad_up).sum().backward()
            what = f"[smoothing sp={sp}]"
            if not sp:  # what the docstring says: Megatron smooths per partition, so it differs
                with torch.no_grad():
                    logits, _ = lyr(hidden)
                    meg = vocab_parallel_cross_entropy(
                        logits, labels.transpose(0, 1).contiguous(), label_smoothing=0.1
                    ).transpose(0, 1)
                    both = [torch.empty_like(meg) for _ in range(TP)]
                    torch.distributed.all_gather(both, meg.contiguous(), group=tp_group)
                assert not torch.allclose(both[0], both[1], atol=1e-3), "Megatron's smoothing is per rank"
            _close(f"{what} loss", loss, oracle.detach())
            _close(f"{what} dH", h.grad, hf.grad[tok] if sp else hf.grad)
            _close(f"{what} dW", lyr.weight.grad, wf.grad[rows])
            _close(f"{what} db", lyr.bias.grad, bf.grad[rows])
            cases += 1

        # return_lse and shift (along the sequence: labels' last dim)
        hidden, labels, labels_ign, ignored, grad_up, w_full, b_full = _inputs(300)
        lyr = layer(False, False, False, w_full, b_full)
        loss, lse = output_layer_loss(lyr, hidden, labels_ign, return_lse=True)
        assert lse.shape == (B, S)
        _close("lse", lse[~ignored], torch.logsumexp(hidden @ w_full.T, dim=-1).transpose(0, 1)[~ignored])
        shifted = torch.full_like(labels_ign, IGNORE)
        shifted[:, :-1] = labels_ign[:, 1:]
        with torch.no_grad():
            _close(
                "shift", output_layer_loss(lyr, hidden, labels_ign, shift=1), output_layer_loss(lyr, hidden, shifted)
            )
        # a layer without a tp_group attribute (megatron-core 0.12): parallel_state's TP group
        if hasattr(lyr, "tp_group"):  # >= 0.13
            assert lyr.tp_group is tp_group
            with torch.no_grad():
                want = output_layer_loss(lyr, hidden, labels_ign)
                del lyr.tp_group
                _close("no tp_group attribute", output_layer_loss(lyr, hidden, labels_ign), want)
        cases += 1

        # disable_grad_reduce (LoRA): the layer leaves dH partial per rank, and so must we
        hidden, labels, labels_ign, ignored, grad_up, w_full, b_full = _inputs(400)
        ref = layer(False, True, False, w_full, b_full, disable_grad_reduce=True)
        want_loss, want_dh, want_dw, want_db = reference(ref, hidden, labels, grad_up, None)
        lyr = layer(False, True, False, w_full, b_full, disable_grad_reduce=True)
        h = hidden.clone().requires_grad_(True)
        loss = output_layer_loss(lyr, h, labels_ign)
        (loss * grad_up).sum().backward()
        _close("[disable_grad_reduce] loss", loss[~ignored], want_loss[~ignored])
        _close("[disable_grad_reduce] partial dH", h.grad, want_dh)
        _close("[disable_grad_reduce] dW", lyr.weight.grad, want_dw)
        _close("[disable_grad_reduce] db", lyr.bias.grad, want_db)
        cases += 1

        # bf16 weights and activations (Megatron casts the bf16 logits to fp32 for the loss; cce_dist
        # rounds logits to bf16 too and accumulates in fp32): agreement to bf16 resolution
        hidden, labels, labels_ign, ignored, grad_up, w_full, b_full = _inputs(500)
        hidden = hidden.bfloat16()
        ref = layer(False, True, False, w_full, b_full, dtype=torch.bfloat16)
        want_loss, want_dh, want_dw, want_db = reference(ref, hidden, labels, grad_up, None)
        lyr = layer(False, True, False, w_full, b_full, dtype=torch.bfloat16)
        h = hidden.clone().requires_grad_(True)
        loss = output_layer_loss(lyr, h, labels_ign)
        (loss * grad_up).sum().backward()
        assert loss.dtype == torch.float32 and h.grad.dtype == lyr.weight.grad.dtype == torch.bfloat16
        _close("[bf16] loss", loss[~ignored], want_loss[~ignored].float(), atol=3e-2, rtol=1e-2)
        for name, got, want in (
            ("dH", h.grad, want_dh),
            ("dW", lyr.weight.grad, want_dw),
            ("db", lyr.bias.grad, want_db),
        ):
            scale = want.float().abs().max().item()
            _close(f"[bf16] {name}", got.float(), want.float(), atol=2e-2 * scale, rtol=2e-2)
        cases += 1

        # a bad input on one rank only (its labels, then the weight it hands over): that rank raises its own error,
        # the other an InputError naming it, none waits in a collective; then the group still scores a good call
        from cce_dist import InputError

        hidden, labels, labels_ign, ignored, grad_up, w_full, b_full = _inputs(600)
        lyr = layer(False, False, False, w_full, b_full)
        faults = (
            ({}, labels.reshape(-1), r"labels must be a \[b, s\] tensor"),
            ({"weight": torch.zeros(V // TP + 1, H)}, labels, r"supplied weight's shape"),
        )
        for kw, bad_labels, match in faults:
            if rank == 1:
                with pytest.raises(ValueError, match=match):
                    output_layer_loss(lyr, hidden, bad_labels, **kw)
            else:
                with pytest.raises(InputError, match=r"rank\(s\) \[1\] of the tensor-parallel group rejected"):
                    output_layer_loss(lyr, hidden, labels)
        want_loss = reference(layer(False, False, False, w_full, b_full), hidden, labels, grad_up, None)[0]
        _close("[after the refused calls] loss", output_layer_loss(lyr, hidden, labels).detach(), want_loss)
        cases += 1
        return cases
    finally:
        parallel_state.destroy_model_parallel()


def test_output_layer_loss_matches_megatron_tp2(tmp_path):
    out = run_ranks(_megatron_body, TP, tmp_path, timeout=240)
    assert out == {0: 14, 1: 14}


class _FakeLayer:
    weight = torch.zeros(4, 3)
    bias = None
    sequence_parallel = False
    tp_group = None


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(reduction="mean"), "reduction='none'"),
        (dict(reduction="sum"), "reduction='none'"),
        (dict(shard=None), "shard"),
        (dict(bias=None), "bias"),
    ],
)
def test_rejects_conflicting_options(bad, match):
    from cce_dist.megatron import output_layer_loss

    with pytest.raises(ValueError, match=match):
        output_layer_loss(_FakeLayer(), torch.zeros(2, 1, 3), torch.zeros(1, 2, dtype=torch.long), **bad)


def test_single_device_layer_without_group():
    """tp=1 (no group): the plain full-vocab loss, [b, s]."""
    import torch.nn.functional as F

    from cce_dist.megatron import output_layer_loss

    g = torch.Generator().manual_seed(0)
    lyr = _FakeLayer()
    lyr.weight = torch.randn(5, 3, generator=g)
    h = torch.randn(4, 2, 3, generator=g)
    labels = torch.randint(0, 5, (2, 4), generator=g)
    got = output_layer_loss(lyr, h, labels)
    want = (
        F.cross_entropy(F.linear(h, lyr.weight).reshape(-1, 5), labels.T.reshape(-1), reduction="none").reshape(4, 2).T
    )
    _close("loss", got, want)


def test_tied_layer_without_weight_is_a_clear_error():
    from cce_dist.megatron import output_layer_loss

    lyr = _FakeLayer()
    lyr.weight = None
    with pytest.raises(ValueError, match="weight="):
        output_layer_loss(lyr, torch.zeros(2, 1, 3), torch.zeros(1, 2, dtype=torch.long))


def test_missing_megatron_is_a_clear_import_error(monkeypatch):
    from cce_dist import megatron as cm

    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # makes `import megatron...` raise ImportError
    with pytest.raises(ImportError, match=r"cce_dist\[megatron\]"):
        cm.output_layer_loss(_FakeLayer(), torch.zeros(2, 1, 3), torch.zeros(1, 2, dtype=torch.long))


def test_importing_cce_dist_does_not_import_megatron():
    code = (
        "import sys, cce_dist, cce_dist.megatron; "
        "bad = [m for m in sys.modules if m.split('.')[0] == 'megatron']; assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-2000:]
