"""Engine death under steady load: how many requests fail, and which.

One private Ray on 127.0.0.1, the app with 2 LLMServer replicas (configs/local.yaml's options), and
`--streams` client loops (8) each streaming one completion after another through Serve's proxy. After
`--warmup-s`, one replica's engine loop is killed (the tests' fault logger, tests/serving/faults.py:
its next step raises) and the load goes on for `--after-s`. Every request's start, end and outcome is
recorded. Reported: requests that failed; those among them that started after the death, and after
the first second following it; the victim's in-flight requests at the death (read from the replicas'
routing stats just before); when the replacement replica was running. Target: only requests in flight
on the dead replica fail.

`--mode exit` (default) is the shipped behaviour (`exit_on_engine_death`: the replica exits, routers
drop it at once); `--mode health-check` switches that off (only Serve's periodic health check acts),
for comparison.

    .venv/bin/python loadtest/bench_engine_death.py            # both modes → reports/engine_death.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on the loopback address only
FAULT_FILE = Path(tempfile.gettempdir()) / f"serve_app_engine_death_{os.getpid()}"
os.environ["SERVE_APP_TEST_FAULT_FILE"] = str(FAULT_FILE)  # replicas inherit it (tests/serving/faults.py)

from loadtest.replica_probe import serve_replicas  # noqa: E402

APP = "bench-engine-death"
MODEL_NAME = "smollm2-135m-instruct"


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_args(mode: str) -> dict[str, Any]:
    import yaml

    args = dict(yaml.safe_load((REPO / "configs" / "local.yaml").read_text())["applications"][0]["args"])
    args.update({"model": str(REPO / "models" / MODEL_NAME), "num_replicas": 2, "api_key_env": "", "health_check_period_s": 2.0,
                 "stat_logger_factories": ["tests.serving.faults:make_fault_logger"],
                 "exit_on_engine_death": mode == "exit"})
    return args


async def client_loop(index: int, base_url: str, stop_at: float, records: list[dict], max_tokens: int) -> None:
    import httpx

    body = {"model": MODEL_NAME, "prompt": f"Story number {index}: once upon a time", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        while time.monotonic() < stop_at:
            record = {"client": index, "start": time.monotonic(), "end": None, "status": None, "tokens": 0, "error": None}
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    record["status"] = r.status_code
                    if r.status_code != 200:
                        record["error"] = json.loads(await r.aread()).get("error", {}).get("code") or str(r.status_code)
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            payload = json.loads(line[len("data: "):])
                            if "error" in payload:
                                record["error"] = payload["error"].get("code") or "error"
                            elif payload.get("choices"):
                                record["tokens"] += 1
            except Exception as exc:  # noqa: BLE001 - a dropped connection is a failure like any other
                record["error"] = type(exc).__name__
            record["end"] = time.monotonic()
            records.append(record)
            if record["error"] is not None:
                await asyncio.sleep(0.05)


def running_per_replica() -> dict[str, int]:
    import ray

    actors = serve_replicas(APP)
    stats = {name: ray.get(a.record_routing_stats.remote(), timeout=10) for name, a in actors.items()}
    return {name: s["num_running"] + s["num_waiting"] for name, s in stats.items()}


def replaced(victim: str) -> bool:
    """Serve runs 2 replicas again, the victim not among them."""
    from ray import serve

    names = set(serve_replicas(APP))
    status = serve.status().applications[APP].deployments["LLMServer"]
    return victim not in names and len(names) == 2 and status.replica_states.get("RUNNING", 0) == 2


async def drive(base_url: str, opts: argparse.Namespace, records: list[dict]) -> tuple[dict[str, int], str, float, float | None]:
    """The load, the death after the warm-up, and the wait for the replacement."""
    stop_at = time.monotonic() + opts.warmup_s + opts.after_s
    tasks = [asyncio.create_task(client_loop(i, base_url, stop_at, records, opts.max_tokens)) for i in range(opts.streams)]
    await asyncio.sleep(opts.warmup_s)
    placed = await asyncio.to_thread(running_per_replica)
    victim = max(sorted(placed), key=lambda name: placed[name])
    death = time.monotonic()
    FAULT_FILE.write_text(victim)  # its engine loop dies at its next step
    replaced_at = None
    while replaced_at is None and time.monotonic() < stop_at + 120:
        if await asyncio.to_thread(replaced, victim):
            replaced_at = time.monotonic()
        await asyncio.sleep(0.5)
    await asyncio.gather(*tasks)
    return placed, victim, death, replaced_at


def run_mode(mode: str, opts: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    from serve_app.serving.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_args(mode)), name=APP, route_prefix="/")
    base_url = f"http://127.0.0.1:{port}"
    records: list[dict] = []
    try:
        before = set(serve_replicas(APP))
        placed, victim, death, replaced_at = asyncio.run(drive(base_url, opts, records))
    finally:
        FAULT_FILE.unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            serve.delete(APP)
        serve.shutdown()
    failed = [r for r in records if r["error"] is not None]
    in_flight = [r for r in records if r["start"] <= death < r["end"]]
    return {
        "mode": mode, "requests": len(records), "ok": len(records) - len(failed), "failed": len(failed),
        "failed_started_after_death": sum(r["start"] > death for r in failed),
        "failed_started_after_first_second": sum(r["start"] > death + 1.0 for r in failed),
        "victim_in_flight_at_death": placed[victim], "in_flight_at_death_all_replicas": len(in_flight),
        "failed_in_flight_at_death": sum(r["start"] <= death for r in failed),
        "error_codes": sorted({r["error"] for r in failed}),
        "failure_start_offsets_s": sorted(round(r["start"] - death, 2) for r in failed),
        "replacement_running_after_s": None if replaced_at is None else round(replaced_at - death, 1),
        "replicas_before": len(before),
        "meets_target": all(r["start"] <= death for r in failed) and len(failed) <= placed[victim],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=["exit", "health-check"], choices=["exit", "health-check"])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--after-s", type=float, default=30.0)
    parser.add_argument("--out", default="reports/engine_death")
    opts = parser.parse_args()

    import ray

    from tests.ray_start import init_local_ray

    load = os.getloadavg()[0]
    init_local_ray(include_dashboard=False, log_to_driver=False, namespace="bench-engine-death")
    try:
        results = [run_mode(mode, opts) for mode in opts.modes]
    finally:
        ray.shutdown()
    command = "make bench-engine-death  # " + " ".join(["loadtest/bench_engine_death.py", *sys.argv[1:]])
    report = {"command": command, "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average_before": round(load, 2),
              "streams": opts.streams, "max_tokens": opts.max_tokens, "warmup_s": opts.warmup_s, "after_s": opts.after_s,
              "results": results}
    out = REPO / opts.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Engine death under steady load", "",
             f"Command: `{command}`; {report['machine']}, load average {report['load_average_before']} before the run. "
             f"{opts.streams} client loops stream {opts.max_tokens}-token completions back to back through Serve's proxy to 2 "
             f"replicas; after {opts.warmup_s:g} s one replica's engine loop is killed; the load goes on for {opts.after_s:g} s.", "",
             "| mode | requests | failed | failed, started after the death | failed, started > 1 s after | victim's in-flight at death | replacement running after | meets target |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['requests']} | {r['failed']} | {r['failed_started_after_death']} | "
                     f"{r['failed_started_after_first_second']} | {r['victim_in_flight_at_death']} | "
                     f"{r['replacement_running_after_s']} s | {'yes' if r['meets_target'] else 'no'} |")
    lines += ["", "Error codes and failure start times (s from the death) per mode:", ""]
    lines += [f"- {r['mode']}: {r['error_codes']}; {r['failure_start_offsets_s']}" for r in results]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
