"""cce_dist.megatron.patch on a real megatron-core GPTModel, on CPU gloo at tp=1 and tp=2.

Each case builds a tiny GPTModel (2 layers, hidden 64, 4 heads, local layer spec, CPU
initialization, no dropout, float32; real vocab 1001 padded to a multiple of tp: 1001 rows at
tp=1, 2 x 501 at tp=2) and runs megatron-core's own forward / _postprocess / MTP code twice: once
unpatched (the reference) and once patched. The per-token loss [b, s], every parameter's gradient
(of Megatron's masked-mean loss) and, with multi-token prediction, Megatron's MTP loss log must
agree; the patched forward must save no [s, b, V/tp] tensor for backward (the logits and their
softmax). Without labels and in eval the patched model must return what the unpatched one does,
and unpatch must restore the instance exactly.

What needs CUDA in megatron-core 0.16 and how it is stood in for, in the rank processes only:
- ``torch.cuda.current_device`` returns the CPU device: megatron's sequence-parallel
  all-gather / reduce-scatter buffers and the MTP loss tracker are allocated on it;
- the RNG tracker is megatron's own inference tracker (``initialize_rng_tracker(
  inference_rng_tracker=True)``), whose fork is a no-op: dropout is 0, so no RNG is drawn;
- under sequence parallelism the layer norms are ``torch.nn.LayerNorm`` with their parameters
  marked ``sequence_parallel`` (what TENorm / FusedLayerNorm do), swapped into the local spec for
  ``WrappedTorchNorm``, which refuses sequence parallelism. Their gradients stay per-rank partial
  sums, as before Megatron's finalize_model_grads all-reduces them; compared per rank, which is
  stricter than comparing the sums.
Everything else (embedding, attention, MLP, output layer, _postprocess, roll_tensor,
MTPLossAutoScaler, the vocab-parallel cross-entropy) is megatron-core's unchanged code.

GPTModel's output layer has no bias; the "bias" cases swap in a ColumnParallelLinear with one
(same config), which megatron's _postprocess then calls as its output layer. The "bf16" case casts
the model to bf16 (what megatron's Float16Module does); all other cases are float32.

All cases of one tensor-parallel size run in ONE spawn (each spawn imports torch + megatron-core,
~15-40 s on this machine); each case is still its own pytest item, reading its outcome from that
spawn. The same file passes on megatron-core 0.12.2, 0.13.1, 0.14.0, 0.15.3 and 0.16.1.
"""

import inspect
import math
import traceback

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from dist_utils import run_ranks  # noqa: E402

B, S, H, HEADS, V_REAL = 2, 16, 64, 4, 1001
MTP_LAYERS = 2

# name: (tp, sequence_parallel, mtp, tied, extra)
CASES = {
    "tp1-untied": (1, False, False, False, ""),
    "tp1-tied": (1, False, False, True, ""),
    "tp1-mtp-untied": (1, False, True, False, ""),
    "tp1-mtp-tied": (1, False, True, True, ""),
    "tp1-mtp-bias": (1, False, True, False, "bias"),
    "tp2-untied": (2, False, False, False, ""),
    "tp2-tied": (2, False, False, True, ""),
    "tp2-mtp-untied": (2, False, True, False, ""),
    "tp2-mtp-tied": (2, False, True, True, ""),
    "tp2-sp-untied": (2, True, False, False, ""),
    "tp2-sp-tied": (2, True, False, True, ""),
    "tp2-sp-mtp-untied": (2, True, True, False, ""),
    "tp2-sp-mtp-tied": (2, True, True, True, ""),
    "tp2-sp-mtp-bias": (2, True, True, False, "bias"),
    "tp2-sp-mtp-per-token-loss": (2, True, True, True, "per_token_loss"),
    "tp2-sp-z-loss": (2, True, False, False, "z_loss"),
    "tp2-sp-mtp-bf16": (2, True, True, True, "bf16"),
    "tp2-refusals": (2, False, False, False, "refusals"),
}

