"""Load-test building blocks without a server or Locust: workload profiles, the Poisson clock, base URLs
(loadtest/llm_workloads.py) and the report's statistics and files (loadtest/loadtest_report.py)."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from loadtest import loadtest_report
from loadtest.llm_workloads import (
    PROFILES,
    LLMRequest,
    PoissonArrivals,
    Workload,
    api_base,
    choose_api,
    shared_system_prompt,
)
from loadtest.loadtest_report import load_records, summarize, time_series


def _draw(profile: str, n: int, seed: int = 0, **kw) -> list[LLMRequest]:
    w = Workload(profile, random.Random(seed), **kw)
    return [w.next_request() for _ in range(n)]


def test_profiles_are_reproducible_and_shaped():
    for profile in PROFILES:
        assert _draw(profile, 20, seed=1) == _draw(profile, 20, seed=1)
    short = _draw("short-chat", 50)
    assert all(r.tag == "short" and r.default_api == "chat" and 32 <= r.max_tokens <= 96 for r in short)
    long = _draw("long-prompt", 5)
    assert all(r.default_api == "completions" and r.max_tokens == 64 and len(r.prompt.split()) > 900 for r in long)
    assert len({r.prompt for r in long}) == 5  # every long prompt differs: no accidental prefix sharing
    skewed = _draw("skewed", 2000)
    share = sum(r.tag == "long" for r in skewed) / len(skewed)
    assert 0.08 < share < 0.12
    assert {r.max_tokens for r in skewed if r.tag == "long"} == {256}
    assert all(r.max_tokens == 7 for r in _draw("skewed", 50, max_tokens=7))


def test_shared_prefix_conversations_carry_replies_and_restart():
    w = Workload("shared-prefix", random.Random(0), turns=3)
    system = shared_system_prompt()
    first = w.next_request()
    assert first.tag == "turn-1" and first.messages[0] == {"role": "system", "content": system}
    assert [m["role"] for m in first.messages] == ["system", "user"]
    w.record_reply("an answer")
    second = w.next_request()
    assert second.tag == "turn-2"
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user"]
    assert second.messages[2]["content"] == "an answer" and second.messages[:2] == first.messages
    w.record_reply("another")
    assert w.next_request().tag == "turn-3"
    w.record_reply("third")
    restarted = w.next_request()
    assert restarted.tag == "turn-1" and len(restarted.messages) == 2
    w.record_reply("")  # a failed turn ends the conversation
    assert w.next_request().tag == "turn-1"
    # the completions rendering is a transcript ending where the assistant speaks
    assert second.prompt.startswith("System: You are") and second.prompt.endswith("\nAssistant:")
    assert "\nAssistant: an answer\nUser: " in second.prompt


def test_choose_api():
    rng = random.Random(0)
    req = _draw("long-prompt", 1)[0]
    assert choose_api(req, "auto", rng) == "completions"
    assert choose_api(req, "chat", rng) == "chat"
    assert {choose_api(req, "mixed", rng) for _ in range(50)} == {"chat", "completions"}
    with pytest.raises(ValueError, match="turns"):
        Workload("shared-prefix", rng, turns=0)


def test_poisson_arrivals_rate_and_open_loop():
    clock = PoissonArrivals(4.0, seed=0)
    times = [clock.claim(now=100.0) for _ in range(4000)]
    gaps = [b - a for a, b in zip([100.0, *times], times, strict=False)]
    assert all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.08)  # exponential: sd == mean
    # the schedule does not depend on when users ask (open loop)
    late = PoissonArrivals(4.0, seed=0)
    assert [late.claim(now=100.0 + i) for i in range(5)] == times[:5]


@pytest.mark.parametrize(("host", "base"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ("https://example.test/openai/v1/", "https://example.test/openai/v1"),
])
def test_api_base(host, base):
    assert api_base(host) == base


# ---- report ----------------------------------------------------------------------------------------
def _record(start, ttft, e2e, tokens, ok=True, name="/v1/chat/completions [short]", error=None):
    return {"start_time": start, "end_time": start + e2e, "name": name, "api": "chat", "tag": "short", "ok": ok,
            "error": error, "ttft_s": ttft if ok else None, "tpot_s": (e2e - ttft) / (tokens - 1) if ok else None,
            "e2e_s": e2e, "output_tokens": tokens if ok else 0, "prompt_tokens": 10, "max_tokens": 32, "lag_s": 0.0}


def test_summary_numbers_and_files(tmp_path):
    records = [_record(1000.0 + i, ttft=0.1 * (i + 1), e2e=2.0, tokens=11) for i in range(10)]
    records.append(_record(1005.0, 0, 0.5, 0, ok=False, error="HTTP 503: overloaded"))
    s = summarize(records)
    assert (s["num_requests"], s["num_ok"], s["num_failed"]) == (11, 10, 1)
    assert s["window_s"] == pytest.approx(11.0)  # 1000.0 → 1011.0 (last request ends at 1009 + 2)
    assert s["output_tokens"] == 110
    assert s["output_tok_s"] == pytest.approx(10.0)
    assert s["request_throughput"] == pytest.approx(10 / 11)
    assert s["ttft_s"]["p50"] == pytest.approx(0.55)
    assert s["e2e_s"]["p99"] == pytest.approx(2.0)
    assert s["tpot_s"]["n"] == 10
    assert s["errors"] == {"HTTP 503: overloaded": 1}

    series = time_series(records, bin_s=2.0)
    # every ok request's 11 tokens, in the bin it ended in: the total comes back
    assert sum(series["tok_s"]) * 2.0 == pytest.approx(110)
    assert sum(series["req_s"]) * 2.0 == pytest.approx(10)

    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:6]))
    (tmp_path / "r.jsonl.123").write_text("".join(json.dumps(r) + "\n" for r in records[6:]))  # a worker's file
    assert len(load_records(str(tmp_path / "r.jsonl"))) == 11
    assert loadtest_report.main(["--records", str(tmp_path / "r.jsonl"), "--out-dir",
                                 str(tmp_path / "out"), "--title", "t", "--command", "make loadtest", "--load-before", "0.5 0.4 0.3"]) == 0
    md = (tmp_path / "out" / "loadtest.md").read_text()
    assert md.startswith("# Load test: t\n\n`make loadtest`") and "[0.5, 0.4, 0.3] before" in md
    assert "**1 failed**" in md and "| TTFT (send → first token) | 550 |" in md
    assert "| HTTP 503: overloaded | 1 |" in md
    assert "![loadtest_ttft_cdf](loadtest_ttft_cdf.png)" in md and (tmp_path / "out" / "loadtest_timeseries.png").stat().st_size > 5000
    assert json.loads((tmp_path / "out" / "loadtest.json").read_text())["summary"]["num_failed"] == 1
