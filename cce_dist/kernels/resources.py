"""What a compiled kernel uses: registers, spills (stack and local memory) and shared memory per thread, read
from its cubin with the ``cuobjdump`` Triton ships (``--dump-resource-usage``).

Two users: :mod:`.aot` (the kernels compiled ahead of time for targets this machine does not have) and the GPU
suite's ``spills`` stage (``benchmarks/gpu_suite.py``), which reads every kernel a run on a real GPU compiled
from Triton's cache (:func:`scan_cache`), so that the spill bound :mod:`.aot` asserts without a GPU is checked
on the launches themselves. Nothing here imports triton or torch, or needs a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["SPILL_BOUND", "cce_dist_kernels", "cuobjdump", "describe", "resource_usage", "scan_cache"]

#: Bytes of stack / local memory per thread a compiled cce_dist launch may use: none, for every compute mode (bf16,
#: fp16, TF32 and fp32 IEEE, whose FMA dot holds its fp32 tiles in registers: :data:`.config.FP32_BWD`), at every
#: shape (rows not 16-byte aligned and token counts not a multiple of 16 included). tests/test_aot_compile.py asserts
#: it of the launches compiled ahead of time (:mod:`.aot`), the GPU suite's ``spills`` stage of those a GPU run
#: compiled; ``benchmarks.aot_matrix`` reports against it.
SPILL_BOUND = 0


def cuobjdump() -> str:
    """Path of the ``cuobjdump`` in the installed Triton's wheel (``backends/nvidia/bin``), else the one on
    ``PATH``. Raises FileNotFoundError when there is neither."""
    spec = importlib.util.find_spec("triton")
    for root in (spec.submodule_search_locations or []) if spec else []:
        exe = Path(root, "backends", "nvidia", "bin", "cuobjdump")
        if exe.is_file():
            return str(exe)
    found = shutil.which("cuobjdump")
    if found:
        return found
    raise FileNotFoundError("cuobjdump: not in the installed Triton (backends/nvidia/bin) nor on PATH")


def resource_usage(cubin: str | os.PathLike) -> dict[str, int]:
    """``{registers, stack, local, static_shared}`` of the one kernel in the cubin file ``cubin`` (per thread,
    bytes but registers)."""
    out = subprocess.run(
        [cuobjdump(), "--dump-resource-usage", os.fspath(cubin)], capture_output=True, text=True, check=True
    ).stdout
    vals = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    return {"registers": vals["REG"], "stack": vals["STACK"], "local": vals["LOCAL"], "static_shared": vals["SHARED"]}


def cce_dist_kernels() -> frozenset[str]:
    """Names of the kernels cce_dist launches: every ``@triton.jit`` function named ``*_kernel`` in this package
    (read from the source, nothing imported)."""
    names: set[str] = set()
    for src in Path(__file__).parent.glob("*.py"):
        names |= set(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+_kernel)\(", src.read_text()))
    return frozenset(names)


def scan_cache(cache_dir: str | os.PathLike, jobs: int = 8) -> list[dict]:
    """Every kernel compiled into the Triton cache ``cache_dir`` (``TRITON_CACHE_DIR``): one dict per cubin with
    its metadata (``name``, ``hash``, ``arch``, ``num_warps``, ``num_stages``, ``maxnreg``, ``shared`` (the dynamic
    shared memory the launch requests), ``triton_version``), its :func:`resource_usage`, ``spill`` (stack + local
    bytes per thread) and ``ours`` (a cce_dist kernel, :func:`cce_dist_kernels`), sorted by name and hash.
    A cubin whose usage cannot be read gets an ``error`` instead."""
    ours = cce_dist_kernels()
    cubins = sorted(Path(cache_dir).glob("*/*.cubin"))

    def one(cubin: Path) -> dict:
        rec: dict = {"name": cubin.stem, "cubin": str(cubin)}
        meta = cubin.with_suffix(".json")
        if meta.is_file():
            m = json.loads(meta.read_text())
            target = m.get("target") or {}
            rec.update(
                hash=m.get("hash", ""),
                arch=target.get("arch") if isinstance(target, dict) else None,
                **{k: m.get(k) for k in ("num_warps", "num_stages", "maxnreg", "shared", "triton_version")},
            )
        rec["ours"] = rec["name"] in ours
        try:
            rec.update(resource_usage(cubin))
            rec["spill"] = rec["stack"] + rec["local"]
        except (OSError, subprocess.CalledProcessError, KeyError) as e:
            rec["error"] = f"{type(e).__name__}: {e}"[:300]
        return rec

    with ThreadPoolExecutor(max(1, jobs)) as ex:
        recs = list(ex.map(one, cubins))
    return sorted(recs, key=lambda r: (r["name"], r.get("hash", ""), r["cubin"]))


def describe(rec: dict) -> str:
    """``sm_90 w8s3 maxnreg 255``: the target and launch options of one :func:`scan_cache` record."""
    cap = f" maxnreg {rec['maxnreg']}" if rec.get("maxnreg") else ""
    return f"sm_{rec.get('arch')} w{rec.get('num_warps')}s{rec.get('num_stages')}{cap}"


def main(argv: list[str] | None = None) -> int:
    """``python -m cce_dist.kernels.resources [CACHE_DIR] [--all]``: registers and spills of every cce_dist kernel
    in a Triton cache (default ``$TRITON_CACHE_DIR``, else ``~/.triton/cache``) after a run on a GPU, one line per
    compiled variant; exit code 1 when one spills past :data:`SPILL_BOUND` or its cubin cannot be read (either is
    worth a bug report, with this output). ``--all``: the other kernels in the cache too (never counted)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    default = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    ap.add_argument("cache_dir", nargs="?", default=default)
    ap.add_argument("--all", action="store_true", help="list every kernel in the cache, not only cce_dist's")
    a = ap.parse_args(argv)
    recs = [r for r in scan_cache(a.cache_dir) if r["ours"] or a.all]
    over = unread = 0
    for r in recs:
        if "error" in r:
            unread += r["ours"]
            print(f"{r['name']:24s} {r['cubin']}: {r['error']}{'  <- unreadable' if r['ours'] else ''}")
            continue
        spills = r["ours"] and r["spill"] > SPILL_BOUND
        over += spills
        print(
            f"{r['name']:24s} {describe(r)}: {r['registers']} "
            f"registers, {r['spill']} B spilled, {r.get('shared')} B shared{'  <- spills' if spills else ''}"
            f"  ({str(r.get('hash', ''))[:12]}, Triton {r.get('triton_version')})"
        )
    ours = sum(r["ours"] for r in recs)
    unreadable = f", {unread} could not be read" if unread else ""
    print(f"{ours} cce_dist kernel variants in {a.cache_dir}; {over} spill past {SPILL_BOUND} B{unreadable}")
    return 1 if over or unread else 0


if __name__ == "__main__":
    raise SystemExit(main())
