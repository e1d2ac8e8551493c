"""Every kernel the library can launch, compiled ahead of time for real GPU targets (no GPU needed),
by both ends of the supported Triton range (``cce_dist.kernels.TRITON_RANGE``).

The installed (newest) Triton compiles for every target; the oldest (3.6, what torch 2.10 / 2.11 pin;
installed beside it by ``tests/install_oldest_triton.sh``) for sm_90 and sm_100. Code that the
interpreter runs can still be rejected by a compiler's frontend (Triton 3.6 refused the
star-expanded ``tl.constexpr`` tuples that 3.8 accepts), so both compile everything.

For each target (sm_80, sm_86, sm_90, sm_100, sm_120; see ``kernels.config.KNOWN_DEVICES``) a
subprocess with ``TRITON_INTERPRET`` unset (conftest sets it for the interpreter tests) runs
``python -m cce_dist.kernels.aot --level each``. The flag sets are enumerated from the launchers' own planners
(``kernels.aot.planner_axes``: the parameters of ``plan_row_stats``, ``plan_grads`` and the distillation's
``plan_*``, with the compute modes and shapes), not listed here; each is planned on meta tensors (config selection
from the device record, the autotune candidates, the schedules) and the launches are reduced to distinct
specializations, compiled through the JIT launcher's specialization path with the target's backend (ptxas /
ptxas-blackwell from the Triton wheel). The whole product is far too large to compile in CI (about 2,000 distinct
forward kernels alone per target), so CI compiles the ``each`` level, a deterministic covering subset
(``kernels.aot.LEVELS``): every value of every axis (mode, shape, bias, softcap, temperature, statistics and row
outputs, filtering, class weights, gradients wanted, deterministic, schedule, divergence, hard label), every kernel,
every boolean constexpr on and off, every config the planners select, and every feature on at once (bf16).
``python -m benchmarks.aot_matrix`` compiles the ``pairs`` (every pair of flag values) or ``full`` level for any
Triton and writes benchmarks/results/aot_spills.md. Compiled kernels are cached (``~/.cache/cce_dist/aot`` or
``$CCE_DIST_AOT_CACHE``, keyed by Triton's kernel hash), so only changed kernels recompile.

Asserted per compiled kernel:
- it compiles;
- the shared memory it requests fits the target's per-block limit (else the launch fails with
  "out of resource");
- no spills (stack + local bytes per thread == ``kernels.aot.SPILL_BOUND``, 0) in any compute mode (bf16 / fp16 /
  TF32 on tensor cores, fp32 IEEE on the FMA dot), at every shape (the unaligned one too);
- bf16 / fp16 use ``wgmma`` on sm_90 and ``tcgen05`` on sm_100 (else the kernel silently falls
  back to mma.sync at a fraction of the peak), and some tensor-core instruction on sm_80/86/120.
"""

from __future__ import annotations

import inspect
import itertools
import json
import pathlib
import subprocess
import sys

import pytest
from triton_oldest import OLDEST, env_with, require_oldest

pytest.importorskip("triton")

