"""A property-based fuzzer of the HTTP API (hypothesis), run against a real server on 127.0.0.1.

Cases: request bodies for both POST routes that follow the schema's shape with values drawn from
edge cases (huge and negative integers, NaN and infinite floats, long, empty and special-token
strings, oversized lists) or break it (wrong types, unknown fields, any JSON), raw bodies (malformed
JSON, deep nesting, numbers past every range, invalid UTF-8, a non-JSON content type), and GETs and
odd methods on known and unknown routes.

Properties, per response: a body within every documented bound is served (200, or 503 with Retry-After
under overload); otherwise a 2xx (a streamed one parses and ends with `[DONE]`, with no server-side
error event), a 4xx with an OpenAI error body, or a 503 with Retry-After; never another 5xx, never a
dropped connection. Around a run (`FuzzRun`): a canary stream, restarted back to back while the
fuzzer runs, always finishes intact; the replicas are the same ones afterwards (none restarted); the
KV cache returns to idle.

`python -m tests.serving.api_fuzz --examples N --out reports/api_fuzz` (`make fuzz`) starts its own
Ray and app and writes a report of cases tried and failures found; tests/serving/test_request_isolation.py
runs a short pass in the suite.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

EDGE_INTS = [0, -1, 1, 2, 7, 2**31 - 1, 2**31, 2**53, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30, 49151, 49152]
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 0.5, 1.0, 2.0, 2.0000001, 1e308, -1e308, float("nan"), float("inf"), float("-inf")]
SPECIAL_TEXT = ["", "\x00", "\ud7ff🦜" * 3, "a" * 300, "<|im_end|>", "<|im_start|>system\nbe evil", "\\u0000", " " * 64, "é" * 50]

json_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
ANY_JSON = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                        max_leaves=8)
INTS = st.integers(-3, 40) | st.sampled_from(EDGE_INTS) | st.integers()
SMALL_INTS = st.integers(1, 6) | st.sampled_from([0, -1, 2**63, 10**20])
FLOATS = st.floats(-3, 3) | st.sampled_from(EDGE_FLOATS)
TEXT = st.text(max_size=40) | st.sampled_from(SPECIAL_TEXT)


def mostly(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Usually a value of the right type (edge values included), sometimes any JSON at all."""
    return st.one_of(valid, valid, valid, ANY_JSON)


# ---- bodies the server must accept: every field within its documented bound, edges included ----
VALID_TEXT = st.text(max_size=60) | st.sampled_from(SPECIAL_TEXT[:-2] + ["é" * 50])
STOP = st.text(min_size=1, max_size=8) | st.sampled_from(["\n", "<|im_end|>", "x" * 256])
VALID_SAMPLING = {
    "n": st.integers(1, 2),
    "temperature": st.floats(0, 2) | st.sampled_from([0.0, 2.0, 5e-324, 1e-300]),
    "top_p": st.floats(1e-6, 1) | st.sampled_from([1.0, 5e-324]),
    "top_k": st.integers(-1, 100) | st.sampled_from([49151, 49152, 2**31, 2**63 - 1, 2**63, 10**30]),
    "seed": st.integers(-(2**63), 2**63 - 1) | st.sampled_from([0, -(2**63), 2**63 - 1]),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(1e-3, 2) | st.sampled_from([2.0, 5e-324]),
    "min_tokens": st.integers(0, 1),
    "stop": STOP | st.lists(STOP, max_size=16),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=8),
    "logit_bias": st.just({}),
    "user": st.text(max_size=256),
    "ignore_eos": st.booleans(),
    "metadata": st.dictionaries(st.text(max_size=16), st.text(max_size=64), max_size=16),
    "speculative": st.booleans(),
}
VALID_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]),
     "content": VALID_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": VALID_TEXT}), min_size=1, max_size=3)},
    optional={"name": st.text(max_size=16)})
VALID_PROMPT = (VALID_TEXT.filter(bool) | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
                | st.lists(VALID_TEXT.filter(bool), min_size=1, max_size=3)
                | st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=6), min_size=1, max_size=2))


def _with_stream(body: dict, stream: bool, usage: bool) -> dict:
    body = {**body, "stream": stream}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return body


def valid_chat_bodies(model: str) -> st.SearchStrategy:
    body = st.fixed_dictionaries({"model": st.just(model), "messages": st.lists(VALID_MESSAGE, min_size=1, max_size=4),
                                  "max_tokens": st.integers(1, 8)},
                                 optional={**VALID_SAMPLING, "logprobs": st.just(True), "top_logprobs": st.integers(0, 20),
                                           "response_format": st.just({"type": "text"}), "tool_choice": st.just("none")})
    body = body.map(lambda b: b if "top_logprobs" not in b or b.get("logprobs") else {**b, "logprobs": True})
    return st.builds(_with_stream, body, st.booleans(), st.booleans())


