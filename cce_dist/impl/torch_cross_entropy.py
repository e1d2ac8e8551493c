"""Pure-PyTorch implementation of the backend contract (:mod:`cce_dist.core.backend`), any device.

The logits are formed one token chunk at a time, transposed (``[V_local, n]``, computed as
``weight @ hidden_chunk.T``): on CPU this layout runs all three GEMMs (logits, dH, dW) on
contiguous operands, measured faster than ``hidden @ weight.T`` for thin chunks.
Peak extra memory is one ``[V_local, n]`` float32 block (``n`` from :func:`chunk_tokens`) plus
``O(N + V_local)`` vectors and, for low-precision weights, a float32 dW accumulator. The block
is allocated once per call and reused by every chunk (:class:`LogitsBlock`):
a fresh multi-MiB allocation per chunk costs page faults on every first touch, a measurable share
of the logits GEMM for thin chunks (both measured: docs/design.md, "torch (cce_dist/impl/torch_cross_entropy.py)").

On a CPU without native GEMMs for a bf16/fp16 compute dtype (no AVX-512-BF16/AMX: the GEMM is
emulated, measured far slower than float32: docs/design.md, "Precision contract"), the GEMM
operands are upcast to float32 once per call (``+4 * (V_local + N) * D`` bytes) and the logits
rounded to the compute dtype after the GEMM: the same values as a native low-precision GEMM with
float32 accumulation (:func:`gemm_inputs`).

No autograd and no torch.distributed here: :mod:`cce_dist.engine.autograd` calls these functions and
passes a ``reduce_stats`` callback where statistics must be combined across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ..core.backend import ALPHA, BETA, DELTA, GAMMA
from ..core.formulas import CrossEntropyTerms
from ..core.options import DEFAULT_CHUNK_SIZE, MIN_CHUNK_TOKENS
from ..core.runtime import f32_out_gemm, matmul_f32, mm_f32
from ..core.stats import ARGMAX, ENTROPY, MAX, NUM_STATS, SUM, SUM_SCALE, SUMEXP, SUMSQ, TARGET, empty_stats, safe_max


def chunk_tokens(n_tokens: int, v_local: int, chunk_size: int | None) -> int:
    """Tokens per chunk: at most ``chunk_size`` logits (at least one token), or for ``None``
    ``max(DEFAULT_CHUNK_SIZE // v_local, MIN_CHUNK_TOKENS)`` (see :mod:`cce_dist.core.options`)."""
    v = max(v_local, 1)
    step = max(DEFAULT_CHUNK_SIZE // v, MIN_CHUNK_TOKENS) if chunk_size is None else chunk_size // v
    return max(1, min(max(n_tokens, 1), step))


def token_chunks(n_tokens: int, step: int) -> Iterator[slice]:
    for lo in range(0, n_tokens, step):
        yield slice(lo, min(lo + step, n_tokens))


class LogitsBlock:
    """One reusable float32 buffer for the ``[V_local, n]`` logits of successive token chunks."""

    def __init__(self, v_local: int, max_tokens: int, device: torch.device):
        self._flat = torch.empty(v_local * max_tokens, dtype=torch.float32, device=device)
        self._v = v_local

    def view(self, n: int) -> torch.Tensor:
        """A contiguous ``[V_local, n]`` view (``n`` at most the ``max_tokens`` it was made for)."""
        return self._flat[: self._v * n].view(self._v, n)


def _native_low_precision_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has native (not emulated) GEMMs for ``dtype`` (bf16/fp16)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # private probes; assume emulated when absent
        return False


def gemm_inputs(hidden, weight, bias):
    """``(hidden, weight, bias, round_to)`` for the GEMMs: float32 copies plus the dtype to round
    the logits to when ``weight`` is bf16/fp16 on a CPU without native GEMMs of that dtype, else
    the inputs unchanged and ``None``."""
    dt = weight.dtype
    if weight.device.type != "cpu" or dt == torch.float32 or dt == torch.float64 or _native_low_precision_gemm(dt):
        return hidden, weight, bias, None
    return hidden.float(), weight.float(), None if bias is None else bias.float(), dt


def logits_t(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    temperature: float,
    block: LogitsBlock | None = None,
    round_to: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Transposed logits ``z float32 [V_local, n]`` of a token chunk, and ``tanh(raw/softcap)``.

    ``raw`` is rounded once to the compute dtype (a single addmm), exactly like ``F.linear``:
    the compute dtype is ``weight.dtype``, or ``round_to`` for float32 operands upcast from it.
    With ``block``, float32 logits are written into it (no allocation), others copied into it.
    """
    direct = block is not None and weight.dtype == torch.float32
    out = block.view(hidden.shape[0]) if block is not None and direct else None
    if bias is None:
        raw = torch.mm(weight, hidden.t(), out=out) if direct else torch.mm(weight, hidden.t())
    else:
        b = bias.unsqueeze(1)
        raw = torch.addmm(b, weight, hidden.t(), out=out) if direct else torch.addmm(b, weight, hidden.t())
    if direct or block is None:
        z = raw.float()  # no copy for float32
    else:
        z = block.view(hidden.shape[0]).copy_(raw)
        del raw
    if round_to is not None:
        z.copy_(z.to(round_to))
    th = None
    if softcap is not None:
        th = torch.tanh(z.div_(softcap))  # z is ours: raw/softcap in place, then tanh
        z = torch.mul(th, softcap, out=z)
    if temperature != 1.0:
        z.div_(temperature)
    return z, th


def target_cols(targets: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local rows, columns) of the targets that fall in this shard."""
    t_loc = targets - vocab_start
    cols = torch.nonzero((t_loc >= 0) & (t_loc < v_local), as_tuple=True)[0]
    return t_loc[cols], cols


def _chunk_stats(
    z: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    need_entropy: bool,
    need_sum: bool = True,
    need_argmax: bool = False,
    need_sumsq: bool = False,
) -> torch.Tensor:
    """Statistics of one transposed chunk. Overwrites ``z`` with ``exp(z - m)`` (with
    ``need_entropy``: with ``z - m``).

    ``need_sum`` / ``need_entropy`` / ``need_argmax`` / ``need_sumsq`` False leave those columns 0 and save a pass
    each.
    """
    v_local, n = z.shape
    if v_local == 0:
        return empty_stats(n, device=z.device)
    out = z.new_zeros(n, NUM_STATS)
    rows, cols = target_cols(targets, vocab_start, v_local)
    out[cols, TARGET] = z[rows, cols]
    if need_sum:  # sum_j z_j * 2**-32 as one GEMV: each term is scaled before it is accumulated
        out[:, SUM] = torch.mv(z.t(), z.new_full((v_local,), SUM_SCALE))
    if need_argmax:  # torch.argmax: the first (lowest) id of the max; as float32, exact below 2**24
        out[:, ARGMAX] = z.argmax(0).float() + vocab_start
    m = z.amax(0)
    out[:, MAX] = m
    z.sub_(safe_max(m))  # a row with no finite logit here (a masked shard): z stays -inf, not -inf - -inf = NaN
    if need_sumsq:  # sum_j exp(2 (z_j - m))
        out[:, SUMSQ] = torch.exp(2.0 * z).sum(0)
    if need_entropy:
        ex = torch.exp(z)
        out[:, SUMEXP] = ex.sum(0)
        ent = ex.mul_(z).sum(0)
        bad = torch.nonzero(torch.isnan(ent), as_tuple=True)[0]
        if bad.numel():  # a -inf logit (p = 0) gave 0 * -inf: its term is 0 (NaN logits stay NaN)
            zb = z[:, bad]
            ent[bad] = torch.where(torch.isneginf(zb), 0.0, torch.exp(zb) * zb).sum(0)
        out[:, ENTROPY] = ent
    else:
        out[:, SUMEXP] = z.exp_().sum(0)
    return out


def row_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    softcap: float | None,
    temperature: float,
    chunk_size: int | None = None,
    need_entropy: bool = True,
    need_sum: bool = True,
    need_argmax: bool = False,
    need_sumsq: bool = False,
) -> torch.Tensor:
    """Row statistics ``float32 [N, NUM_STATS]`` of this shard (contract: :mod:`cce_dist.core.backend`).

    ``need_entropy`` / ``need_sum`` / ``need_argmax`` / ``need_sumsq``: form the ENTROPY / SUM / ARGMAX / SUMSQ
    columns (else left 0).
    """
    n_tokens, v_local = hidden.shape[0], weight.shape[0]
    out = empty_stats(n_tokens, device=hidden.device)
    if n_tokens == 0 or v_local == 0:
        return out
    hidden, weight, bias, round_to = gemm_inputs(hidden, weight, bias)
    step = chunk_tokens(n_tokens, v_local, chunk_size)
    block = LogitsBlock(v_local, step, hidden.device)
    for sl in token_chunks(n_tokens, step):
        z = logits_t(hidden[sl], weight, bias, softcap, temperature, block, round_to)[0]
        out[sl] = _chunk_stats(z, targets[sl], vocab_start, need_entropy, need_sum, need_argmax, need_sumsq)
    return out


class GradAccumulator:
    """float32 accumulators for dH rows, dW and db, written in place where the dtype allows.

    ``round_to``: the bf16/fp16 compute dtype of float32 operands upcast from it (:func:`gemm_inputs`, a CPU
    without native GEMMs of that dtype): ``dz`` is rounded to it before the GEMMs, the values a native GEMM (and
    the Triton kernels, and the materialized program) would be given, and a chunk's dH rows are rounded to it as
    the native GEMM's output is, so results do not depend on the CPU."""

    def __init__(self, hidden, weight, need_hidden, need_weight, need_bias, round_to: torch.dtype | None = None):
        dev = hidden.device
        self.round_to = round_to
        self.dh = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_hidden else None
        # dW is written (not added) by the first chunk that reaches it: no zero-fill pass over [V, D].
        self.dw = torch.empty(weight.shape, dtype=torch.float32, device=dev) if need_weight else None
        self.db = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_bias else None
        self._dw_written = False

    def add(self, dz: torch.Tensor, hidden_chunk: torch.Tensor, weight: torch.Tensor, sl: slice) -> None:
        """Accumulate the contributions of ``dz float32 [V_local, n]`` for token chunk ``sl``."""
        if self.db is not None:
            self.db.add_(dz.sum(1))
        low = weight.dtype != torch.float32
        dzc = dz.to(weight.dtype) if low else dz
        if self.round_to is not None and not low:
            dzc = dz.to(self.round_to).float()
        if self.dh is not None:
            if low:  # a complete sum over this shard's vocab in one GEMM: one rounding, as materialized
                self.dh[sl] = torch.mm(dzc.t(), weight)
            else:
                torch.mm(dzc.t(), weight, out=self.dh[sl])
                if self.round_to is not None:  # the same rounding as the native GEMM's output
                    self.dh[sl] = self.dh[sl].to(self.round_to)
        if self.dw is not None:
            first, self._dw_written = not self._dw_written, True
            # The chunk's sum over its tokens stays float32 (never rounded to the head dtype) before
            # it joins the float32 accumulation over chunks.
            # One GEMM with a float32 result where the device has one (cce_dist.core.runtime: decided once per device
            # and dtype, never by catching the GEMM's own errors); else the upcast operands (bf16/fp16 products are
            # exact in float32: the same values, at the cost of float32 copies).
            if low and f32_out_gemm(dzc.device, dzc.dtype):
                part = matmul_f32(dzc, hidden_chunk)
                if first:
                    self.dw.copy_(part)
                else:
                    self.dw.add_(part)
            else:
                a, b = (dzc.float(), hidden_chunk.float()) if low else (dzc, hidden_chunk)
                mm_f32(self.dw, a, b, accumulate=not first)

    def result(self):
        if self.dw is not None and not self._dw_written:
            self.dw.zero_()
        return self.dh, self.dw, self.db


def _finish_dz(
    dz: torch.Tensor,
    z: torch.Tensor | None,
    th: torch.Tensor | None,
    coef: torch.Tensor,
    inactive: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    temperature: float,
    p_scale: torch.Tensor | None = None,
    gamma_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Turn ``dz = p`` (in place) into the gradient w.r.t. the raw logits of the chunk.

    ``z`` (only with an entropy term): the chunk's ``z - lse`` (= log p), for the DELTA term.
    ``p_scale [n]`` (optional, no entropy term): ``dz`` holds ``p / p_scale``, rescaled in the
    same pass as the ``alpha`` multiply. ``gamma_weights [V_local]``: the GAMMA term is ``GAMMA_i * w_j``.

    Rows whose coefficients are all zero (``inactive``, from :func:`_inactive_rows`: ignored
    targets, zero upstream gradient) get an exactly zero gradient even when their logits are not
    finite (p * 0 would be NaN there); the caller must also keep their hidden rows out of dW
    (:func:`inactive_rows_zeroed`).
    """
    alpha, beta, gamma, delta = (coef[:, k] for k in (ALPHA, BETA, GAMMA, DELTA))
    rows, cols = target_cols(targets, vocab_start, dz.shape[0])
    p_t = dz[rows, cols] if p_scale is None else dz[rows, cols] * p_scale[cols]  # p at the targets (a copy)
    if z is not None:  # entropy term: p * (alpha + delta * (z - lse)); p == 0 gives 0, not 0 * inf
        assert p_scale is None
        dz.mul_(torch.addcmul(alpha, delta, z).masked_fill_(dz == 0, 0.0))
    else:
        dz.mul_(alpha if p_scale is None else alpha * p_scale)
    # At the target: (p - 1)*ALPHA + BETA (+ the DELTA term), p - 1 exact near p = 1 (no cancellation)
    t_term = torch.addcmul(beta[cols], p_t - 1.0, alpha[cols])
    if z is not None:
        t_term += torch.where(p_t != 0, p_t * delta[cols] * z[rows, cols], 0.0)
    dz[rows, cols] = t_term
    if bool((gamma != 0).any()):
        dz.add_(gamma if gamma_weights is None else torch.outer(gamma_weights, gamma))
    if th is not None:
        dz.mul_(1.0 - th * th)
    if temperature != 1.0:
        dz.div_(temperature)
    if inactive.numel():
        dz.index_fill_(1, inactive, 0.0)
    return dz


def _inactive_rows(coef: torch.Tensor) -> torch.Tensor:
    """Indices of the chunk's rows whose coefficients are all zero."""
    return torch.nonzero((coef == 0).all(1), as_tuple=True)[0]


def inactive_rows_zeroed(hidden_chunk: torch.Tensor, inactive: torch.Tensor) -> torch.Tensor:
    """The chunk's hidden rows, with the ``inactive`` rows zeroed (a copy, only if any): a
    non-finite hidden row of an ignored token must not reach dW through 0 * inf."""
    return hidden_chunk.index_fill(0, inactive, 0.0) if inactive.numel() else hidden_chunk


# The Backend protocol's grads (cce_dist.core.backend), plus this backend's chunk_size: mypy checks the module against
# the protocol, and test_backend_signature_is_the_protocols_plus_declared_options (tests/test_signatures.py) that the
# extra keywords are the declared GRADS_OPTIONS.
def grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    coef: torch.Tensor,
    *,
    vocab_start: int,
    softcap: float | None,
    temperature: float,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    filter_eps: float | None = None,
    deterministic: bool = False,
    gamma_weights: torch.Tensor | None = None,
    chunk_size: int | None = None,
):
    """Gradients of this shard from the global ``lse`` and ``coef`` (contract: :mod:`cce_dist.core.backend`).

    Exact: ``filter_eps`` is accepted for interface parity and ignored; always deterministic.
    """
    del filter_eps, deterministic
    n_tokens, v_local = hidden.shape[0], weight.shape[0]
    if n_tokens == 0 or v_local == 0:
        return GradAccumulator(hidden, weight, need_hidden, need_weight, need_bias).result()
    need_z = bool((coef[:, DELTA] != 0).any())
    hidden, weight, bias, round_to = gemm_inputs(hidden, weight, bias)
    acc = GradAccumulator(hidden, weight, need_hidden, need_weight, need_bias, round_to)
    step = chunk_tokens(n_tokens, v_local, chunk_size)
    block = LogitsBlock(v_local, step, hidden.device)

    def chunk(sl: slice, c: torch.Tensor) -> None:
        # A function per chunk, so its temporaries die before the next chunk starts.
        z, th = logits_t(hidden[sl], weight, bias, softcap, temperature, block, round_to)
        z.sub_(lse[sl])  # log p
        p = torch.exp(z) if need_z else z.exp_()
        inactive = _inactive_rows(c)
        dz = _finish_dz(
            p,
            z if need_z else None,
            th,
            c,
            inactive,
            targets[sl],
            vocab_start,
            temperature,
            gamma_weights=gamma_weights,
        )
        acc.add(dz, inactive_rows_zeroed(hidden[sl], inactive), weight, sl)

    for sl in token_chunks(n_tokens, step):
        c = coef[sl]
        if bool(c.any()):  # else every row of the chunk is ignored or has a zero upstream gradient
            chunk(sl, c)
    return acc.result()


def fused_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    terms: CrossEntropyTerms,
    row_grad: float,
    *,
    vocab_start: int,
    softcap: float | None,
    chunk_tokens_: int,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
    reduce_stats: Callable[[torch.Tensor], torch.Tensor] | None = None,
    need_sum: bool = True,
    sum_column: torch.Tensor | None = None,
    gamma_weights: torch.Tensor | None = None,
):
    """Loss rows and gradients in one pass over token chunks (3 GEMMs; the scalar-loss schedule).

    Each chunk's full rows of logits give the (global, via ``reduce_stats``) statistics, then the
    loss rows ``terms.rows(stats, rows) -> (loss, lse)`` and, while the logits are still held,
    the gradient for an upstream gradient of ``row_grad`` on every counted row (``terms.valid``) from
    ``terms.coef(lse, rows)`` (``rows``: the chunk's slice of the N rows; ``p`` is formed as
    ``exp(z - m) / s``, exactly: the coefficients need no
    :func:`~cce_dist.core.formulas.lse_residual`). ``chunk_tokens_`` must be the same on every rank when
    ``reduce_stats`` communicates. ``need_sum=False`` skips the SUM statistic (no label smoothing);
    ``sum_column`` (``float32 [N]``) replaces this shard's SUM column before the exchange, and ``gamma_weights``
    (``float32 [V_local]``) weighs the GAMMA term per vocab row (class weights).
    Returns ``(loss_rows, lse, d_hidden, d_weight, d_bias)``.
    """
    n_tokens = hidden.shape[0]
    loss = hidden.new_zeros(n_tokens, dtype=torch.float32)
    lse = hidden.new_zeros(n_tokens, dtype=torch.float32)
    block = LogitsBlock(weight.shape[0], min(chunk_tokens_, max(n_tokens, 1)), hidden.device)
    hidden, weight, bias, round_to = gemm_inputs(hidden, weight, bias)
    acc = GradAccumulator(hidden, weight, need_hidden, need_weight, need_bias, round_to)

    def chunk(sl: slice) -> None:
        # A function per chunk, so its temporaries die before the next chunk starts.
        z, th = logits_t(hidden[sl], weight, bias, softcap, 1.0, block, round_to)
        local = _chunk_stats(z, targets[sl], vocab_start, need_entropy=False, need_sum=need_sum)  # z := exp(z - m)
        if sum_column is not None:
            local[:, SUM] = sum_column[sl]
        glob = reduce_stats(local) if reduce_stats is not None else local
        loss[sl], lse[sl] = terms.rows(glob, sl)
        if acc.dh is None and acc.dw is None and acc.db is None:
            return
        # p = exp(z - m_local) * exp(m_local - m) / s, the factor joining alpha's pass: exact to a few float32
        # roundings, where exp(m_local - lse) would carry the rounding of lse (an ulp of the logits' magnitude)
        c = terms.coef(lse[sl], sl) * row_grad
        inactive = _inactive_rows(c)
        p_scale = torch.exp(local[:, MAX] - glob[:, MAX]) / glob[:, SUMEXP]
        dz = _finish_dz(
            z, None, th, c, inactive, targets[sl], vocab_start, 1.0, p_scale=p_scale, gamma_weights=gamma_weights
        )
        acc.add(dz, inactive_rows_zeroed(hidden[sl], inactive), weight, sl)

    for sl in token_chunks(n_tokens, chunk_tokens_):
        chunk(sl)
    return (loss, lse) + acc.result()
