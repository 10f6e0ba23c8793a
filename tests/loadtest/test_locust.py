"""loadtest/locustfile.py, headless, against a real local deployment (Ray Serve on 127.0.0.1, one
LLMServer replica, an API key): no request fails and the LLM metrics (TTFT, TPOT, e2e, output tokens)
are recorded, in Locust's statistics and in the per-request records; then the report script
summarizes the run. A wrong key makes every request fail, counted as such, with exit status 1.

Locust runs as its own process (the `locust` CLI): it monkey-patches with gevent, which breaks ssl in a
process that already imported Ray, so this test process never imports it.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_start import init_local_ray
from tests.serving.conftest import API_KEY, API_KEY_ENV, MODEL_NAME, REPO, app_args, serve_app

LOCUST = Path(sys.executable).with_name("locust")
MAX_TOKENS = 12

pytestmark = [pytest.mark.timeout(600), pytest.mark.startup(reason="starts Ray, Serve and a Locust process within bounds")]


@pytest.fixture(scope="module")
def served(model_dir):
    """Ray + the Serve app: one replica, one torch thread (a shared 2-core machine), a small KV cache,
    an API key."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's own traffic on loopback
    import ray

    if ray.is_initialized():  # pragma: no cover - a previous module left one
        ray.shutdown()
    init_local_ray(include_dashboard=False, log_to_driver=False, namespace="loadtest-tests")
    try:
        args = app_args(num_replicas=1, torch_num_threads=1, api_key_env=API_KEY_ENV,
                        engine={"dtype": "bfloat16", "num_blocks": 512, "max_num_seqs": 16})
        with serve_app(ray, args) as app:
            yield app
    finally:
        ray.shutdown()


def run_locust(app, out: Path, run_time_s: int, *options: str, api_key: str = API_KEY) -> subprocess.CompletedProcess:
    assert LOCUST.is_file(), f"{LOCUST} missing: `make install` installs locust (dev extras)"
    cmd = [str(LOCUST), "-f", "loadtest/locustfile.py", "--host", app.base_url, "--headless", "--only-summary",
           "-t", f"{run_time_s}s", "--stop-timeout", "30", "--csv", str(out / "locust"), "--records", str(out / "records.jsonl"),
           "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--api-key", api_key, *options]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "OPENAI_API_KEY"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=run_time_s + 90, env=env)
    print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
    return proc


def read_stats(out: Path) -> dict[tuple[str, str], dict]:
    with open(out / "locust_stats.csv") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def read_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_closed_loop_mixed_apis_records_llm_metrics(served, tmp_path):
    proc = run_locust(served, tmp_path, 20, "-u", "4", "-r", "4", "--workload", "short-chat", "--api", "mixed",
                      "--model", MODEL_NAME)
    assert proc.returncode == 0, "Locust exited non-zero (a request failed?)"
    assert "Traceback" not in proc.stderr

    stats = read_stats(tmp_path)
    requests = {name: row for (kind, name), row in stats.items() if kind == "POST"}
    assert set(requests) == {"/v1/chat/completions [short]", "/v1/completions [short]"}, requests.keys()
    num_requests = sum(int(r["Request Count"]) for r in requests.values())
    assert num_requests >= 4
    assert all(int(r["Failure Count"]) == 0 for r in stats.values())
    with open(tmp_path / "locust_failures.csv") as f:
        assert list(csv.DictReader(f)) == []
    # one event per successful request for each LLM metric
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms", "output_tokens"):
        assert int(stats[("LLM", metric)]["Request Count"]) == num_requests, metric
    ttft, tpot, e2e = (float(stats[("LLM", m)]["Average Response Time"]) for m in ("ttft_ms", "tpot_ms", "e2e_ms"))
    assert 0 < ttft < e2e and 0 < tpot < e2e
    assert float(stats[("LLM", "output_tokens")]["Min Response Time"]) == MAX_TOKENS  # ignore_eos: exactly max_tokens
    # the request rows time the whole stream, not just the response headers
    for row in requests.values():
        assert float(row["Average Response Time"]) > ttft * 0.5

    records = read_records(tmp_path)
    assert len(records) == num_requests
    assert all(r["ok"] and r["error"] is None for r in records)
    assert {r["api"] for r in records} == {"chat", "completions"}
    for r in records:
        assert r["output_tokens"] == MAX_TOKENS
        assert 0 < r["ttft_s"] < r["e2e_s"]
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (MAX_TOKENS - 1))
        assert r["prompt_tokens"] > 0

    report = subprocess.run([sys.executable, "-m", "loadtest.loadtest_report", "--records", str(tmp_path / "records.jsonl"),
                             "--out-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    summary = json.loads((tmp_path / "loadtest.json").read_text())["summary"]
    assert summary["num_failed"] == 0 and summary["num_ok"] == num_requests
    assert summary["output_tokens"] == num_requests * MAX_TOKENS
    assert summary["ttft_s"]["p50"] > 0 and summary["tpot_s"]["p99"] > 0
    assert (tmp_path / "loadtest_ttft_cdf.png").stat().st_size > 10_000
    assert (tmp_path / "loadtest_timeseries.png").stat().st_size > 10_000
    assert "**0 failed**" in (tmp_path / "loadtest.md").read_text()


def test_open_loop_poisson_multi_turn(served, tmp_path):
    """Poisson arrivals (1/s) with enough users that none is late; shared-prefix conversations continue
    with the server's replies (turn 2 carries turn 1's answer); the model name comes from /v1/models."""
    proc = run_locust(served, tmp_path, 14, "-u", "12", "-r", "12", "--workload", "shared-prefix", "--arrival-rate", "1",
                      "--turns", "2", "--seed", "3")
    assert proc.returncode == 0
    assert f"model '{MODEL_NAME}'" in proc.stderr  # discovered, not given
    records = read_records(tmp_path)
    assert 3 <= len(records) <= 40
    assert all(r["ok"] for r in records)
    assert {r["tag"] for r in records} <= {"turn-1", "turn-2"}
    assert max(r["lag_s"] for r in records) < 2.0  # a free user was there whenever an arrival was due
    # a second turn's prompt holds the shared system prompt, turn 1 and its reply: longer than any first turn
    first = [r["prompt_tokens"] for r in records if r["tag"] == "turn-1"]
    second = [r["prompt_tokens"] for r in records if r["tag"] == "turn-2"]
    assert first and min(first) > 400  # the ~450-token shared system prompt
    if second:
        assert min(second) > min(first) + MAX_TOKENS


def test_wrong_api_key_fails_every_request(served, tmp_path):
    proc = run_locust(served, tmp_path, 3, "-u", "2", "-r", "2", "--model", MODEL_NAME, api_key="wrong")
    assert proc.returncode == 1
    stats = read_stats(tmp_path)
    rows = [row for (kind, _), row in stats.items() if kind == "POST"]
    assert rows and all(int(r["Failure Count"]) == int(r["Request Count"]) > 0 for r in rows)
    assert not any(kind == "LLM" for kind, _ in stats)  # no latency metric from a failed request
    with open(tmp_path / "locust_failures.csv") as f:
        errors = {row["Error"] for row in csv.DictReader(f)}
    assert errors and all("HTTP 401: invalid API key" in e for e in errors), errors
    records = read_records(tmp_path)
    assert records and not any(r["ok"] for r in records)
    # a closed-loop user backs off after a failure instead of hammering the server
    assert len(records) <= 2 * 5