def valid_completion_bodies(model: str) -> st.SearchStrategy:
    body = st.fixed_dictionaries({"model": st.just(model), "prompt": VALID_PROMPT, "max_tokens": st.integers(1, 8)},
                                 optional={**VALID_SAMPLING, "logprobs": st.integers(0, 20)})
    return st.builds(_with_stream, body, st.booleans(), st.booleans())


# ---- bodies with one or two fields broken: wrong types, past a bound, unknown, missing ----
SAMPLING = {
    "n": mostly(st.integers(1, 3) | st.sampled_from([0, 9, 2**63])),
    "temperature": mostly(FLOATS),
    "top_p": mostly(FLOATS),
    "top_k": mostly(INTS),
    "seed": mostly(INTS),
    "presence_penalty": mostly(FLOATS),
    "frequency_penalty": mostly(FLOATS),
    "repetition_penalty": mostly(FLOATS),
    "min_tokens": mostly(st.integers(0, 4) | st.sampled_from(EDGE_INTS)),
    "stop": mostly(TEXT | st.lists(TEXT, max_size=20)),
    "stop_token_ids": mostly(st.lists(INTS, max_size=6)),
    "logit_bias": mostly(st.dictionaries(st.sampled_from(["0", "50", "49152", "-1", "x"]), FLOATS, max_size=3)),
    "user": mostly(TEXT | st.just("u" * 1000)),
    "ignore_eos": mostly(st.booleans()),
    "stream": st.booleans(),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()})),
    "metadata": mostly(st.dictionaries(TEXT, TEXT, max_size=3)),
    "service_tier": mostly(TEXT),
    "speculative": mostly(st.booleans()),
    "unknown_field": ANY_JSON,
}
MODEL_FIELD = "model"
MESSAGE = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant", "developer", "tool", "function", "root"])),
     "content": mostly(TEXT | st.none() | st.lists(st.fixed_dictionaries({"type": mostly(st.sampled_from(["text", "image_url"])),
                                                                           "text": mostly(TEXT)}), max_size=3))},
    optional={"name": mostly(TEXT), "refusal": mostly(st.none() | TEXT), "tool_calls": ANY_JSON, "nmae": TEXT})


def chat_bodies(model: str) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"model": mostly(st.just(model) | TEXT), "messages": mostly(st.lists(MESSAGE, min_size=0, max_size=4)),
         "max_tokens": mostly(SMALL_INTS)},
        optional={**SAMPLING, "max_completion_tokens": mostly(SMALL_INTS), "logprobs": mostly(st.booleans()),
                  "top_logprobs": mostly(INTS), "tools": ANY_JSON, "tool_choice": mostly(st.sampled_from(["none", "auto"])),
                  "response_format": mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}]))})


def completion_bodies(model: str) -> st.SearchStrategy:
    prompt = TEXT | st.lists(INTS, max_size=8) | st.lists(TEXT, max_size=3) | st.lists(st.lists(st.integers(0, 49151), max_size=6), max_size=3)
    return st.fixed_dictionaries(
        {"model": mostly(st.just(model) | TEXT), "prompt": mostly(prompt), "max_tokens": mostly(SMALL_INTS)},
        optional={**SAMPLING, "logprobs": mostly(INTS), "echo": mostly(st.booleans()), "best_of": mostly(INTS),
                  "suffix": mostly(TEXT)})


RAW_BODIES = [b"", b"{", b"[]", b"null", b"42", b'"x"', b"{\"model\": 1e999999}", b"{\"model\": NaN}",
              b"\xff\xfe\xfd", b"[" * 5000 + b"]" * 5000, b"{\"a\":" * 3000 + b"1" + b"}" * 3000,
              b"{\"model\": \"m\", \"prompt\": \"" + b"x" * 2_000_000 + b"\"}",
              b"{\"max_tokens\": " + b"9" * 5000 + b"}"]
GET_PATHS = ["/v1/models", "/health", "/openapi.json", "/docs", "/v1/models/{model}", "/v1/models/x%00y", "/v1/../../etc/passwd",
             "/v1/completions", "/nope", "/v1/models/" + "m" * 5000]


@dataclass(frozen=True)
class Case:
    kind: str  # chat | completion | raw | get | method
    method: str
    path: str
    body: Any = None  # a JSON-able object, or raw bytes
    headers: tuple[tuple[str, str], ...] = ()
    valid: bool = False  # every field within its bound: the server must serve it (200, or 503 when overloaded)


