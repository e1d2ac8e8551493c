"""cce_dist: cut cross-entropy without materialized logits, on one device or a vocab-parallel group.

Public API:

- :func:`linear_cross_entropy` — loss of ``hidden @ weight.T (+ bias)`` against target ids.
- :func:`linear_logprobs` — per-token log-probabilities (and entropies) for RL scoring.
- :func:`linear_distillation` — KL / reverse KL / JSD between a teacher's and a student's heads.
- :class:`LinearCrossEntropy` — the module form of :func:`linear_cross_entropy`.
- :class:`VocabShard` — this rank's slice of a vocab-parallel head and its process group.
- :class:`RowOutputs` — the per-token outputs ``row_outputs=`` asks for (predicted token, is_top1,
  log sum p^2, mean logit).
- :class:`CrossEntropyOptions`, :class:`LogprobOptions`,
  :class:`DistillationOptions` — the options, one frozen dataclass each.
"""

from .api import LinearCrossEntropy, linear_cross_entropy, linear_logprobs
from .core.options import CrossEntropyOptions, DistillationOptions, LogprobOptions
from .core.outputs import ROW_OUTPUTS, RowOutputs
from .core.shard import VocabShard
from .distill import linear_distillation
from .tp.collectives import InputError

__all__ = [
    "CrossEntropyOptions",
    "DistillationOptions",
    "InputError",
    "LinearCrossEntropy",
    "LogprobOptions",
    "ROW_OUTPUTS",
    "RowOutputs",
    "VocabShard",
    "linear_cross_entropy",
    "linear_distillation",
    "linear_logprobs",
]
# The one version source: pyproject.toml reads it (tool.setuptools.dynamic).
__version__ = "0.1.0"
