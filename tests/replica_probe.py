"""Per-replica engine facts for routing tests and the routing benchmarks (loadtest/bench_routing.py,
bench_prefix.py), through the `stat_logger_factories` hook, like tests/serving/faults.py's fault logger.

With `FACTORY` in a ServeConfig's `stat_logger_factories` and `PROBE_DIR_ENV` set where Ray starts (its
workers inherit it), each LLMServer replica keeps `<dir>/<replica id>.json` up to date: {"replica_id",
"node_id", "pid", "request_ids" (engine request ids it ran, in order), "num_finished", "num_preemptions",
"num_steps", "max_kv_cache_usage", "max_num_waiting"}, rewritten atomically when a request finishes or is
preempted, at most every 0.2 s when only new requests appeared (so the last write holds the final state).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

PROBE_DIR_ENV = "SERVE_APP_PROBE_DIR"
FACTORY = "tests.replica_probe:make_probe_logger"
WRITE_INTERVAL_S = 0.2


class ReplicaProbe:
    def __init__(self, path: Path | None, replica_id: str, node_id: str) -> None:
        self.path = path
        self.state: dict[str, Any] = {"replica_id": replica_id, "node_id": node_id, "pid": os.getpid(),
                                      "request_ids": [], "num_finished": 0, "num_preemptions": 0, "num_steps": 0,
                                      "max_kv_cache_usage": 0.0, "max_num_waiting": 0}
        self._seen: set[str] = set()
        self._last_write = 0.0
        self._write()

    def record(self, scheduler_stats, finished) -> None:
        if self.path is None:
            return
        s = self.state
        changed = bool(finished)
        s["num_finished"] += len(finished)
        if scheduler_stats is not None:
            s["num_steps"] += 1
            s["num_preemptions"] += scheduler_stats.num_preempted
            changed |= scheduler_stats.num_preempted > 0
            s["max_kv_cache_usage"] = max(s["max_kv_cache_usage"], scheduler_stats.kv_cache_usage)
            s["max_num_waiting"] = max(s["max_num_waiting"], scheduler_stats.num_waiting)
            for request_id, _, _ in scheduler_stats.batch:
                if request_id not in self._seen:
                    self._seen.add(request_id)
                    s["request_ids"].append(request_id)
                    changed |= time.monotonic() - self._last_write >= WRITE_INTERVAL_S
        if changed:
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)
        self._last_write = time.monotonic()


def make_probe_logger(config) -> ReplicaProbe:
    """`stat_logger_factories` entry (called in the replica with its ServeConfig)."""
    import ray
    from ray import serve

    replica_id = serve.get_replica_context().replica_id.unique_id
    directory = os.environ.get(PROBE_DIR_ENV)
    path = None
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / f"{replica_id}.json"
    return ReplicaProbe(path, replica_id, ray.get_runtime_context().get_node_id())


def read_probes(directory: str | Path) -> dict[str, dict[str, Any]]:
    """Every replica's latest state in `directory`, by replica id."""
    out = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out[state["replica_id"]] = state
    return out


def where(probes: dict[str, dict[str, Any]]) -> dict[str, str]:
    """engine request id → replica id that ran it."""
    return {rid: replica for replica, state in probes.items() for rid in state["request_ids"]}
