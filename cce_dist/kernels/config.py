"""Block sizes for the cce_dist Triton kernels, chosen from what the device reports.

Nothing here launches a kernel or touches CUDA except :meth:`DeviceProps.of`. Every choice is a
pure function of a small :class:`DeviceProps` record (compute capability, SM count, shared memory
per block), so ``tests/test_aot_compile.py`` can ask what the library would select on a device
it does not have and compile exactly that ahead of time.

The matrix instruction family comes from the capability: 9.x -> Hopper ``wgmma``, 10.x / 11.x ->
datacenter Blackwell ``tcgen05`` (tensor memory holds the accumulator), everything else from 8.0
on (Ampere, Ada, and consumer Blackwell 12.x) -> ``mma.sync``. Which tiles fit is decided by the
reported shared memory per block, never by the major version alone (sm_120 reports 101,376 B like
sm_86/89, not Hopper's 232,448 B).

The forward kernel gets a small autotune set (its outputs are plain stores, so re-running a
config while tuning is harmless). The backward kernels accumulate into their outputs (atomics or
read-modify-write), so they use one fixed config per (device, dtype, flags) instead.

The candidate lists below were checked with the real compiler for sm_80/86/90/100/120 (see
tests/test_aot_compile.py): none exceeds its target's shared memory, and bf16/fp16 configs do not
spill. fp32 without TF32 has no tensor-core path; its configs are kept small (it is a
correctness mode, not a fast one).

Under ``TRITON_INTERPRET=1`` (kernels run by numpy on the CPU) there is no autotuning and the
blocks are small fixed sizes, so that tests with tiny shapes stay fast and still exercise several
tiles, partial tiles and the multi-split path.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative host integers (grids, tile counts). Not ``triton.cdiv``: that is a
    ``ConstexprFunction`` (about 14 us a call), and the chunked backward plans several per chunk on every call."""
    return -(-a // b)


#: FP contraction (a*b+c -> fma) in the kernels' elementwise code. Set explicitly: Triton 3.9
#: enables it by default and warns that 3.10 disables it, which would move results by an ulp.
#: Off matches the 3.10 default and the eager PyTorch elementwise ops of the reference program
#: (which never contract across ops); the matmuls are unaffected (they accumulate with MMA).
ENABLE_FP_FUSION = False


@functools.lru_cache(maxsize=16)  # triton_version() runs in every config choice
def parse_version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``"3.6.0"`` or ``"3.7.0+git1234"``."""
    m = re.match(r"\s*(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"not a version: {text!r}")
    return int(m.group(1)), int(m.group(2))


def triton_version() -> tuple[int, int]:
    """``(major, minor)`` of the Triton that is imported (``triton.__version__``)."""
    import triton

    return parse_version(triton.__version__)


@dataclass(frozen=True)
class DeviceProps:
    """What config selection needs to know about a GPU.

    capability: (major, minor). sms: streaming multiprocessors. smem_per_block: the largest
    dynamic shared memory one block may opt into, in bytes
    (``cudaDevAttrMaxSharedMemoryPerBlockOptin``). name: for reports only.
    """

    capability: tuple[int, int]
    sms: int
    smem_per_block: int
    name: str = ""

    @staticmethod
    def of(device: torch.device | str | int | None = None) -> DeviceProps:
        """The record of a CUDA device (the current one by default).

        torch before 2.7 has no ``shared_memory_per_block_optin`` in the device properties (only the 48 KB that
        needs no opt-in, or nothing): there the opt-in maximum comes from the capability
        (:data:`OPTIN_SMEM_BY_CAPABILITY`), never less than what torch reports, since reading 48 KB (or 0) would
        reject every candidate config and leave the smallest tiles. Any other field torch lacks falls back the
        same way (the SM count to 1: correct, but no vocab splits)."""
        p = torch.cuda.get_device_properties(device)
        cap = (int(getattr(p, "major", 0)), int(getattr(p, "minor", 0)))
        smem = int(getattr(p, "shared_memory_per_block_optin", 0) or 0)
        if smem <= 0:
            smem = max(optin_smem_of(cap), int(getattr(p, "shared_memory_per_block", 0) or 0))
        sms = int(getattr(p, "multi_processor_count", 0) or 0) or 1
        return DeviceProps(cap, sms, smem, str(getattr(p, "name", "")))

    @property
    def consumer_ampere_ada(self) -> bool:
        """Capability 8.6 or later of major 8 (sm_86 / sm_87 / sm_89: RTX 30 / A10 / A40, Orin, RTX 40 / L4 / L40):
        mma.sync like sm_80, where some kernels' register allocation differs from sm_80's (``backward_config``)."""
        return self.capability[0] == 8 and self.capability[1] >= 6

    @property
    def consumer_blackwell(self) -> bool:
        """Capability 12.x (sm_120: RTX 50, RTX PRO 6000): mma.sync with 99 KB of shared memory, no tcgen05."""
        return self.mma == "mma" and self.capability[0] >= 12

    @property
    def mma(self) -> str:
        """Tensor-core instruction family: 'wgmma', 'tcgen05', 'mma' (mma.sync) or 'none'."""
        major = self.capability[0]
        if major == 9:
            return "wgmma"
        if major in (10, 11):
            return "tcgen05"
        if major >= 8:
            return "mma"
        return "none"


#: The largest shared memory one block may opt into (``cudaDevAttrMaxSharedMemoryPerBlockOptin``, bytes) per
#: compute capability, from NVIDIA's CUDA C++ Programming Guide (table "Technical Specifications per Compute
#: Capability"): what :meth:`DeviceProps.of` uses where torch does not report it (before torch 2.7).
OPTIN_SMEM_BY_CAPABILITY: dict[tuple[int, int], int] = {
    (8, 0): 166_912,  # A100, A30: 163 KB
    (8, 6): 101_376,  # consumer / workstation Ampere: 99 KB
    (8, 7): 166_912,  # Jetson Orin: 163 KB
    (8, 9): 101_376,  # Ada: 99 KB
    (9, 0): 232_448,  # Hopper: 227 KB
    (10, 0): 232_448,  # datacenter Blackwell: 227 KB
    (12, 0): 101_376,  # consumer Blackwell: 99 KB
}


def optin_smem_of(capability: tuple[int, int]) -> int:
    """:data:`OPTIN_SMEM_BY_CAPABILITY` for ``capability``; for one not listed, the closest listed capability below
    it of the same major version, else 48 KB (what every CUDA GPU allows without opting in)."""
    if capability in OPTIN_SMEM_BY_CAPABILITY:
        return OPTIN_SMEM_BY_CAPABILITY[capability]
    same_major = [c for c in OPTIN_SMEM_BY_CAPABILITY if c[0] == capability[0] and c <= capability]
    return OPTIN_SMEM_BY_CAPABILITY[max(same_major)] if same_major else 48 * 1024


#: Devices the AOT test compiles for (one per shared-memory / instruction class).
KNOWN_DEVICES: dict[str, DeviceProps] = {
    "sm_80": DeviceProps((8, 0), 108, 166_912, "A100"),
    "sm_86": DeviceProps((8, 6), 84, 101_376, "RTX A6000 / RTX 3090 class"),
    "sm_90": DeviceProps((9, 0), 132, 232_448, "H100 / H200 SXM"),
    "sm_100": DeviceProps((10, 0), 148, 232_448, "B200"),
    "sm_120": DeviceProps((12, 0), 170, 101_376, "RTX 5090 class"),
}


@dataclass(frozen=True)
class FwdConfig:
    block_n: int
    block_v: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 2
    #: ptxas's register cap per thread (the launch option ``maxnreg``); None: ptxas's own occupancy heuristic
    maxnreg: int | None = None


@dataclass(frozen=True)
class BwdConfig:
    block_n: int  # token tile
    block_v: int  # vocab tile
    block_d: int  # reduction chunk of the logit recompute (h @ W.T)
    block_d_out: int  # column chunk of the dH / dW tiles written per step
    group_n: int = 8  # L2 swizzle of the fused kernel's (token tile, vocab tile) grid
    num_warps: int = 4
    num_stages: int = 2
    #: ptxas's register cap per thread (the launch option ``maxnreg``); None: ptxas's own occupancy heuristic
    maxnreg: int | None = None


def register_cap(c: FwdConfig | BwdConfig) -> dict:
    """The launch option of ``c``'s register cap: ``{"maxnreg": c.maxnreg}``, or nothing (ptxas's own heuristic)."""
    return {} if c.maxnreg is None else {"maxnreg": c.maxnreg}


# Interpreter: tiny tiles, chosen so that the test shapes (N <= 33, V_local <= 100, D <= 40)
# cover several token tiles, several vocab tiles, ragged last tiles and a ragged D loop.
INTERPRET_FWD = FwdConfig(block_n=16, block_v=32, block_d=16)
INTERPRET_BWD = BwdConfig(block_n=16, block_v=32, block_d=16, block_d_out=16, group_n=2)


def _elt(dtype: torch.dtype) -> int:
    return 4 if dtype == torch.float32 else 2


def fwd_smem_estimate(c: FwdConfig, dtype: torch.dtype) -> int:
    """Upper estimate of the forward's shared memory: num_stages buffers of an H and a W chunk
    (what Triton's pipeliner allocates) plus 1 KB for barriers."""
    return c.num_stages * (c.block_n + c.block_v) * c.block_d * _elt(dtype) + 1024


def bwd_smem_estimate(c: BwdConfig, dtype: torch.dtype) -> int:
    """Upper estimate of the backward's shared memory: the pipelined recompute buffers plus the
    gradient matmuls' operands (the dz tile and two W / H column chunks)."""
    e = _elt(dtype)
    recompute = c.num_stages * (c.block_n + c.block_v) * c.block_d * e
    return recompute + c.block_n * c.block_v * e + 2 * max(c.block_n, c.block_v) * c.block_d_out * e + 1024


def _fits(smem: int, props: DeviceProps) -> bool:
    return smem <= props.smem_per_block


#: Scratch of the chunked backward (the default schedule): the dz of one (row block, vocab chunk)
#: pair, ``[Nc, Vc]`` in the compute dtype, plus its db partial sums (see :func:`chunk_shape`).
CHUNK_SCRATCH_BYTES = 16 << 20

#: Narrowest vocab chunk the chunked backward walks before it also splits the tokens into row
#: blocks. Vc is the K dimension of its dH GEMM (``dH[rows] += dz @ W[chunk]``), which reads and
#: writes those rows of the fp32 dH once per chunk: Vc FLOPs per 4 bytes of dH moved, so at 1024
#: columns it sits near the H100's ridge point (docs/design.md, "Backward", chunked, has the figure
#: from benchmarks/gpu_model.py's rates) and narrower chunks make it HBM-bound. With more tokens
#: than let 1024 columns fit the scratch (about 8192 in bf16), fewer rows per block keep the chunks
#: this wide instead.
CHUNK_MIN_COLS = 1024

#: Interpreter: vocab columns per chunk, so that the tests' shapes (V_local <= 200) walk several
#: chunks, the last one ragged. (Row blocks are forced small per call, by ``grads(_chunk_rows=)``.)
INTERPRET_CHUNK_COLS = 64


def chunk_shape(
    n: int, v: int, block_n: int, block_v: int, elt: int, need_bias: bool, max_rows: int | None = None
) -> tuple[int, int]:
    """``(Nc, Vc)``: rows per row block and vocab columns per chunk of the chunked backward for
    ``n`` tokens and a ``v``-row shard, so that its scratch (dz ``[Nc, Vc]`` at ``elt`` bytes plus,
    with ``need_bias``, fp32 db partial sums ``[cdiv(Nc, block_n), Vc]``) fits
    ``CHUNK_SCRATCH_BYTES`` at any ``n``.

    All ``n`` rows in one block (``Nc = n``) whenever :data:`CHUNK_MIN_COLS` columns (or the whole
    shard, if narrower) fit with them; otherwise equal row blocks (the last one ragged) of a
    multiple of ``block_n`` rows, as few as keep that width. Vc is then the widest multiple of
    ``block_v`` that fits with Nc rows (at least one tile, at most the shard). ``max_rows`` (tests)
    caps Nc below what the budget allows (rounded down to a multiple of ``block_n``)."""

    def col_bytes(rows: int) -> int:
        return rows * elt + (cdiv(rows, block_n) * 4 if need_bias else 0)

    budget = CHUNK_SCRATCH_BYTES
    v_pad = max(1, cdiv(v, block_v)) * block_v
    min_cols = min(max(block_v, CHUNK_MIN_COLS // block_v * block_v), v_pad)
    rows = max(n, 1)
    if max_rows is not None and max_rows < rows:
        rows = max(block_n, max_rows // block_n * block_n)
    if min_cols * col_bytes(rows) > budget:
        rows = max(block_n, budget // (min_cols * elt) // block_n * block_n)
        while rows > block_n and min_cols * col_bytes(rows) > budget:
            rows -= block_n
    if rows < n:  # as few blocks as that allows, of equal size (a multiple of block_n)
        rows = cdiv(cdiv(n, cdiv(n, rows)), block_n) * block_n
    vc = max(block_v, budget // max(col_bytes(rows), 1) // block_v * block_v)
    return rows, min(vc, v_pad)


#: The smallest configs, used where nothing else fits and for fp32 without tensor cores (an FMA
#: dot: small tiles keep the fp32 operands in registers without spilling).
SMALL_FWD = FwdConfig(32, 64, 16, num_warps=4, num_stages=2)
SMALL_BWD = BwdConfig(32, 64, 16, 32, group_n=8, num_warps=4, num_stages=2)
#: The forward's config for fp32 IEEE (and GPUs without tensor cores): with ptxas's own register cap the FMA dot's
#: 32 x 64 tiles spilled 8 B with every statistic and row output on (sm_100, Triton 3.7 / 3.8); capped at 255 they
#: spill nowhere (benchmarks/results/aot_spills_pairs.md).
FP32_FWD = FwdConfig(32, 64, 16, num_warps=4, num_stages=2, maxnreg=255)
#: ... and with the row outputs (ARGMAX / SUMSQ): over 4 warps, with every statistic and row output at rows not
#: 16-byte aligned, 8 B spilled at 255 registers (sm_90, Triton 3.9, the forward's whole flag product); 8 warps
#: over the same tile hold at most 230.
FP32_FWD_HEAVY = dataclasses.replace(FP32_FWD, num_warps=8)
#: The backward's and the distillation's config for fp32 IEEE (and GPUs without tensor cores): the FMA dot holds
#: every fp32 operand in registers, and ptxas held the 32 x 64 tiles to 128-168 registers by its occupancy heuristic
#: and spilled 8-32 B (the owner-computes dH kernel with every epilogue; the distillation's kernels, every Triton
#: 3.6-3.9). 32 x 32 tiles with the register cap at 255 spill nowhere (benchmarks/results/aot_spills_pairs.md).
FP32_BWD = BwdConfig(32, 32, 16, 32, group_n=8, num_warps=4, num_stages=2, maxnreg=255)


def forward_candidates(
    props: DeviceProps,
    dtype: torch.dtype,
    tf32: bool = True,
    softcap: bool = False,
    aligned: bool = True,
    lean: bool = False,
    heavy: bool = False,
    compiler: tuple[int, int] | None = None,
    bias: bool = False,
    temperature: bool = False,
) -> list[FwdConfig]:
    """Every forward config the library may try on ``props`` for ``dtype`` (autotuned among these).

    ``tf32``: fp32 inputs with TF32 matmuls allowed (otherwise fp32 uses no tensor cores).
    ``softcap``: the tanh epilogue needs a few more registers (drops 64x256 on tcgen05).
    ``aligned``: rows of H and W start on 16-byte boundaries; unaligned rows get no vectorized /
    async loads and more address registers, so 256-wide vocab tiles are dropped (on wgmma / tcgen05 one
    64 x 128 x 32 candidate is left; on mma.sync the candidates run over 8 warps).
    ``lean``: the kernel skips the SUM / ENTROPY statistics (the cross-entropy without label
    smoothing); its epilogue holds two fewer running values per row, which lets a 128x256 wgmma tile
    (two warpgroups, each a full-width m64n256 instruction) run without spilling on sm_90 (not with a ``bias``: its
    256-wide row spilled 224-256 B there, the forward's whole flag product, Triton 3.9).
    ``heavy``: the row outputs' ARGMAX / SUMSQ too (two more running values and a per-tile argmax): tiles of more
    than 64x128 logits spill then, so they are dropped (docs/design.md, "Row outputs").
    ``compiler``: the Triton ``(major, minor)`` that will compile the kernel (default: the installed one); where one
    version's ptxas spills a candidate the others do not, that version gets a narrower K chunk (below).
    ``bias``: the head has a bias (one more row of the tile's epilogue): no 256-wide vocab tile then on tcgen05 (8 B
    at 255 registers, sm_100, Triton 3.9) and on wgmma (24-224 B with the entropy statistic, Triton 3.6), and on
    tcgen05 the register cap at 255 (ptxas held 64 x 128 to 128 registers: 8 B); TF32 on both with a softcap too:
    no 128 x 128 tile (32-64 B at a token count not a multiple of 16; sm_100 with Triton 3.9, sm_90 with 3.8), nor on
    wgmma with a temperature and Triton 3.8 (8 B in fp16), whose wgmma tiles all take half-wide K chunks.
    ``temperature``: the logits are divided by a temperature (one more multiply per logit).

    On tcgen05 (sm_100) the forward's whole flag product with Triton 3.9 found three more classes, each answered for
    every compiler: the 64 x 256 tile with a temperature and the SUM / ENTROPY statistics (88 B at 255 registers: no
    256-wide tile with a temperature, as with a softcap or a bias); TF32 with a bias in 128 x 128 (8-56 B at 255
    registers: no 128-row tile with a bias in TF32); and the row outputs' tiles with a softcap or a temperature,
    which ptxas held to 128 registers (8 B, aligned rows or not: the register cap at 255 with the row outputs)."""
    if props.mma == "none" or (dtype == torch.float32 and not tf32):
        return [FP32_FWD_HEAVY if heavy else FP32_FWD]
    if compiler is None:
        compiler = triton_version()
    bd = 64 if dtype != torch.float32 else 32
    if props.mma == "wgmma" and compiler == (3, 8):
        # Triton 3.8 on wgmma: with the SUM / ENTROPY statistics 64-wide K chunks spilled 24-88 B at 255 registers in
        # bf16 / fp16, 32-wide ones 64-96 B in TF32 (the 128 x 128 tile over two warpgroups and 64 x 128 over one; the
        # forward's whole flag product on sm_90). Half as wide, none of them spills, nor does the lean 128 x 256 tile
        # (16 B in 64-wide chunks)
        bd //= 2
    # mma.sync's 8-warp tiles on sm_120: ptxas held them to 128 registers and spilled 8-16 B (below), capped at 255
    cap120 = 255 if props.consumer_blackwell else None
    if props.mma == "tcgen05":
        # The accumulator lives in tensor memory, but the epilogue reads it back into registers:
        # 128x128 tiles spill there (the readback plus the online-softmax state), 64-row tiles do not.
        # Triton 3.7 (ptxas held these two to 128 registers) spilled 8 B in TF32 128x128 with 16-wide K chunks and
        # 16 B in 64x128 with 64-wide ones; 32-wide chunks do not spill (benchmarks/results/aot_spills.md).
        k37 = compiler == (3, 7)
        # Triton 3.6 held TF32 64 x 256 to 128 registers and spilled 8 B with the entropy statistic (the forward's
        # whole flag product on sm_100): the cap at 255 there. Not on 3.8 / 3.9, where it is clean at 141-160
        # registers uncapped and the cap made ptxas spill 40-96 B at 255
        cap36 = 255 if compiler < (3, 7) else None
        if dtype == torch.float32:
            cands = [
                FwdConfig(64, 256, 16, num_warps=8, num_stages=3, maxnreg=cap36),
                FwdConfig(128, 128, 32 if k37 else 16, num_warps=8, num_stages=3),
                FwdConfig(64, 128, 32, num_warps=8, num_stages=3),
            ]
        else:
            cands = [
                FwdConfig(64, 256, bd, num_warps=8, num_stages=3),
                FwdConfig(64, 128, 32 if k37 else bd, num_warps=8, num_stages=3),
            ]
        if softcap or bias or temperature:
            cands = [c for c in cands if c.block_v < 256]
        if bias:
            cands = [c for c in cands if not ((softcap or dtype == torch.float32) and c.block_n == 128)]
    elif props.mma == "wgmma":
        # the one-warpgroup 64x128 tile over 3 stages with a softcap: over 4, ptxas spilled 8 B at 255 registers with
        # a softcap and SUM but no ENTROPY (sm_90, Triton 3.9, the forward's whole flag product); over 3, 233
        cands = [
            FwdConfig(128, 128, bd, num_warps=8, num_stages=3),
            FwdConfig(64, 256, bd, num_warps=8, num_stages=3),
            FwdConfig(64, 128, bd, num_warps=4, num_stages=3 if softcap else 4),
        ]
        if bias:
            # the 256-wide tile with a bias spilled 24-224 B with the entropy statistic (bf16 / fp16 / TF32, Triton 3.6:
            # 24 launches of the forward's whole flag product on sm_90) and 224 B with a softcap (TF32, 3.6, a ragged
            # token count); with a softcap in TF32 the 128-row one 64 B (Triton 3.8, a ragged token count), and with a
            # temperature in fp16 8 B (Triton 3.8, the forward's whole flag product)
            tall = (softcap and dtype == torch.float32) or (temperature and compiler == (3, 8))
            cands = [c for c in cands if c.block_v < 256 and not (tall and c.block_n == 128)]
        if lean and not softcap and not bias and dtype != torch.float32:
            cands.insert(0, FwdConfig(128, 256, bd, num_warps=8, num_stages=3))
    else:
        # mma.sync keeps the accumulator in registers: a 128x128 (or 4-warp 64x128) fp32 tile plus
        # the online-softmax epilogue spills; 64x128 over 8 warps does not. TF32 takes 2 stages of its 16-wide
        # chunks: with 3, ptxas held the lean epilogue (no SUM / ENTROPY) to 128 registers and spilled 8 B on sm_120
        # (Triton 3.9, benchmarks/results/aot_spills.md).
        # On sm_120 ptxas held the 8-warp 64x128 tile to 128 registers and spilled 8-16 B (a bias and a temperature in
        # bf16; TF32 at a token count not a multiple of 16; Triton 3.9, the triples level): capped at 255 there. So is
        # the 64 x 64 one: 168 registers over 4 warps and 8 B with a bias, SUM and ENTROPY (fp16), 128 over the 8 warps
        # of rows not aligned and 16 B with a softcap, a temperature and SUM (TF32; the forward's whole flag product,
        # Triton 3.9).
        cands = [
            FwdConfig(64, 128, 32, num_warps=8, num_stages=3, maxnreg=cap120)
            if dtype != torch.float32
            else FwdConfig(64, 128, 16, num_warps=8, num_stages=2, maxnreg=cap120),
            FwdConfig(64, 64, 32, num_warps=4, num_stages=3, maxnreg=cap120),
        ]
    if heavy and props.mma == "wgmma":
        # the NaN-aware per-tile argmax: a 64x128 tile over one warpgroup spills (~100 B), over two it does not
        cands = [FwdConfig(64, 128, bd, num_warps=8, num_stages=3)]
    elif heavy and props.mma == "tcgen05":
        cands = [c for c in cands if c.block_n * c.block_v <= 64 * 128]
    elif heavy:  # mma.sync: the accumulator in registers too; 8 warps over 64x64 (64x128 and 4-warp 64x64 spill)
        # in 16-wide K chunks: with 32, ptxas held a token count not a multiple of 16 to 128 registers and spilled 8 B
        # on sm_120 (fp16 with argmax + sumsq, Triton 3.9; bf16 with sumsq, 3.6; benchmarks/results/aot_spills_pairs.md)
        # TF32 over 2 stages, as above: 3 spilled 8 B at 128 registers (sm_120, a ragged token count, Triton 3.9)
        # on sm_120 capped at 255, as the 8-warp tiles above: Triton 3.8 held TF32 to 128 registers (16 B, a softcap)
        # on every mma.sync target: Triton 3.6 held bf16 to 128 registers on sm_80 (8 B with SUM, ENTROPY and SUMSQ, the
        # forward's whole flag product)
        cands = [FwdConfig(64, 64, 16, num_warps=8, num_stages=2 if dtype == torch.float32 else 3, maxnreg=255)]
    if not aligned and props.mma == "mma":
        # no vectorized loads: the 4-warp 64x64 tile spilled 8-24 B there (sm_120, Triton 3.6 / 3.7), 8 warps do not
        cands = [dataclasses.replace(c, num_warps=8) for c in cands]
    elif not aligned:
        # wgmma / tcgen05 without vectorized or asynchronous loads (the operands pass through registers): 128-row tiles
        # and 64-wide K chunks spilled 16-1048 B there (sm_90 / sm_100, Triton 3.6 and 3.9, every pair of flags:
        # benchmarks/results/aot_spills_pairs.md); 64 x 128 tiles in 32-wide chunks over two warpgroups do not, nor
        # 64 x 64 with the row outputs (64 x 128 spilled 48 B with every feature on: TF32, sm_100, Triton 3.9)
        cands = [FwdConfig(64, 64 if heavy else 128, 32, num_warps=8, num_stages=3)]
    if props.mma == "tcgen05" and (bias or heavy):
        # after the tile choices above (the unaligned one included): ptxas's own heuristic held these to 128 registers
        cands = [dataclasses.replace(c, maxnreg=255) for c in cands]
    out = [c for c in cands if _fits(fwd_smem_estimate(c, dtype), props) and (aligned or c.block_v < 256)]
    return out or [SMALL_FWD]


def backward_config(
    props: DeviceProps,
    dtype: torch.dtype,
    *,
    tf32: bool = True,
    softcap: bool = False,
    filtering: bool = False,
    deterministic: bool = False,
    class_weights: bool = False,
    compiler: tuple[int, int] | None = None,
    ragged_rows: bool = False,
    aligned: bool = True,
    bias: bool = False,
) -> BwdConfig:
    """The one backward config for ``props``, ``dtype`` and flags (see the module docstring for
    why it is not tuned): the first candidate whose shared memory fits.

    The softcap and filtering epilogues keep more fp32 tiles live (tanh factor, filter test):
    with a 128x128 tile they spill on every target, so they get 64-row tiles. ``deterministic``
    matters on tcgen05 only (its load-add-store epilogue needs narrower column chunks there).
    ``class_weights`` (the GAMMA term weighed per vocab row): the deterministic dW kernel beside the softcap tiles
    then spills 8 B with 64x64 tiles on mma.sync (sm_80, sm_120), so it gets 64x32 tiles (on every target; over 4
    warps on mma.sync, where the deterministic configs also take 16-wide gradient-product chunks).
    ``bias``: the head has a bias (its gradient is the dz row sums the kernels add up).
    ``compiler``: the Triton ``(major, minor)`` that will compile the kernel (default: the installed
    one, :func:`triton_version`); Triton before 3.8 allocates the filter test's registers worse on
    tcgen05, so filtering there gets 64x64 tiles (and 32-wide gradient-product chunks).
    ``ragged_rows``: a token count that is not a multiple of 16 (no divisibility hint for N): beside any epilogue
    (softcap, filter, deterministic, class weights) every schedule's kernels spilled there (the per-tile filtering
    epilogue 150-240 B with 128-wide vocab tiles, Triton 3.6-3.9; the chunked dz and owner-computes kernels 8-320 B
    with every feature on, 3.9), so the vocab tiles are halved (below).
    ``aligned``: every row of H and W starts on a 16-byte boundary (:func:`._common.rows_aligned`). Without it
    the operands load through registers (no vectorized or asynchronous copies): on wgmma / tcgen05 the 128-row tiles
    and 64-wide chunks spilled 8-704 B (the chunked dz kernel with class weights, the owner-computes dH / dW kernels;
    sm_90 / sm_100, Triton 3.6 and 3.9), so bf16 / fp16 there take 64 x 64 tiles in 32-wide chunks, and every
    config's vocab tiles are halved (below): the per-tile kernel spilled 16-336 B on mma.sync even without an
    epilogue (Triton 3.9)."""
    if compiler is None:
        compiler = triton_version()
    c = _backward_tiles(
        props, dtype, tf32, softcap, filtering, deterministic, class_weights, compiler, ragged_rows, aligned
    )
    # Register pressure: the triples level (every triple of flag values, each mode's every-feature flag set at every
    # shape; benchmarks/results/aot_spills_triples.md) found every kernel spilling 8-376 B on every target (Triton 3.9)
    # with rows not 16-byte aligned, with a token count not a multiple of 16 beside any epilogue (softcap, filter,
    # deterministic load-add-store, class weights), and with three of those at once; half-wide vocab tiles spilled in
    # none of them but a few (fewer warps, narrower K chunks or the register cap alone moved the spill): rows not
    # aligned with two epilogues still spilled 8 B in the per-tile kernel (TF32, sm_100), so those halve twice; and
    # on mma.sync and tcgen05 ptxas held the narrowest tiles (TF32 64 x 16 / 64 x 32, every feature on) to 128
    # registers and spilled 8-16 B, so the halved tiles there carry the cap at 255 (96-198 registers).
    # Triton 3.6 and 3.7 on mma.sync and wgmma: the chunked dz kernel with the filter spilled 88-136 B (3.6) and
    # 16-80 B (3.7) at 255 registers (sm_80 / sm_86 / sm_90, without dH) where 3.8 and 3.9 did not; half-wide tiles
    # do not. On wgmma the filter beside a softcap spilled with 3.9 too (8-40 B, the per-tile and chunked dz kernels,
    # the backward's whole flag product on sm_90).
    filter_pressure = (
        filtering and props.mma in ("mma", "wgmma") and (compiler < (3, 8) or (softcap and props.mma == "wgmma"))
    )
    # wgmma: the owner-computes dW kernel (bf16 / fp16, 128 x 128 x 64 over 8 warps) with a bias or class weights
    # spilled 8-264 B at 255 registers (19 launches of the backward's whole flag product on sm_90 with Triton 3.6, 14
    # with 3.9; none of the covering levels'); half-wide vocab tiles (or half-high row tiles) do not. tcgen05: the same
    # kernel (64 x 128 x 32) with a bias, class weights and a temperature, 48 B at 255 registers (sm_100, Triton 3.9).
    sixteen_bit = dtype != torch.float32
    owner_pressure = deterministic and (bias or class_weights) and props.mma in ("wgmma", "tcgen05") and sixteen_bit
    # tcgen05 with Triton 3.6: the chunked dz kernel with a bias spilled 80-96 B at 255 registers beside class weights
    # (bf16 / fp16, 128 x 128 x 64; 3.9 holds it in 193) and 16 B beside a softcap and the filter (TF32, 64 x 128 x
    # 32; the backward's whole flag product on sm_100); half-wide vocab tiles do not
    old_tcgen05 = props.mma == "tcgen05" and compiler < (3, 7) and bias and not deterministic
    tcgen05_pressure = old_tcgen05 and (
        (class_weights and sixteen_bit) or (softcap and filtering and dtype == torch.float32 and tf32)
    )
    # sm_120, TF32 with a bias: the per-tile kernel (64 x 64 x 32 over 8 warps) spilled 8 B at 255 registers without
    # the bias gradient (Triton 3.9, the backward's whole flag product); half-wide vocab tiles do not
    sm120 = props.consumer_blackwell
    sm120_tf32 = sm120 and not sixteen_bit and tf32
    tf32_bias = sm120_tf32 and bias and not deterministic
    epilogues = softcap + filtering + deterministic + class_weights
    halvings = (not aligned) + (ragged_rows and epilogues > 0) + (epilogues >= 3) + (not aligned and epilogues >= 2)
    halvings += filter_pressure + owner_pressure + tcgen05_pressure + tf32_bias
    if halvings:
        cap = 255 if props.mma == "mma" else c.maxnreg  # tcgen05: below
        c = dataclasses.replace(c, block_v=max(16, c.block_v >> halvings), maxnreg=cap)
    # mma.sync: ptxas held the 8-warp per-tile kernel (64 x 128) to 128 registers and spilled 8-16 B with a bias (bf16,
    # fp16, TF32), or with a softcap beside class weights (bf16 / fp16; the backward's whole flag product on sm_80,
    # Triton 3.6: 14 launches; the chunked dz kernel shares the config): the cap at 255. Not TF32 with a softcap beside
    # class weights and no bias: there the cap made ptxas spill 16 B at 255 registers where its own choice did not
    # (64 x 64 on sm_120, Triton 3.7 / 3.8, the each level)
    held = bias or (softcap and class_weights and sixteen_bit)
    if props.mma == "mma" and not deterministic and c.num_warps == 8 and held:
        c = dataclasses.replace(c, maxnreg=255)
    # and with Triton 3.8 on sm_80 the 8-warp deterministic dW kernel (bf16 / fp16, 64 x 64 x 32) with a bias and the
    # filter to 128 registers: 8 B (4 launches of the backward's whole flag product; 3.6 / 3.7 compiled them clean,
    # 3.9 runs 4 warps): the cap at 255 there. Not on sm_86, whose whole product with 3.8 compiled them clean.
    owner_held = deterministic and bias and filtering and sixteen_bit and c.num_warps == 8 and compiler == (3, 8)
    if props.mma == "mma" and not props.consumer_ampere_ada and owner_held:
        c = dataclasses.replace(c, maxnreg=255)
    # and on sm_120 the 4-warp deterministic dH kernel (bf16, its token tile halved to 32 x 64) with a bias, a
    # temperature and the filter to 168 registers: 16 B (Triton 3.9, the backward's whole flag product): the cap at 255
    # with a bias beside the filter there. Not on sm_86, where the cap made that kernel (64 x 64) spill 40 B (3.9, the
    # each level). The 8-warp TF32 deterministic dW kernel (64 x 64 x 16) to 128 registers too: 16 B with a temperature
    # and the filter (3.9), or a bias, a softcap and a temperature (3.6, a sweep of TF32 with a bias): the cap for
    # every TF32 deterministic config there
    if sm120 and deterministic and ((c.num_warps == 4 and bias and filtering) or sm120_tf32):
        c = dataclasses.replace(c, maxnreg=255)
    # and on sm_86 / sm_89 with Triton 3.8 that TF32 dW kernel to 128 registers too: 8 B beside a bias, a softcap and a
    # temperature (the backward's whole flag product; with 3.9 none): the cap for every TF32 deterministic config there
    if props.consumer_ampere_ada and deterministic and not sixteen_bit and tf32 and compiler == (3, 8):
        c = dataclasses.replace(c, maxnreg=255)
    # sm_120 with a softcap: with Triton 3.8 in bf16 / fp16 ptxas held the 8-warp per-tile kernel (64 x 128 x 32) to 128
    # registers and the 4-warp deterministic dW kernel (64 x 64 x 32) to 168 beside a temperature (8-16 B, 6 launches),
    # with 3.6 in TF32 the 8-warp per-tile kernel without dH (64 x 64 x 32) to 128 (8 B, 2 launches; the backward's
    # whole flag products there; with 3.9 none): the cap at 255 for every such config (not TF32 with 3.7 / 3.8, where
    # the cap made ptxas spill beside class weights: above)
    if softcap and ((sm120 and sixteen_bit and compiler == (3, 8)) or (sm120_tf32 and compiler == (3, 6))):
        c = dataclasses.replace(c, maxnreg=255)
    # and with Triton 3.7 in bf16 / fp16 the 4-warp deterministic dW kernel (64 x 64 x 32) to 168 registers beside a
    # temperature with a softcap or a bias (8-16 B, 5 launches of the backward's whole flag product there): the cap at
    # 255 for the deterministic configs with either
    if sm120 and sixteen_bit and deterministic and compiler == (3, 7) and (softcap or bias):
        c = dataclasses.replace(c, maxnreg=255)
    if props.mma == "tcgen05":
        # ptxas's own heuristic held 8-warp backward kernels there to 128 registers and spilled 8-24 B in flag sets no
        # covering level reached (the backward's whole flag product on sm_100, Triton 3.9: the fused and dH kernels
        # with a bias beside a softcap or a temperature; the chunked dz kernel in TF32 with a softcap, a temperature
        # and class weights): every backward config there takes the cap at 255 (the accumulators live in tensor
        # memory; one 8-warp program per SM, as the pipelined tcgen05 kernels run anyway)
        c = dataclasses.replace(c, maxnreg=255)
    return c


def _backward_tiles(
    props: DeviceProps,
    dtype: torch.dtype,
    tf32: bool,
    softcap: bool,
    filtering: bool,
    deterministic: bool,
    class_weights: bool,
    compiler: tuple[int, int],
    ragged_rows: bool,
    aligned: bool,
) -> BwdConfig:
    """:func:`backward_config` before its register-pressure rule."""
    if props.mma == "none" or (dtype == torch.float32 and not tf32):
        return FP32_BWD
    if not aligned and props.mma in ("wgmma", "tcgen05") and dtype != torch.float32:
        return BwdConfig(64, 64, 32, 32, group_n=8, num_warps=8, num_stages=2)
    heavy = softcap or filtering
    if props.mma == "tcgen05" and filtering and not deterministic and dtype != torch.float32 and compiler < (3, 8):
        return BwdConfig(64, 64, 64, 32, group_n=8, num_warps=8, num_stages=3)
    if deterministic and (heavy or props.mma == "mma"):
        # The deterministic kernels' load-add-store epilogue next to the softcap / filter tiles
        # (or mma.sync's register accumulators) spills with 128-wide vocab tiles on every target.
        # On mma.sync the gradient products go in 16-wide chunks: with 32, ptxas traded 8-24 B of spill for
        # occupancy in the dH / dW kernels (TF32 on sm_80 / sm_120 with Triton 3.7 / 3.8; class weights on sm_80 with
        # 3.8 / 3.9), and class weights run over 4 warps (8 held them to 128 registers: 8 B on sm_80 with 3.9).
        # TF32 there also recomputes in 16-wide chunks (two k=8 steps): 32 spilled 8-16 B at 128 / 168 registers on
        # sm_120 (the dW kernel with 3.6, the class-weight dH kernel with 3.9).
        d_out = 16 if props.mma == "mma" else 32
        d = 16 if props.mma == "mma" and dtype == torch.float32 else 32
        if class_weights:
            # Triton 3.8 on mma.sync recomputes in 16-wide chunks there too: with 32, the bf16 dH kernel spilled 8 B at
            # 168 registers (sm_80); 8 warps spilled 8-24 B, 32-wide gradient chunks 8-24 B in the dW kernel
            if props.mma == "mma" and compiler == (3, 8):
                d = 16
            # and ptxas held the TF32 dW kernel there to 96 registers over 4 warps and spilled 8 B (sm_86, Triton
            # 3.7, the each level): capped at 255 on mma.sync
            return BwdConfig(
                64,
                32,
                d,
                d_out,
                group_n=8,
                num_warps=4 if props.mma == "mma" else 8,
                num_stages=2,
                maxnreg=255 if props.mma == "mma" else None,
            )
        # bf16 / fp16 there over 4 warps with Triton 3.9, and on sm_120 from 3.7: 8 held the dH kernel to 128 registers
        # at a token count not a multiple of 16 and spilled 8 B (sm_120, 3.7-3.9); before 3.9, 4 warps spilled 8-48 B
        # in the filtering dH kernel on sm_80 / sm_86 and 8 did not. TF32 keeps 8 (its 16-wide chunks fit 128
        # registers). On sm_86 / sm_89 the filtering dH kernel over 4 warps spilled with 3.9 too, beside a bias or a
        # temperature (8-16 B at the paper shape, 48-56 B at 255 registers at a token count not a multiple of 16; the
        # backward's whole flag product, 11 launches): the filter keeps 8 warps there.
        four = (compiler >= (3, 9) and not (props.consumer_ampere_ada and filtering)) or (
            props.consumer_blackwell and compiler >= (3, 7)
        )
        warps = 4 if props.mma == "mma" and dtype != torch.float32 and four else 8
        return BwdConfig(64, 64, d, d_out, group_n=8, num_warps=warps, num_stages=2)
    if props.mma == "tcgen05" and deterministic:
        # The deterministic kernels' load-add-store epilogue spills with 64-wide chunks there.
        cands = [
            BwdConfig(64, 128, 32, 32, group_n=8, num_warps=8, num_stages=2),
            BwdConfig(64, 64, 32, 32, group_n=8, num_warps=4, num_stages=2),
        ]
        if dtype == torch.float32:
            # TF32: Triton 3.8 spilled 16 B in the dH kernel with 32-wide gradient chunks (128 registers); 16 do not
            d_out = 16 if compiler == (3, 8) else 32
            cands = [BwdConfig(64, 64, 32, d_out, group_n=8, num_warps=8, num_stages=2)]
        return next((c for c in cands if _fits(bwd_smem_estimate(c, dtype), props)), SMALL_BWD)
    if dtype == torch.float32:  # TF32 (64x64 over 4 warps spills the deterministic epilogue on sm_86/120)
        cands = [
            BwdConfig(64, 128, 32, 32, group_n=8, num_warps=8, num_stages=2),
            BwdConfig(64, 64, 32, 32, group_n=8, num_warps=8, num_stages=2),
        ]
    elif props.mma in ("wgmma", "tcgen05"):
        cands = [BwdConfig(64, 128, 64, 64, group_n=8, num_warps=8, num_stages=3)]
        if not heavy:  # tcgen05 reads 64-wide chunks of the dH / dW products back with a spill
            cands.insert(
                0, BwdConfig(128, 128, 64, 64 if props.mma == "wgmma" else 32, group_n=8, num_warps=8, num_stages=3)
            )
    else:  # mma.sync: the 128x128 register accumulator spills even without softcap / filtering
        # Triton 3.6 held the per-tile kernel to 128 registers with 64-wide gradient chunks and spilled 8 B (sm_120)
        cands = [BwdConfig(64, 128, 32, 32 if compiler < (3, 7) else 64, group_n=8, num_warps=8, num_stages=2)]
    for c in cands:
        if _fits(bwd_smem_estimate(c, dtype), props):
            return c
    return SMALL_BWD


def all_backward_configs(props: DeviceProps, compiler: tuple[int, int] | None = None) -> set[BwdConfig]:
    """Every backward config :func:`backward_config` can return on ``props`` with the Triton
    ``compiler`` (default: the installed one; for the AOT test)."""
    out = set()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tf32 in (True, False):
            for sc in (False, True):
                for flt in (False, True):
                    for det in (False, True):
                        for cw, rr, al, b in itertools.product((False, True), repeat=4):
                            flags = dict(softcap=sc, filtering=flt, deterministic=det, class_weights=cw, ragged_rows=rr)
                            out.add(
                                backward_config(props, dtype, tf32=tf32, compiler=compiler, aligned=al, bias=b, **flags)
                            )
    return out


def pick_splits(n: int, v: int, block_n: int, block_v: int, props: DeviceProps, blocks_per_sm: int = 1) -> int:
    """Vocab splits of the forward for the tile actually launched (``block_n`` x ``block_v``).

    Small N leaves SMs idle with one program per token tile; splitting the vocab adds programs
    (merged afterwards, ``splits * N * 5`` floats). Choose the split count, at most one more wave
    than needed and with >= 4 vocab tiles per split, whose last wave is fullest (waves of
    ``sms * blocks_per_sm`` programs); ties go to fewer splits."""
    tiles = cdiv(n, block_n)
    slots = max(1, props.sms * blocks_per_sm)
    most = max(1, cdiv(v, 4 * block_v))
    best, best_eff = 1, 0.0
    for s in range(1, min(most, max(1, cdiv(2 * slots, tiles))) + 1):
        p = tiles * s
        waves = cdiv(p, slots)
        eff = p / (waves * slots)
        if eff > best_eff + 0.02:
            best, best_eff = s, eff
    return best
