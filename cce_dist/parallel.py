"""The stable public path of the tensor-parallel protocol's names (``cce_dist.parallel``), kept for code that imports
them from here. The code lives in :mod:`cce_dist.core.shard` (:class:`VocabShard`) and
:mod:`cce_dist.tp.collectives` (the handshake, the collectives, ``AUTO_ALLGATHER_MAX_ROWS_X_RANKS``, and
``released``, for a script's own last gloo collective: docs/reliability.md, "A clean exit"); this module only
re-exports them (tests/test_layering.py)."""

from .core.shard import StatsCollective, VocabShard
from .tp.collectives import (
    AUTO_ALLGATHER_MAX_ROWS_X_RANKS,
    OPTION_SLOTS,
    Comm,
    InputError,
    Layout,
    NamedOptions,
    check_tiling,
    fingerprint,
    from_max_id_key,
    handshake,
    max_id_key,
    released,
    targets_checksum,
    values_checksum,
)

__all__ = [
    "AUTO_ALLGATHER_MAX_ROWS_X_RANKS",
    "OPTION_SLOTS",
    "Comm",
    "InputError",
    "Layout",
    "NamedOptions",
    "StatsCollective",
    "VocabShard",
    "check_tiling",
    "fingerprint",
    "from_max_id_key",
    "handshake",
    "max_id_key",
    "released",
    "targets_checksum",
    "values_checksum",
]
