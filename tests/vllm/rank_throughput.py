"""Not a test: the figures for docs/vllm-backend.md ("Several ranks on CPU"), one engine per run.

Starts our vLLM backend (`VLLMBackend`, as an LLMServer replica does, without Ray: on CPU the ranks
are the engine's own processes either way) with the given ranks, sends one warm-up request, then
`--requests` concurrent greedy requests of exactly `--max-tokens` tokens each (different short
prompts, `ignore_eos`), and prints one JSON line: engine start seconds, wall seconds, output tok/s.

    .venv/bin/python -m tests.vllm.rank_throughput --tp 3
    .venv/bin/python -m tests.vllm.rank_throughput --pp 2 --compile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from serve_app.backends.vllm import VLLMBackend
from serve_app.backends.vllm_options import VLLMOptions
from serve_app.types import GenerateRequest, SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-instruct"


async def run(args: argparse.Namespace) -> dict:
    options = VLLMOptions(dtype=args.dtype, enforce_eager=not args.compile, max_model_len=2048,
                          kv_cache_memory_gib=0.25, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
    backend = VLLMBackend(str(MODEL), options)
    started = time.monotonic()
    await backend.start()
    start_s = time.monotonic() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    async def one(i: int) -> int:
        req = GenerateRequest(f"r{i}", messages=({"role": "user", "content": f"Request {i}: tell me about the sea."},),
                              sampling_params=params)
        return sum([len(out.token_ids) async for out in backend.generate(req)])

    try:
        await one(-1)  # warm-up: first-step allocations out of the measurement
        t0 = time.monotonic()
        tokens = await asyncio.gather(*(one(i) for i in range(args.requests)))
        wall = time.monotonic() - t0
    finally:
        backend.shutdown()
    assert all(n == args.max_tokens for n in tokens), tokens
    return {"tp": args.tp, "pp": args.pp, "dtype": args.dtype, "eager": not args.compile, "requests": args.requests,
            "max_tokens": args.max_tokens, "engine_start_s": round(start_s, 1), "wall_s": round(wall, 2),
            "output_tok_s": round(sum(tokens) / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", action="store_true", help="torch.compile (needed for --pp > 1 on CPU)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