# float32 throughout. The loss: cce_dist and Megatron both form the fp32 logits of a 64-long dot
# product and a logsumexp over ~1000 entries, in different orders (chunked online logsumexp vs
# max, exp, sum): a few fp32 ulps of a loss of ~7 (measured: <= 4.8e-7 abs). Gradients: the
# softmax - onehot difference agrees to fp32 rounding, then flows back through the same Megatron
# graph (2 layers + MTP), with the token / vocab sums in different fp32 orders (measured: <= 9e-7
# of each tensor's largest entry, over all cases). The bounds leave ~10x margin; atol is relative
# to each tensor's largest entry so tiny gradients (layer-norm biases, ~1e-3) are held to the same
# relative standard as large ones.
LOSS_ATOL, LOSS_RTOL = 5e-6, 1e-6
GRAD_RTOL, GRAD_ATOL_REL = 1e-5, 1e-5
# bf16 parameters (the model cast to bf16, as Float16Module does): the loss is fp32 in both, and
# so are its tolerances. Megatron rounds the bf16 matmul dW = dlogits^T h once per micro-batch;
# cce_dist accumulates dW over vocab/token chunks in fp32 and rounds once: entries of the output
# (here tied embedding) weight gradient may differ by a bf16 rounding step (2**-8 relative;
# measured: 1.9e-6 = 1.6e-5 of the largest entry, one step of a small entry). Allow two steps per
# entry, plus 2**-12 of the largest entry (~15x the measured) for entries that cancel to near zero.
BF16_GRAD_RTOL, BF16_GRAD_ATOL_REL = 2**-7, 2**-12


def _close(name, got, want, atol, rtol):
    import torch

    assert got is not None, f"{name}: missing"
    assert want is not None, f"{name}: missing in the reference"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert torch.allclose(got, want, atol=atol, rtol=rtol), f"{name}: max abs err {err:.3g} (atol {atol:.3g})"


class _SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm with the constructor of megatron's norms, its parameters marked
    ``sequence_parallel`` as megatron's fused / TE norms mark theirs."""

    def __init__(self, config, hidden_size, eps=1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def _swap_norms(spec):
    """The spec with megatron's WrappedTorchNorm replaced by _SequenceParallelLayerNorm (in place:
    the local spec functions build fresh spec objects on every call)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return _SequenceParallelLayerNorm
    if isinstance(spec, list):
        return [_swap_norms(item) for item in spec]
    if isinstance(spec, ModuleSpec):
        spec.module = _swap_norms(spec.module)
        spec.submodules = _swap_norms(spec.submodules)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            setattr(spec, field.name, _swap_norms(getattr(spec, field.name)))
    return spec


def _stand_ins():
    import torch
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.current_device = lambda: torch.device("cpu")
    # force_reset: megatron-core >= 0.13 (on 0.12 this fresh process has no tracker yet)
    reset = {"force_reset": True} if "force_reset" in inspect.signature(initialize_rng_tracker).parameters else {}
    initialize_rng_tracker(inference_rng_tracker=True, **reset)


def _build(tp, sp, mtp, tied, extra):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    config = TransformerConfig(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        mtp_num_layers=MTP_LAYERS if mtp else None,
        mtp_loss_scaling_factor=0.1,  # 0.12 has no default
        calculate_per_token_loss=extra == "per_token_loss",
        params_dtype=torch.bfloat16 if extra == "bf16" else torch.float32,
        bf16=extra == "bf16",
    )
    spec = get_gpt_layer_local_spec()
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp else None
    if sp:
        # a block spec, so that the final layer norm is given rather than chosen by megatron
        spec = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=WrappedTorchNorm)
        spec, mtp_spec = _swap_norms(spec), _swap_norms(mtp_spec)
    vocab = math.ceil(V_REAL / tp) * tp  # Megatron's padding of the vocab to the tp size
    torch.manual_seed(1234)  # CPU initialization draws each full weight on every rank, then splits it
    model = GPTModel(
        config,
        spec,
        vocab_size=vocab,
        max_sequence_length=S,
        share_embeddings_and_output_weights=tied,
        mtp_block_spec=mtp_spec,
    )
    if extra == "bias":
        layer = ColumnParallelLinear(
            H,
            vocab,
            config=config,
            init_method=config.init_method,
            bias=True,
            gather_output=False,
            skip_weight_param_allocation=tied,
        )
        with torch.no_grad():
            layer.bias.normal_(0.0, 0.5)  # Megatron zero-initialises it; make it matter
        model.output_layer = layer
    if extra == "bf16":
        model = model.bfloat16()  # what megatron's Float16Module does to the module it wraps
    return model, vocab // tp


def _inputs():
    """Identical on every rank: token ids, positions, causal mask, labels, a loss mask with zeros."""
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V_REAL, (B, S), generator=g)
    labels = torch.randint(0, V_REAL, (B, S), generator=g)
    loss_mask = (torch.rand(B, S, generator=g) > 0.2).float()
    loss_mask[0, 0] = 0.0
    positions = torch.arange(S).expand(B, S)
    attention_mask = torch.ones(1, 1, S, S, dtype=torch.bool).triu(1)  # True = masked out
    return ids, positions, attention_mask, labels, loss_mask


def _step(model, inputs, v_local, extra_loss=None):
    """Megatron's training step on the last stage: forward with labels, its loss_func (masked mean,
    or masked sum under calculate_per_token_loss), backward. Returns the per-token loss, every
    parameter's gradient, the MTP loss log and whether a [s, b, V/tp] tensor was saved."""
    import torch
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    ids, positions, attention_mask, labels, loss_mask = inputs
    model.train()
    model.zero_grad(set_to_none=True)
    MTPLossLoggingHelper.tracker.clear()
    big = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == v_local and t.numel() >= B * S * v_local:
            big.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, positions, attention_mask, labels=labels, loss_mask=loss_mask)
        if extra_loss is not None:
            loss = loss + extra_loss(model, inputs)
    total = (loss * loss_mask).sum()
    if not model.config.calculate_per_token_loss:
        total = total / loss_mask.sum()
    total.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    values = MTPLossLoggingHelper.tracker.get("values")
    return loss.detach(), grads, None if values is None else values.clone(), big


