"""The benchmark harness (loadtest/stats.py, machine.py, report.py, client.py, worker.py): the one
percentile definition, repeat statistics, machine facts, the report's files and the stream parser."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from loadtest import machine, report
from loadtest.client import Stream
from loadtest.stats import interleaved, paired_ratios, percentile, ratio, spread
from loadtest.worker import Worker, WorkerError


# ---- the percentile ---------------------------------------------------------------------------------
def test_percentile_is_linear_interpolation_between_closest_ranks():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == pytest.approx(50.5)  # the median of an even count
    assert percentile(values, 0.99) == pytest.approx(99.01)  # between the two largest, not either one
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0  # order of the input does not matter
    assert percentile([1.0, 2.0], 0.25) == pytest.approx(1.25)
    assert (percentile(values, 0.0), percentile(values, 1.0)) == (1.0, 100.0)
    assert percentile([7.0], 0.99) == 7.0 and percentile([], 0.5) is None
    for q in (0.1, 0.5, 0.9, 0.99):  # numpy's default definition, on uneven data
        data = [math.exp(x / 7) for x in range(37)]
        assert percentile(data, q) == pytest.approx(float(np.percentile(data, 100 * q)))
    with pytest.raises(ValueError, match="q"):
        percentile(values, 99)  # a fraction, not a percentage


def test_spread_ratios_and_interleaved_repeats():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0, "n": 4}
    assert spread([]) is None and spread(iter([5.0]))["n"] == 1
    assert ratio(3.0, 2.0) == 1.5 and ratio(None, 2.0) is None and ratio(3.0, 0.0) is None
    assert [interleaved(["a", "b", "c"], r) for r in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert interleaved([], 3) == []
    runs = {"native": {0: 10.0, 1: 12.0, 2: 9.0}, "hf": {0: 5.0, 2: 3.0}}  # hf's repeat 1 failed
    assert paired_ratios(runs, "native", "hf") == [2.0, 3.0]  # per repeat, only where both ran
    assert paired_ratios(runs, "vllm", "hf") == []


# ---- machine facts ------------------------------------------------------------------------------------
LSCPU = """Architecture:                         x86_64
Model name:                           AMD EPYC 9B14
Thread(s) per core:                   1
Core(s) per socket:                   2
Socket(s):                            1
Flags:                                fpu sse avx2 avx512f avx512bw avx512_bf16 vaes
"""
CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_cpu_facts_from_lscpu_and_proc_cpuinfo():
    assert machine.parse_cpu_info(LSCPU) == {"cpu": "AMD EPYC 9B14", "flags": ["avx2", "avx512f", "avx512_bf16"], "physical_cores": 2}
    info = machine.parse_cpu_info(CPUINFO)
    assert info["cpu"].startswith("Intel(R) Xeon(R) Platinum 8481C")
    assert info["flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"] and info["physical_cores"] is None
    assert machine.parse_cpu_info("Flags: fpu sse")["flags"] == []


def test_facts_of_this_machine_and_the_load_before():
    facts = machine.facts()
    assert facts["logical_cores"] >= 1 and facts["memory_gib"] > 0 and facts["cpu"] and facts["git"]
    assert len(facts["load_avg_before"]) == 3 and "load_avg_after" not in facts  # report.write adds it
    line = machine.describe(facts)
    assert facts["cpu"] in line and "before" in line and "after" in line
    assert machine.own_cpu_s() > 0 and machine.busy_cpu_s() > 0


# ---- the report ---------------------------------------------------------------------------------------
def test_wait_quiet_waits_while_a_core_is_busy_and_no_longer_than_its_bound():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        waited = machine.wait_quiet(timeout_s=0.6)
    finally:
        busy.kill()
        busy.wait()
    assert 0.6 <= waited < 1.0  # a whole core busy: never quiet, so it waits its bound (and only that)


def test_report_writes_json_markdown_and_png_in_one_shape(tmp_path):
    results = report.start("bench_x")
    results["rows"] = [{"x": 1, "y": 2.5}]
    assert results["command"].startswith(".venv/bin/python -m loadtest.bench_x")

    def plot(plt):
        fig, ax = plt.subplots()
        ax.plot([0, 1], [0, 1])
        return fig

    body = report.table(["x", "y"], [[r["x"], report.num(r["y"], 1)] for r in results["rows"]])
    paths = report.write(results, tmp_path / "out", "x", "A title", body, {"x": plot, "x_detail": plot})
    assert [p.name for p in paths] == ["x.json", "x.md", "x.png", "x_detail.png"]
    saved = json.loads(paths[0].read_text())
    assert saved["rows"] == results["rows"] and "started" not in saved and saved["duration_s"] >= 0
    assert len(saved["machine"]["load_avg_after"]) == 3
    md = paths[1].read_text()
    assert md.startswith("# A title\n\n`.venv/bin/python -m loadtest.bench_x")
    assert "load average" in md and "| x | y |\n|---|---|\n| 1 | 2.5 |" in md and "![x_detail](x_detail.png)" in md
    assert paths[2].read_bytes()[:4] == b"\x89PNG"


def test_report_cells():
    assert report.cell({"median": 2.0, "min": 1.0, "max": 3.5, "n": 3}) == "2.0 (1.0–3.5)"
    assert report.cell({"median": 0.25, "min": 0.25, "max": 0.25, "n": 1}, scale=100, digits=0) == "25"
    assert report.cell(None) == "–" and report.num(None) == "–" and report.num(1234.5, 0) == "1,234"


# ---- the stream parser ----------------------------------------------------------------------------------
def feed(events: list[dict | str]) -> Stream:
    s = Stream(0.0)
    for i, event in enumerate(events):
        s.feed(b"data: " + (event.encode() if isinstance(event, str) else json.dumps(event).encode()), float(i + 1))
    s.end = float(len(events) + 1)
    return s


def test_stream_times_tokens_and_ends():
    s = feed([{"choices": [{"text": "Hi"}]}, {"choices": [{"text": " there"}]}, {"choices": [{"text": "", "finish_reason": "length"}]},
              {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 7}}, "[DONE]"])
    assert (s.ttft_s, s.token_times, s.tokens, s.prompt_tokens) == (1.0, [1.0, 2.0], 3, 7)
    assert s.tpot_s == pytest.approx((6.0 - 1.0) / 2) and s.done and s.error is None and "".join(s.text) == "Hi there"
    chat = feed([{"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]}])
    assert chat.tokens == 2 and not chat.done  # no usage: one token per event with text; no [DONE] yet
    assert feed([{"error": {"code": "engine_dead", "message": "x"}}]).error == "engine_dead"


def test_an_empty_reply_that_ends_properly_is_not_a_missing_token():
    empty = feed([{"choices": [{"text": ""}]}, {"choices": [{"text": "", "finish_reason": "stop"}]}, "[DONE]"])
    assert empty.empty_reply and empty.ttft_s is None
    assert not feed([{"choices": [{"text": ""}]}, "[DONE]"]).empty_reply  # no text, and never said why it ended
    assert not feed([{"choices": [{"text": "Hi", "finish_reason": "stop"}]}, "[DONE]"]).empty_reply


# ---- the worker process -------------------------------------------------------------------------------------
class Echo:
    """A worker object (built in the spawned process from its options)."""

    def __init__(self, opts: dict) -> None:
        if opts.get("fail"):
            raise RuntimeError("cannot build")
        self.offset = opts["offset"]

    def add(self, x: int) -> int:
        return x + self.offset

    def boom(self) -> None:
        raise ValueError("boom")


def test_worker_builds_its_object_in_a_process_and_reports_failures():
    worker = Worker("tests.loadtest.test_harness:Echo", {"offset": 10}, timeout_s=120)
    try:
        assert worker.call("add", 5) == 15 and worker.proc.pid != os.getpid() and worker.load_s > 0
        with pytest.raises(WorkerError, match="ValueError: boom"):
            worker.call("boom")
        assert worker.call("add", 1) == 11  # a failed call leaves the worker serving
    finally:
        worker.stop()
    assert not worker.proc.is_alive()
    with pytest.raises(WorkerError, match="RuntimeError: cannot build"):
        Worker("tests.loadtest.test_harness:Echo", {"fail": True}, timeout_s=120)
