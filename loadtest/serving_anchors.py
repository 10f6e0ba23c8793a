"""Anchors for the serving-path benchmark (`bench_serving.py --anchors`): what other stacks' serving
layers cost over their own engine, on the same workload and machine, in the same run as ours.

- `vllm-offline`: vLLM's offline `LLM.generate` on every prompt at once (the engine, no server);
- `vllm-server`: vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`, a subprocess on
  127.0.0.1): the path vLLM users already have;
- `ray-serve-llm`: Ray Serve LLM (`ray.serve.llm.build_openai_app`, one replica) over the same
  vLLM engine: Ray Serve's flexibility, at its own cost;
- `ray-serve-llm-direct`: the same application with Ray's direct streaming (HAProxy mode,
  `serve_app.serving.haproxy_env`, plus `RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING`):
  HAProxy takes the HTTP port and forwards each request straight to the LLMServer replica's own
  HTTP server (vLLM's FastAPI app), picked by Ray's ingress request router; no proxy actor, no
  OpenAiIngress replica, no Ray streaming hop per token;
- `native-offline`: our offline `LLM.generate`, the counterpart of vLLM's offline run.

vLLM runs in bfloat16, eager (no torch.compile), both cores, a 1 GiB KV cache and no prefix cache
(each repeat sends new random prompts anyway). Each anchor runs in a process of its own (this module
with `--anchor NAME`, printing one JSON line), one after the other. Streams are timed at the client
exactly as ours are (`OpenAIStreams`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # serve_app from this checkout when run as a script
from serve_app.metrics import local_stack  # noqa: E402
from serve_app.serving.haproxy_env import LLM_DIRECT_STREAMING, STATE_DIR, haproxy_env  # noqa: E402

ANCHORS = ("native-offline", "vllm-offline", "vllm-server", "ray-serve-llm", "ray-serve-llm-direct")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
MODEL_ID = "anchor"
START_TIMEOUT_S = 600


class OpenAIStreams:
    """Streamed POST /v1/completions with token-id prompts over one pooled aiohttp session, opened on
    the event loop of the first call (aiohttp sessions belong to one loop).

    aiohttp, not httpx: httpcore 1.0's pool walks every pooled connection, and for each one the whole
    pool again, whenever a request starts or ends. With 256 keep-alive connections that made the
    benchmark's own client the bottleneck from the second burst on: its CPU per token doubled
    (0.039 → 0.08 ms) and 256 streams took 4 s to start instead of 0.6 s."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self._session = None

    def _client(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024),
                                                  timeout=aiohttp.ClientTimeout(total=600))
        return self._session

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}

    async def reads(self, prompt: list[int], max_tokens: int) -> AsyncIterator[bytes]:
        """The raw SSE bytes of one streamed completion, as each read returns them."""
        async with self._client().post(self.url, json=self.body(prompt, max_tokens)) as r:
            r.raise_for_status()
            async for raw in r.content.iter_any():
                yield raw

    async def get(self, url: str) -> None:
        """GET `url`; raises on a non-2xx status."""
        async with self._client().get(url) as r:
            r.raise_for_status()
            await r.read()

    async def stream(self, prompt: list[int], max_tokens: int, arrivals: list[float] | None = None) -> tuple[float, int]:
        """(TTFT, completion tokens); `arrivals` gets the time of every event that carries text."""
        start, ttft, tokens, buffer = time.perf_counter(), None, 0, b""
        async for raw in self.reads(prompt, max_tokens):
            now = time.perf_counter()
            *lines, buffer = (buffer + raw).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    raise RuntimeError(f"stream error: {payload['error']}")
                if ttft is None and payload["choices"]:
                    ttft = now - start
                if arrivals is not None and any(c.get("text") for c in payload["choices"]):
                    arrivals.append(now)
                if payload.get("usage"):
                    tokens = payload["usage"]["completion_tokens"]
        return ttft, tokens

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` random token ids (ids from 100 up: no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def prompts_for(repeat: int, n: int, length: int, vocab: int) -> list[list[int]]:
    """New prompts for each repeat (no prefix-cache hits across repeats)."""
    return random_prompts(n, length, vocab, seed=1000 * repeat + n)


def wait_ready(url: str, proc: subprocess.Popen | None = None) -> float:
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < START_TIMEOUT_S:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return time.monotonic() - start
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {START_TIMEOUT_S} s")


async def _http_runs(streams: OpenAIStreams, opts: argparse.Namespace) -> list[dict[str, Any]]:
    warm = prompts_for(99, 2, opts.prompt_len, opts.vocab)
    await asyncio.gather(*(streams.stream(p, 8) for p in warm))
    runs = []
    for repeat in range(opts.repeats):
        for c in opts.concurrency:
            prompts = prompts_for(repeat, c, opts.prompt_len, opts.vocab)
            start = time.perf_counter()
            results = await asyncio.gather(*(streams.stream(p, opts.output_len) for p in prompts))
            elapsed = time.perf_counter() - start
            tokens = sum(t for _, t in results)
            if tokens != c * opts.output_len:
                raise RuntimeError(f"{tokens} output tokens, expected {c * opts.output_len}")
            runs.append({"repeat": repeat, "concurrency": c, "output_tok_s": tokens / elapsed, "elapsed_s": elapsed,
                         "ttft_p50_s": sorted(t for t, _ in results)[len(results) // 2]})
    return runs


def _offline_runs(generate, opts: argparse.Namespace) -> list[dict[str, Any]]:
    """`generate(prompts, max_tokens)` returns the output token count."""
    generate(prompts_for(99, 2, opts.prompt_len, opts.vocab), 8)
    runs = []
    for repeat in range(opts.repeats):
        for c in opts.concurrency:
            prompts = prompts_for(repeat, c, opts.prompt_len, opts.vocab)
            start = time.perf_counter()
            tokens = generate(prompts, opts.output_len)
            elapsed = time.perf_counter() - start
            if tokens != c * opts.output_len:
                raise RuntimeError(f"{tokens} output tokens, expected {c * opts.output_len}")
            runs.append({"repeat": repeat, "concurrency": c, "output_tok_s": tokens / elapsed, "elapsed_s": elapsed})
    return runs


def run_native_offline(opts: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from serve_app.engine import LLM, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    llm = LLM(opts.model, **json.loads(opts.engine))

    def generate(prompts, max_tokens):
        llm.reset_prefix_cache()
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return sum(len(o.token_ids) for o in outs)

    return _offline_runs(generate, opts)


def run_vllm_offline(opts: argparse.Namespace) -> list[dict[str, Any]]:
    os.environ.update(VLLM_ENV)
    from vllm import LLM, SamplingParams

    llm = LLM(model=opts.model, dtype="bfloat16", enforce_eager=True, max_num_seqs=64, enable_prefix_caching=False, seed=0)

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return _offline_runs(generate, opts)


def run_vllm_server(opts: argparse.Namespace) -> list[dict[str, Any]]:
    port = local_stack.free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", opts.model, "--served-model-name", MODEL_ID,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager", "--max-num-seqs", "64",
           "--no-enable-prefix-caching", "--seed", "0"]
    proc = subprocess.Popen(cmd, env={**os.environ, **VLLM_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}/v1/models", proc)
        return asyncio.run(_streams_runs(f"http://127.0.0.1:{port}/v1/completions", opts))
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()


def run_ray_serve_llm(opts: argparse.Namespace, direct_streaming: bool = False) -> list[dict[str, Any]]:
    """Ray Serve LLM over vLLM-CPU, one LLMServer replica. `direct_streaming`: HAProxy on the HTTP
    port forwards to the replica's own HTTP server (Ray refuses an ingress deployment config there:
    there is no OpenAiIngress deployment)."""
    env = {}
    if direct_streaming:  # Ray reads it at import (here) and at process start (inherited from here)
        env = {**haproxy_env(), LLM_DIRECT_STREAMING: "1"}
        os.environ.update(env)
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    port = local_stack.free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = LLMConfig(
            model_loading_config={"model_id": MODEL_ID, "model_source": opts.model},
            engine_kwargs={"dtype": "bfloat16", "enforce_eager": True, "max_num_seqs": 64, "enable_prefix_caching": False, "seed": 0},
            # Ray's defaults (a CPU per replica and per ingress) leave nothing to schedule on 2 cores
            placement_group_config={"bundles": [{"CPU": 1}]},
            deployment_config={"ray_actor_options": {"num_cpus": 0}},
            runtime_env={"env_vars": {**VLLM_ENV, **env}},
        )
        ingress = {} if direct_streaming else {"ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}}
        serve.run(build_openai_app({"llm_configs": [config], **ingress}), name="anchor", route_prefix="/")
        wait_ready(f"http://127.0.0.1:{port}/v1/models")
        return asyncio.run(_streams_runs(f"http://127.0.0.1:{port}/v1/completions", opts))
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        if STATE_DIR in env:
            shutil.rmtree(env[STATE_DIR], ignore_errors=True)


async def _streams_runs(url: str, opts: argparse.Namespace) -> list[dict[str, Any]]:
    streams = OpenAIStreams(url, MODEL_ID)
    try:
        return await _http_runs(streams, opts)
    finally:
        await streams.aclose()


RUNNERS = {"native-offline": run_native_offline, "vllm-offline": run_vllm_offline, "vllm-server": run_vllm_server,
           "ray-serve-llm": run_ray_serve_llm,
           "ray-serve-llm-direct": functools.partial(run_ray_serve_llm, direct_streaming=True)}


def measure(names: list[str], model: str, engine: dict[str, Any], opts: Any, vocab: int, log=print) -> dict[str, Any]:
    """Run each anchor in its own process; {name: {"runs": [...]} or {"error": "..."}}."""
    out: dict[str, Any] = {}
    for name in names:
        log(f"[bench-serving] anchor {name}: starting")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--anchor", name, "--model", model, "--engine", json.dumps(engine),
               "--vocab", str(vocab), "--prompt-len", str(opts.prompt_len), "--output-len", str(opts.output_len),
               "--repeats", str(opts.repeats), "--concurrency", *map(str, opts.anchor_concurrency)]
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            out[name] = {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
        else:
            out[name] = json.loads(lines[-1])
        log(f"[bench-serving] anchor {name}: {json.dumps(out[name])[:300]} ({time.monotonic() - started:.0f} s)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", required=True, choices=ANCHORS)
    p.add_argument("--model", required=True)
    p.add_argument("--engine", default="{}", help="native-offline: engine options (JSON)")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32])
    opts = p.parse_args()
    print(json.dumps({"runs": RUNNERS[opts.anchor](opts)}), flush=True)


if __name__ == "__main__":
    main()
