"""What other processes' CPU costs an engine that owns every core: the async engine in this process
(configs/local.yaml's engine options, all cores) runs bursts of concurrent streams while a background
process burns a given share of one core in short bursts; each burst's output tok/s is compared with
the bursts run without it, which are interleaved with them.

On a CPU backend the serving processes (ingress, Ray, the client) run on the engine's cores. Their
cost to the engine is not their CPU share: the engine's operators split their work statically over
its threads and wait for the slowest, so a thread that loses its core for a millisecond holds the
others for that millisecond too (docs/serving-path.md).

    .venv/bin/python loadtest/cpu_interference.py                 # burn 10% and 20% of a core
    .venv/bin/python loadtest/cpu_interference.py --nice 19       # the burner at the lowest priority
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def burn(busy_ms: float, period_ms: float, nice: int, stop) -> None:
    """Busy-loop `busy_ms` out of every `period_ms` until `stop` is set."""
    if nice:
        os.nice(nice)
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < busy_ms / 1000:
            pass
        time.sleep(max(0.0, period_ms / 1000 - (time.perf_counter() - start)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.1, 0.2], help="shares of one core to burn")
    parser.add_argument("--period-ms", type=float, default=10.0, help="the burner's cycle: busy share × period, then sleep")
    parser.add_argument("--nice", type=int, default=0, help="the burner's niceness")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    opts = parser.parse_args()

    from loadtest.bench_serving import LOOP, DirectTarget
    from loadtest.serving_anchors import random_prompts
    from serve_app.serving.app import resolve_model_path

    args = yaml.safe_load((REPO / "configs/local.yaml").read_text())["applications"][0]["args"]
    model = resolve_model_path(args["model"])
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    engine = DirectTarget(model, dict(args["engine"]))
    seeds = iter(range(10_000))

    async def burst() -> float:
        prompts = random_prompts(opts.streams, 128, vocab, seed=next(seeds))  # new prompts: no prefix-cache hits
        start = time.perf_counter()
        await asyncio.gather(*(engine.stream(p, opts.output_len) for p in prompts))
        return opts.streams * opts.output_len / (time.perf_counter() - start)

    LOOP.run_until_complete(burst())  # warm-up
    rates: dict[float, list[float]] = {0.0: []}
    for repeat in range(opts.repeats):
        for share in opts.shares:
            for current in (0.0, share):  # every loaded burst next to an unloaded one
                stop = mp.Event()
                burner = None
                if current:
                    burner = mp.Process(target=burn, args=(current * opts.period_ms, opts.period_ms, opts.nice, stop))
                    burner.start()
                    time.sleep(0.2)
                rate = LOOP.run_until_complete(burst())
                stop.set()
                if burner is not None:
                    burner.join()
                rates.setdefault(current, []).append(rate)
                print(f"[cpu-interference] repeat {repeat} burner {current:.0%} of a core: {rate:.1f} output tok/s", flush=True)
    engine.close()
    base = statistics.median(rates[0.0])
    print(f"\n{os.cpu_count()} cores, engine alone: {base:.1f} output tok/s (median of {len(rates[0.0])}); "
          f"burner cycle {opts.period_ms:g} ms, nice {opts.nice}\n")
    print("| burner (share of one core) | share of the machine | engine tok/s vs alone | engine's loss ÷ burner's machine share |")
    print("|---|---|---|---|")
    for share in opts.shares:
        ratio = statistics.median(rates[share]) / base
        machine = share / (os.cpu_count() or 1)
        print(f"| {share:.0%} | {machine:.0%} | {ratio:.3f} | {(1 - ratio) / machine:.1f}× |")


if __name__ == "__main__":
    main()
