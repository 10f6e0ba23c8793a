"""Anchors for `bench_serving --anchors`: other stacks' serving cost over their own engine, same workload and
machine, each in a worker process: `vllm-offline` (vLLM's `LLM.generate`), `vllm-server` (its OpenAI server),
`ray-serve-llm` (Ray Serve LLM over it, one replica), `ray-serve-llm-direct` (the same with Ray's direct
streaming: HAProxy to the replica's own HTTP server), `native-offline` (our offline `LLM`). vLLM: bfloat16,
eager, both cores, 1 GiB KV cache, no prefix cache. Alone: `python -m loadtest.bench_serving --skip-null --skip-real --anchors NAME`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from loadtest import server
from loadtest.bench_engine import make_prompts
from loadtest.client import Completions, burst
from loadtest.engines import VLLM
from loadtest.worker import Worker, WorkerError

ANCHORS = ("native-offline", "vllm-offline", "vllm-server", "ray-serve-llm", "ray-serve-llm-direct")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
VLLM_ENGINE = {"dtype": "bfloat16", "enforce_eager": True, "max_num_seqs": 64, "enable_prefix_caching": False, "seed": 0}
MODEL_ID = "anchor"


def prompts_for(repeat: int, n: int, opts: argparse.Namespace) -> list[list[int]]:
    """New prompts for each repeat (no prefix-cache hits across repeats)."""
    return make_prompts(n, opts.prompt_len, opts.vocab, 100, seed=1000 * repeat + n)


def _runs(measure, opts: argparse.Namespace) -> list[dict[str, Any]]:
    """`measure(prompts, max_tokens)` → {"output_tok_s", ...}; a warm-up, then every repeat × concurrency, new prompts each."""
    measure(prompts_for(99, 2, opts), 8)
    return [{"repeat": repeat, "concurrency": c, **measure(prompts_for(repeat, c, opts), opts.output_len)}
            for repeat in range(opts.repeats) for c in opts.concurrency]


def _offline(generate):
    """`generate(prompts, max_tokens)` → output token count, timed."""
    def measure(prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        start = time.perf_counter()
        tokens = generate(prompts, max_tokens)
        elapsed = time.perf_counter() - start
        if tokens != len(prompts) * max_tokens:
            raise RuntimeError(f"{tokens} output tokens, expected {len(prompts) * max_tokens}")
        return {"output_tok_s": tokens / elapsed, "elapsed_s": elapsed}
    return measure


def _http_runs(base_url: str, opts: argparse.Namespace) -> list[dict[str, Any]]:
    client, loop = Completions(base_url, MODEL_ID), asyncio.new_event_loop()
    try:
        return _runs(lambda prompts, n: loop.run_until_complete(burst(client.stream, prompts, n)), opts)
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()


def run_native_offline(opts: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from serve_app.engine import LLM, SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    llm = LLM(opts.model, **opts.engine)

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        llm.reset_prefix_cache()
        return sum(len(o.token_ids) for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))

    return _runs(_offline(generate), opts)


def run_vllm_offline(opts: argparse.Namespace) -> list[dict[str, Any]]:
    # W1's vLLM engine (loadtest/engines.py) with VLLM_ENGINE's settings: vLLM's own step budget, a 1 GiB KV cache
    engine = VLLM({"model": opts.model, "device": "cpu", "kv_cache_gib": 1, "dtype": "bfloat16", "max_num_seqs": 64,
                   "max_num_batched_tokens": None, "vllm_enforce_eager": True})
    return _runs(_offline(lambda prompts, max_tokens: sum(map(len, engine.run(prompts, max_tokens).token_ids))), opts)


@contextlib.contextmanager
def vllm_server(model: str, model_id: str = MODEL_ID) -> Iterator[str]:
    """vLLM-CPU's OpenAI server (VLLM_ENGINE's settings, VLLM_ENV) on a free loopback port, until the block ends; yields its base URL."""
    port = server.free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", model_id, "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager", "--max-num-seqs", "64", "--no-enable-prefix-caching",
           "--seed", "0"]
    with server.server_process(cmd, f"http://127.0.0.1:{port}/v1/models", VLLM_ENV):
        yield f"http://127.0.0.1:{port}"


def run_vllm_server(opts: argparse.Namespace) -> list[dict[str, Any]]:
    with vllm_server(opts.model) as base_url:
        return _http_runs(base_url, opts)


def run_ray_serve_llm(opts: argparse.Namespace, direct_streaming: bool = False) -> list[dict[str, Any]]:
    """Ray Serve LLM over vLLM-CPU, one replica. `direct_streaming`: HAProxy on the HTTP port forwards to
    the replica's own HTTP server (there is no ingress deployment to configure then)."""
    from serve_app.serving.haproxy_env import LLM_DIRECT_STREAMING, haproxy_env

    env = {**haproxy_env(), LLM_DIRECT_STREAMING: "1"} if direct_streaming else {}
    with server.ray_started("anchor", env), server.serve_http() as base_url:
        from ray import serve
        from ray.serve.llm import LLMConfig, build_openai_app

        config = LLMConfig(model_loading_config={"model_id": MODEL_ID, "model_source": opts.model}, engine_kwargs=VLLM_ENGINE,
                           # Ray's defaults (a CPU per replica and per ingress) leave nothing to schedule on 2 cores
                           placement_group_config={"bundles": [{"CPU": 1}]}, deployment_config={"ray_actor_options": {"num_cpus": 0}},
                           runtime_env={"env_vars": {**VLLM_ENV, **env}})
        ingress = {} if direct_streaming else {"ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0}}}
        serve.run(build_openai_app({"llm_configs": [config], **ingress}), name="anchor", route_prefix="/")
        server.wait_ready(f"{base_url}/v1/models")
        return _http_runs(base_url, opts)


RUNNERS = {"native-offline": run_native_offline, "vllm-offline": run_vllm_offline, "vllm-server": run_vllm_server,
           "ray-serve-llm": run_ray_serve_llm, "ray-serve-llm-direct": functools.partial(run_ray_serve_llm, direct_streaming=True)}


class Anchor:
    """The worker's object: `run()` measures the anchor `opts["anchor"]`."""

    def __init__(self, opts: dict[str, Any]) -> None:
        self.opts = argparse.Namespace(**opts)

    def run(self) -> list[dict[str, Any]]:
        return RUNNERS[self.opts.anchor](self.opts)


def measure(names: list[str], model: str, engine: dict[str, Any], opts: Any, vocab: int) -> dict[str, Any]:
    """Each anchor in a worker process of its own, one after the other; {name: {"runs": [...]} or {"error": "..."}}."""
    out: dict[str, Any] = {}
    for name in names:
        started = time.monotonic()
        try:
            with Worker("loadtest.serving_anchors:Anchor", {"anchor": name, "model": model, "engine": engine, "vocab": vocab,
                                                           "prompt_len": opts.prompt_len, "output_len": opts.output_len,
                                                           "repeats": opts.repeats, "concurrency": opts.anchor_concurrency}, 1800) as worker:
                out[name] = {"runs": worker.call("run")}
        except WorkerError as exc:
            out[name] = {"error": str(exc).splitlines()[0][:300]}
        print(f"[bench-serving] anchor {name}: {json.dumps(out[name])[:300]} ({time.monotonic() - started:.0f} s)", flush=True)
    return out
