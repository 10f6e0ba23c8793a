"""Locust load test for any OpenAI-compatible server (docs/loadtest.md): streamed chat and text completions, LLM
metrics as Locust events of type `LLM`, per-request records (`--records`). A request fails on an HTTP error, an error
event, a stream without `[DONE]`, or no text unless it said why it finished (an empty reply: a success without TTFT).
Run it as its own process from the repository root (Locust monkey-patches with gevent: never next to Ray or vLLM):

    .venv/bin/locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 4 -t 60s --workload skewed
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
import types
import urllib.request

from locust import constant, events, task
from locust.contrib.fasthttp import FastHttpUser
from locust.runners import WorkerRunner
from locust.stats import CSV_STATS_INTERVAL_SEC

from loadtest.client import Stream
from loadtest.llm_workloads import APIS, ENDPOINTS, PROFILES, PoissonArrivals, Workload, api_base, choose_api

logger = logging.getLogger("llm-locust")


# what every user of this process shares (set as the test starts): resolved options, the Poisson clock, the records
STATE = types.SimpleNamespace(model="", base="", arrivals=None, records=[], user_index=0, process_seed=0)


@events.init_command_line_parser.add_listener
def _add_options(parser) -> None:
    add = parser.add_argument
    add("--workload", choices=PROFILES, default="short-chat", env_var="LOCUST_WORKLOAD", help="workload profile")
    add("--api", choices=APIS, default="auto", env_var="LOCUST_API", help="API per request")
    add("--model", default="", env_var="LOCUST_MODEL", help="model name (default: first of /v1/models)")
    add("--api-key", default=os.environ.get("OPENAI_API_KEY", ""), env_var="LOCUST_API_KEY", help="bearer token", is_secret=True)
    add("--arrival-rate", type=float, default=0.0, env_var="LOCUST_ARRIVAL_RATE", help="open loop: Poisson arrivals/s per process")
    add("--think-time", type=float, default=0.0, env_var="LOCUST_THINK_TIME", help="closed loop: mean pause between requests (s)")
    add("--max-tokens", type=int, default=0, env_var="LOCUST_MAX_TOKENS", help="override the profile's output caps")
    add("--ignore-eos", action="store_true", default=False, env_var="LOCUST_IGNORE_EOS", help="generate exactly max_tokens")
    add("--turns", type=int, default=4, env_var="LOCUST_TURNS", help="shared-prefix: turns per conversation")
    add("--seed", type=int, default=0, env_var="LOCUST_SEED", help="seeds the workload and the arrivals")
    add("--records", default="", env_var="LOCUST_RECORDS", help="JSON lines of per-request results")


def _auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    opts = environment.parsed_options
    STATE.base, STATE.records, STATE.model = api_base(environment.host or "http://127.0.0.1:8000"), [], opts.model
    STATE.process_seed = opts.seed * 1_000_003 + 7919 * max(0, getattr(environment.runner, "worker_index", 0) or 0)  # per --processes worker
    STATE.arrivals = PoissonArrivals(opts.arrival_rate, STATE.process_seed) if opts.arrival_rate > 0 else None
    if not STATE.model:
        try:  # the first model the server lists
            request = urllib.request.Request(f"{STATE.base}/models", headers=_auth(opts.api_key))
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
                STATE.model = json.load(response)["data"][0]["id"]
        except Exception as exc:  # noqa: BLE001 - every request will then fail and say why
            logger.error("could not list models at %s/models (%r); pass --model", STATE.base, exc)
            STATE.model = "unknown"
    mode = f"open loop, Poisson {opts.arrival_rate:g} req/s" if STATE.arrivals else f"closed loop, think time {opts.think_time:g} s"
    logger.info("LLM load test: %s, model %r, workload %s, api %s, %s", STATE.base, STATE.model, opts.workload, opts.api, mode)


@events.test_stop.add_listener
def _on_test_stop(environment, **_kwargs) -> None:
    if getattr(environment.parsed_options, "csv_prefix", None):
        # one more round of Locust's CSV writer, so that requests finished during --stop-timeout are in the CSV too
        time.sleep(CSV_STATS_INTERVAL_SEC + 0.5)
    path, worker = environment.parsed_options.records, isinstance(environment.runner, WorkerRunner)
    if not path or (not STATE.records and not worker):
        return
    path = f"{path}.{os.getpid()}" if worker else path  # one file per worker process
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in STATE.records)
    logger.info("wrote %d request records to %s", len(STATE.records), path)


class OpenAIStreamingUser(FastHttpUser):
    """One simulated client: one streamed request at a time (chat or completions)."""

    wait_time = constant(0)  # pauses are taken in the task (think time or the Poisson clock)
    network_timeout = 600.0  # s per read
    connection_timeout = 10.0

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        STATE.user_index += 1
        self.rng = random.Random(STATE.process_seed * 1_000_003 + STATE.user_index)
        self.workload = Workload(opts.workload, self.rng, turns=opts.turns, max_tokens=opts.max_tokens)

    def _pause(self) -> float:
        """Sleep until this user's next request is due; returns how late it is sent (open loop)."""
        if STATE.arrivals is not None:
            due = STATE.arrivals.claim(time.monotonic())
            time.sleep(max(0.0, due - time.monotonic()))  # gevent-patched: yields to the other users
            return max(0.0, time.monotonic() - due)
        if self.environment.parsed_options.think_time > 0:
            time.sleep(self.rng.expovariate(1.0 / self.environment.parsed_options.think_time))
        return 0.0

    def body(self, request, api: str) -> dict:
        return {"model": STATE.model, "max_tokens": request.max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                **({"ignore_eos": True} if self.environment.parsed_options.ignore_eos else {}),
                **({"messages": list(request.messages)} if api == "chat" else {"prompt": request.prompt})}

    @task
    def stream(self) -> None:
        lag_s, request = self._pause(), self.workload.next_request()
        api = choose_api(request, self.environment.parsed_options.api, self.rng)
        name, result, sent_at, num_bytes = f"/v1{ENDPOINTS[api]} [{request.tag}]", Stream(0.0), time.time(), 0
        headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity", **_auth(self.environment.parsed_options.api_key)}
        start = time.perf_counter()
        with self.client.post(STATE.base + ENDPOINTS[api], json=self.body(request, api), headers=headers, name=name, stream=True,
                              catch_response=True) as response:
            if response.status_code != 200:
                try:
                    result.error = f"HTTP {response.status_code}: {response.json()['error']['message']}"
                except Exception:  # noqa: BLE001 - not an OpenAI error body (or no response at all)
                    result.error = f"HTTP {response.status_code}: {(response.text or '')[:200] or getattr(response, 'error', None)!r}"
            else:
                try:  # readline returns as soon as a line is complete
                    while not result.done and (line := response._response.readline(b"\n")):
                        num_bytes += len(line)
                        result.feed(line.strip(), time.perf_counter() - start)
                except Exception as exc:  # noqa: BLE001 - a broken stream is a failed request
                    result.error = f"stream broken: {exc!r}"
            result.end = time.perf_counter() - start
            if result.error is None and not (result.done and (result.token_times or result.empty_reply)):
                result.error = "no token in the stream" if result.done else "stream ended without [DONE]"
            response.request_meta.update(response_time=result.end * 1000, response_length=num_bytes)
            if result.error is None:
                response.success()
            else:
                response.failure(result.error)
        ok, ttft_s, tpot_s = result.error is None, result.ttft_s, result.tpot_s
        if ok:
            for metric, value in (("ttft_ms", ttft_s), ("tpot_ms", tpot_s), ("e2e_ms", result.end), ("output_tokens", result.tokens)):
                if value is not None:
                    self.environment.events.request.fire(request_type="LLM", name=metric, response_time=value * (1000 if metric.endswith("_ms") else 1),
                                                         response_length=0, exception=None, context={})
        self.workload.record_reply("".join(result.text) if ok else "")
        if not ok and STATE.arrivals is None:
            time.sleep(1.0)  # closed loop: no hot loop against a server that is down
        if self.environment.parsed_options.records:
            STATE.records.append({"start_time": sent_at, "end_time": sent_at + result.end, "name": name, "api": api, "tag": request.tag, "ok": ok,
                                  "error": result.error, "ttft_s": ttft_s, "tpot_s": tpot_s if ok else None, "e2e_s": result.end,
                                  "output_tokens": result.tokens, "prompt_tokens": result.prompt_tokens, "max_tokens": request.max_tokens, "lag_s": lag_s, "empty": result.empty_reply})
