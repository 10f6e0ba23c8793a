"""Prototype: the LLMServer replica as the HTTP ingress behind Ray Serve's HAProxy (Ray 2.60's
direct-streaming shape, with our API and engine instead of vLLM's). Not the default deployment:
`build_haproxy_app` refuses to build unless HAProxy mode is on (`serving.haproxy_env`), and nothing
else imports this module.

    client → HAProxy ─(POST /internal/route: the request body)→ `PrefixIngressRouter` → our request router
           └───────→ the chosen `IngressLLMServer` replica's own HTTP port → our FastAPI app → its engine

- `IngressLLMServer` is `LLMServer` (same engine, routing stats, drain, health check) that is also a
  Serve ingress: its FastAPI app (`build_fastapi_app`: API keys, body limit, OpenAI errors, SSE) calls
  the replica's own `generate` in-process (`InProcessHandle`). No OpenAIIngress, no Ray streaming hop,
  no delta channel: every token goes engine → SSE in one process.
- `PrefixIngressRouter` answers HAProxy's `/internal/route` contract ({"host", "port", "replica_id"}) by
  asking the LLMServer deployment's request router (`request_router_config`: ours, prefix-aware by
  default) with a `GenerateRequest` made from the body. HAProxy forwards the body only with
  `RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1`; without it (or for a body that does not parse)
  the router gets no request and picks as it does for any request without token ids.
- Exposure: in HAProxy mode Serve binds every ingress replica's port on all interfaces, whatever
  `http_options.host` says, so the API is checked as reachable from the network (fail closed: it
  needs an API key or `allow_unauthenticated`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.metrics.api_metrics import APIMetrics
from serve_app.serving.api import OpenAIAPI, build_fastapi_app
from serve_app.serving.app import llm_server_app, load_serve_config
from serve_app.serving.config import ServeConfig
from serve_app.serving.haproxy_env import HAPROXY
from serve_app.serving.ingress import load_keyring, make_input_processor
from serve_app.serving.llm_server import LLMServer
from serve_app.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from serve_app.types import GenerateRequest

logger = logging.getLogger("ray.serve")

ALL_INTERFACES = "0.0.0.0"  # where Serve binds ingress replicas in HAProxy mode (its get_all_interfaces_ip)


class InProcessCall:
    """One `generate` call on a replica in this process, shaped like a Serve streaming response
    (`__anext__`, `cancel()`): the generator runs in a task of its own, as in a replica, so that
    `cancel()` (client gone) cancels it there and the engine aborts the request, and the drain can
    cut it."""

    def __init__(self, chunks: AsyncIterator[Any]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._run(chunks))

    async def _run(self, chunks: AsyncIterator[Any]) -> None:
        try:
            async for chunk in chunks:
                self._queue.put_nowait(chunk)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(StopAsyncIteration())

    def __aiter__(self) -> InProcessCall:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)  # a later read raises it again
            raise item
        return item

    def cancel(self) -> None:
        self._task.cancel()


class _Method:
    def __init__(self, call) -> None:
        self.remote = call


class InProcessHandle:
    """The handle shape `OpenAIAPI` uses (`options(stream=True).generate.remote(request)`,
    `check_health.remote()`), over an `LLMServer` in this process."""

    def __init__(self, server: Any) -> None:
        self.generate = _Method(lambda request: InProcessCall(server.generate(request)))
        self.check_health = _Method(lambda: asyncio.to_thread(server.check_health))

    def options(self, **_: Any) -> InProcessHandle:
        return self


@serve.ingress()
class IngressLLMServer(LLMServer.func_or_class):
    """An LLMServer replica that also answers the OpenAI API on its own HTTP port."""

    async def __init__(self, config: ServeConfig) -> None:
        keyring = await load_keyring(config, exposed_host=ALL_INTERFACES)  # before the engine loads
        await super().__init__(config)
        processor = make_input_processor(config, self._info)
        self.api = OpenAIAPI(InProcessHandle(self), config, self._info, processor, None, keyring)
        self._api_metrics = APIMetrics.for_ray(self._info.name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_fastapi_app(self.api, record=self._api_metrics.record)


router_app = FastAPI()


@serve.ingress(router_app)
class PrefixIngressRouter:
    """HAProxy's ingress request router for `IngressLLMServer`: picks a replica with the LLMServer
    deployment's own request router, from the `GenerateRequest` the body describes."""

    async def __init__(self, server: DeploymentHandle, config: ServeConfig) -> None:
        self._handle = server
        self._handle._init()  # before any call: a call initializes it with defaults
        info = await server.model_info.remote()  # also: a replica is up before HAProxy routes here
        self._processor = make_input_processor(config, info)
        logger.info("ingress request router ready: replicas of %s picked by %s", server.deployment_id,
                    config.request_router_class or config.router)

    @router_app.post("/internal/route")
    async def route(self, request: Request) -> JSONResponse:
        routable = await asyncio.to_thread(self.routable, await request.body())
        try:
            async with self._handle.choose_replica(*((routable,) if routable else ()), _reserve=False) as selection:
                replica = selection._replica
                if replica.backend_http_endpoint is None:
                    raise RuntimeError(f"replica {selection.replica_id} has no HTTP port")
                host, port = replica.backend_http_endpoint
                return JSONResponse({"host": host, "port": port, "replica_id": replica.replica_id.to_full_id_str()})
        except Exception as exc:  # noqa: BLE001 - any non-200 is a routing failure to HAProxy (its 503)
            logger.warning("ingress router: no replica (%s)", exc)
            return JSONResponse({"detail": str(exc)}, status_code=503)

    def routable(self, body: bytes) -> GenerateRequest | None:
        """The request the router ranks replicas by (its first prompt, tokenized as the replica
        will), or None: no body, or one the replica will reject anyway (it answers the 400)."""
        with contextlib.suppress(Exception):
            data = json.loads(body)
            salt = data.get("cache_salt")  # the tenant's salt needs its key, which the router never sees
            if "messages" in data:
                chat = ChatCompletionRequest.model_validate(data)
                request = GenerateRequest(f"route-{uuid.uuid4().hex}", messages=chat.engine_messages(),
                                          sampling_params=chat.sampling_params(), cache_salt=salt, user=chat.user)
            else:
                completion = CompletionRequest.model_validate(data)
                request = GenerateRequest(f"route-{uuid.uuid4().hex}", prompt=completion.prompts()[0],
                                          sampling_params=completion.sampling_params(), cache_salt=salt,
                                          user=completion.user)
            if self._processor is None:
                return request
            ids = tuple(self._processor.process(request).prompt_token_ids)
            return GenerateRequest(request.request_id, request.prompt, request.messages, request.sampling_params,
                                   prompt_token_ids=ids, cache_salt=salt, user=request.user)
        return None

    @router_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}


