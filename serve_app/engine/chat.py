"""Interactive chat with the offline engine: `python -m serve_app.engine.chat --model DIR`.

Streams the reply token by token through `AsyncLLMEngine`, keeps the conversation, and prints TTFT
and decode speed after each answer. An empty line or Ctrl-D quits.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys

from serve_app.engine.async_engine import AsyncLLMEngine
from serve_app.types import GenerateRequest, SamplingParams


async def chat(engine: AsyncLLMEngine, params: SamplingParams) -> None:
    history: list[dict] = []
    ids = itertools.count()
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, lambda: input("you> "))
        if not line.strip():
            return
        history.append({"role": "user", "content": line})
        reply = ""
        print("bot> ", end="", flush=True)
        request = GenerateRequest(f"chat-{next(ids)}", messages=tuple(history), sampling_params=params)
        async for out in engine.generate(request):
            print(out.text, end="", flush=True)
            reply += out.text
        m = out.metrics
        speed = f", {1 / m.tpot_s:.1f} tok/s" if m.tpot_s else ""
        print(f"\n     [{m.num_generation_tokens} tokens, TTFT {m.ttft_s * 1000:.0f} ms{speed}, {out.finish_reason}]")
        history.append({"role": "assistant", "content": reply})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    engine = AsyncLLMEngine.from_kwargs(args.model, dtype=args.dtype, kv_cache_memory_gib=0.5)
    print(f"chatting with {args.model} ({args.dtype}); empty line to quit", flush=True)
    try:
        asyncio.run(chat(engine, SamplingParams(temperature=args.temperature, top_p=0.9, max_tokens=args.max_tokens)))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
