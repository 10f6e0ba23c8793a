"""Fault injection through the backend's `stat_loggers` hook (imported inside LLMServer replicas).

`make_fault_logger` (a `stat_logger_factories` entry) returns a stat logger that acts inside the
engine's step once the file named by the environment variable `SERVE_APP_TEST_FAULT_FILE` names the
replica: `<replica id>` makes the step raise (the engine loop dies), `hang:<replica id>` makes the
step block until the file no longer says so (a hung engine, its thread alive). Test-only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

FAULT_FILE_ENV = "SERVE_APP_TEST_FAULT_FILE"
HANG_PREFIX = "hang:"
MAX_HANG_S = 600.0


class EngineKiller:
    def __init__(self, replica_id: str, trigger: Path) -> None:
        self.replica_id = replica_id
        self.trigger = trigger

    def _fault(self) -> str:
        try:
            return self.trigger.read_text().strip()
        except OSError:
            return ""

    def record(self, scheduler_stats, finished) -> None:
        if scheduler_stats is None:
            return
        fault = self._fault()
        if fault == self.replica_id:
            raise RuntimeError(f"injected engine failure in replica {self.replica_id}")
        deadline = time.monotonic() + MAX_HANG_S
        while self._fault() == HANG_PREFIX + self.replica_id and time.monotonic() < deadline:
            time.sleep(0.1)


def make_fault_logger(config) -> EngineKiller:
    from ray import serve

    replica_id = serve.get_replica_context().replica_id.unique_id
    return EngineKiller(replica_id, Path(os.environ[FAULT_FILE_ENV]))
