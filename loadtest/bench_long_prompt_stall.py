"""Does a huge chat stall the other streams of its ingress? The largest inter-token gap of two
unrelated streams, without and with a long chat sent meanwhile.

One private Ray on 127.0.0.1, the app with 1 LLMServer replica (configs/local.yaml's options). Two
client streams (greedy, `--tokens` tokens each) run; in the second round a chat of `--chars`
characters is sent while they stream (answered 400: it cannot fit the context once tokenized, or at
once when it cannot fit whatever it says). The ingress tokenizes in a worker thread, so the streams'
largest gap should not grow by the tokenizing time.

    .venv/bin/python loadtest/bench_long_prompt_stall.py   # → reports/long_prompt_stall.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

MODEL_NAME = "smollm2-135m-instruct"


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_gaps(client, index: int, tokens: int) -> float:
    """The largest gap between two streamed events of one completion, in seconds."""
    body = {"model": MODEL_NAME, "prompt": f"Stream {index}: the weather today", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    last, gap = None, 0.0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if last is not None:
                gap = max(gap, now - last)
            last = now
    return gap


async def round_(base_url: str, tokens: int, chars: int) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        streams = [asyncio.create_task(stream_gaps(client, i, tokens)) for i in range(2)]
        result: dict = {"chat_chars": chars}
        if chars:
            await asyncio.sleep(1.0)  # both streams are decoding
            text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
            start = time.monotonic()
            r = await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "max_tokens": 4,
                                                                 "messages": [{"role": "user", "content": text}]})
            result.update(chat_status=r.status_code, chat_answer_s=round(time.monotonic() - start, 3),
                          chat_error=r.json().get("error", {}).get("message", "")[:160])
        gaps = await asyncio.gather(*streams)
        result["max_gap_ms"] = round(1000 * max(gaps))
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--chars", type=int, nargs="+", default=[600_000, 900_000])
    parser.add_argument("--out", default="reports/long_prompt_stall")
    opts = parser.parse_args()

    import ray
    import yaml
    from ray import serve

    from serve_app.serving.app import build_app
    from tests.ray_start import init_local_ray

    load = os.getloadavg()[0]
    init_local_ray(include_dashboard=False, log_to_driver=False, namespace="bench-long-prompt")
    args = dict(yaml.safe_load((REPO / "configs" / "local.yaml").read_text())["applications"][0]["args"])
    args.update({"model": str(REPO / "models" / MODEL_NAME), "num_replicas": 1, "api_key_env": ""})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="bench-long-prompt", route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        asyncio.run(round_(base_url, 16, 0))  # warm-up
        rounds = [asyncio.run(round_(base_url, opts.tokens, chars)) for chars in [0, *opts.chars]]
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    command = "loadtest/bench_long_prompt_stall.py " + " ".join(sys.argv[1:])
    report = {"command": command, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average_before": round(load, 2),
              "rounds": rounds}
    out = REPO / opts.out
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# A long chat beside two streams: their largest inter-token gap", "",
             f"Command: `{command}`; {report['machine']}, load average {report['load_average_before']} before the run. "
             f"Two greedy {opts.tokens}-token streams on one replica; in the later rounds a chat of the given size is sent "
             "while they stream.", "", "| chat characters | chat answer | answered after | streams' largest gap |", "|---|---|---|---|"]
    for r in rounds:
        answer = f"{r['chat_status']}: {r['chat_error']}" if r["chat_chars"] else "—"
        after = f"{r['chat_answer_s']} s" if r["chat_chars"] else "—"
        lines.append(f"| {r['chat_chars']:,} | {answer} | {after} | {r['max_gap_ms']} ms |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