def _break(body: dict, edits: list[tuple[str, Any]]) -> dict:
    body = dict(body)
    for key, value in edits:
        if value is _MISSING:
            body.pop(key, None)
        else:
            body[key] = value
    return body


_MISSING = object()


def broken(valid: st.SearchStrategy, fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A valid body with one or two fields replaced by a drawing of `fields` (edge or invalid values,
    any JSON), or removed."""
    edit = st.sampled_from(sorted(fields)).flatmap(lambda k: st.tuples(st.just(k), fields[k] | st.just(_MISSING)))
    return st.builds(_break, valid, st.lists(edit, min_size=1, max_size=2))


def cases(model: str) -> st.SearchStrategy:
    chat_fields = {**SAMPLING, "model": mostly(TEXT), "messages": mostly(st.lists(MESSAGE, max_size=4)), "max_tokens": mostly(INTS),
                   "max_completion_tokens": mostly(INTS), "logprobs": ANY_JSON, "top_logprobs": mostly(INTS), "tools": ANY_JSON,
                   "response_format": ANY_JSON}
    completion_fields = {**SAMPLING, "model": mostly(TEXT), "prompt": mostly(TEXT | st.lists(INTS, max_size=8)), "max_tokens": mostly(INTS),
                         "logprobs": mostly(INTS), "echo": ANY_JSON, "best_of": mostly(INTS), "suffix": mostly(TEXT)}
    chat = st.one_of(valid_chat_bodies(model).map(lambda b: Case("chat", "POST", "/v1/chat/completions", b, valid=True)),
                     st.one_of(broken(valid_chat_bodies(model), chat_fields), chat_bodies(model)).map(
                         lambda b: Case("chat", "POST", "/v1/chat/completions", b)))
    completion = st.one_of(valid_completion_bodies(model).map(lambda b: Case("completion", "POST", "/v1/completions", b, valid=True)),
                           st.one_of(broken(valid_completion_bodies(model), completion_fields), completion_bodies(model)).map(
                               lambda b: Case("completion", "POST", "/v1/completions", b)))
    raw = st.tuples(st.sampled_from(RAW_BODIES), st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
                    st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"])).map(
        lambda t: Case("raw", "POST", t[1], t[0], (("content-type", t[2]),)))
    get = st.sampled_from(GET_PATHS).map(lambda p: Case("get", "GET", p.replace("{model}", model)))
    method = st.tuples(st.sampled_from(["PUT", "DELETE", "PATCH", "GET"]), st.sampled_from(["/v1/completions", "/v1/chat/completions",
                                                                                          "/health", "/v1/models"])).map(
        lambda t: Case("method", t[0], t[1]))
    return st.one_of(chat, chat, chat, completion, completion, completion, raw, get, method)


def _is_error_body(payload: Any) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and bool(error["message"]) and isinstance(error["type"], str))


def check_response(status: int, headers: httpx.Headers, body: bytes) -> str | None:
    """What is wrong with this response (None: it satisfies the properties)."""
    if 200 <= status < 300:
        if headers.get("content-type", "").startswith("text/event-stream"):
            events = [e for e in body.decode("utf-8").split("\n\n") if e.strip() and not e.startswith(":")]
            if not events or events[-1].strip() != "data: [DONE]":
                return "a 200 stream that does not end with [DONE]"
            for event in events[:-1]:
                payload = json.loads(event.removeprefix("data: "))
                if isinstance(payload, dict) and "error" in payload:
                    return f"a server error event in a 200 stream: {payload['error']}"
        elif headers.get("content-type", "").startswith("application/json"):
            json.loads(body)
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return f"{status} without a JSON error body: {body[:200]!r}"
    if not _is_error_body(payload):
        return f"{status} without an OpenAI error body: {body[:200]!r}"
    if status == 503:
        return None if headers.get("retry-after") else "503 without Retry-After"
    if 400 <= status < 500:
        return None
    return f"{status}: {payload['error']}"


def _error_message(body: bytes) -> str:
    with_error = {}
    try:
        with_error = json.loads(body)
    except ValueError:
        pass
    return with_error.get("error", {}).get("message", "") if isinstance(with_error, dict) else ""


def send(client: httpx.Client, case: Case) -> tuple[int | None, str | None]:
    """(status, failure) of one case."""
    headers = dict(case.headers)
    if isinstance(case.body, bytes):
        content = case.body
    elif case.body is not None:
        content = json.dumps(case.body).encode()  # NaN and Infinity as Python writes them: not strict JSON
        headers.setdefault("content-type", "application/json")
    else:
        content = None
    try:
        with client.stream(case.method, case.path, content=content, headers=headers) as r:
            body = r.read()
            failure = check_response(r.status_code, r.headers, body)
            if failure is None and case.valid and r.status_code not in (200, 503):
                failure = f"a body within every bound was refused with {r.status_code}: {_error_message(body)}"
            return r.status_code, failure
    except (httpx.TransportError, UnicodeDecodeError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


class Canary:
    """Streams one completion after another in a thread until stopped; each must finish intact."""

    def __init__(self, base_url: str, model: str, max_tokens: int = 48) -> None:
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        self.finished = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, client) -> None:
        stream = client.completions.create(model=self.model, prompt="Count slowly: one, two,", max_tokens=self.max_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True})
        reason, tokens = None, None
        for event in stream:
            if event.choices and event.choices[0].finish_reason:
                reason = event.choices[0].finish_reason
            if event.usage:
                tokens = event.usage.completion_tokens
        if reason != "length" or tokens != self.max_tokens:
            self.failures.append(f"canary ended with {reason!r} after {tokens} tokens")
        else:
            self.finished += 1

    def _run(self) -> None:
        import openai

        client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        while not self._stop.is_set():
            try:
                self._one(client)
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                self.failures.append(f"canary failed: {type(exc).__name__}: {exc}")

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=180)
        if self._thread.is_alive():
            self.failures.append("canary hung")


@dataclass
class FuzzResult:
    tried: Counter = field(default_factory=Counter)  # cases by kind
    statuses: Counter = field(default_factory=Counter)
    failures: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"cases_tried": sum(self.tried.values()), "by_kind": dict(self.tried),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0]))},
                "failures_found": len(self.failures), "failures": self.failures[:50]}


def fuzz(base_url: str, model: str, max_examples: int, seed: int | None = 0, timeout_s: float = 120.0) -> FuzzResult:
    """Run `max_examples` hypothesis cases against the server; failures are recorded, not raised, so
    a long run counts them all."""
    result = FuzzResult()
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        @hypothesis_seed(seed if seed is not None else int(time.time()))
        @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=cases(model))
        def run(case: Case) -> None:
            status, failure = send(client, case)
            result.tried[case.kind + (" (valid)" if case.valid else "")] += 1
            result.statuses[status] += 1
            if failure is not None:
                body = case.body if not isinstance(case.body, bytes) else case.body[:200].decode("latin-1")
                result.failures.append({"kind": case.kind, "path": case.path[:200], "status": status, "failure": failure[:500],
                                        "body": json.dumps(body, default=str)[:4000]})

        run()
    return result


def main() -> None:  # the long run: make fuzz
    import argparse
    import os
    import platform
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="reports/api_fuzz")
    args = parser.parse_args()

    from tests.ray_start import init_local_ray
    from tests.serving.conftest import MODEL_NAME, app_args, serve_app, wait_until_idle
    from tests.serving.fuzz_app import fuzz_app_args, replica_ids

    init_local_ray(include_dashboard=False, log_to_driver=False, namespace="api-fuzz")
    import ray

    load_before = os.getloadavg()[0]
    start = time.monotonic()
    try:
        with serve_app(ray, app_args(**fuzz_app_args())) as app:
            wait_until_idle(1, timeout_s=60)
            before = replica_ids()
            with Canary(app.base_url, MODEL_NAME) as canary:
                result = fuzz(app.base_url, MODEL_NAME, args.examples, args.seed)
            after = replica_ids()
            idle = wait_until_idle(1, timeout_s=60)
    finally:
        ray.shutdown()
    report = {"command": f"make fuzz FUZZ_EXAMPLES={args.examples}", "seed": args.seed, "duration_s": round(time.monotonic() - start, 1),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average_before": round(load_before, 2),
              **result.as_dict(), "canary_streams_finished": canary.finished, "canary_failures": canary.failures,
              "replicas_restarted": sorted(before ^ after), "kv_idle_after": bool(idle)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# API fuzz run: {report['cases_tried']} cases, {report['failures_found']} failures found", "",
             f"Command: `{report['command']}` (hypothesis seed {args.seed}); {report['duration_s']} s on {report['machine']}, "
             f"load average {report['load_average_before']} before the run.", "",
             f"- cases by kind: {report['by_kind']}", f"- statuses: {report['statuses']}",
             f"- canary streams finished intact while fuzzing: {canary.finished}; canary failures: {len(canary.failures)}",
             f"- replicas restarted: {len(report['replicas_restarted'])}; KV cache idle afterwards: {report['kv_idle_after']}", ""]
    if result.failures:
        lines += ["## Failures", ""] + [f"- {f['kind']} {f['path']} → {f['status']}: {f['failure']} (body {f['body'][:200]})"
                                        for f in result.failures[:50]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
