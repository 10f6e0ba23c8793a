"""Fault injection through the backend's `stat_loggers` hook (imported inside LLMServer replicas).

`make_fault_logger` (a `stat_logger_factories` entry) returns a stat logger that raises inside the
engine's step, which kills that replica's engine loop, once the file named by the environment
variable `SERVE_APP_TEST_FAULT_FILE` contains the replica's id. Test-only.
"""

from __future__ import annotations

import os
from pathlib import Path

FAULT_FILE_ENV = "SERVE_APP_TEST_FAULT_FILE"


class EngineKiller:
    def __init__(self, replica_id: str, trigger: Path) -> None:
        self.replica_id = replica_id
        self.trigger = trigger

    def record(self, scheduler_stats, finished) -> None:
        if scheduler_stats is None:
            return
        try:
            victim = self.trigger.read_text().strip()
        except OSError:
            return
        if victim == self.replica_id:
            raise RuntimeError(f"injected engine failure in replica {self.replica_id}")


def make_fault_logger(config) -> EngineKiller:
    from ray import serve

    replica_id = serve.get_replica_context().replica_id.unique_id
    return EngineKiller(replica_id, Path(os.environ[FAULT_FILE_ENV]))
