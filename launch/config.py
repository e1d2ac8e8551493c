"""The training run's configuration: one frozen dataclass, one field per command-line flag.

Each field of :class:`TrainConfig` is the flag of the same name with dashes (``seq_len`` is
``--seq-len``); its type gives the argparse type (``Literal`` fields become choices, ``bool``
fields switches) and its metadata the help text, so the flags, their defaults and ``--help`` are
written once. ``dataclasses.asdict`` of it is the ``config`` section of ``summary.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Union

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"


def _flag(default, help_text: str | None = None):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class TrainConfig:
    """What one run of ``launch.train`` does; see the field comments and launch/README.md."""

    # schedule and parallel layout
    steps: int = _flag(200, "training steps")
    tp: int = _flag(0, "tensor-parallel size (0 = world size)")
    dtype: Literal["fp32", "bf16"] = _flag("fp32", "compute dtype (bf16 = autocast; master weights stay fp32)")
    device: Literal["cpu", "cuda"] = _flag("cpu", "cpu uses gloo, cuda uses NCCL (one GPU per local rank)")
    impl: Literal["auto", "torch", "triton"] = _flag("auto", "cce_dist implementation")
    loss: Literal["both", "cce", "materialized"] = _flag("both", "train both variants side by side, or only one")
    # model
    d_model: int = _flag(128, "model width")
    layers: int = _flag(2, "transformer blocks")
    heads: int = _flag(4, "attention heads")
    seq_len: int = _flag(128, "tokens per sequence")
    # data
    batch_size: int = _flag(4, "sequences per DP rank per step")
    vocab_size: int = _flag(32768, "BPE vocabulary trained on the stdlib (the demo wants >= 32768)")
    max_files: int | None = _flag(None, "train the tokenizer on the first N stdlib files only (fast tests)")
    # loss and optimizer
    chunk_size: int = _flag(1 << 20, "cce_dist torch impl: logits elements held at once (0 = library default)")
    lr: float = _flag(1e-3, "AdamW peak learning rate (betas 0.9, 0.95)")
    warmup: int = _flag(20, "linear warmup steps, then cosine decay to 10%%")
    seed: int = _flag(0, "seed of the weights and the batches")
    # process and output
    threads: int = _flag(0, "torch CPU threads per rank (0 = cores / local ranks)")
    log_every: int = _flag(10, "table row every N steps")
    out_dir: Path = _flag(DEFAULT_OUT_DIR, "where summary.json and curves.png go")
    no_progress: bool = _flag(False, "no progress bar (there is none anyway when stdout is not a terminal)")

    @classmethod
    def from_cli(cls, argv: list[str] | None = None, description: str | None = None) -> TrainConfig:
        """Parse ``argv`` (default: ``sys.argv[1:]``); exits with a usage message on a bad flag."""
        ap = argparse.ArgumentParser(
            prog="python -m launch.train",
            description=description,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            ap.add_argument(
                "--" + f.name.replace("_", "-"),
                default=f.default,
                help=f.metadata["help"],
                **_argparse_kind(hints[f.name]),
            )
        cfg = cls(**vars(ap.parse_args(argv)))
        if cfg.steps < 1:
            ap.error("--steps must be >= 1")
        if cfg.vocab_size < 512:
            ap.error("--vocab-size must be >= 512")
        return cfg

    def to_json(self) -> dict:
        """The fields as JSON values (paths as strings)."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}


def _argparse_kind(hint) -> dict:
    """argparse keywords for a field type: bool -> a switch, Literal -> choices, Optional[T] -> T."""
    if hint is bool:
        return {"action": "store_true"}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return {"choices": list(args), "type": type(args[0])}
    if origin in (Union, types.UnionType):
        (inner,) = (a for a in args if a is not type(None))
        return _argparse_kind(inner)
    return {"type": hint}
