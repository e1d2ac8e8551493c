"""tests/interpreter_patch_memo.py (the test harness's skip of the interpreter's redundant re-patching) changes no
result: the same calls, with it and with the plain interpreter (``CCE_TEST_PLAIN_INTERPRETER=1``), give bitwise the
same losses and gradients, on both ends of the supported Triton range; and it does skip patches (else it would be
dead weight in every interpreter test)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from triton_oldest import env_with, require_oldest

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The forward, the backward in forward and after it, the deterministic one (bias, softcap, smoothing, filtering), the
#: distillation's statistics / rows / gradient kernels (JSD with both softcaps, a temperature and a hard label):
#: helper calls from every kernel family; a digest of every loss and gradient.
_PROBE = """
import hashlib, json, sys
sys.path.insert(0, "tests")
import interpreter_patch_memo as memo
installed = memo.install()
import torch
import cce_dist

g = torch.Generator().manual_seed(0)
n, d, v = 21, 20, 70
digest = hashlib.sha256()

def add(*tensors):
    for t in tensors:
        digest.update(t.detach().double().contiguous().numpy().tobytes())

h = torch.randn(n, d, generator=g, requires_grad=True)
w = (0.4 * torch.randn(v, d, generator=g)).requires_grad_()
b = (0.1 * torch.randn(v, generator=g)).requires_grad_()
t = torch.randint(0, v, (n,), generator=g)
t[3] = -100
for kw in (
    dict(softcap=5.0, label_smoothing=0.1, grad_in_forward=False),
    dict(bias=b, filter_eps="auto", deterministic=True),
):
    loss = cce_dist.linear_cross_entropy(h, w, t, impl="triton", **kw)
    add(loss, *torch.autograd.grad(loss, [h, w] + ([b] if "bias" in kw else [])))
ht = torch.randn(n, 2 * d, generator=g)
wt = 0.3 * torch.randn(v, 2 * d, generator=g)
loss = cce_dist.linear_distillation(
    h, w, ht, wt, t, divergence="jsd", temperature=2.0, softcap=(4.0, 6.0), hard_label_weight=0.25, impl="triton"
)
add(loss, *torch.autograd.grad(loss, [h, w]))
print(json.dumps({"installed": installed, "digest": digest.hexdigest(), **memo.stats}))
"""


def _probe(triton: str, plain: bool) -> dict:
    env = env_with(require_oldest() if triton == "oldest" else None)
    env["TRITON_INTERPRET"] = "1"
    env.pop("CCE_TEST_PLAIN_INTERPRETER", None)
    if plain:
        env["CCE_TEST_PLAIN_INTERPRETER"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("triton", ["newest", "oldest"])
def test_the_memo_skips_patches_and_changes_no_bit(triton):
    fast, plain = _probe(triton, plain=False), _probe(triton, plain=True)
    assert fast["installed"] and not plain["installed"], (fast, plain)
    assert plain["skipped"] == plain["patched"] == 0, plain
    assert fast["skipped"] > 10 * fast["patched"] > 0, fast  # most helper calls skip the walk
    assert fast["digest"] == plain["digest"]