def _compare(what, got, want, bf16=False):
    loss, grads, mtp_log, _ = got
    ref_loss, ref_grads, ref_mtp_log, _ = want
    _close(f"{what} loss", loss, ref_loss, LOSS_ATOL, LOSS_RTOL)
    assert set(grads) == set(ref_grads), what
    atol_rel, rtol = (BF16_GRAD_ATOL_REL, BF16_GRAD_RTOL) if bf16 else (GRAD_ATOL_REL, GRAD_RTOL)
    errors = []
    for name, ref in ref_grads.items():
        assert ref is not None, f"{what} {name}: no gradient in the reference"
        try:
            _close(f"{what} d{name}", grads[name], ref, atol_rel * ref.abs().max().item(), rtol)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)
    if ref_mtp_log is None:
        assert mtp_log is None, what
    else:
        assert ref_mtp_log.shape == (MTP_LAYERS,) and bool((ref_mtp_log > 0).all()), ref_mtp_log
        _close(f"{what} MTP loss log", mtp_log, ref_mtp_log, LOSS_ATOL, LOSS_RTOL)


def _assert_unpatched(model):
    for name in ("forward", "_postprocess", "compute_language_model_loss", "_cce_dist_patch"):
        assert name not in vars(model), name
    assert "forward" not in vars(model.output_layer)


def _z_loss_term(coefficient):
    """The z-loss Megatron would add from its logits: coefficient * lse**2 per token, the lse over
    the whole padded vocab (gathered, differentiably, from the vocab shards)."""

    def term(model, inputs):
        import torch
        from megatron.core.tensor_parallel import (
            gather_from_tensor_model_parallel_region,
        )

        ids, positions, attention_mask, _, _ = inputs
        logits = model(ids, positions, attention_mask)  # [b, s, V/tp]
        lse = torch.logsumexp(gather_from_tensor_model_parallel_region(logits), dim=-1)
        return coefficient * lse.square()

    return term


def _run_case(name, rank):
    """Runs every collective of the case first, then asserts (locally), so that a failed check on
    one rank cannot leave the other ranks waiting in a collective of this case."""
    import torch

    from cce_dist import megatron as cm

    tp, sp, mtp, tied, extra = CASES[name]
    if extra == "refusals":
        return _refusals()
    model, v_local = _build(tp, sp, mtp, tied, extra)
    inputs = _inputs()
    ids, positions, attention_mask, labels, _ = inputs
    if extra == "z_loss":
        want = _step(model, inputs, v_local, extra_loss=_z_loss_term(1e-3))
        options = {"z_loss": 1e-3}
    else:
        want = _step(model, inputs, v_local)
        options = {}
    if not mtp:  # megatron-core's MTP path needs labels (labels.clone()); no logits forward with MTP
        model.eval()
        with torch.no_grad():
            ref_logits = model(ids, positions, attention_mask)
            ref_eval_loss = model(ids, positions, attention_mask, labels=labels)

    patched_is_model = cm.patch(model, **options) is model
    was_patched = cm.is_patched(model)
    got = _step(model, inputs, v_local)
    if not mtp:
        model.eval()
        with torch.no_grad():
            logits = model(ids, positions, attention_mask)
            eval_loss = model(ids, positions, attention_mask, labels=labels)
    cm.patch(model, **options)  # patching again replaces, it does not stack
    unpatched_is_model = cm.unpatch(model) is model
    _assert_unpatched(model)
    again = _step(model, inputs, v_local)

    assert want[3], "the unpatched model saves its [s, b, V/tp] logits/softmax for backward"
    assert patched_is_model and was_patched and unpatched_is_model and not cm.is_patched(model)
    assert not got[3], f"the patched model saved {got[3]} for backward"
    _compare(f"[{name}]", got, want, bf16=extra == "bf16")
    if not mtp:
        assert torch.equal(logits, ref_logits), "without labels the patched model must run unchanged"
        if extra != "z_loss":
            _close(f"[{name}] eval loss", eval_loss, ref_eval_loss, LOSS_ATOL, LOSS_RTOL)
    assert again[3]
    if extra != "z_loss":
        assert torch.equal(again[0], want[0]), "unpatched: Megatron's own loss, bitwise"
    return True


