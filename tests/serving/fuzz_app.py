"""The app the fuzzer and the request-isolation tests share: one LLMServer replica with the test-only
fault hook (requests whose `user` asks for a fault fail there; no other request is touched), the
OpenAPI schema switched on, a short context so that no fuzz case can generate for long."""

from __future__ import annotations

from typing import Any

MAX_MODEL_LEN = 512


def fuzz_app_args() -> dict[str, Any]:
    return {"num_replicas": 1, "max_ongoing_requests": 32, "openapi_docs": True,
            "fault_hook_factory": "tests.serving.faults:make_request_faults",
            "engine": {"max_model_len": MAX_MODEL_LEN, "num_blocks": 256, "max_num_seqs": 16}}


def replica_ids(deployment: str = "LLMServer") -> set[str]:
    from tests.serving.conftest import replica_actors

    return set(replica_actors(deployment))
