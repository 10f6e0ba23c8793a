"""Locust load test for any OpenAI-compatible LLM server (ours, vLLM's api_server, ...): streamed
chat and text completions, with LLM latency metrics.

Run it as its own process (the `locust` CLI), never imported into a process that imported Ray, vLLM
or ssl: Locust monkey-patches with gevent . `make loadtest` runs it headless against
`make serve`; by hand:

    .venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 4 -t 60s \\
        --workload skewed --csv build/loadtest/run --html build/loadtest/run.html --records build/loadtest/records.jsonl

Options (besides Locust's own; also as LOCUST_* environment variables):
  --workload      short-chat | long-prompt | skewed | shared-prefix        (loadtest/llm_workloads.py)
  --api           auto (the profile's API) | chat | completions | mixed (50/50)
  --model         model name; default: the first id of GET {base}/models
  --api-key       sent as `Authorization: Bearer ...` (default: $OPENAI_API_KEY, else none)
  --arrival-rate  requests/s of an open-loop Poisson process (0: closed loop, each user sends its next
                  request when the previous one is done, after --think-time)
  --think-time    closed loop: mean pause between a user's requests, exponential (s)
  --max-tokens / --temperature / --ignore-eos / --turns / --seed / --request-timeout
  --records       write one JSON line per request (timings, tokens, errors) here at the end of the run

--host is the server (`http://127.0.0.1:8000`, /v1 is appended) or a full base URL with a path
(`http://127.0.0.1:8000/v1`, used as is).

Statistics (Locust's tables, CSV and HTML):
- Each request is one entry named `<endpoint> [<class>]` (e.g. `/v1/chat/completions [short]`) whose
  response time is the whole stream (send → `data: [DONE]`). It fails on an HTTP error, an error
  event in the stream, a stream that ends without `[DONE]`, or no token at all unless the stream
  says why it finished (an empty reply: the model's first token was its end of sequence; it counts
  as a success with no TTFT, and its record has `"empty": true`).
- Custom metrics, fired as request events of type `LLM` once per successful request:
  `ttft_ms` (send → first token), `tpot_ms` (mean time per output token after the first:
  (e2e - ttft) / (tokens - 1)), `e2e_ms` (send → last event), and `output_tokens`, whose "response
  time" columns hold token counts, not milliseconds. They also count in Locust's "Aggregated" row,
  so take request rates from the endpoint rows.
Token counts come from the final usage chunk (`stream_options.include_usage`), else one per chunk.

Open loop: one shared Poisson clock per Locust process (with --processes N each process runs
--arrival-rate). A due arrival waits for a free user, so start enough users (-u) that some are
always free; the records keep each request's lag behind its scheduled time. In the closed loop a
user pauses FAILURE_BACKOFF_S after a failed request (no hot loop against a server that is down).
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
import urllib.request
from dataclasses import dataclass, field

from llm_workloads import APIS, ENDPOINTS, PROFILES, PoissonArrivals, Workload, api_base, choose_api
from locust import constant, events, task
from locust.contrib.fasthttp import FastHttpUser
from locust.runners import WorkerRunner
from locust.stats import CSV_STATS_INTERVAL_SEC

logger = logging.getLogger("llm-locust")
METRIC_TYPE = "LLM"
FAILURE_BACKOFF_S = 1.0


@dataclass
class RunState:
    """What every user of this process shares: resolved options, the Poisson clock, the records."""

    model: str = ""
    base: str = ""
    arrivals: PoissonArrivals | None = None
    records: list[dict] = field(default_factory=list)
    user_index: int = 0
    process_seed: int = 0


STATE = RunState()


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    parser.add_argument("--workload", choices=PROFILES, default="short-chat", env_var="LOCUST_WORKLOAD", help="workload profile")
    parser.add_argument("--api", choices=APIS, default="auto", env_var="LOCUST_API", help="API per request")
    parser.add_argument("--model", default="", env_var="LOCUST_MODEL", help="model name (default: first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), env_var="LOCUST_API_KEY",
                       help="bearer token (default: $OPENAI_API_KEY)", is_secret=True)
    parser.add_argument("--arrival-rate", type=float, default=0.0, env_var="LOCUST_ARRIVAL_RATE",
                       help="open loop: Poisson arrivals per second per process (0: closed loop)")
    parser.add_argument("--think-time", type=float, default=0.0, env_var="LOCUST_THINK_TIME",
                       help="closed loop: mean pause between a user's requests (exponential, s)")
    parser.add_argument("--max-tokens", type=int, default=0, env_var="LOCUST_MAX_TOKENS", help="override the profile's output caps")
    parser.add_argument("--temperature", type=float, default=0.0, env_var="LOCUST_TEMPERATURE")
    parser.add_argument("--ignore-eos", action="store_true", default=False, env_var="LOCUST_IGNORE_EOS",
                       help="generate exactly max_tokens (server extension: ours and vLLM support it)")
    parser.add_argument("--turns", type=int, default=4, env_var="LOCUST_TURNS", help="shared-prefix: turns per conversation")
    parser.add_argument("--seed", type=int, default=0, env_var="LOCUST_SEED", help="seeds the workload and the arrivals")
    parser.add_argument("--request-timeout", type=float, default=600.0, env_var="LOCUST_REQUEST_TIMEOUT", help="seconds per read")
    parser.add_argument("--records", default="", env_var="LOCUST_RECORDS", help="JSON lines of per-request results")


def _auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _worker_index(environment) -> int:
    return max(0, getattr(environment.runner, "worker_index", 0) or 0)


def discover_model(base: str, api_key: str, timeout_s: float = 30.0) -> str:
    request = urllib.request.Request(f"{base}/models", headers=_auth_headers(api_key))
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - the URL is the tested server
        models = json.load(response)["data"]
    if not models:
        raise RuntimeError(f"{base}/models lists no model")
    return models[0]["id"]


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    opts = environment.parsed_options
    STATE.base = api_base(environment.host or "http://127.0.0.1:8000")
    STATE.records = []
    STATE.process_seed = opts.seed * 1_000_003 + 7919 * _worker_index(environment)  # distinct per --processes worker
    STATE.arrivals = PoissonArrivals(opts.arrival_rate, STATE.process_seed) if opts.arrival_rate > 0 else None
    STATE.model = opts.model
    if not STATE.model:
        try:
            STATE.model = discover_model(STATE.base, opts.api_key)
        except Exception as exc:  # noqa: BLE001 - every request will then fail and say why
            logger.error("could not list models at %s/models (%r); pass --model", STATE.base, exc)
            STATE.model = "unknown"
    mode = f"open loop, Poisson {opts.arrival_rate:g} req/s" if STATE.arrivals else f"closed loop, think time {opts.think_time:g} s"
    logger.info("LLM load test: %s, model %r, workload %s, api %s, %s", STATE.base, STATE.model, opts.workload, opts.api, mode)


@events.test_stop.add_listener
def _on_test_stop(environment, **_kwargs) -> None:
    if getattr(environment.parsed_options, "csv_prefix", None):
        # Locust's CSV writer rewrites the files every CSV_STATS_INTERVAL_SEC until the process exits:
        # give it one more round so that requests finished during --stop-timeout are in the CSV too
        time.sleep(CSV_STATS_INTERVAL_SEC + 0.5)
    path = environment.parsed_options.records
    if not path or (not STATE.records and not isinstance(environment.runner, WorkerRunner)):
        return
    if isinstance(environment.runner, WorkerRunner):  # one file per worker process
        path = f"{path}.{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for record in STATE.records:
            f.write(json.dumps(record) + "\n")
    logger.info("wrote %d request records to %s", len(STATE.records), path)


class StreamResult:
    """What one streamed response contained."""

    def __init__(self) -> None:
        self.first_token_s: float | None = None
        self.last_event_s: float | None = None
        self.num_chunks_with_text = 0
        self.usage: dict | None = None
        self.text_parts: list[str] = []
        self.said_finish = False  # some choice carried a finish_reason
        self.done = False
        self.error: str | None = None
        self.num_bytes = 0

    @property
    def empty_reply(self) -> bool:
        """Ended properly, saying why it finished, with no text at all."""
        return self.done and self.first_token_s is None and self.said_finish

    @property
    def num_output_tokens(self) -> int:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return self.num_chunks_with_text

    def feed(self, event: dict, now: float) -> None:
        self.last_event_s = now
        if "error" in event:
            error = event["error"]
            self.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            return
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            self.said_finish = self.said_finish or bool(choice.get("finish_reason"))
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                self.text_parts.append(text)
                self.num_chunks_with_text += 1
                if self.first_token_s is None:
                    self.first_token_s = now


def read_sse(raw_response, result: StreamResult, start: float) -> None:
    """Parse `data: ...` lines as they arrive (readline returns as soon as a line is complete)."""
    while True:
        line = raw_response.readline(b"\n")
        if not line:
            return
        result.num_bytes += len(line)
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            result.done = True
            return
        result.feed(json.loads(data), time.perf_counter() - start)


class OpenAIStreamingUser(FastHttpUser):
    """One simulated client: sends one streamed request at a time (chat or completions)."""

    wait_time = constant(0)  # pauses are taken in the task (think time or the Poisson clock)
    network_timeout = 600.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        STATE.user_index += 1
        self.rng = random.Random(STATE.process_seed * 1_000_003 + STATE.user_index)
        self.workload = Workload(opts.workload, self.rng, turns=opts.turns, max_tokens=opts.max_tokens)
        self.network_timeout = opts.request_timeout

    def _pause(self) -> float:
        """Sleep until this user's next request is due; returns how late it is sent (open loop)."""
        opts = self.environment.parsed_options
        if STATE.arrivals is not None:
            due = STATE.arrivals.claim(time.monotonic())
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # gevent-patched: yields to the other users
            return max(0.0, time.monotonic() - due)
        if opts.think_time > 0:
            time.sleep(self.rng.expovariate(1.0 / opts.think_time))
        return 0.0

    def body(self, request, api: str) -> dict:
        opts = self.environment.parsed_options
        body: dict = {"model": STATE.model, "max_tokens": request.max_tokens, "temperature": opts.temperature,
                      "stream": True, "stream_options": {"include_usage": True}}
        if opts.ignore_eos:
            body["ignore_eos"] = True
        if api == "chat":
            body["messages"] = list(request.messages)
        else:
            body["prompt"] = request.prompt
        return body

    @property
    def headers(self) -> dict[str, str]:
        return {"Accept": "text/event-stream", "Accept-Encoding": "identity",
                **_auth_headers(self.environment.parsed_options.api_key)}

    @staticmethod
    def _error_message(response) -> str:
        try:
            return f"HTTP {response.status_code}: {response.json()['error']['message']}"
        except Exception:  # noqa: BLE001 - not an OpenAI error body
            return f"HTTP {response.status_code}: {(response.text or '')[:200]}"

    def fire_metric(self, name: str, value: float) -> None:
        self.environment.events.request.fire(request_type=METRIC_TYPE, name=name, response_time=value,
                                             response_length=0, exception=None, context={})

    def _record(self, **fields) -> None:
        if self.environment.parsed_options.records:
            STATE.records.append(fields)

    @task
    def stream(self) -> None:
        lag_s = self._pause()
        request = self.workload.next_request()
        api = choose_api(request, self.environment.parsed_options.api, self.rng)
        path = ENDPOINTS[api]
        name = f"/v1{path} [{request.tag}]"
        result = StreamResult()
        sent_at = time.time()
        start = time.perf_counter()
        with self.client.post(STATE.base + path, json=self.body(request, api), headers=self.headers, name=name,
                              stream=True, catch_response=True) as response:
            if response.status_code != 200:
                result.error = self._error_message(response) if response.status_code else f"connection error: {getattr(response, 'error', None)!r}"
            else:
                try:
                    read_sse(response._response, result, start)
                except Exception as exc:  # noqa: BLE001 - a broken stream is a failed request
                    result.error = f"stream broken: {exc!r}"
            e2e_s = time.perf_counter() - start
            if result.error is None and not result.done:
                result.error = "stream ended without [DONE]"
            if result.error is None and result.first_token_s is None and not result.empty_reply:
                result.error = "no token in the stream"
            response.request_meta["response_time"] = e2e_s * 1000
            response.request_meta["response_length"] = result.num_bytes
            if result.error is None:
                response.success()
            else:
                response.failure(result.error)
        tokens = result.num_output_tokens
        ttft_s = result.first_token_s
        tpot_s = (e2e_s - ttft_s) / (tokens - 1) if result.error is None and ttft_s is not None and tokens > 1 else None
        if result.error is None:
            if ttft_s is not None:
                self.fire_metric("ttft_ms", ttft_s * 1000)
            if tpot_s is not None:
                self.fire_metric("tpot_ms", tpot_s * 1000)
            self.fire_metric("e2e_ms", e2e_s * 1000)
            self.fire_metric("output_tokens", tokens)
        self.workload.record_reply("".join(result.text_parts) if result.error is None else "")
        if result.error is not None and STATE.arrivals is None:
            time.sleep(FAILURE_BACKOFF_S)  # closed loop: no hot loop against a server that is down
        self._record(start_time=sent_at, end_time=sent_at + e2e_s, name=name, api=api, tag=request.tag,
                     ok=result.error is None, error=result.error, ttft_s=ttft_s, tpot_s=tpot_s, e2e_s=e2e_s,
                     output_tokens=tokens, prompt_tokens=(result.usage or {}).get("prompt_tokens"),
                     max_tokens=request.max_tokens, lag_s=lag_s, empty=result.empty_reply)
