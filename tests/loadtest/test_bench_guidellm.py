"""loadtest/bench_guidellm.py without a server: what it reads from GuideLLM's report (data/guidellm_report.json: GuideLLM 0.8.1's
json from a 15 s smoke run of `make bench-guidellm` against configs/local.yaml's app, trimmed to the benchmark's duration and
the metrics read), the command it runs, and the comparison report it writes from runs."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
from pathlib import Path

import pytest

from loadtest import bench_guidellm, report

REPORT = json.loads((Path(__file__).parent / "data" / "guidellm_report.json").read_text())


def opts(**kw) -> argparse.Namespace:
    base = {"concurrency": 16, "seconds": 40.0, "prompt_tokens": 128, "output_tokens": 64, "model": "models/smollm2-135m-instruct",
            "config": "configs/local.yaml", "repeats": 2, "raw_dir": "build/guidellm-runs", "out_dir": "reports"}
    return argparse.Namespace(**{**base, **kw})


def test_summary_reads_guidellms_own_figures():
    s = bench_guidellm.summary(REPORT)
    # output tok/s as GuideLLM prints it: every output token in the window (cut-off requests' too) over the window
    assert s["output_tok_s"] == pytest.approx(178.0)
    assert s["window_s"] == 15.0
    assert s["ttft_p50_ms"] == pytest.approx(1039.73, abs=0.01) and s["ttft_p99_ms"] == pytest.approx(2867.70, abs=0.01)
    assert s["itl_p50_ms"] == pytest.approx(71.65, abs=0.01) and s["itl_p99_ms"] == pytest.approx(104.76, abs=0.01)
    # 128 synthetic prompt tokens + the chat template, as the server counts them; ignore_eos: exactly 64 out
    assert (s["prompt_tokens_p50"], s["output_tokens_p50"]) == (158.0, 64.0)
    assert s["requests"] == {"successful": 34, "incomplete": 16, "errored": 0}
    assert bench_guidellm.requests_cell(s) == "34 (16 cut off, 0 errored)"


def test_a_run_that_completed_nothing_has_throughput_and_no_latencies():
    """A server slower than one request per window: GuideLLM reports zeros for latencies it never measured."""
    slow = copy.deepcopy(REPORT)
    slow["benchmarks"][0]["metrics"]["request_totals"].update(successful=0, incomplete=16)
    s = bench_guidellm.summary(slow)
    assert s["output_tok_s"] == pytest.approx(178.0) and s["ttft_p50_ms"] is None and s["itl_p99_ms"] is None


def test_command_names_guidellm_0_8_1s_options():
    cmd = bench_guidellm.guidellm_cmd("http://127.0.0.1:8000", Path("out/r.json"), opts(seconds=15.0))
    assert cmd[1] == "run"
    args = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert args["--backend"] == "kind=openai_http,target=http://127.0.0.1:8000"
    assert args["--profile"] == "kind=concurrent,streams=16"
    assert args["--constraint"] == "kind=max_duration,seconds=15"
    assert args["--data"] == "kind=synthetic_text,prompt_tokens=128,output_tokens=64"
    assert args["--tokenizer"] == "kind=huggingface_auto,model=models/smollm2-135m-instruct"  # a local directory: no hub access
    assert "kind=json,path=out/r.json" in cmd


def test_run_files_are_named_so_that_guidellms_output_option_parses():
    stem = bench_guidellm.raw_stem("ours waiting_served_ratio=0.5,max_waiting_steps=8", 2)
    assert stem == "ours_waiting_served_ratio_0.5_max_waiting_steps_8-r2"
    cmd = bench_guidellm.guidellm_cmd("http://127.0.0.1:8000", Path("out") / f"{stem}.json", opts())
    output = cmd[cmd.index("--output") + 1]
    assert dict(item.split("=", 1) for item in output.split(",")) == {"kind": "json", "path": f"out/{stem}.json"}


def test_comparison_report_pairs_ratios_per_repeat(tmp_path):
    base = bench_guidellm.summary(REPORT)
    runs = [{**base, "server": server, "repeat": repeat, "startup_s": 30.0, "client_cpu_s": 20.0, "others_cpu_pct": 4.0, "output_tok_s": tok_s, "itl_p50_ms": itl}
            for server, repeat, tok_s, itl in (("ours", 0, 260.0, 50.0), ("vllm", 0, 200.0, 50.0), ("vllm", 1, 180.0, 60.0), ("ours", 1, 252.0, 66.0),
                                               ("vllm", 2, 40.0, None), ("ours", 2, 250.0, 70.0))]  # vLLM completed nothing in repeat 2
    results = {**report.start("bench_guidellm"), "guidellm": "0.8.1", "config": "configs/local.yaml", "profile": "haproxy",
               "workload": {"concurrency": 16, "prompt_tokens": 128, "output_tokens": 64, "seconds": 40.0}, "runs": runs}
    bench_guidellm.write(results, opts(out_dir=str(tmp_path)))
    assert results["vs_vllm"]["ours"]["output_tok_s"] == pytest.approx([1.3, 1.4, 6.25])
    assert results["vs_vllm"]["ours"]["itl_p50_ms"] == pytest.approx([1.0, 1.1])  # (no ITL for vLLM in repeat 2)
    assert results["servers"]["ours"]["output_tok_s"] == {"median": 252.0, "min": 250.0, "max": 260.0, "n": 3}
    assert results["servers"]["vllm"]["itl_p50_ms"]["n"] == 2
    md = (tmp_path / "guidellm.md").read_text()
    assert "| ours (configs/local.yaml, SERVE_PROFILE=haproxy) | 252.0 (250.0–260.0) |" in md
    assert "| ours (configs/local.yaml, SERVE_PROFILE=haproxy) | 1.30, 1.40, 6.25 | 1.00, 1.10 |" in md
    assert json.loads((tmp_path / "guidellm.json").read_text())["vs_vllm"] == results["vs_vllm"]


def test_ours_engine_items_set_engine_options_over_the_configs(tmp_path):
    assert bench_guidellm.engine_options("waiting_served_ratio=0,max_waiting_steps=8,batching=dynamic") == {
        "waiting_served_ratio": 0, "max_waiting_steps": 8, "batching": "dynamic"}
    assert bench_guidellm.engine_options("") == {}
    base = bench_guidellm.summary(REPORT)
    runs = [{**base, "server": server, "repeat": 0, "startup_s": 30.0, "client_cpu_s": 20.0, "others_cpu_pct": 4.0, "output_tok_s": tok_s}
            for server, tok_s in (("ours", 260.0), ("ours waiting_served_ratio=0", 240.0), ("vllm", 200.0))]
    results = {**report.start("bench_guidellm"), "guidellm": "0.8.1", "config": "configs/local.yaml", "profile": "haproxy",
               "workload": {"concurrency": 16, "prompt_tokens": 128, "output_tokens": 64, "seconds": 40.0}, "runs": runs}
    bench_guidellm.write(results, opts(out_dir=str(tmp_path)))
    assert results["vs_vllm"]["ours waiting_served_ratio=0"]["output_tok_s"] == pytest.approx([1.2])
    md = (tmp_path / "guidellm.md").read_text()
    assert "| ours (configs/local.yaml, SERVE_PROFILE=haproxy) with waiting_served_ratio=0 | 1.20 |" in md


def test_make_targets_keep_guidellm_in_its_own_venv():
    """install-guidellm installs only into .venv-guidellm, from a file that pins every package (guidellm 0.8.1, the project's
    torch); guidellm runs the client mode, bench-guidellm the comparison."""
    def dry_run(*args: str) -> str:
        out = subprocess.run(["make", "-n", *args], cwd=report.machine.REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    install = dry_run("-W", "loadtest/guidellm-requirements.txt", "install-guidellm")
    assert ".venv-guidellm/bin/pip install -q -r loadtest/guidellm-requirements.txt" in install and ".venv/bin/pip" not in install
    pins = [line for line in (report.machine.REPO / "loadtest" / "guidellm-requirements.txt").read_text().splitlines() if line and line[0] != "#"]
    assert all("==" in line for line in pins) and {"guidellm==0.8.1", "torch==2.13.0"} <= set(pins)
    run = dry_run("guidellm", "GUIDELLM_URL=http://127.0.0.1:9000", "GUIDELLM_OUT=build/x")
    assert "-m loadtest.bench_guidellm --url http://127.0.0.1:9000 --seconds 40 --out-dir build/x" in run
    assert "-m loadtest.bench_guidellm --repeats 1" in dry_run("bench-guidellm", "BENCH_GUIDELLM_ARGS=--repeats 1")
