"""A self-contained dashboard demo without Grafana: a private Ray instance running the app (2 replicas,
the prefix-aware router, n-gram speculation with adaptive k, so that every panel has data),
Prometheus with the shipped config and rules, ~2 minutes of mixed load (light → burst → light; short
and long prompts, shared prefixes, stop and length finishes), then every panel of
dashboards/llm-serving.json rendered to PNG from Prometheus (`render_panels.py --all`).

    make dashboard-demo            # → reports/dashboard/{overview.png, <panel>.png, panels.json}

Everything it starts is stopped at the end; nothing else on the machine is touched.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from serve_app.metrics import local_stack

REPO = local_stack.REPO
MODEL_NAME = "smollm2-135m-instruct"
SHARED = "You are a concise assistant. Answer in one short sentence, without preamble or lists. " * 3


def one_request(base_url: str, i: int, rng: random.Random) -> int:
    long = i % 5 == 0
    prompt = (SHARED if i % 2 else "") + f"Question {i}: tell me about the number {rng.randrange(1000)}. " * (4 if long else 1)
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 48 if long else 16, "temperature": 0,
            "ignore_eos": i % 3 != 0}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=600).status_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "reports" / "dashboard")
    parser.add_argument("--model", default=str(REPO / "models" / MODEL_NAME))
    parser.add_argument("--phases", default="8x2,32x12,8x2", help="requests x concurrency, per phase")
    args = parser.parse_args(argv)
    phases = [tuple(int(n) for n in p.split("x")) for p in args.phases.split(",")]

    from ray import serve

    from serve_app.serving.app import build_app

    rng = random.Random(0)
    with local_stack.ray_instance(metrics_report_interval_ms=2000, namespace="dashboard-demo") as ray_instance:
        http_port = local_stack.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        serve.run(build_app({"model": args.model, "num_replicas": 2, "num_cpus_per_replica": 0.5, "torch_num_threads": 1,
                             "max_ongoing_requests": 32, "api_key_env": "", "router": "prefix_aware",
                             "engine": {"dtype": "float32", "num_blocks": 96, "max_num_seqs": 16,
                                        "speculative": {"method": "ngram"}}}),
                  name="llm", route_prefix="/")
        base_url = f"http://127.0.0.1:{http_port}"
        config = local_stack.prometheus_config(ray_instance.sd_file, scrape_interval="2s", evaluation_interval="2s")
        with local_stack.prometheus_server(config) as prometheus:
            time.sleep(15)  # a few idle samples first
            start = time.time()
            for n, concurrency in phases:
                with ThreadPoolExecutor(concurrency) as pool:
                    codes = list(pool.map(lambda i: one_request(base_url, i, rng), range(n)))
                print(f"[demo] {n} requests at concurrency {concurrency}: {codes.count(200)} ok, t={time.time() - start:.0f} s", flush=True)
                time.sleep(10)
            time.sleep(10)
            cmd = [sys.executable, str(REPO / "dashboards" / "render_panels.py"), "--prometheus-url", prometheus.url,
                   "--all", "--out", str(args.out), "--start", f"{start - 20:.0f}", "--rate-interval", "20s",
                   "--var", f"model={MODEL_NAME}"]
            return subprocess.run(cmd, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
