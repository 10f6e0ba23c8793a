"""Fault-injection hook: lets tests make one request's stage fail, to prove the failure stays its own.

The engine and the LLMServer replica call a `FaultHook` (when one is installed, never in production
configs) at each per-request stage: `admit` once when a request arrives, then `check(stage,
request_id)` each time the request passes a stage (once per sampled token for `sample`, once per
delta for `detokenize` and `stream`). A hook raises from `check` to inject a fault there; the code
around it must then abort that request alone (`RequestFailedError` on its stream, KV blocks freed)
and carry on with every other request.
"""

from __future__ import annotations

import enum
from typing import Protocol

from serve_app.types import GenerateRequest


class Stage(enum.StrEnum):
    PREPARE = "prepare"  # the request enters the engine (engine thread)
    SAMPLE = "sample"  # its next token is sampled (model runner)
    DETOKENIZE = "detokenize"  # its new tokens become text (output processor)
    STREAM = "stream"  # a delta is sent towards the client (LLMServer)


class FaultHook(Protocol):
    def admit(self, request: GenerateRequest) -> None:
        """A request arrived (may be called more than once for one request)."""

    def check(self, stage: Stage, request_id: str) -> None:
        """The request passes `stage`; raise to make that stage fail for it."""