def _refusals():
    """Clear errors, raised before anything runs, for what the patch cannot reproduce."""
    import torch
    from megatron.core import package_info

    from cce_dist import megatron as cm

    def raises(exc, match, fn):
        with pytest.raises(exc, match=match):
            fn()

    model, _ = _build(2, False, False, False, "")
    raises(TypeError, "GPTModel instances", lambda: cm.patch(torch.nn.Linear(2, 2)))
    wrapper = torch.nn.Module()
    wrapper.module = model
    raises(TypeError, "unwrap_model", lambda: cm.patch(wrapper))
    raises(TypeError, "unsupported option", lambda: cm.patch(model, reduction="mean"))
    raises(TypeError, "unsupported option", lambda: cm.patch(model, shift=1))
    raises(ValueError, "label_smoothing", lambda: cm.patch(model, label_smoothing=2.0))
    raises(ValueError, "stats_collective", lambda: cm.patch(model, stats_collective="bcast"))
    raises(ValueError, "not patched", lambda: cm.unpatch(model))
    version = package_info.__version__
    try:
        package_info.__version__ = "0.11.2"
        raises(TypeError, ">= 0.12", lambda: cm.patch(model))
    finally:
        package_info.__version__ = version
    for field, match in (("use_mup", "use_mup"), ("defer_embedding_wgrad_compute", "defer_embedding_wgrad")):
        old = getattr(model.config, field, None)
        setattr(model.config, field, True)
        try:
            raises(ValueError, match, lambda: cm.patch(model))
        finally:
            setattr(model.config, field, old)
    model.post_process = False
    raises(ValueError, "last pipeline stage", lambda: cm.patch(model))
    model.post_process = True
    assert not cm.is_patched(model)
    _assert_unpatched(model)

    # options Megatron's config expresses come from it (an explicit option wins)
    model.config.deterministic_mode = True
    try:
        assert cm.patch(model)._cce_dist_patch.options["deterministic"] is True
        assert cm.patch(model, deterministic=False)._cce_dist_patch.options["deterministic"] is False
    finally:
        model.config.deterministic_mode = False
        cm.unpatch(model)

    # the deferred logits fail loudly if anything but the loss uses them
    cm.patch(model)
    ids, positions, attention_mask, labels, _ = _inputs()
    state = vars(model)["_cce_dist_patch"]
    state.deferring += 1
    try:
        logits, _ = model.output_layer(torch.zeros(S, B, H))
        raises(RuntimeError, "not materialized", lambda: logits.transpose(0, 1))
    finally:
        state.deferring -= 1
    cm.unpatch(model)
    # gathered logits at tp > 1 (runtime_gather_output=True): Megatron's own path, unchanged
    model.train()
    with torch.no_grad():
        want = model(ids, positions, attention_mask, labels=labels, runtime_gather_output=True)
        cm.patch(model)
        got = model(ids, positions, attention_mask, labels=labels, runtime_gather_output=True)
    assert torch.equal(got, want)
    cm.unpatch(model)
    return True


def _spawned_body(rank, world, group, names):
    from megatron.core import parallel_state

    _stand_ins()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, create_gloo_process_groups=False)
    outcomes = {}
    try:
        for name in names:
            try:
                outcomes[name] = _run_case(name, rank) and None
            except Exception as e:  # noqa: BLE001 - reported per case to the parent
                outcomes[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        parallel_state.destroy_model_parallel()
    return outcomes


_OUTCOMES: dict = {}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    def get(tp):
        if tp not in _OUTCOMES:
            names = [n for n, c in CASES.items() if c[0] == tp]
            per_rank = run_ranks(
                _spawned_body, tp, tmp_path_factory.mktemp(f"tp{tp}"), kw={"names": names}, timeout=480, pg_timeout=240
            )
            _OUTCOMES[tp] = per_rank
        return _OUTCOMES[tp]

    return get


# under pytest-xdist, --dist loadgroup keeps each tensor-parallel size's cases on one worker (one spawn)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.xdist_group(f"megatron_patch_tp{c[0]}")) for n, c in CASES.items()]
)
def test_patched_gpt_model_matches_megatron(outcomes, name):
    per_rank = outcomes(CASES[name][0])
    for rank, result in sorted(per_rank.items()):
        assert name in result, f"rank {rank} did not run {name}"
        assert result[name] is None, f"rank {rank}: {result[name]}"
