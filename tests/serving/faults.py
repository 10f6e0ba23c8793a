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


# ---- per-request faults (serve_app/faults.py) --------------------------------------------------
# A request whose `user` is "inject-fault:<stage>:<n>" fails at <stage> once it has passed it n times
# (sample / detokenize / stream: n tokens or deltas in, so n > 0 is a fault mid-stream).
FAULT_USER_PREFIX = "inject-fault:"


def fault_user(stage: str, after: int = 0) -> str:
    return f"{FAULT_USER_PREFIX}{stage}:{after}"


class RequestFaults:
    """A `FaultHook` that fails the stages the requests' `user` fields ask for (and nothing else)."""

    def __init__(self) -> None:
        self._plans: dict[str, list] = {}  # request id → [stage, passes allowed, passes so far]

    def admit(self, request) -> None:
        user = request.user or ""
        if user.startswith(FAULT_USER_PREFIX) and request.request_id not in self._plans:
            stage, after = user[len(FAULT_USER_PREFIX):].rsplit(":", 1)
            self._plans[request.request_id] = [stage, int(after), 0]

    def check(self, stage, request_id: str) -> None:
        plan = self._plans.get(request_id)
        if plan is None or plan[0] != str(stage):
            return
        plan[2] += 1
        if plan[2] > plan[1]:
            raise RuntimeError(f"injected {stage} fault")


def make_request_faults(config) -> RequestFaults:
    """`fault_hook_factory` entry for LLMServer replicas."""
    return RequestFaults()
