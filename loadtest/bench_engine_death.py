"""An engine dies under steady load (docs/failure-handling.md): 2 replicas, `--streams` client loops through Serve's
proxy; after `--warmup-s` one replica's engine loop is killed (tests/serving/faults.py), the load goes on `--after-s`.
Target: only the dead replica's requests in flight fail; `exit` (shipped: the replica exits) vs `health-check` mode.

    .venv/bin/python -m loadtest.bench_engine_death     # make bench-engine-death → reports/engine_death.{json,md}
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest import report, server
from loadtest.client import Completions, Stream
from loadtest.report import table
from tests.serving.faults import FAULT_FILE_ENV

APP = "bench-engine-death"


def replaced(victim: str) -> bool:
    """Serve runs 2 replicas again, the victim not among them."""
    from ray import serve

    names, status = set(server.serve_replicas(APP)), serve.status().applications[APP].deployments["LLMServer"]
    return victim not in names and len(names) == 2 and status.replica_states.get("RUNNING", 0) == 2


async def drive(client: Completions, opts: argparse.Namespace, fault_file: Path, records: list[Stream]) -> tuple[int, float, float | None]:
    """The load, the death after the warm-up and the wait for the replacement; (the victim's requests in flight, death, replaced)."""
    async def client_loop(index: int) -> None:  # completions back to back
        while time.perf_counter() < stop_at:
            records.append(await client.stream(f"Story number {index}: once upon a time", opts.max_tokens))
            if records[-1].error is not None:
                await asyncio.sleep(0.05)

    stop_at = time.perf_counter() + opts.warmup_s + opts.after_s
    tasks = [asyncio.create_task(client_loop(i)) for i in range(opts.streams)]
    await asyncio.sleep(opts.warmup_s)
    placed = {rid: s["num_running"] + s["num_waiting"] for rid, s in (await asyncio.to_thread(server.routing_stats, APP)).items()}
    victim, death, replaced_at = max(sorted(placed), key=placed.__getitem__), time.perf_counter(), None
    fault_file.write_text(victim)  # its engine loop dies at its next step
    while replaced_at is None and time.perf_counter() < stop_at + 120:
        replaced_at = time.perf_counter() if await asyncio.to_thread(replaced, victim) else None
        await asyncio.sleep(0.5)
    await asyncio.gather(*tasks)
    return placed[victim], death, replaced_at


def run_mode(mode: str, opts: argparse.Namespace, fault_file: Path) -> dict[str, Any]:
    args = server.config_args(num_replicas=2, health_check_period_s=2.0, stat_logger_factories=["tests.serving.faults:make_fault_logger"],
                              exit_on_engine_death=mode == "exit")
    records: list[Stream] = []
    with server.serve_http() as base_url, server.deployed(args, APP):
        client, loop = Completions(base_url, Path(args["model"]).name), asyncio.new_event_loop()
        try:
            in_flight, death, replaced_at = loop.run_until_complete(drive(client, opts, fault_file, records))
        finally:
            fault_file.unlink(missing_ok=True)
            loop.run_until_complete(client.aclose())
    failed = [r for r in records if r.error is not None]
    return {"mode": mode, "requests": len(records), "ok": len(records) - len(failed), "failed": len(failed),
            "failed_started_after_death": sum(r.start > death for r in failed), "failed_started_after_first_second": sum(r.start > death + 1 for r in failed),
            "victim_in_flight_at_death": in_flight, "in_flight_at_death_all_replicas": sum(r.start <= death < r.end for r in records),
            "error_codes": sorted({r.error for r in failed}), "failure_start_offsets_s": sorted(round(r.start - death, 2) for r in failed),
            "replacement_running_after_s": None if replaced_at is None else round(replaced_at - death, 1),
            "meets_target": all(r.start <= death for r in failed) and len(failed) <= in_flight}


def main() -> None:
    parser = report.Parser(__doc__)
    parser.add_argument("--modes", nargs="+", default=["exit", "health-check"], choices=["exit", "health-check"])
    parser.options(streams=8, max_tokens=32, warmup_s=10.0, after_s=30.0)
    opts, results = parser.parse_args(), report.start("bench_engine_death")
    results.update({k: getattr(opts, k) for k in ("streams", "max_tokens", "warmup_s", "after_s")})
    fault_file = Path(tempfile.mkdtemp(prefix="engine-death-")) / "fault"
    with server.ray_started(APP, {FAULT_FILE_ENV: str(fault_file)}):  # replicas inherit it
        results["results"] = [run_mode(mode, opts, fault_file) for mode in opts.modes]
    paths = report.write(results, opts.out_dir, "engine_death", "Engine death under steady load", [
        f"{opts.streams} client loops stream {opts.max_tokens}-token completions back to back through Serve's proxy to 2 replicas; after "
        f"{opts.warmup_s:g} s one replica's engine loop is killed; the load goes on for {opts.after_s:g} s.", ""] + table(
        ["mode", "requests", "failed", "failed, started after the death", "failed, started > 1 s after", "victim's in-flight at death",
         "replacement running after", "meets target"],
        [[r["mode"], r["requests"], r["failed"], r["failed_started_after_death"], r["failed_started_after_first_second"], r["victim_in_flight_at_death"],
          f"{r['replacement_running_after_s']} s", "yes" if r["meets_target"] else "no"] for r in results["results"]]) + [
        "Error codes and failure start times (s from the death):", "", *(f"- {r['mode']}: {r['error_codes']}; {r['failure_start_offsets_s']}"
                                                                        for r in results["results"])])
    print(paths[1].read_text())


if __name__ == "__main__":
    main()
