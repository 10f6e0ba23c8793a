"""Where the engine's step loop runs beside a server's event loop, measured: in a thread of the serving
process (`AsyncLLMEngine`, what an LLMServer replica does), or in a process of its own fed over a local
socket (`ProcessLLMEngine`, the engine-core split of vLLM V1: requests in and each step's deltas out as frames),
against the engine's own batch API (`LLM.generate`) on the same prompts. The two streaming variants share
one consumer, which does per delta what a server does (an OpenAI chunk encoded as JSON), so the serving
loop's own CPU is in the comparison.

Each run is a fresh process (the split variant: that process and its engine child), the variants take
turns, the order rotating each repeat. Per run: a burst of `--concurrency` streams (output tok/s, TTFT
and inter-token p50, CPU seconds per output token of the whole process tree) and, for the streaming
variants, TTFT of lone requests one after another. Engine options: the first application's of `--config`.

    .venv/bin/python -m loadtest.bench_engine_process [--repeats 3]   # → reports/engine-process.{json,md,png}
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest import machine, report, server
from loadtest.bench_engine import make_prompts
from loadtest.client import Stream, burst
from loadtest.stats import interleaved, paired_ratios, percentile, spread
from serve_app.serving.config import OMP_WAIT_POLICIES
from serve_app.types import GenerateRequest, SamplingParams

VARIANTS = ("offline", "thread", "process")
LABELS = {"offline": "batch API (`LLM.generate`), no server", "thread": "engine thread in the serving process (`AsyncLLMEngine`)",
          "process": "engine in a process of its own (`ProcessLLMEngine`)"}


def chunk(request_id: str, text: str) -> bytes:
    """What a server does per delta: the OpenAI chunk as an SSE event."""
    body = {"id": request_id, "object": "text_completion", "model": "m", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- the engine behind this process's event loop ------------------------------------------------------
class StreamingEngine:
    """An engine front end (`AsyncLLMEngine`: a thread; `ProcessLLMEngine`: a child process) and what a
    server does with each delta."""

    def __init__(self, variant: str, model: str, engine_kwargs: dict[str, Any]) -> None:
        if variant == "thread":
            import torch

            from serve_app.engine.async_engine import AsyncLLMEngine as Engine

            torch.set_num_threads(os.cpu_count() or 1)
        else:
            from serve_app.engine.process_engine import ProcessLLMEngine as Engine

            os.environ["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)  # (what a replica sets for its engine process)
        self.engine, self._ids = Engine.from_kwargs(model, **engine_kwargs), itertools.count()

    async def stream(self, prompt: list[int], max_tokens: int) -> Stream:
        s, rid = Stream(time.perf_counter()), f"r-{next(self._ids)}"
        async for out in self.engine.generate(GenerateRequest(rid, prompt=prompt, sampling_params=params(max_tokens))):
            if out.token_ids:
                chunk(rid, out.text)
                s.text.append(out.text)
                s.token_times.append(time.perf_counter())
                s.tokens += len(out.token_ids)
        s.end = time.perf_counter()
        return s

    def close(self) -> None:
        self.engine.shutdown()


# ---- one run (a process of its own) -------------------------------------------------------------------
def run_one(variant: str, opts: argparse.Namespace) -> dict[str, Any]:
    args = server.config_args(opts.config)
    model, engine_kwargs = args["model"], dict(args.get("engine", {}))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(opts.concurrency, opts.prompt_len, vocab, 100, seed=1000 * opts.repeat + opts.concurrency)
    lone = make_prompts(opts.ttft_requests, opts.prompt_len, vocab, 100, seed=1000 * opts.repeat + 7)
    me = machine.tree(os.getpid())[:1]
    if variant == "offline":
        import torch

        from serve_app.engine import LLM

        torch.set_num_threads(os.cpu_count() or 1)
        llm = LLM(model, **engine_kwargs)
        llm.generate(make_prompts(2, opts.prompt_len, vocab, 100, seed=99), params(8))
        cpu, start = machine.cpu_s(machine.tree(os.getpid())), time.perf_counter()
        tokens = sum(len(o.token_ids) for o in llm.generate(prompts, params(opts.output_len)))
        elapsed, cpu = time.perf_counter() - start, machine.cpu_s(machine.tree(os.getpid())) - cpu
        return {"output_tok_s": tokens / elapsed, "cpu_ms_per_token": 1000 * cpu / tokens}
    engine = StreamingEngine(variant, model, engine_kwargs)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(burst(engine.stream, make_prompts(2, opts.prompt_len, vocab, 100, seed=99), 8))
        procs = machine.tree(os.getpid()) if variant == "process" else me
        cpu = machine.cpu_s(procs)
        result = loop.run_until_complete(burst(engine.stream, prompts, opts.output_len))
        result["cpu_ms_per_token"] = 1000 * (machine.cpu_s(procs) - cpu) / result["output_tokens"]
        ttfts = [loop.run_until_complete(engine.stream(p, 1)).ttft_s for p in lone]
        result["lone_ttft_p50_s"] = percentile(ttfts, 0.5)
        return result
    finally:
        engine.close()
        loop.close()


# ---- the comparison -----------------------------------------------------------------------------------
def omp_env(setting: str) -> dict[str, str]:
    """'POLICY[:SPINS]' → OMP_WAIT_POLICY (none for `default`) and GOMP_SPINCOUNT (none without SPINS)."""
    policy, _, spins = setting.partition(":")
    if policy not in OMP_WAIT_POLICIES or (spins and not spins.isdigit()):
        raise ValueError(f"OpenMP setting {setting!r}: POLICY[:SPINS], POLICY one of {OMP_WAIT_POLICIES}")
    return {**({"OMP_WAIT_POLICY": policy.upper()} if policy != "default" else {}), **({"GOMP_SPINCOUNT": spins} if spins else {})}


def summarize(results: dict[str, Any]) -> list[str]:
    """Per OpenMP setting and variant: spreads over repeats, and tok/s ratios paired per repeat, into `results`."""
    w = results["workload"]
    rows, ratio_rows = [], []
    for setting in w["omp_settings"]:
        runs = [r for r in results["runs"] if r["omp"] == setting]
        per_repeat = {v: {r["repeat"]: r["output_tok_s"] for r in runs if r["variant"] == v} for v in VARIANTS}
        for v in VARIANTS:
            s = {k: spread(r[k] for r in runs if r["variant"] == v and r.get(k) is not None)
                 for k in ("output_tok_s", "cpu_ms_per_token", "ttft_p50_s", "itl_p50_s", "lone_ttft_p50_s")}
            results.setdefault("summary", {}).setdefault(setting, {})[v] = s
            rows.append([f"`{setting}`", LABELS[v], report.cell(s["output_tok_s"]), report.cell(s["cpu_ms_per_token"], digits=2),
                         report.cell(s["ttft_p50_s"], 1000, 0), report.cell(s["itl_p50_s"], 1000), report.cell(s["lone_ttft_p50_s"], 1000)])
        ratios = {f"{a} ÷ {b}": spread(paired_ratios(per_repeat, a, b)) for a, b in (("thread", "offline"), ("process", "offline"),
                                                                                     ("process", "thread"))}
        results.setdefault("ratios", {})[setting] = ratios
        ratio_rows.append([f"`{setting}`", *(report.cell(r, digits=3) for r in ratios.values())])
    return [f"Engine options (from {w['config']}): `{json.dumps(w['engine'])}`. OpenMP settings `POLICY[:SPINS]`: OMP_WAIT_POLICY "
            "(passive: an idle thread sleeps at once; default: OpenMP's own, it spins a while) and GOMP_SPINCOUNT. "
            f"{w['concurrency']} streams at once of {w['prompt_len']} random prompt tokens and {w['output_len']} output tokens, greedy; "
            f"lone TTFT: {w['ttft_requests']} requests one after another. Median (min–max) over {w['repeats']} repeats.", "",
            *report.table(["OpenMP", "where the step loop runs", "output tok/s", "CPU ms per output token", "TTFT p50 (ms)",
                           "inter-token p50 (ms)", "lone TTFT p50 (ms)"], rows), "",
            "Output tok/s ratios, paired per repeat:", "",
            *report.table(["OpenMP", "thread ÷ batch API", "own process ÷ batch API", "own process ÷ thread"], ratio_rows)]


def parse_args() -> argparse.Namespace:
    parser = report.Parser(__doc__, "build/bench-engine-process-quick", repeats=1, output_len=16, ttft_requests=2)
    parser.options({"config": "Serve YAML whose first application's engine options are used",
                    "omp_settings": "OpenMP settings, each POLICY[:SPINS] (OMP_WAIT_POLICY, GOMP_SPINCOUNT)"},
                   config="configs/local.yaml", repeats=3, concurrency=32, prompt_len=128, output_len=64, ttft_requests=8,
                   omp_settings=["passive", "default", "passive:3000"])
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, in a child process
    parser.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    opts = parse_args()
    if opts.variant:
        Path(opts.json).write_text(json.dumps(run_one(opts.variant, opts)))
        return
    log, args = report.logger("engine-process"), server.config_args(opts.config)
    envs = {setting: omp_env(setting) for setting in opts.omp_settings}  # (a bad setting fails before anything runs)
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    results = {**report.start("bench_engine_process"), "runs": [],
               "workload": {"config": opts.config, "engine": args.get("engine", {}), "omp_settings": opts.omp_settings, "repeats": opts.repeats,
                            "concurrency": opts.concurrency, "prompt_len": opts.prompt_len, "output_len": opts.output_len,
                            "ttft_requests": opts.ttft_requests}}
    passthrough = ["--config", opts.config, "--concurrency", str(opts.concurrency), "--prompt-len", str(opts.prompt_len),
                   "--output-len", str(opts.output_len), "--ttft-requests", str(opts.ttft_requests)]
    points = [(setting, variant) for setting in opts.omp_settings for variant in VARIANTS]
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(opts.repeats):
            for setting, variant in interleaved(points, repeat):
                log(f"repeat {repeat + 1}/{opts.repeats}: {variant}, OpenMP {setting} (load average {machine.load_average()[0]:.2f})")
                out = Path(tmp) / "run.json"
                subprocess.run([sys.executable, "-m", "loadtest.bench_engine_process", "--variant", variant, "--repeat", str(repeat),
                                "--json", str(out), *passthrough], check=True, env={**base, **envs[setting]})
                run = {"omp": setting, "variant": variant, "repeat": repeat, **json.loads(out.read_text())}
                results["runs"].append(run)
                log(f"  {run['output_tok_s']:.1f} tok/s, {run['cpu_ms_per_token']:.2f} CPU ms/token")
    body = summarize(results)
    plots = {"engine-process": report.bars("Where the step loop runs: output tok/s", "tok/s",
                                           {LABELS[v].split(" (")[0]: {s: results["summary"][s][v]["output_tok_s"] for s in opts.omp_settings}
                                            for v in VARIANTS})}
    for path in report.write(results, opts.out_dir, "engine-process", "The engine's step loop: a thread, a process of its own, or no server",
                             body, plots):
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
