"""Offline training text: the Python standard library's own source, BPE-tokenized.

Everything here is deterministic and needs no download:

* the corpus is every ``*.py`` file under ``sysconfig.get_paths()['stdlib']`` (``site-packages``
  excluded), in sorted relative-path order, each file followed by ``<|endoftext|>``;
* a byte-level BPE tokenizer (HuggingFace ``tokenizers``) is trained on it to ``vocab_size`` ids;
* the whole corpus is encoded once and the ids are stored as a ``.npy`` array.

Both artifacts are cached under ``launch/.cache/`` (override with ``CCE_DIST_CACHE``), keyed by
the Python version, the file list and sizes, ``vocab_size`` and ``max_files``, so a second run
loads them in well under a second.  In a ``torchrun`` job only one process builds
(:func:`prepare`, called by local rank 0 before a barrier); the others just load.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

EOT = "<|endoftext|>"
DEFAULT_CACHE = Path(__file__).resolve().parent / ".cache"


def cache_dir() -> Path:
    return Path(os.environ.get("CCE_DIST_CACHE", DEFAULT_CACHE))


def stdlib_files(max_files: int | None = None) -> tuple[Path, list[Path]]:
    """Sorted ``.py`` files of the standard library (first ``max_files`` if given)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts and p.is_file())
    if max_files is not None:
        files = files[:max_files]
    if not files:
        raise RuntimeError(f"no .py files found under {root}")
    return root, files


def _key(root: Path, files: list[Path], vocab_size: int, max_files: int | None) -> str:
    import tokenizers

    h = hashlib.sha256()
    h.update(f"v1|{sys.version_info[:3]}|{tokenizers.__version__}|{vocab_size}|{max_files}".encode())
    for p in files:
        h.update(f"|{p.relative_to(root)}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _read(p: Path) -> str:
    # A few stdlib test files are deliberately mis-encoded; keep what decodes.
    return p.read_bytes().decode("utf-8", errors="ignore")


def _build(root: Path, files: list[Path], vocab_size: int, out: Path, progress: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t0 = time.perf_counter()
    texts = [_read(p) for p in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    t1 = time.perf_counter()

    eot = tok.token_to_id(EOT)
    n_vocab = tok.get_vocab_size()
    ids: list[np.ndarray] = []
    enc = tok.encode_batch(texts, add_special_tokens=False)
    dtype = np.uint16 if n_vocab <= np.iinfo(np.uint16).max else np.uint32
    for e in enc:
        ids.append(np.asarray(e.ids, dtype=dtype))
        ids.append(np.asarray([eot], dtype=dtype))
    arr = np.concatenate(ids)
    t2 = time.perf_counter()

    out.mkdir(parents=True, exist_ok=True)
    tag = f"{socket.gethostname()}.{os.getpid()}"  # ranks of several nodes may share the cache
    tmp = out / f"tokenizer.json.tmp.{tag}"
    tok.save(str(tmp))
    os.replace(tmp, out / "tokenizer.json")
    tmp = out / f"tokens.tmp.{tag}.npy"
    np.save(tmp, arr)
    os.replace(tmp, out / "tokens.npy")
    meta = {
        "stdlib": str(root),
        "files": len(files),
        "bytes": sum(len(t.encode()) for t in texts),
        "tokens": int(arr.size),
        "vocab_size": n_vocab,
        "requested_vocab_size": vocab_size,
        "eot_id": eot,
        "train_s": round(t1 - t0, 2),
        "encode_s": round(t2 - t1, 2),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def prepare(vocab_size: int = 32768, max_files: int | None = None, progress: bool = True) -> Path:
    """Build (once) and return the cache folder holding tokenizer.json, tokens.npy, meta.json."""
    root, files = stdlib_files(max_files)
    out = cache_dir() / f"stdlib-bpe{vocab_size}-{_key(root, files, vocab_size, max_files)}"
    if not (out / "meta.json").exists():
        if progress:
            print(
                f"[data] building tokenizer (vocab {vocab_size}) on {len(files)} stdlib files under {root} -> {out}",
                flush=True,
            )
        _build(root, files, vocab_size, out, progress)
        if progress:
            m = json.loads((out / "meta.json").read_text())
            print(
                f"[data] {m['bytes'] / 2**20:.1f} MiB of source -> {m['tokens']:,} tokens, "
                f"vocab {m['vocab_size']} (train {m['train_s']} s, encode {m['encode_s']} s)",
                flush=True,
            )
    return out


def load(folder: Path) -> tuple[np.ndarray, dict]:
    """Memory-mapped token ids and the metadata of a prepared cache folder."""
    meta = json.loads((folder / "meta.json").read_text())
    return np.load(folder / "tokens.npy", mmap_mode="r"), meta


class Batches:
    """Seeded random windows of ``seq_len + 1`` tokens.

    Batch ``step`` for data-parallel rank ``dp_rank`` depends only on (seed, dp_rank, step), so
    every rank of a TP group reads the same tokens and a rerun reads the same data.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, dp_rank: int):
        if tokens.size < seq_len + 2:
            raise ValueError(f"corpus of {tokens.size} tokens is shorter than seq_len + 2")
        self.tokens, self.b, self.s = tokens, batch_size, seq_len
        self.seed, self.dp_rank = seed, dp_rank

    def get(self, step: int):
        import torch

        rng = np.random.default_rng([self.seed, self.dp_rank, step])
        starts = rng.integers(0, self.tokens.size - self.s - 1, size=self.b)
        win = np.stack([np.asarray(self.tokens[i : i + self.s + 1], dtype=np.int64) for i in starts])
        win = torch.from_numpy(win)
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="build the cached stdlib BPE tokenizer and token ids")
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--max-files", type=int, default=None)
    a = ap.parse_args()
    folder = prepare(a.vocab_size, a.max_files)
    print(folder)
    print((folder / "meta.json").read_text())
