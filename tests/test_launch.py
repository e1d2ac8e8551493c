"""launch/: the torchrun training entry point and its pieces.

The end-to-end test spawns ``python -m launch.train`` under torchrun at tp=2 on gloo for a few steps of a
tiny model, with a small tokenizer trained on a slice of the stdlib (a few seconds; the demo's
32k vocabulary is built by the demo itself), and checks the JSON summary: the cce_dist and
materialized curves agree, are finite and go down, the step-0 gradients match, the trunk replicas
stayed in sync and the cce loss needed less memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tokenizers", reason="launch/ needs the 'launch' extra (pip install -e .[launch])")

from launch import baseline, data  # noqa: E402
from launch.memory import TensorMemory  # noqa: E402
from launch.model import ModelConfig, VocabParallelLM  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TINY = (
    "--vocab-size 1024 --max-files 60 --d-model 64 --layers 1 --heads 2 --seq-len 32 --batch-size 4 "
    "--chunk-size 16384 --lr 1e-2 --warmup 2 --log-every 1"
).split()


def _torchrun(tmp_path: Path, nproc: int, *args: str, timeout: float = 300):
    # As the README runs it: from the repository root, as a module (no PYTHONPATH).
    env = dict(os.environ, CCE_DIST_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd = [*torchrun, "-m", "launch.train", *args, "--out-dir", str(tmp_path / "out")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"launch.train failed ({p.returncode}):\n{out[-6000:]}"
    return json.loads((tmp_path / "out" / "summary.json").read_text()), p.stdout


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    pytest.importorskip("cce_dist")
    return _torchrun(tmp_path_factory.mktemp("tp2"), 2, "--steps", "6", "--tp", "2", *TINY)


def test_train_tp2_curves_agree(tp2_run):
    s, stdout = tp2_run
    assert (s["world"], s["tp"], s["dp"]) == (2, 2, 1)
    cce, mat = s["cce"]["loss"], s["materialized"]["loss"]
    assert len(cce) == len(mat) == 6
    assert all(map(torch.isfinite, torch.tensor(cce + mat)))
    # Identical weights at step 0: the two losses are the same number up to fp32 rounding.
    assert abs(cce[0] - mat[0]) <= 1e-5 * abs(mat[0])
    assert max(abs(a - b) for a, b in zip(cce, mat)) <= 1e-4
    assert s["agreement"]["agree"] is True
    assert s["agreement"]["hidden_grad_max_rel_diff"] < 1e-5
    assert s["agreement"]["head_grad_max_rel_diff"] < 1e-5
    # Sane: starts near log(V) and learns.
    assert abs(mat[0] - torch.log(torch.tensor(float(s["vocab"]))).item()) < 0.5
    assert min(mat[-3:]) < mat[0] - 0.1
    assert s["trunk_replicas_in_sync"] is True
    # Memory: the logits-free loss needs less than the materialized one, on every rank, and the
    # materialized loss needs at least its float32 logits block.
    pc, pm = s["cce"]["peak_loss_mem_mib_per_rank"], s["materialized"]["peak_loss_mem_mib_per_rank"]
    assert len(pc) == len(pm) == 2
    assert all(c < m for c, m in zip(pc, pm))
    assert min(pm) >= s["materialized_logits_mib_per_rank"]
    assert stdout.strip().splitlines()[-1].startswith("VERDICT: curves agree")


def test_train_writes_plot(tp2_run, tmp_path):
    s, _ = tp2_run
    png = (Path(s["config"]["out_dir"]) / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_train_tp1_matches_tp2(tp2_run, tmp_path):
    """tp=1 and tp=2 train the same function: the seeded head is sliced, not drawn per rank, and
    the vocab-parallel loss is exact, so the materialized curves coincide."""
    s1, _ = _torchrun(tmp_path, 1, "--steps", "6", "--tp", "1", "--loss", "materialized", *TINY)
    a, b = tp2_run[0]["materialized"]["loss"], s1["materialized"]["loss"]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (a, b)


def test_train_tp2_dp2(tmp_path):
    """4 ranks: 2 TP groups of 2, data parallel across them."""
    pytest.importorskip("cce_dist")
    s, _ = _torchrun(tmp_path, 4, "--steps", "3", "--tp", "2", *TINY)
    assert (s["world"], s["tp"], s["dp"]) == (4, 2, 2)
    assert s["agreement"]["agree"] is True
    assert s["agreement"]["max_abs_diff"] <= 1e-4
    assert s["trunk_replicas_in_sync"] is True
    assert len(s["cce"]["peak_loss_mem_mib_per_rank"]) == 4


# ---------------------------------------------------------------------------- pieces, in-process


def _baseline_body(rank, world, group, n, v, d):
    torch.manual_seed(0)
    h = torch.randn(n, d)
    w = torch.randn(v, d)
    t = torch.randint(0, v, (n,))
    t[::5] = -100
    per = v // world
    ref_h, ref_w = h.double().requires_grad_(), w.double().requires_grad_()
    ref = F.cross_entropy(ref_h @ ref_w.T, t, ignore_index=-100)
    ref.backward()
    hh = h.clone().requires_grad_()
    ws = w[rank * per : (rank + 1) * per].clone().requires_grad_()
    loss = baseline.vocab_parallel_cross_entropy(hh, ws, t, rank * per, group)
    loss.backward()
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref.float(), **tol)
    torch.testing.assert_close(hh.grad, ref_h.grad.float(), **tol)
    torch.testing.assert_close(ws.grad, ref_w.grad[rank * per : (rank + 1) * per].float(), **tol)


def test_baseline_is_exact_cross_entropy(tmp_path):
    from dist_utils import run_ranks

    run_ranks(_baseline_body, world=2, tmp_path=tmp_path, kw=dict(n=37, v=50, d=8))


def test_head_init_does_not_depend_on_tp():
    cfg = ModelConfig(vocab_size=96, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    full = VocabParallelLM(cfg, 0, 96, seed=3)
    part = VocabParallelLM(cfg, 32, 64, seed=3)
    torch.testing.assert_close(part.head_weight, full.head_weight[32:64], rtol=0, atol=0)
    for (n1, p1), (_, p2) in zip(full.named_parameters(), part.named_parameters()):
        if n1 != "head_weight":
            assert torch.equal(p1, p2), n1
    other = VocabParallelLM(cfg, 0, 96, seed=4)
    assert not torch.equal(other.head_weight, full.head_weight)


def test_tensor_memory_counts_logits():
    n, v, d = 64, 1000, 16
    h = torch.randn(n, d, requires_grad=True)
    w = torch.randn(v, d, requires_grad=True)
    t = torch.randint(0, v, (n,))
    with TensorMemory() as m:
        F.cross_entropy(h @ w.T, t).backward()
    assert m.peak >= 2 * n * v * 4  # logits and log-softmax are alive together
    assert m.current == 0 or m.current <= (n * d + v * d) * 4  # what is left: the .grad tensors


def test_data_tokenizer_and_batches(tmp_path, monkeypatch):
    monkeypatch.setenv("CCE_DIST_CACHE", str(tmp_path))
    folder = data.prepare(vocab_size=600, max_files=20, progress=False)
    assert data.prepare(vocab_size=600, max_files=20, progress=False) == folder  # cached
    tokens, meta = data.load(folder)
    assert meta["vocab_size"] == 600 and tokens.size == meta["tokens"] > 10_000
    assert int(tokens.max()) < 600
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    _, files = data.stdlib_files(20)
    text = files[0].read_text(errors="ignore")[:500]
    assert tok.decode(tok.encode(text).ids) == text  # byte-level BPE round-trips
    b0 = data.Batches(tokens, 3, 16, seed=1, dp_rank=0)
    x, y = b0.get(5)
    assert x.shape == y.shape == (3, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(b0.get(5)[0], x)  # deterministic
    assert not torch.equal(data.Batches(tokens, 3, 16, seed=1, dp_rank=1).get(5)[0], x)