REPO = pathlib.Path(__file__).resolve().parents[1]
TARGETS = ["sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
#: (which Triton, target): the installed one on every target, the oldest supported one on Hopper and
#: datacenter Blackwell.
CASES = [("newest", t) for t in TARGETS] + [("oldest", t) for t in ("sm_90", "sm_100")]
LIMITS = {"sm_80": 166_912, "sm_86": 101_376, "sm_90": 232_448, "sm_100": 232_448, "sm_120": 101_376}


#: Constexprs that are constant on a GPU (interpreter-only switches): not expected to take both values.
INTERPRETER_ONLY = {"USE_LIBDEVICE", "INTERP_BF16", "INTERP_S", "INTERP_T"}


def _assert_every_flag_on_and_off(rows: list[dict], kernels: set[str], per_kernel: bool) -> None:
    """Every kernel in ``kernels`` was compiled, each boolean constexpr (but the interpreter's) with both values (in
    each kernel that takes it when ``per_kernel``, else in some kernel), and each integer-coded mode (``DIV``,
    ``CROSS``) with every value the launchers give it (``kernels.aot``'s ``each`` level promises this: it fails when
    the enumeration stops reaching a flag value)."""
    seen: dict[str, set] = {}
    for r in rows:
        for k, v in r["constexprs"].items():
            seen.setdefault(f"{r['kernel']}.{k}" if per_kernel else k, set()).add(v)
    compiled = {r["kernel"] for r in rows}
    assert kernels <= compiled, f"never compiled: {sorted(kernels - compiled)}"
    one_sided = sorted(
        f"{k}={vals}"
        for k, vals in seen.items()
        if k.split(".")[-1] not in INTERPRETER_ONLY and vals <= {True, False} and len(vals) < 2
    )
    assert not one_sided, f"flags compiled with one value only: {one_sided}"
    for k in ("DIV", "CROSS"):
        got = set().union(*(vals for key, vals in seen.items() if key.split(".")[-1] == k))
        assert not got or got == {0, 1, 2}, f"{k}: compiled {sorted(got)}, the launchers produce 0, 1 and 2"


def _compile(target: str, tmp_path: pathlib.Path, matrix: str = "main", triton: str = "newest") -> list[dict]:
    env = env_with(require_oldest() if triton == "oldest" else None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")  # the kernels set it explicitly; silences the 3.9 warning
    out = tmp_path / f"{target}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cce_dist.kernels.aot", "--target", target, "--json", str(out), "--jobs", "2"]
        + ["--matrix", matrix, "--level", "each"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(1800)  # a cold cache compiles 20-30 kernels per target; warm: seconds
@pytest.mark.parametrize("triton,target", CASES)
def test_every_selectable_kernel_compiles_within_limits(triton, target, tmp_path):
    from cce_dist.kernels.aot import SPILL_BOUND

    rows = _compile(target, tmp_path, triton=triton)
    assert len(rows) >= 15, f"matrix too small for {target}: {len(rows)}"  # sanity: not silently emptied
    _assert_every_flag_on_and_off(
        rows,
        {"_row_stats_kernel", "_grads_fused_kernel", "_dz_store_kernel", "_grads_dh_kernel", "_grads_dw_kernel"},
        per_kernel=True,
    )
    failed = [f"{r['label']}: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    limit = LIMITS[target]
    problems = []
    for r in rows:
        mode = r["label"].split("/")[0]
        c = r["constexprs"]
        where = f"{r['label']} {c.get('BLOCK_N')}x{c.get('BLOCK_V')} w{r['num_warps']}s{r['num_stages']}"
        if r["shared"] > limit:
            problems.append(f"{where}: shared {r['shared']} B > {limit} B")
        bound = SPILL_BOUND
        if r["stack"] + r["local"] > bound:
            problems.append(f"{where}: spills {r['stack'] + r['local']} B/thread > {bound}")
        if mode in ("bf16", "fp16"):
            want = {"sm_90": "wgmma", "sm_100": "tcgen05"}.get(target)
            if want is not None and want not in r["mma"]:
                problems.append(f"{where}: no {want} in the PTX (has {r['mma']})")
            if want is None and not r["mma"]:
                problems.append(f"{where}: no tensor-core instruction in the PTX")
    assert not problems, "\n".join(problems)
    _assert_every_config_compiled(target, rows, triton)


_SCRATCH_PROBE = """
import json, os, torch
from cce_dist.kernels import aot, config
kernel, _grid, args, kw = aot.forward_launches(config.KNOWN_DEVICES["sm_80"], torch.bfloat16, 256, 128, 512)[0]
rec = aot.compile_launch(kernel, args, kw, 80)
print(json.dumps({"registers": rec.registers, "cache_env": os.environ.get("TRITON_CACHE_DIR")}))
"""


def test_an_aot_compile_keeps_its_record_not_tritons_intermediates(tmp_path):
    """With no ``TRITON_CACHE_DIR``, ``compile_launch`` keeps only its record (``$CCE_DIST_AOT_CACHE``): Triton's
    intermediates (IR, PTX, cubin: about 0.6 MB a kernel, tens of GB over a whole flag product) go to a scratch
    folder removed after the compile, and the process's environment is left as it was."""
    env = env_with(None)
    env.pop("TRITON_CACHE_DIR", None)
    env.update(CCE_DIST_AOT_CACHE=str(tmp_path / "aot"), TMPDIR=str(tmp_path / "tmp"), TRITON_DEFAULT_FP_FUSION="0")
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _SCRATCH_PROBE], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["registers"] > 0 and got["cache_env"] is None, got
    kept = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert len(kept) == 1 and kept[0].startswith("aot/_row_stats_kernel-sm80-") and kept[0].endswith(".json"), kept


def _run_probe(code: str, timeout: int):
    """Runs ``code`` in a Python with ``TRITON_INTERPRET`` unset (the installed Triton compiling for real targets) and
    returns the JSON its last line prints."""
    env = env_with(None)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


_MEMO_PROBE = """
import itertools, json
import torch
from cce_dist.kernels import aot, config
props, keys, total = config.KNOWN_DEVICES["sm_90"], {}, 0
for sched, nh, nw, nb in itertools.product(("chunked", "tiles"), *[(True, False)] * 3):
    wanted = dict(need_hidden=nh, need_weight=nw, need_bias=nb)
    for kernel, _g, args, kw in aot.backward_launches(
        props, torch.bfloat16, *aot.RAGGED_SHAPE, bias=True, schedule=sched, **wanted
    ):
        keys.setdefault(aot._launch_inputs(kernel, args, kw), set()).add(aot.launch_key(kernel, args, kw, 90))
        total += 1
print(json.dumps({"inputs": len(keys), "keys": sum(map(len, keys.values())), "total": total, "none": None in keys}))
"""


def test_launch_keys_are_memoized_by_launch_inputs():
    """``kernels.aot.plan`` reuses the launch key of a launch whose inputs (``_launch_inputs``: each tensor's dtype,
    address, shape and strides, each scalar, every keyword) it has keyed before, instead of binding and hashing it
    again (~10 ms; the whole backward product repeats ~19k launches). Sound only if equal inputs give equal keys:
    checked on the backward's launches of 16 flag sets, among which the gradients wanted repeat launches."""
    got = _run_probe(_MEMO_PROBE, timeout=600)
    assert not got["none"] and got["keys"] == got["inputs"], got  # one key per inputs: the memo is sound
    assert got["total"] > got["inputs"] > 1, got  # and launches repeat: it saves keying them again


# The distillation kernels are held to the same bound (kernels.aot.SPILL_BOUND): none, with tensor cores (bf16 heads,
# or a bf16 student with a TF32 teacher) or without (fp32 IEEE). Each program holds two logit tiles (and in the
# backward their softmax terms) and reaches the 255-register ceiling with every epilogue on; with Triton 3.9, before
# the configs and the code were adjusted, the JSD backward spilled 8 B on sm_90, the forward-KL statistics with a TF32
# teacher 104 B on sm_80, the deterministic kernels 8-40 B on sm_120 and the unaligned heads 24-320 B everywhere, so a
# regression there shows.


@pytest.mark.timeout(1800)  # a cold cache compiles about 21 kernels per target; warm: seconds
@pytest.mark.parametrize("triton,target", CASES)
def test_distill_kernels_compile_within_limits(triton, target, tmp_path):
    """Every enumerated launch of ``linear_distillation(impl="triton")`` (``kernels.aot``'s ``distill`` family at
    the ``each`` level: statistics, per-row sums, fused and deterministic gradients; bf16, fp16, bf16 + TF32 teacher,
    TF32, fp32 IEEE; every divergence and epilogue flag on and off) compiles for ``target`` with the config the
    launcher selects there, within its shared memory and the spill bounds above, on tensor cores where the dtype
    has them. The registers / spills of each kernel are printed (``pytest -s``)."""
    from cce_dist.kernels.aot import SPILL_BOUND

    rows = _compile(target, tmp_path, "distill", triton)
    assert len(rows) >= 20, [r["label"] for r in rows]  # sanity: not silently emptied
    kernels = {"_distill_stats_kernel", "_distill_rows_kernel", "_distill_grads_kernel"}
    _assert_every_flag_on_and_off(rows, kernels | {"_distill_dh_kernel", "_distill_dw_kernel"}, per_kernel=False)
    failed = [f"{r['label']}: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    problems = []
    for r in rows:
        c = r["constexprs"]
        where = f"{r['label']} {c.get('BLOCK_N')}x{c.get('BLOCK_V')} w{r['num_warps']}s{r['num_stages']}"
        spill = r["stack"] + r["local"]
        print(f"{target} {where}: {r['registers']} registers, {spill} B spilled, {r['shared']} B shared, {r['mma']}")
        if r["shared"] > LIMITS[target]:
            problems.append(f"{where}: shared {r['shared']} B > {LIMITS[target]} B")
        fp32 = r["label"].startswith("fp32/")
        bound = SPILL_BOUND
        if spill > bound:
            problems.append(f"{where}: spills {spill} B/thread > {bound}")
        if not fp32:
            want = {"sm_90": "wgmma", "sm_100": "tcgen05"}.get(target)
            if (want is not None and want not in r["mma"]) or not r["mma"]:
                problems.append(f"{where}: no {want or 'tensor-core'} instruction in the PTX (has {r['mma']})")
    assert not problems, "\n".join(problems)


def _assert_every_config_compiled(target: str, rows: list[dict], triton: str) -> None:
    """Every config the library can select on ``target`` with that Triton is among the compiled launches."""
    import torch

    from cce_dist.kernels import config as C

    compiler = C.parse_version(OLDEST) if triton == "oldest" else C.triton_version()
    props = C.KNOWN_DEVICES[target]
    seen = set()
    for r in rows:
        c = r["constexprs"]
        seen.add(
            (
                "fwd" if r["kernel"] == "_row_stats_kernel" else "bwd",
                c["BLOCK_N"],
                c["BLOCK_V"],
                c["BLOCK_D"],
                c.get("BLOCK_D_OUT"),
                r["num_warps"],
                r["num_stages"],
                r.get("maxnreg"),
            )
        )
    want = set()
    for dtype, tf32 in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, True), (torch.float32, False)):
        # every combination of forward_candidates' boolean flags, read from its signature (tf32 is the mode; lean and
        # heavy exclude each other: plan_row_stats)
        params = inspect.signature(C.forward_candidates).parameters.values()
        names = tuple(p.name for p in params if isinstance(p.default, bool) and p.name != "tf32")
        assert {"softcap", "aligned", "lean", "heavy", "bias", "temperature"} <= set(names), names
        combos = [dict(zip(names, vals)) for vals in itertools.product((False, True), repeat=len(names))]
        for f in (f for f in combos if not (f["lean"] and f["heavy"])):
            for c in C.forward_candidates(props, dtype, tf32, compiler=compiler, **f):
                want.add(("fwd", c.block_n, c.block_v, c.block_d, None, c.num_warps, c.num_stages, c.maxnreg))
    for c in C.all_backward_configs(props, compiler):
        want.add(("bwd", c.block_n, c.block_v, c.block_d, c.block_d_out, c.num_warps, c.num_stages, c.maxnreg))
    missing = want - seen
    assert not missing, f"selectable on {target} but never compiled: {sorted(missing)}"


def test_selection_uses_reported_shared_memory_not_major():
    """sm_120 (consumer Blackwell) reports 101,376 B per block like sm_86 and has no wgmma: it must
    get the mma.sync configs that fit that, not Hopper's (selection keyed on ``major >= 9`` gave
    it configs needing up to 163,840 B). A Hopper part reporting less memory gets smaller tiles."""
    import dataclasses

    import torch

    from cce_dist.kernels import config as C

    p120, p86, p90 = (C.KNOWN_DEVICES[k] for k in ("sm_120", "sm_86", "sm_90"))
    assert (p120.mma, p90.mma, C.KNOWN_DEVICES["sm_100"].mma) == ("mma", "wgmma", "tcgen05")
    for dtype, tf32 in ((torch.bfloat16, True), (torch.float32, True), (torch.float32, False)):
        # the same tiles (sm_120's register cap aside: ptxas held its 8-warp 64 x 128 tile to 128 registers)
        def tiles(props, dtype=dtype, tf32=tf32):
            return [dataclasses.replace(c, maxnreg=None) for c in C.forward_candidates(props, dtype, tf32)]

        assert tiles(p120) == tiles(p86)
    for props in C.KNOWN_DEVICES.values():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for c in C.forward_candidates(props, dtype):
                assert C.fwd_smem_estimate(c, dtype) <= props.smem_per_block
            for sc in (False, True):
                c = C.backward_config(props, dtype, softcap=sc)
                assert C.bwd_smem_estimate(c, dtype) <= props.smem_per_block, (props, dtype, c)
    small_hopper = C.DeviceProps((9, 0), 132, 101_376)
    c = C.backward_config(small_hopper, torch.float32)
    assert C.bwd_smem_estimate(c, torch.float32) <= 101_376
    assert c != C.backward_config(p90, torch.float32)


def _launch_config(kwargs: dict) -> tuple:
    return tuple(kwargs.get(k) for k in ("BLOCK_N", "BLOCK_V", "BLOCK_D", "BLOCK_D_OUT", "num_warps", "num_stages"))


@pytest.fixture
def planning_for_gpus(monkeypatch):
    """The kernels' planners choose configs as on a GPU, not the interpreter's (conftest sets TRITON_INTERPRET for
    this process): plans on meta tensors only, nothing is launched."""
    from cce_dist.kernels import backward, distill, forward

    for module in (forward, backward, distill):
        monkeypatch.setattr(module, "_INTERPRET", False)


def test_every_planner_picks_unaligned_configs_from_the_tensors(planning_for_gpus):
    """Rows not 16-byte aligned (D = 2303 in bf16) are loaded through registers (no vectorized or asynchronous
    copies), and on wgmma the 128-row tiles and 64-wide K chunks then spilled 8-1048 B (benchmarks/results/
    aot_spills_pairs.md). The forward and the backward planners both read the alignment from the tensors
    (``kernels._common.rows_aligned``); the backward's planner ignored it and launched the aligned tiles."""
    import torch

    from cce_dist.kernels import aot
    from cce_dist.kernels import config as C

    p90 = C.KNOWN_DEVICES["sm_90"]
    for d, aligned in ((2304, True), (2303, False)):
        fwd = {_launch_config(kw) for _k, _g, _a, kw in aot.forward_launches(p90, torch.bfloat16, 8192, d, 4096)}
        want_fwd = {
            (c.block_n, c.block_v, c.block_d, None, c.num_warps, c.num_stages)
            for c in C.forward_candidates(p90, torch.bfloat16, aligned=aligned)
        }
        assert fwd == want_fwd, (d, fwd)
        for schedule, det in (("chunked", False), ("owner", True), ("tiles", False)):
            launches = aot.backward_launches(
                p90, torch.bfloat16, 8192, d, 4096, schedule=schedule, deterministic=det, class_weights=True
            )
            c = C.backward_config(p90, torch.bfloat16, deterministic=det, class_weights=True, aligned=aligned)
            for kernel, _grid, _args, kw in launches:
                got = _launch_config(kw)
                if kernel.fn.__name__ == "_dz_store_kernel":  # the chunked schedule's dz: no gradient chunks
                    assert got == (c.block_n, c.block_v, c.block_d, None, c.num_warps, c.num_stages), (d, schedule)
                elif kernel.fn.__name__ != "_grads_dh_kernel":  # the dH kernel may halve its token tile
                    assert got == (c.block_n, c.block_v, c.block_d, c.block_d_out, c.num_warps, c.num_stages)
    unaligned = C.backward_config(p90, torch.bfloat16, aligned=False)
    assert (
        (unaligned.block_n, unaligned.block_d)
        == (64, 32)
        != (
            C.backward_config(p90, torch.bfloat16).block_n,
            C.backward_config(p90, torch.bfloat16).block_d,
        )
    )
    assert all((c.block_n, c.block_d) == (64, 32) for c in C.forward_candidates(p90, torch.float16, aligned=False))


def test_backward_halves_vocab_tiles_under_register_pressure(planning_for_gpus):
    """The triples level (each mode's every-feature flag set at every shape) found every backward kernel spilling
    8-376 B on every target with Triton 3.9: rows not 16-byte aligned (even without an epilogue, the per-tile kernel
    on mma.sync), a token count not a multiple of 16 beside any epilogue in every schedule (the planner passed it to
    the per-tile kernel only), and three epilogues at once. Half-wide vocab tiles spilled in none, so each of those
    halves the config's vocab tile (unaligned rows with two epilogues twice; the filter on mma.sync / wgmma with
    Triton 3.6 and 3.7 once: the chunked dz kernel; the owner-computes kernels with a bias or class weights on wgmma
    with 3.6 once; on mma.sync and tcgen05 with the register cap at 255); a ragged token count alone, or one or two
    epilogues, keep it. On tcgen05 every config takes the register cap (the whole backward product on sm_100,
    Triton 3.9: 8-24 B at 128 registers)."""
    import torch

    from cce_dist.kernels import aot
    from cce_dist.kernels import config as C

    for props in C.KNOWN_DEVICES.values():
        for dtype, tf32 in ((torch.bfloat16, True), (torch.float32, True), (torch.float32, False)):
            for compiler in ((3, 6), (3, 7), (3, 8), (3, 9)):

                def block_v(props=props, dtype=dtype, tf32=tf32, compiler=compiler, **flags):
                    return C.backward_config(props, dtype, tf32=tf32, compiler=compiler, **flags).block_v

                def tiles(props=props, dtype=dtype, tf32=tf32, compiler=compiler, **flags):  # before the rule
                    return C._backward_tiles(
                        props, dtype, tf32, **{**_BWD_FLAGS, "compiler": compiler, **flags}
                    ).block_v

                ctx = (props.capability, dtype, tf32, compiler)
                assert block_v() == tiles(), ctx
                assert block_v(ragged_rows=True) == tiles(ragged_rows=True), ctx
                assert block_v(softcap=True, deterministic=True) == tiles(softcap=True, deterministic=True), ctx
                assert block_v(aligned=False) == max(16, tiles(aligned=False) // 2), ctx
                assert block_v(ragged_rows=True, softcap=True) == max(16, tiles(softcap=True) // 2), ctx
                # Triton 3.6 / 3.7 on mma.sync / wgmma: the filter halves them (the chunked dz kernel spilled
                # 88-136 B with 3.6, 16-80 B with 3.7); on wgmma beside a softcap with every Triton (8-40 B, 3.9)
                old = props.mma in ("mma", "wgmma") and compiler < (3, 8)
                with_softcap = old or props.mma == "wgmma"
                sf = dict(softcap=True, filtering=True)
                assert block_v(**sf) == max(16, tiles(**sf) // (2 if with_softcap else 1)), ctx
                heavy = dict(softcap=True, filtering=True, deterministic=True)
                assert block_v(**heavy) == max(16, tiles(**heavy) // (4 if with_softcap else 2)), ctx
                assert block_v(filtering=True) == max(16, tiles(filtering=True) // (2 if old else 1)), ctx
                # wgmma, 16-bit: the owner-computes dW kernel with a bias or class weights spilled 8-264 B (the whole
                # backward product on sm_90, Triton 3.6 and 3.9); bias alone, then with class weights, then neither
                owner = props.mma in ("wgmma", "tcgen05") and dtype != torch.float32  # tcgen05: 48 B, sm_100, 3.9
                det = dict(deterministic=True)
                assert block_v(bias=True, **det) == max(16, tiles(**det) // (2 if owner else 1)), ctx
                cw = dict(deterministic=True, class_weights=True)
                assert block_v(bias=True, **cw) == block_v(**cw) == max(16, tiles(**cw) // (2 if owner else 1)), ctx
                # the chunked and per-tile kernels keep theirs, but in TF32 on sm_120 (the per-tile kernel spilled 8 B
                # at 255 registers: the whole backward product, Triton 3.9)
                by_b = 2 if props.capability[0] >= 12 and dtype == torch.float32 and tf32 else 1
                assert block_v(bias=True) == tiles() // by_b, ctx
                # tcgen05 with Triton 3.6: a bias beside class weights (bf16 / fp16) or beside a softcap and the filter
                # (TF32) halves them (the chunked dz kernel spilled 80-96 B / 16 B: the whole backward product, sm_100)
                early = props.mma == "tcgen05" and compiler == (3, 6)
                by_cw = 2 if early and dtype != torch.float32 else 1
                assert block_v(bias=True, class_weights=True) == max(16, tiles(class_weights=True) // by_cw // by_b), (
                    ctx
                )
                assert block_v(class_weights=True) == tiles(class_weights=True), ctx
                by_sf = (2 if with_softcap else 1) * (2 if early and dtype == torch.float32 and tf32 else 1)
                assert block_v(bias=True, **sf) == max(16, tiles(**sf) // by_sf // by_b), ctx
                # tcgen05: every config takes the register cap (ptxas held 8-warp kernels to 128 registers: 8-24 B in
                # the whole backward product on sm_100, Triton 3.9); mma.sync: the 8-warp per-tile / chunked configs
                # with a bias, or a softcap beside class weights (8-16 B at 128 registers: the whole backward product
                # on sm_80, Triton 3.6; in bf16 / fp16); elsewhere a bias does not change the cap
                extras = (dict(), dict(softcap=True), dict(deterministic=True), dict(aligned=False))
                for extra in (*extras, dict(class_weights=True), dict(softcap=True, class_weights=True)):
                    for b in (False, True):
                        got = C.backward_config(props, dtype, tf32=tf32, compiler=compiler, bias=b, **extra)
                        plain = C.backward_config(props, dtype, tf32=tf32, compiler=compiler, **extra)
                        held = extra.get("softcap") and extra.get("class_weights") and dtype != torch.float32
                        pressure = b or held  # not TF32 with a softcap and class weights (16 B at 255: sm_120)
                        per_tile = not extra.get("deterministic") and got.num_warps == 8
                        capped = props.mma == "tcgen05" or (props.mma == "mma" and per_tile and pressure)
                        # and sm_120's deterministic bf16 / fp16 ones with Triton 3.7 (the 4-warp dW kernel held to 168
                        # registers beside a temperature with a bias or a softcap: 8-16 B, the whole backward product)
                        det37 = extra.get("deterministic") and compiler == (3, 7) and dtype != torch.float32
                        capped = capped or bool(props.capability[0] >= 12 and det37 and b)
                        assert got.maxnreg == (255 if capped else plain.maxnreg), (ctx, extra, b)
                        if props.mma == "mma":  # there only the cap changes (and TF32 on sm_120 halves, above)
                            halved = by_b if b and not extra.get("deterministic") else 1
                            want = (max(16, plain.block_v // halved), plain.num_warps)
                            assert (got.block_v, got.num_warps) == want, (ctx, extra, b)
                # the 4-warp deterministic configs on sm_120 with a bias beside the filter: the register cap (the dH
                # kernel held to 168 registers: 16 B in bf16, Triton 3.9, the whole backward product); not on sm_80 /
                # sm_86 (there the cap made the dH kernel spill 40 B: sm_86, 3.9)
                df = dict(deterministic=True, filtering=True)
                with_b = C.backward_config(props, dtype, tf32=tf32, compiler=compiler, bias=True, **df)
                without = C.backward_config(props, dtype, tf32=tf32, compiler=compiler, **df)
                newer = compiler >= (3, 9) or (props.capability[0] >= 12 and compiler >= (3, 7))  # 4 warps there
                if props.capability[0] >= 12 and dtype != torch.float32 and newer:
                    assert (with_b.num_warps, with_b.maxnreg) == (4, 255), ctx
                elif props.capability == (8, 0) and dtype != torch.float32 and compiler == (3, 8):
                    # but sm_80's 8-warp ones with Triton 3.8 (the dW kernel held to 128 registers: 8 B, the whole
                    # backward product there)
                    assert (with_b.num_warps, with_b.maxnreg, without.maxnreg) == (8, 255, None), ctx
                elif props.mma != "tcgen05":
                    assert with_b.maxnreg == without.maxnreg, ctx
                # and every TF32 one there, the filter or not (the 8-warp dW kernel held to 128 registers: 16 B with a
                # temperature and the filter, Triton 3.9, the whole backward product; with a bias, a softcap and a
                # temperature, 3.6)
                if props.capability[0] >= 12 and dtype == torch.float32 and tf32:
                    assert (without.num_warps, without.maxnreg) == (8, 255), ctx
                    for extra in (dict(), dict(bias=True, softcap=True), dict(class_weights=True)):
                        got = C.backward_config(props, dtype, compiler=compiler, deterministic=True, **extra)
                        assert got.maxnreg == 255, (ctx, extra)
                # bf16 / fp16 with a softcap there with Triton 3.8: the cap in every schedule (the 8-warp per-tile
                # kernel held to 128 registers, the 4-warp deterministic dW kernel to 168: 8-16 B beside a temperature,
                # the whole backward product)
                # and TF32 with a softcap there with Triton 3.6 (the 8-warp per-tile kernel without dH held to 128: 8 B)
                mode = "16-bit" if dtype != torch.float32 else "tf32" if tf32 else "ieee"
                if props.capability[0] >= 12 and (mode, compiler) in (("16-bit", (3, 8)), ("tf32", (3, 6))):
                    for extra in (dict(), dict(deterministic=True), dict(bias=True), dict(class_weights=True)):
                        got = C.backward_config(props, dtype, tf32=tf32, compiler=compiler, softcap=True, **extra)
                        assert got.maxnreg == 255, (ctx, extra)
                # deterministic class weights on mma.sync: the register cap (TF32 dW held to 96 registers: 8 B)
                cw = C.backward_config(
                    props, dtype, tf32=tf32, compiler=compiler, deterministic=True, class_weights=True
                )
                assert cw.maxnreg == (255 if props.mma in ("mma", "tcgen05") or not tf32 else None), ctx
                # rows not aligned with two epilogues: twice (the per-tile kernel still spilled 8 B at half width)
                two = dict(softcap=True, filtering=True)
                got = block_v(aligned=False, **two)
                assert got == max(16, tiles(aligned=False, **two) // (8 if with_softcap else 4)), ctx
                # on mma.sync and tcgen05 the halved tiles carry the register cap (ptxas held TF32 64 x 16 to 128)
                squeezed = C.backward_config(props, dtype, tf32=tf32, compiler=compiler, aligned=False)
                capped = props.mma in ("mma", "tcgen05", "none") or not tf32
                assert squeezed.maxnreg == (255 if capped else None), ctx
    p90 = C.KNOWN_DEVICES["sm_90"]
    for schedule, det in (("chunked", False), ("owner", True), ("tiles", False)):
        got = {}
        for n in (8192, 8191):
            launches = aot.backward_launches(
                p90, torch.bfloat16, n, 2048, 4096, softcap=30.0, schedule=schedule, deterministic=det
            )
            got[n] = {kw["BLOCK_V"] for _k, _g, _a, kw in launches}
        assert {v // 2 for v in got[8192]} == got[8191], (schedule, got)


def test_filtering_deterministic_configs_keep_8_warps_on_consumer_ampere_and_ada():
    """The deterministic (owner-computes) configs run bf16 / fp16 over 4 warps on mma.sync with Triton 3.9, but on
    sm_86 / sm_89 the filtering dH kernel spilled there (8-16 B beside a bias or a temperature, 48-56 B at 255
    registers at a token count not a multiple of 16: 11 launches of the backward's whole flag product, which no
    covering level reached): the filter keeps 8 warps there. sm_80 (the same configs spill-free) and sm_120 keep 4."""
    import dataclasses

    import torch

    from cce_dist.kernels import config as C

    sm86 = C.KNOWN_DEVICES["sm_86"]
    sm89 = dataclasses.replace(sm86, capability=(8, 9))
    for dtype in (torch.bfloat16, torch.float16):
        for props, want in ((sm86, 8), (sm89, 8), (C.KNOWN_DEVICES["sm_80"], 4), (C.KNOWN_DEVICES["sm_120"], 4)):
            for extra in (dict(), dict(bias=True), dict(ragged_rows=True), dict(aligned=False)):
                got = C.backward_config(props, dtype, compiler=(3, 9), deterministic=True, filtering=True, **extra)
                assert got.num_warps == want, (props.capability, dtype, extra, got)
            # without the filter every mma.sync target keeps 4 warps with 3.9
            assert C.backward_config(props, dtype, compiler=(3, 9), deterministic=True).num_warps == 4
        # and before 3.9 sm_86 ran 8 warps anyway (4 spilled 8-48 B with the filter)
        assert C.backward_config(sm86, dtype, compiler=(3, 8), deterministic=True, filtering=True).num_warps == 8
    # TF32 there with Triton 3.8: ptxas held the 8-warp deterministic dW kernel to 128 registers (8 B beside a bias, a
    # softcap and a temperature; the backward's whole flag product): the cap at 255, on sm_86 / sm_89 with 3.8 only
    for props in (sm86, sm89, C.KNOWN_DEVICES["sm_80"]):
        for compiler in ((3, 6), (3, 7), (3, 8), (3, 9)):
            for extra in (dict(), dict(bias=True, softcap=True)):
                got = C.backward_config(props, torch.float32, compiler=compiler, deterministic=True, **extra)
                want = 255 if props.capability != (8, 0) and compiler == (3, 8) else None
                assert (got.num_warps, got.maxnreg) == (8, want), (props.capability, compiler, extra, got)


def test_sm120_deterministic_16bit_configs_take_the_register_cap_with_triton_37():
    """With Triton 3.7 ptxas held the 4-warp owner-computes dW kernel on sm_120 (bf16 / fp16, 64 x 64 x 32) to 168
    registers beside a temperature with a softcap or a bias and spilled 8-16 B (5 launches of the backward's whole
    flag product there, which no covering level reached; 3.6 / 3.8 / 3.9 compiled them clean): the cap at 255 for
    the deterministic configs with either. Every other target and Triton keeps the config it had."""
    import torch

    from cce_dist.kernels import config as C

    sm120 = C.KNOWN_DEVICES["sm_120"]
    assert sm120.consumer_blackwell and not sm120.consumer_ampere_ada
    assert C.KNOWN_DEVICES["sm_86"].consumer_ampere_ada and not C.KNOWN_DEVICES["sm_86"].consumer_blackwell
    for name in ("sm_80", "sm_90", "sm_100"):
        props = C.KNOWN_DEVICES[name]
        assert not (props.consumer_ampere_ada or props.consumer_blackwell), name
    for dtype in (torch.bfloat16, torch.float16):
        for extra in (dict(softcap=True), dict(bias=True), dict(softcap=True, bias=True)):
            got = C.backward_config(sm120, dtype, compiler=(3, 7), deterministic=True, **extra)
            assert (got.num_warps, got.block_v, got.maxnreg) == (4, 64, 255), (dtype, extra, got)
            # not without the deterministic epilogue (the per-tile kernel), nor on sm_80 / sm_86 with 3.7
            assert C.backward_config(sm120, dtype, compiler=(3, 7), **extra).num_warps == 8
            for name in ("sm_80", "sm_86"):
                other = C.backward_config(C.KNOWN_DEVICES[name], dtype, compiler=(3, 7), deterministic=True, **extra)
                assert other.maxnreg is None, (name, dtype, extra, other)
        # ptxas's own choice kept where 3.7 compiled clean: deterministic without a bias or a softcap, and with 3.6
        # and 3.9 (3.8's softcap rule caps every bf16 / fp16 config with a softcap there: asserted beside it)
        assert C.backward_config(sm120, dtype, compiler=(3, 7), deterministic=True).maxnreg is None
        for compiler in ((3, 6), (3, 9)):
            got = C.backward_config(sm120, dtype, compiler=compiler, deterministic=True, bias=True)
            assert got.maxnreg is None, (compiler, dtype, got)


def test_sm80_filtering_deterministic_configs_with_a_bias_take_the_register_cap_with_triton_38():
    """With Triton 3.8 ptxas held the 8-warp owner-computes dW kernel on sm_80 (bf16 / fp16, 64 x 64 x 32) with a bias
    and the filter to 128 registers and spilled 8 B (4 launches of the backward's whole flag product there, which no
    covering level reached; 3.6 / 3.7 run half-wide vocab tiles there, 3.9 4 warps): the cap at 255 there.
    sm_86 (whose whole product with 3.8 compiled them clean) keeps ptxas's own choice."""
    import torch

    from cce_dist.kernels import config as C

    sm80, sm86 = C.KNOWN_DEVICES["sm_80"], C.KNOWN_DEVICES["sm_86"]
    flags = dict(deterministic=True, filtering=True, bias=True)
    for dtype in (torch.bfloat16, torch.float16):
        got = C.backward_config(sm80, dtype, compiler=(3, 8), **flags)
        assert (got.num_warps, got.block_v, got.maxnreg) == (8, 64, 255), (dtype, got)
        assert C.backward_config(sm86, dtype, compiler=(3, 8), **flags).maxnreg is None
        assert C.backward_config(sm80, dtype, compiler=(3, 9), **flags).num_warps == 4
        # without the bias or without the filter ptxas's own choice compiled clean
        for drop in ("bias", "filtering"):
            other = C.backward_config(sm80, dtype, compiler=(3, 8), **{**flags, drop: False})
            assert other.maxnreg is None, (dtype, drop, other)


_GA10X_PROBE = """
import json, sys
from cce_dist.kernels import aot, config
props, out = config.KNOWN_DEVICES["sm_86"], []
for shape, extra in (("rows", dict(bias=True)), ("paper", dict(temperature=0.7))):
    row = dict(mode="bf16", shape=shape, bias=False, softcap=None, temperature=None, filter_eps="auto",
               deterministic=True, _schedule="owner", gamma_weights=False, need_hidden=True, need_weight=True,
               need_bias=True)
    row.update(extra)
    for kernel, _grid, args, kw in aot._bwd_row(props, row):
        if kernel.fn.__name__ == "_grads_dh_kernel":
            rec = aot.compile_launch(kernel, args, kw, 86)
            out.append(dict(shape=shape, warps=kw["num_warps"], spill=rec.stack + rec.local, shared=rec.shared))
print(json.dumps(out))
"""


@pytest.mark.timeout(900)
def test_filtering_deterministic_dh_kernel_compiles_without_spills_on_sm86():
    """The two worst of the 11 launches the backward's whole flag product on sm_86 found spilling with Triton 3.9
    (the filtering owner-computes dH kernel in bf16: with a bias at the rows shape 56 B, with a temperature at the
    paper shape 16 B), compiled for sm_86 by the installed Triton: within ``SPILL_BOUND``. The ``each`` level CI
    compiles holds neither flag set."""
    from cce_dist.kernels.aot import SPILL_BOUND

    got = _run_probe(_GA10X_PROBE, timeout=850)
    assert [g["shape"] for g in got] == ["rows", "paper"], got  # one dH launch per flag set: the probe planned them
    assert all(g["spill"] <= SPILL_BOUND and g["shared"] <= LIMITS["sm_86"] for g in got), got


_BWD_FLAGS = dict(
    softcap=False, filtering=False, deterministic=False, class_weights=False, ragged_rows=False, aligned=True
)


def test_forward_candidates_under_register_pressure():
    """Configs the triples level found spilling with Triton 3.9: on tcgen05 a bias spilled 8 B in the 64 x 256 tile
    and in 64 x 128 held to 128 registers (no 256-wide tile with a bias, the cap at 255), TF32 with a bias and a
    softcap 32 B in 128 x 128 (not a candidate then); rows not 16-byte aligned with the row outputs 48 B in 64 x 128
    on wgmma / tcgen05 (64 x 64 then); on sm_120 ptxas held the 8-warp 64 x 128 mma.sync tile to 128 registers and
    spilled 8-16 B (capped at 255 there). The forward's whole flag product on sm_90 with Triton 3.6 found the 64 x 256
    wgmma tile with a bias and the entropy statistic spilling 24-224 B: no 256-wide tile with a bias there either.
    The whole product on sm_100 with Triton 3.9 found 24 spilling launches: the 64 x 256 tile with a temperature
    (88 B), TF32 128 x 128 with a bias and no softcap (8-56 B), and the row outputs' tiles with a softcap or a
    temperature held to 128 registers (8 B, aligned rows or not)."""
    import torch

    from cce_dist.kernels import config as C

    p100, p90, p120, p86 = (C.KNOWN_DEVICES[k] for k in ("sm_100", "sm_90", "sm_120", "sm_86"))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for softcap in (False, True):
            with_bias = C.forward_candidates(p100, dtype, softcap=softcap, bias=True)
            assert with_bias and all(c.block_v < 256 and c.maxnreg == 255 for c in with_bias), (dtype, softcap)
            if dtype == torch.float32:
                assert all(c.block_n < 128 for c in with_bias)
            for compiler in ((3, 6), (3, 7), (3, 8), (3, 9)):  # uncapped, but TF32 64 x 256 with 3.6 (below)
                plain = C.forward_candidates(p100, dtype, softcap=softcap, compiler=compiler)
                tf32_36 = dtype == torch.float32 and compiler == (3, 6)
                assert all(c.maxnreg is None for c in plain if not (tf32_36 and c.block_v == 256)), (dtype, compiler)
            warm = C.forward_candidates(p100, dtype, softcap=softcap, temperature=True)
            assert warm and all(c.block_v < 256 and c.maxnreg is None for c in warm), (dtype, softcap)
            for aligned in (True, False):
                rows = C.forward_candidates(p100, dtype, softcap=softcap, heavy=True, aligned=aligned)
                assert rows and all(c.maxnreg == 255 for c in rows), (dtype, softcap, aligned)
        assert any(c.block_v == 256 for c in C.forward_candidates(p100, dtype))
        # TF32 64 x 256 on tcgen05: capped at 255 with Triton 3.6 only (held to 128 registers: 8 B with the entropy
        # statistic, the whole forward product on sm_100); with 3.8 / 3.9 the cap made it spill 40-96 B
        for compiler in ((3, 6), (3, 7), (3, 8), (3, 9)):
            wide = [c for c in C.forward_candidates(p100, dtype, compiler=compiler) if c.block_v == 256]
            capped = dtype == torch.float32 and compiler == (3, 6)
            assert wide and all((c.maxnreg == 255) == capped for c in wide), (dtype, compiler)
        # wgmma with a bias: no 256-wide tile (24-224 B with the entropy statistic, Triton 3.6; with a softcap TF32
        # 224 B), with every compiler; with a softcap in TF32 no 128-row tile either (64 B with Triton 3.8)
        for compiler in ((3, 6), (3, 7), (3, 8), (3, 9)):
            for softcap in (False, True):
                got = C.forward_candidates(p90, dtype, softcap=softcap, bias=True, compiler=compiler)
                assert got and all(c.block_v < 256 for c in got), (dtype, softcap, compiler)
                assert all(c.block_n < 128 for c in got) == (dtype == torch.float32 and softcap), (dtype, softcap)
                assert any(
                    c.block_v == 256 for c in C.forward_candidates(p90, dtype, softcap=softcap, compiler=compiler)
                )
                # and with a temperature, Triton 3.8: no 128-row tile (8 B in fp16, the whole forward product)
                hot = C.forward_candidates(p90, dtype, softcap=softcap, bias=True, temperature=True, compiler=compiler)
                tall = (dtype == torch.float32 and softcap) or compiler == (3, 8)
                assert hot and all(c.block_n < 128 for c in hot) == tall, (dtype, softcap, compiler)
        # Triton 3.8 on wgmma: every tile in half-wide K chunks (SUM / ENTROPY spilled 24-96 B at 255 registers: 128 x
        # 128 and 64 x 128, bf16 / fp16 in 64-wide chunks, TF32 in 32; the forward's whole product on sm_90)
        for compiler in ((3, 6), (3, 7), (3, 8), (3, 9)):
            for flags in (dict(), dict(lean=True), dict(heavy=True), dict(softcap=True), dict(bias=True)):
                got = C.forward_candidates(p90, dtype, compiler=compiler, **flags)
                want = (32 if dtype == torch.float32 else 64) // (2 if compiler == (3, 8) else 1)
                assert got and {c.block_d for c in got} == {want}, (dtype, compiler, flags)
        for props in (p90, p100):
            heavy = C.forward_candidates(props, dtype, aligned=False, heavy=True)
            assert [(c.block_n, c.block_v, c.block_d) for c in heavy] == [(64, 64, 32)], (props.capability, dtype)
        first120, first86 = C.forward_candidates(p120, dtype)[0], C.forward_candidates(p86, dtype)[0]
        assert (first120.num_warps, first120.block_v, first120.maxnreg) == (8, 128, 255)
        assert first86.maxnreg is None
        # every sm_120 candidate: the 4-warp 64 x 64 one was held to 168 registers (8 B with a bias, SUM and ENTROPY in
        # fp16), over the 8 warps of rows not aligned to 128 (16 B in TF32; the whole forward product, Triton 3.9)
        for aligned in (True, False):
            assert all(c.maxnreg == 255 for c in C.forward_candidates(p120, dtype, aligned=aligned, bias=True))
            assert all(c.maxnreg is None for c in C.forward_candidates(p86, dtype, aligned=aligned, bias=True))
        # and its row-output tile (Triton 3.8 held TF32 to 128 registers: 16 B)
        assert [c.maxnreg for c in C.forward_candidates(p120, dtype, heavy=True)] == [255]
        # on every mma.sync target (Triton 3.6 held bf16 to 128 registers on sm_80: 8 B, the whole forward product)
        assert [c.maxnreg for c in C.forward_candidates(p86, dtype, heavy=True)] == [255]
        assert [c.maxnreg for c in C.forward_candidates(C.KNOWN_DEVICES["sm_80"], dtype, heavy=True)] == [255]


def test_distillation_halves_vocab_tiles_for_unaligned_rows():
    """Rows not 16-byte aligned: the distillation's 64 x 64 tiles (32 x 32 in fp32 IEEE) still spilled 8-240 B with
    every feature on (the triples level, Triton 3.9, every target); the vocab tiles are at most 32 wide there (16 in
    fp32 IEEE), K chunks at most 32."""
    import torch

    from cce_dist.kernels import config as C
    from cce_dist.kernels.distill import distill_config

    for props in C.KNOWN_DEVICES.values():
        for dtype, tf32 in ((torch.bfloat16, True), (torch.float32, True), (torch.float32, False)):
            for det in (False, True):
                for compiler in ((3, 6), (3, 9)):
                    a = distill_config(props, dtype, tf32, det, compiler=compiler)
                    u = distill_config(props, dtype, tf32, det, compiler=compiler, aligned=False)
                    ctx = (props.capability, dtype, tf32, det, compiler)
                    assert u.block_v < a.block_v, ctx
                    assert u.block_v <= (16 if dtype == torch.float32 and not tf32 else 32), ctx
                    assert u.block_d <= 32, ctx


def test_distillation_on_mma_sync_and_tcgen05_caps_registers_at_255(monkeypatch, planning_for_gpus):
    """ptxas held the distillation's kernels on mma.sync and tcgen05 to 128-168 registers and spilled 8-24 B (sm_120,
    Triton 3.6 / 3.8 at the pairs level, 3.9 at the triples level; sm_100, 3.9, the gradients of a bf16 student with a
    TF32 teacher); narrower tiles only moved the spill. Their launches there carry ``maxnreg=255`` (a launch option
    every supported Triton takes) with every Triton; on wgmma ptxas keeps its own cap. fp32 IEEE takes
    ``config.FP32_BWD`` (capped on every target)."""
    import torch

    from cce_dist.kernels import aot
    from cce_dist.kernels import config as C

    def options(target: str, compiler: tuple[int, int], **flags) -> set:
        monkeypatch.setattr(C, "triton_version", lambda: compiler)
        launches = aot.distill_launches(
            C.KNOWN_DEVICES[target], (torch.bfloat16, torch.float32), 8192, 2048, 4096, 4096, **flags
        )
        return {kw.get("maxnreg") for _k, _g, _a, kw in launches}

    for flags in (dict(), dict(deterministic=True, hard=True, softcap=(30.0, 50.0), temperature=0.7)):
        for compiler in ((3, 6), (3, 7), (3, 8), (3, 9)):
            for target in ("sm_80", "sm_86", "sm_120", "sm_100"):
                assert options(target, compiler, **flags) == {255}, (target, compiler, flags)
            assert options("sm_90", compiler, **flags) == {None}, (compiler, flags)


def test_splits_follow_the_launched_tile():
    """The forward's vocab splits come from the tile actually launched: 8192 rows in 128-row
    tiles are 64 programs per split on 132 SMs, so 2 splits (128 programs, one full wave), not
    the 3 a 64-row assumption gave (192 programs: a second, 45%-full wave)."""
    from cce_dist.kernels import config as C

    h100 = C.KNOWN_DEVICES["sm_90"]
    assert C.pick_splits(8192, 256000, 128, 128, h100) == 2
    assert C.pick_splits(8192, 256000, 64, 256, h100) == 1  # 128 programs already fill one wave
    assert C.pick_splits(65536, 256000, 128, 128, h100) == 1
    assert C.pick_splits(128, 1000, 128, 128, h100) == 1  # too few vocab tiles to split


def test_host_planning_calls_no_triton_constexpr_function(monkeypatch, planning_for_gpus):
    """Every call plans its launches on the host before the first one starts. ``triton.cdiv`` and
    ``triton.next_power_of_2`` are ``ConstexprFunction``s for kernel code (about 14 us a call): the chunked backward
    over a 256k-column shard called ``triton.cdiv`` about a thousand times a call (9.2 ms of host time; 1.2 ms with
    ``config.cdiv`` and the row blocks' views built once; measured on meta tensors). Plans every family's launches
    with them raising, and checks the grids the host now computes against ``math.ceil``."""
    import math

    import torch
    import triton

    from cce_dist.kernels import aot
    from cce_dist.kernels import config as C

    def refuse(*_a, **_k):
        raise AssertionError("host code called a Triton constexpr function")

    monkeypatch.setattr(triton, "cdiv", refuse)
    monkeypatch.setattr(triton, "next_power_of_2", refuse)
    props = C.KNOWN_DEVICES["sm_90"]
    n, d, v = aot.RAGGED_SHAPE
    assert aot.forward_launches(props, torch.bfloat16, n, d, v)
    for schedule in ("chunked", "tiles", "owner"):
        launches = aot.backward_launches(props, torch.bfloat16, n, d, v, bias=True, schedule=schedule)
        assert launches, schedule
        for kernel, grid, args, kw in launches:
            if kernel is aot._bwd._dz_store_kernel:  # (rows, columns) of its block follow the 9 tensors
                rows, cols = args[9], args[10]
                assert grid == (math.ceil(rows / kw["BLOCK_N"]) * math.ceil(cols / kw["BLOCK_V"]),), (rows, cols)
    assert aot.distill_launches(props, (torch.bfloat16, torch.bfloat16), *aot.DISTILL_RAGGED_SHAPE)
    for a, b in ((0, 7), (1, 7), (7, 7), (8, 7), (256000, 128), (32001, 128)):
        assert C.cdiv(a, b) == math.ceil(a / b)


def test_flag_axes_come_from_the_planners_signatures():
    """A flag added to a planner is enumerated without being listed: a bool keyword takes both values; a parameter
    with no known values stops the enumeration (LookupError) instead of being silently left at its default. The
    real planners' flags are all enumerated."""
    from cce_dist.kernels import aot

    def planner(hidden, bias, *, softcap, need_new_output=False, props=None, _blocks=None):
        raise AssertionError("never called")

    assert aot.planner_axes(planner) == {
        "bias": (False, True),
        "softcap": (None, 30.0),
        "need_new_output": (False, True),
    }

    def unknown(hidden, *, window_size=None):
        raise AssertionError("never called")

    with pytest.raises(LookupError, match="window_size"):
        aot.planner_axes(unknown)
    bwd = aot.FAMILIES["bwd"].axes()
    assert {"filter_eps", "gamma_weights", "_schedule", "deterministic", "need_bias"} <= set(bwd)
    assert bwd["_schedule"] == ("chunked", "tiles", "owner")
    assert {"need_argmax", "need_sumsq", "need_sum", "need_entropy"} <= set(aot.FAMILIES["fwd"].axes())
    assert {"divergence", "hard", "bs", "bt", "deterministic"} <= set(aot.FAMILIES["distill"].axes())


@pytest.mark.parametrize("strength", [2, 3])
def test_cover_holds_every_tuple_a_valid_flag_set_can_hold(strength):
    """``kernels.aot.cover`` at strength 2 (the ``pairs`` level) and 3 (``triples``): every pair / triple of (axis,
    value) that some valid flag set holds occurs in a chosen flag set, no chosen flag set is invalid, and the tuples
    no valid flag set holds are dropped."""
    import itertools

    from cce_dist.kernels import aot

    axes = {"a": (False, True), "b": (False, True), "s": ("x", "y", "z"), "c": (None, 1.0), "d": (False, True)}

    def valid(r):
        return not (r["a"] and r["s"] == "y")  # like deterministic with the tiles schedule

    rows = aot.cover(axes, strength, valid, seeds=[])
    assert all(valid(r) for r in rows)
    full = [dict(zip(axes, v)) for v in itertools.product(*axes.values())]
    for combo in itertools.combinations(axes, strength):
        want = {tuple(r[n] for n in combo) for r in full if valid(r)}
        assert want == {tuple(r[n] for n in combo) for r in rows}, combo
    assert len(rows) < len(full)


def test_triples_level_seeds_every_feature_at_every_shape_and_mode():
    """The ``triples`` level holds, besides every triple of flag values, the flag set with every feature on (and
    the plain one) of each mode at each shape: fp32 IEEE spilled with every row output only at the unaligned shape,
    a 4-way interaction a strength-3 cover alone need not hold. Its flag sets include the ``pairs`` level's seeds."""
    import math

    from cce_dist.kernels import aot
    from cce_dist.kernels import config as C

    props = C.KNOWN_DEVICES["sm_90"]
    family = aot.FAMILIES["fwd"]
    axes = family.axes()
    rows = aot.flag_sets(family, props, "triples")
    heavy = {k: v[-1] for k, v in axes.items() if k not in ("mode", "shape")}
    for mode in axes["mode"]:
        for shape in axes["shape"]:
            assert {**heavy, "mode": mode, "shape": shape} in rows, (mode, shape)
    for seed in aot._seeds(family, axes, "pairs"):
        assert seed in rows
    assert len(rows) < math.prod(len(v) for v in axes.values()) // 10


def test_fp32_ieee_caps_registers_at_255():
    """fp32 IEEE (no tensor cores) multiplies on the FMA dot with every fp32 operand in registers; ptxas's occupancy
    heuristic held its 32 x 64 tiles to 128-168 registers and spilled 8-32 B (the owner-computes dH kernel, the
    distillation's kernels: every Triton 3.6-3.9; the forward with every row output: 3.7 / 3.8), inside the 32 B
    bound the AOT test then allowed. The forward takes :data:`config.FP32_FWD`, the backward and the distillation
    :data:`config.FP32_BWD` (32 x 32 tiles), both with ``maxnreg=255``; they spill nowhere, so the bound is 0 B for
    every compute mode."""
    import torch

    from cce_dist.kernels import config as C
    from cce_dist.kernels.aot import SPILL_BOUND
    from cce_dist.kernels.distill import distill_config

    assert SPILL_BOUND == 0
    for props in C.KNOWN_DEVICES.values():
        for compiler in ((3, 6), (3, 9)):
            assert C.backward_config(props, torch.float32, tf32=False, compiler=compiler) == C.FP32_BWD
            assert distill_config(props, torch.float32, tf32=False, compiler=compiler) == C.FP32_BWD
            assert C.forward_candidates(props, torch.float32, tf32=False, compiler=compiler) == [C.FP32_FWD]
            # with the row outputs, 8 warps over the tile: 4 spilled 8 B at 255 registers (rows not 16-byte
            # aligned, every statistic and row output; sm_90, Triton 3.9, the forward's whole flag product)
            heavy = C.forward_candidates(props, torch.float32, tf32=False, heavy=True, compiler=compiler)
            assert heavy == [C.FP32_FWD_HEAVY]
    assert C.FP32_BWD.maxnreg == C.FP32_FWD.maxnreg == C.FP32_FWD_HEAVY.maxnreg == 255 and C.FP32_BWD.block_v == 32
    assert C.FP32_FWD_HEAVY.num_warps == 8 and C.FP32_FWD_HEAVY.block_v == C.FP32_FWD.block_v


def test_wgmma_forward_with_a_softcap_runs_one_warpgroup_tiles_over_3_stages():
    """The one-warpgroup 64 x 128 wgmma candidate over 4 stages spilled 8 B at 255 registers with a softcap and SUM
    but no ENTROPY (bf16, sm_90, Triton 3.9: found by compiling the forward's whole flag product, which no covering
    level reached); over 3 stages it holds 233. Without a softcap it keeps its 4 stages."""
    import torch

    from cce_dist.kernels import config as C

    p90 = C.KNOWN_DEVICES["sm_90"]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for compiler in ((3, 6), (3, 9)):
            one = [c for c in C.forward_candidates(p90, dtype, softcap=True, compiler=compiler) if c.num_warps == 4]
            assert [(c.block_n, c.block_v, c.num_stages) for c in one] == [(64, 128, 3)]
            plain = [c for c in C.forward_candidates(p90, dtype, compiler=compiler) if c.num_warps == 4]
            assert [(c.block_n, c.block_v, c.num_stages) for c in plain] == [(64, 128, 4)]
