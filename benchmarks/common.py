"""Shared helpers of the benchmark scripts: environment capture, timing, fresh-process memory
measurement, collective counting and result writing.

Benchmarks are never tests: nothing here asserts a timing.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# ----------------------------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return float("nan")


def git_commit() -> str:
    """``git rev-parse --short HEAD`` plus ``-dirty`` when the tree has uncommitted changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def env_info(**extra: Any) -> dict:
    """Everything a result must be recorded with: machine, versions, commit, date, load."""
    import torch

    try:
        import cce_dist

        cce_version = getattr(cce_dist, "__version__", "unknown")
    except ImportError:  # pragma: no cover
        cce_version = "not installed"
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "machine": {
            "cpu_model": _cpu_model(),
            "cpu_flags": _cpu_flags(),
            "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "ram_gib": _ram_gib(),
            "loadavg_at_start": loadavg(),
        },
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cce_dist": cce_version,
        "torch_num_threads": torch.get_num_threads(),
    }
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except Exception:  # noqa: BLE001 - optional
        pass
    info.update(extra)
    return info


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def time_once(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds of all threads) of one call."""
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def time_interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1, log: Callable[[str], None] | None = None
) -> dict[str, dict]:
    """Time several variants round-robin (warm-up first), so load changes hit all of them alike.

    Returns ``{name: {"wall_s": [...], "cpu_s": [...], "median_s": .., "median_cpu_s": ..}}``.
    """
    out = {k: {"wall_s": [], "cpu_s": []} for k in fns}
    for _ in range(warmup):
        for k, fn in fns.items():
            w, _c = time_once(fn)
            if log:
                log(f"  warm-up {k}: {w:.2f}s")
    for r in range(repeats):
        for k, fn in fns.items():
            w, c = time_once(fn)
            out[k]["wall_s"].append(round(w, 4))
            out[k]["cpu_s"].append(round(c, 4))
            if log:
                log(f"  rep {r} {k}: {w:.2f}s wall, {c:.2f}s cpu")
    for d in out.values():
        d["median_s"] = statistics.median(d["wall_s"]) if d["wall_s"] else float("nan")
        d["median_cpu_s"] = statistics.median(d["cpu_s"]) if d["cpu_s"] else float("nan")
        d["min_s"] = min(d["wall_s"]) if d["wall_s"] else float("nan")
    return out


# ----------------------------------------------------------------------------------------------
# memory (in a fresh process)
# ----------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def hwm_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Backup peak measurement: a thread reading VmRSS every ``interval`` seconds."""

    def __init__(self, interval: float = 0.001):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self):
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def malloc_trim() -> bool:
    """Return freed heap memory to the OS (glibc), so RSS reflects live memory."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def steady_growth(step: Callable[[], Any], clear: Callable[[], None] | None = None) -> dict:
    """Peak RSS growth of one more step above the (trimmed) RSS after earlier steps ran."""
    if clear is not None:
        clear()
    gc.collect()
    malloc_trim()
    base = rss_bytes()
    if not reset_hwm():
        return {"steady_growth_bytes": None}
    step()
    return {"steady_rss_base_bytes": base, "steady_growth_bytes": hwm_bytes() - base}


def peak_growth(step: Callable[[], Any], *, steps: int = 2, clear: Callable[[], None] | None = None) -> dict:
    """Peak RSS growth of ``steps`` calls of ``step`` (one warm-up + one measured by default)
    above the RSS right now (call it after the inputs are allocated, in a fresh process).

    ``clear`` runs before every step (e.g. drops ``.grad``), so steps do not accumulate.
    Uses VmHWM, reset to the current RSS first (falls back to a 1 ms sampling thread when
    ``/proc/self/clear_refs`` is not writable); both are reported.
    """
    gc.collect()
    base = rss_bytes()
    was_reset = reset_hwm()
    hwm_before = hwm_bytes()
    with RssSampler() as sampler:
        for _ in range(steps):
            if clear is not None:
                clear()
            step()
    hwm = hwm_bytes()
    peak = hwm if was_reset else sampler.peak
    return {
        "rss_base_bytes": base,
        "peak_bytes": peak,
        "growth_bytes": peak - base,
        "sampler_growth_bytes": sampler.peak - base,
        "hwm_reset": was_reset,
        "hwm_before_reset_ok": hwm_before <= base + (1 << 20) if was_reset else None,
    }


def run_child(module: str | Path, spec: dict, *, timeout: float = 1800, env: dict | None = None) -> dict:
    """Run ``python -m <module> --child '<json spec>'`` in a fresh process from the repository root;
    parse its last JSON line. ``module``: a benchmark's module name (``"benchmarks.cpu_single"``) or
    its file under benchmarks/ (``Path(__file__)``)."""
    if isinstance(module, Path):
        module = f"benchmarks.{module.stem}"
    cmd = [sys.executable, "-m", module, "--child", json.dumps(spec)]
    e = dict(os.environ)
    e.setdefault("PYTHONWARNINGS", "ignore")
    if env:
        e.update(env)
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=e)
    if p.returncode != 0:
        raise RuntimeError(f"child {spec} failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    for line in reversed(p.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"child {spec} printed no JSON:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def child_print(result: dict) -> None:
    print(json.dumps(result), flush=True)


def free_port() -> int:
    """A free TCP port on localhost, for a spawned group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------


def mib(b: float) -> float:
    return round(b / 2**20, 1)


def fmt(x: Any, nd: int = 2) -> str:
    if isinstance(x, float):
        if x != x:
            return "n/a"
        return f"{x:.{nd}f}"
    return "n/a" if x is None else str(x)


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(c) for c in r) + " |")
    return "\n".join(lines)


def env_markdown(env: dict) -> str:
    m = env["machine"]
    return (
        f"- date: {env['date']}; git: `{env['git_commit']}`\n"
        f"- machine: {m['cpu_model']}, {m['cores']} cores, {m['ram_gib']} GiB RAM; "
        f"load average at start {m.get('loadavg_at_start')}, at end {m.get('loadavg_at_end')}\n"
        f"- python {env['python']}, torch {env['torch']}, cce_dist {env['cce_dist']}"
        + (f", megatron-core {env['megatron_core']}" if "megatron_core" in env else "")
        + f"; torch threads {env['torch_num_threads']}; whole run {env.get('run_wall_s')} s\n"
    )


def close_env(env: dict, started: float) -> dict:
    """Record the load at the end and the wall time of the whole run."""
    env["machine"]["loadavg_at_end"] = loadavg()
    env["run_wall_s"] = round(time.perf_counter() - started, 1)
    return env


def write_results(name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    jp, mp = RESULTS / f"{name}.json", RESULTS / f"{name}.md"
    jp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    mp.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return jp, mp


def save_results(name: str, payload: dict, render: Callable[[dict], str], plot: Callable[[dict, Path], None]) -> str:
    """Write ``results/<name>.json`` first (the data survives a rendering error), then the plot
    ``<name>.png`` and the markdown ``<name>.md``; print and return the markdown."""
    write_results(name, payload, "(rendering)")
    md = render(payload)
    plot(payload, RESULTS / f"{name}.png")
    write_results(name, payload, md)
    print(md)
    return md


def logger(prefix: str) -> Callable[[str], None]:
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{prefix} {time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    return log
