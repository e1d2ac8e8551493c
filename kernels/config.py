"""Block sizes for the cce_dist Triton kernels, per GPU generation.

Nothing here launches a kernel. The forward kernel gets a small autotune set on CUDA (its outputs
are plain stores, so re-running a config while tuning is harmless). The backward kernels
accumulate into their outputs (atomics or read-modify-write), so they use one fixed config per
generation instead of autotuning (tuning would need every output zeroed between trials).

Under ``TRITON_INTERPRET=1`` (kernels run by numpy on the CPU) there is no autotuning and the
blocks are small fixed sizes, so that tests with tiny shapes stay fast and still exercise several
tiles, partial tiles and the multi-split path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FwdConfig:
    block_n: int
    block_v: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class BwdConfig:
    block_n: int          # token tile
    block_v: int          # vocab tile
    block_d: int          # reduction chunk of the logit recompute (h @ W.T)
    block_d_out: int      # column chunk of the dH / dW tiles written per step
    group_n: int = 8      # L2 swizzle of the fused kernel's (token tile, vocab tile) grid
    num_warps: int = 4
    num_stages: int = 2


# Interpreter: tiny tiles, chosen so that the test shapes (N <= 33, V_local <= 100, D <= 40)
# cover several token tiles, several vocab tiles, ragged last tiles and a ragged D loop.
INTERPRET_FWD = FwdConfig(block_n=16, block_v=32, block_d=16)
INTERPRET_BWD = BwdConfig(block_n=16, block_v=32, block_d=16, block_d_out=16, group_n=2)

# Largest BLOCK_V any forward config uses: vocab splits are multiples of it so that only the last
# tile of the whole shard is ragged.
MAX_FWD_BLOCK_V = 256


def _capability(device: torch.device) -> tuple[int, int]:
    try:
        return torch.cuda.get_device_capability(device)
    except Exception:  # pragma: no cover - no CUDA
        return (0, 0)


def forward_autotune_configs(device: torch.device, dtype: torch.dtype) -> list[FwdConfig]:
    """A small candidate set for the forward kernel on ``device`` (keyed on D and dtype)."""
    major, _ = _capability(device)
    wide = dtype != torch.float32  # fp32 tiles take twice the shared memory per element
    bd = 64 if wide else 32
    if major >= 9:  # Hopper and newer
        return [
            FwdConfig(128, 128, bd, num_warps=8, num_stages=3),
            FwdConfig(128, 256, bd, num_warps=8, num_stages=3),
            FwdConfig(64, 256, bd, num_warps=8, num_stages=4),
            FwdConfig(64, 128, bd, num_warps=4, num_stages=4),
        ]
    if major >= 8:  # Ampere / Ada
        return [
            FwdConfig(128, 128, 32, num_warps=8, num_stages=3),
            FwdConfig(64, 256, 32, num_warps=8, num_stages=3),
            FwdConfig(64, 128, 32, num_warps=4, num_stages=4),
        ]
    return [  # Volta / Turing and unknown
        FwdConfig(64, 64, 32, num_warps=4, num_stages=2),
        FwdConfig(64, 128, 32, num_warps=4, num_stages=2),
    ]


def backward_config(device: torch.device, dtype: torch.dtype) -> BwdConfig:
    """One fixed backward config per generation (see the module docstring for why not tuned)."""
    major, _ = _capability(device)
    wide = dtype != torch.float32
    if major >= 9:
        return BwdConfig(128, 128, 64 if wide else 32, 64, group_n=8, num_warps=8, num_stages=3)
    if major >= 8:
        return BwdConfig(128, 128, 32, 64 if wide else 32, group_n=8, num_warps=8, num_stages=2)
    return BwdConfig(64, 64, 32, 32, group_n=8, num_warps=4, num_stages=2)


def num_sms(device: torch.device) -> int:
    try:
        return torch.cuda.get_device_properties(device).multi_processor_count
    except Exception:  # pragma: no cover - no CUDA
        return 1
