"""Which slice of a vocab-parallel head this rank holds: :class:`VocabShard`, a frozen value every layer reads.

The options of every entry point hold one (``shard=``) and check its type, so it lives here, below the options; the
handshake and the collectives that run over its group are :mod:`cce_dist.tp.collectives`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

StatsCollective = Literal["auto", "allreduce", "allgather"]


def _integer(name: str, v):
    """``v`` as a Python int where it is an integer scalar of another kind (a numpy integer, a 0-dim integer CPU
    tensor: anything with ``__index__``), else unchanged for the caller's check; a tensor on another device raises
    (reading it would synchronize with the device), naming ``name``."""
    if isinstance(v, bool) or type(v) is int:
        return v
    if isinstance(v, torch.Tensor):
        if v.device.type != "cpu" or v.dim() != 0 or v.is_floating_point() or v.dtype == torch.bool:
            raise TypeError(
                f"{name} must be an int, got a torch.Tensor (dtype {v.dtype}, shape {tuple(v.shape)}, device "
                f"{v.device}); pass a Python int"
            )
        return int(v)
    try:
        return operator.index(v)
    except TypeError:
        return v


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice ``[start, stop)`` of a vocab-parallel head's (padded) vocabulary.

    group               the tensor-parallel process group (always explicit; None = no group, a
                        single device: then ``start`` must be 0)
    start, stop         global vocab rows held here; shards may be uneven but must tile
                        ``[0, V)`` across the group without gaps or overlaps
    sequence_parallel   hidden arrives split along its first (token/sequence) dimension,
                        ``[N / P, ...]``; it is all-gathered inside and dH is reduce-scattered
    reduce_hidden_grad  True (default): the library reduces dH over the group, so a standalone
                        call returns the full, correct hidden gradient on every rank. False: the
                        caller's own layer reduces it (e.g. input already passed through
                        Megatron's ``copy_to_tensor_model_parallel_region``)
    stats_collective    "auto" | "allreduce" | "allgather": how forward combines statistics
    check               run the handshake (one tiny all-gather) that turns a bad input on one
                        rank, or disagreeing ranks, into an error on every rank instead of a hang
    data_parallel       the group is a *data-parallel* one (FSDP2's mesh: the head's weight is
                        ``Shard(0)`` there, as FSDP2 shards it) and each rank passes its OWN tokens,
                        ``hidden [n_r, ..., D]`` / ``targets [n_r, ...]``, any ``n_r`` per rank (0 too).
                        The hidden states and targets of the group are all-gathered inside (in rank
                        order), scored on this rank's vocab rows, and the row statistics combined as
                        in tensor parallelism. Each rank gets the loss (logprobs, ...) of its own
                        tokens with the requested reduction, and dH of its own tokens (dH is
                        reduce-scattered back to its owner). The weight / bias gradient of this
                        shard is the sum over the ranks of the gradient of each rank's own loss,
                        divided by ``grad_divide_factor``: what FSDP2's reduce-scatter gives a
                        ``Shard(0)`` parameter. Needs ``sequence_parallel=False`` and
                        ``reduce_hidden_grad=True``. A scalar loss runs the two-pass schedule (the
                        ranks' upstream gradients differ, so none can be applied in forward).
                        See docs/fsdp.md.
    grad_divide_factor  data_parallel only: the weight and bias gradients are divided by it (None =
                        the group size: FSDP2's default mean over the data-parallel ranks; set it as
                        you set ``FSDPModule.set_gradient_divide_factor``, e.g. 1.0 for a sum). dH is
                        never divided: it is the gradient of this rank's own loss.
    """

    group: dist.ProcessGroup | None
    start: int
    stop: int
    sequence_parallel: bool = False
    reduce_hidden_grad: bool = True
    stats_collective: StatsCollective = "auto"
    check: bool = True
    data_parallel: bool = False
    grad_divide_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("start", "stop"):
            v = _integer(f"VocabShard.{name}", getattr(self, name))  # e.g. numpy ints from a cumsum of shard sizes
            object.__setattr__(self, name, v)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"VocabShard.{name} must be a non-negative int, got {v!r}")
        if self.stop < self.start:
            raise ValueError(f"VocabShard needs start <= stop, got [{self.start}, {self.stop})")
        if self.stats_collective not in ("auto", "allreduce", "allgather"):
            raise ValueError(
                f"VocabShard.stats_collective must be 'auto', 'allreduce' or 'allgather', got {self.stats_collective!r}"
            )
        if self.sequence_parallel and not self.reduce_hidden_grad:
            raise ValueError(
                "VocabShard: sequence_parallel=True requires reduce_hidden_grad=True (the library gathers the "
                "sequence, so it must also reduce-scatter dH); if your layer gathers and reduces, pass the "
                "gathered hidden states with sequence_parallel=False, reduce_hidden_grad=False"
            )
        if self.group is None and self.start != 0:
            raise ValueError("VocabShard with group=None is a single device: start must be 0")
        self._check_data_parallel()

    def _check_data_parallel(self) -> None:
        """The data-parallel fields: local checks, identical on every rank that passes the same fields."""
        if not isinstance(self.data_parallel, bool):
            raise TypeError(f"VocabShard.data_parallel must be a bool, got {self.data_parallel!r}")
        f = self.grad_divide_factor
        if f is not None:
            if not self.data_parallel:
                raise ValueError(
                    "VocabShard.grad_divide_factor applies to data_parallel=True only (a tensor-parallel head's "
                    "weight gradient is never reduced over ranks); pass data_parallel=True or leave it None"
                )
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not (math.isfinite(f) and f > 0):
                raise ValueError(f"VocabShard.grad_divide_factor must be a finite number > 0 or None, got {f!r}")
            object.__setattr__(self, "grad_divide_factor", float(f))
        if self.data_parallel and self.sequence_parallel:
            raise ValueError(
                "VocabShard: data_parallel=True and sequence_parallel=True exclude each other (under data_parallel "
                "each rank passes its own tokens, in any number; sequence_parallel splits one batch evenly)"
            )
        if self.data_parallel and not self.reduce_hidden_grad:
            raise ValueError(
                "VocabShard: data_parallel=True requires reduce_hidden_grad=True (the hidden states of the group "
                "are gathered inside, so dH must be reduce-scattered back to the rank that owns each token)"
            )

    @property
    def divide_factor(self) -> float:
        """What the weight and bias gradients are divided by: ``grad_divide_factor``, or the group size under
        ``data_parallel`` (FSDP2's mean); 1 for a tensor-parallel shard."""
        if not self.data_parallel:
            return 1.0
        return self.grad_divide_factor if self.grad_divide_factor is not None else float(self.world_size)

    # The group is a process-local handle (it cannot be pickled): copies share it by reference, as torch's DeviceMesh
    # does, so `copy.deepcopy(model)` (a reference model in RL) works and its loss runs on the same group.
    def __copy__(self) -> VocabShard:
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __deepcopy__(self, memo: dict) -> VocabShard:
        new = self.__copy__()  # every other field is an immutable scalar or string
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict:
        if self.group is not None:
            raise TypeError(
                f"cce_dist.VocabShard(start={self.start}, stop={self.stop}) cannot be pickled: it holds a "
                f"torch.distributed process group ({type(self.group).__name__}), a handle that is valid only in this "
                "process. copy.deepcopy shares the group; to build the shard in another process, send start/stop and "
                "create VocabShard there with that process's own group"
            )
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @classmethod
    def even(cls, vocab_size: int, group: dist.ProcessGroup | None, **kwargs) -> VocabShard:
        """Megatron's even split: rank r of a group of P holds ``[r*V/P, (r+1)*V/P)``."""
        if not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        if vocab_size % world:
            raise ValueError(
                f"VocabShard.even: vocab_size={vocab_size} is not divisible by the group size {world}; "
                "pad the vocabulary (as Megatron does) or pass uneven VocabShard(group, start, stop)"
            )
        per = vocab_size // world
        return cls(group, rank * per, (rank + 1) * per, **kwargs)

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def local_size(self) -> int:
        return self.stop - self.start
