"""In-memory stand-ins for Serve's `RunningReplica` and `PendingRequest`, and a router factory.

`FakeReplica` has what Serve's routing loop and our routers read: `replica_id`, `routing_stats`
(settable, like a controller broadcast), `max_ongoing_requests`, locality fields, and an async
`get_queue_len` (Serve probes it before sending) that reports `queue_len`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from serve_app.types import GenerateRequest, SamplingParams

DEPLOYMENT = DeploymentID(name="LLMServer", app_name="llm")
BLOCK_SIZE = 16


class Clock:
    """A settable wall clock for the router (`get_curr_time_s`)."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeReplica:
    def __init__(self, unique_id: str, *, max_ongoing_requests: int = 64, node_id: str = "node-0") -> None:
        self.replica_id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self.routing_stats: dict[str, Any] = {}
        self.max_ongoing_requests = max_ongoing_requests
        self.node_id = node_id
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.is_cross_language = False
        self.queue_len = 0
        self.num_probes = 0

    @property
    def name(self) -> str:
        return self.replica_id.unique_id

    def publish(self, *, used: int, total: int, waiting: int = 0, running: int = 0, unread: int = 0,
                at: float | None) -> None:
        """What `LLMServer.record_routing_stats` returns, as Serve would hand it to routers (`unread`:
        prompt tokens not yet computed)."""
        stats: dict[str, Any] = {"kv_cache_usage": used / total, "num_free_blocks": total - used, "num_total_blocks": total,
                                 "num_waiting": waiting, "num_running": running, "num_pending_prompt_tokens": unread}
        if at is not None:
            stats["sampled_at"] = at
        self.routing_stats = stats

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.num_probes += 1
        return self.queue_len

    def update_replica_info(self, info: Any) -> None:  # pragma: no cover - not used by these tests
        pass


def make_router(cls: type, clock: Clock, replicas: list[FakeReplica] | None = None, **kwargs: Any):
    """A router as Serve builds one (then `initialize_state(**request_router_kwargs)`). Call inside a
    running event loop: `update_replicas` starts background probes."""
    router = cls(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, get_curr_time_s=clock,
                 use_replica_queue_len_cache=False)
    kwargs.setdefault("metrics", "prometheus")
    router.initialize_state(**kwargs)
    if replicas:
        router.update_replicas(replicas)
    return router


def gen_request(request_id: str, prompt_tokens: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, prompt=list(range(100, 100 + prompt_tokens)),
                           sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def pending(request: Any, internal_id: str | None = None, method: str = "generate") -> PendingRequest:
    """A handle call as Serve queues it for routing (create inside a running event loop)."""
    rid = internal_id or getattr(request, "request_id", "call")
    args = [request] if request is not None else []
    meta = RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method, is_streaming=True)
    return PendingRequest(args=args, kwargs={}, metadata=meta, future=asyncio.get_running_loop().create_future())


async def route(router, replicas: list[FakeReplica], pr: PendingRequest) -> FakeReplica:
    """One decision as Serve makes it when the first choice accepts: choose, then `on_request_routed`."""
    ranks = await router.choose_replicas(replicas, pr)
    chosen = ranks[0][0]
    router.on_request_routed(pr, chosen.replica_id, None)
    return chosen