def build_haproxy_app(args: dict[str, Any]) -> serve.Application:
    """Serve application builder (`import_path: serve_app.serving.haproxy_ingress:build_haproxy_app`):
    `IngressLLMServer` replicas (the LLMServer options of `serving.app`) as the HTTP ingress, with
    `PrefixIngressRouter` as HAProxy's ingress request router. Needs HAProxy mode in the environment of
    `serve run` (`serving.haproxy_env`); `stream_multiplexing` does not apply (no ingress hop)."""
    if os.environ.get(HAPROXY) != "1":
        raise ValueError(f"build_haproxy_app: the LLMServer replicas are the HTTP ingress only behind HAProxy; "
                         f"start Ray with {HAPROXY}=1 (serve_app.serving.haproxy_env)")
    config = load_serve_config({**args, "stream_multiplexing": False})
    server = llm_server_app(config, serve.deployment(IngressLLMServer, name="LLMServer"))
    router = serve.deployment(PrefixIngressRouter, name="IngressRouter", max_ongoing_requests=1000,
                              ray_actor_options={"num_cpus": 0}).bind(server, config)
    # Serve's only hook for a peer router (`Application._with_ingress_request_router`) is private:
    # Ray Serve LLM's own builder uses it, and it may change in any Ray release
    return server._with_ingress_request_router(router)
