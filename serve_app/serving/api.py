"""The OpenAI-compatible HTTP API: routes, request → `GenerateRequest`s, responses and errors.

`OpenAIAPI` holds the logic and talks to LLMServer through a handle (anything with Ray Serve's
`handle.options(stream=True).generate.remote(request)` / `handle.check_health.remote()` shape);
`build_fastapi_app` wraps it in FastAPI with the API-key and body-size guards. `OpenAIIngress`
(ingress.py) is the Ray Serve deployment around both.

Endpoints: GET /health, GET /v1/models, GET /v1/models/{model}, POST /v1/completions,
POST /v1/chat/completions (streamed or not). A request with `n` > 1 or a batch of prompts fans out
into one engine request per choice, all on the same deadline (`request_timeout_s`); the fan-out is
bounded (`max_prompts_per_request`, n × prompts <= `max_ongoing_requests`) and checked before any
choice is sent. Prompts and outputs are never logged.

With an `input_processor` (the engines' `InputProcessor`, built by the ingress), each prompt is
tokenized (chat template applied) once, here: the engine requests carry `prompt_token_ids`, so the
router hashes exactly the blocks the engine will look up and the replica does not tokenize again.
Bad prompts are rejected here with the engine's 400. Each request's prefix-cache salt
(`serving.cache_salt`) comes from its tenant (`prefix_cache_salt`) and its own `cache_salt`, so
tenants never share (or time) each other's prefixes. `/health` answers from the status the replicas
answers from the engine status of at most one replica call per second (`serving.health_status`), not
from a call per probe. Each generation request is logged with its
tenant (never its key).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from serve_app.backends.base import ModelInfo
from serve_app.serving.api_keys import Keyring
from serve_app.serving.cache_salt import cache_salt
from serve_app.serving.config import ServeConfig
from serve_app.serving.errors import APIError, to_api_error, validation_error
from serve_app.serving.health_status import HealthStatus
from serve_app.serving.middleware import (
    ANONYMOUS,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    ProbeMethodMiddleware,
)
from serve_app.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from serve_app.serving.responses import DONE_EVENT, KEEPALIVE_EVENT, ChoiceState, ResponseBuilder
from serve_app.serving.stream_mux import MuxReceiver
from serve_app.serving.streams import ChoicePump, ChoiceStream, MuxedChoiceStream, start_all
from serve_app.serving.tool_prompt import render_chat
from serve_app.types import GenerateRequest

logger = logging.getLogger("ray.serve")

HEALTH_TIMEOUT_S = 10.0
HEALTH_PERIOD_S = 1.0  # at most one engine check per this long per ingress replica, whatever the probe rate
# engine messages say "prompt: ..." for chat requests too; the client sent "messages"
class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close` (also when the client left before the first
    byte and the body iterator never started), so the replica calls are cancelled."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self._on_close())


class OpenAIAPI:
    def __init__(self, llm_handle, config: ServeConfig, info: ModelInfo, input_processor=None,
                 mux: MuxReceiver | None = None, keyring: Keyring | None = None) -> None:
        self.llm = llm_handle
        self.config = config
        self.info = info
        self.input_processor = input_processor  # serve_app.input_processor.InputProcessor, or None
        # one thread: HF fast tokenizers are not safe to call from several threads at once ("Already borrowed")
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.mux = mux  # this ingress's stream channel with stream multiplexing, else None
        self.keyring = keyring  # the API keys (None: open API)
        self.health_status = HealthStatus(lambda: self.llm.check_health.remote(), HEALTH_PERIOD_S, HEALTH_TIMEOUT_S)

    def _stream(self, request: GenerateRequest, call_suffix: str) -> ChoiceStream:
        retries = self.config.replica_failure_retries
        if self.mux is None:
            return ChoiceStream(self.llm, request, retries, call_suffix)
        return MuxedChoiceStream(self.llm, request, self.mux, retries, call_suffix)

    async def _prepare(self, request: GenerateRequest, salt: str | None) -> GenerateRequest:
        """The request with its token ids (tokenized once, here) and cache salt. Tokenizing and chat
        templating run in a worker thread: a long prompt must not stall the event loop that carries
        every other stream (text that cannot fit is rejected before tokenizing, `InputProcessor`)."""
        ids = None
        if self.input_processor is not None:
            processed = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, self.input_processor.process, request)  # ValueError → 400
            ids = tuple(processed.prompt_token_ids)
        return dataclasses.replace(request, prompt_token_ids=ids, cache_salt=salt)

    def cache_salt(self, tenant: str | None, authorization: str | None, request_salt: str | None = None) -> str | None:
        """The prefix-cache salt of a request from `tenant` (None: the shared cache)."""
        keyring = self.keyring if self.keyring is not None and self.keyring.enabled else None
        return cache_salt(self.config.prefix_cache_salt, tenant if keyring is not None else None,
                          keyring.num_tenants if keyring is not None else 0, authorization, request_salt)

    # ---- GET ------------------------------------------------------------------------------------
    def model_card(self) -> dict:
        return {"id": self.info.name, "object": "model", "created": 0, "owned_by": "serve_app",
                "max_model_len": self.info.max_model_len}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model(self, name: str) -> dict:
        self._check_model(name)
        return self.model_card()

    async def health(self) -> Response:
        exc = await self.health_status.current()
        if exc is not None:
            error = to_api_error(exc, retry_after_s=self.config.retry_after_s)
            return APIError(503, f"unhealthy: {error.message}", code="unhealthy", headers={"Retry-After": str(self.config.retry_after_s)}).response()
        return JSONResponse({"status": "ok", "model": self.info.name})

    # ---- POST -----------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, salt: str | None = None) -> Response:
        self._check_model(body.model)
        body.validate_supported(self.config.max_n)
        prompts = body.prompts()
        self._check_fan_out(len(prompts), body.n)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        requests, prompt_indexes = [], []
        echo = [] if body.echo else None
        for p, prompt in enumerate(prompts):
            first = None
            for j in range(body.n):
                params = body.sampling_params(j, self.info.generation_defaults)
                request = GenerateRequest(f"{request_id}-{p}-{j}", prompt=prompt, sampling_params=params, user=body.user)
                first = await self._prepare(request, salt) if first is None else first
                requests.append(dataclasses.replace(request, prompt_token_ids=first.prompt_token_ids, cache_salt=salt))
                prompt_indexes.append(p)
                if echo is not None:
                    echo.append(self._prompt_text(prompt))
        builder = ResponseBuilder("completion", request_id, self.info.name, body.include_usage, body.continuous_usage)
        return await self._generate(builder, requests, prompt_indexes, body.stream, body.param_aliases(), echo)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        """`echo`: the prompt as text (token ids decoded as the tokenizer writes them)."""
        if isinstance(prompt, str):
            return prompt
        tokenizer = getattr(self.input_processor, "hf_tokenizer", None)
        if tokenizer is None:
            raise ValueError("echo: a prompt of token ids needs the server's tokenizer, which this server does not load")
        return tokenizer.decode(prompt)

    async def chat_completions(self, body: ChatCompletionRequest, salt: str | None = None) -> Response:
        self._check_model(body.model)
        body.validate_supported(self.config.max_n)
        self._check_fan_out(1, body.n)
        tools = body.tool_request()
        messages, template_tools = render_chat(body.engine_messages(), tools, self.info.chat_template_tools)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        params = [body.sampling_params(j, self.info.generation_defaults) for j in range(body.n)]
        if tools is not None:
            params = [tools.sampling_params(p) for p in params]
        first = await self._prepare(GenerateRequest(request_id, messages=messages, tools=template_tools), salt)
        requests = [
            GenerateRequest(f"{request_id}-0-{j}", messages=messages, sampling_params=p, prompt_token_ids=first.prompt_token_ids,
                            cache_salt=salt, user=body.user, tools=template_tools)
            for j, p in enumerate(params)
        ]
        builder = ResponseBuilder("chat", request_id, self.info.name, body.include_usage, body.continuous_usage, tools)
        return await self._generate(builder, requests, [0] * body.n, body.stream, body.param_aliases())

    def _check_fan_out(self, num_prompts: int, n: int) -> None:
        """A request's engine requests must fit what one replica admits, else none is started."""
        if num_prompts > self.config.max_prompts_per_request:
            raise APIError(400, f"prompt: {num_prompts} prompts in one request exceed the limit of "
                           f"{self.config.max_prompts_per_request}; send them as separate requests",
                           param="prompt", code="too_many_prompts")
        limit = self.config.max_ongoing_requests
        if num_prompts * n > limit:
            raise APIError(400, f"n: n × prompts = {n} × {num_prompts} = {num_prompts * n} choices exceed the limit of "
                           f"{limit} per request", param="n", code="too_many_choices")

    def _check_model(self, name: str) -> None:
        if name != self.info.name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.info.name!r}",
                           param="model", code="model_not_found")

    def error(self, exc: BaseException, aliases: dict[str, str] | None = None) -> Response:
        return to_api_error(exc, retry_after_s=self.config.retry_after_s, param_aliases=aliases).response()

    # ---- generation -----------------------------------------------------------------------------
    async def _generate(self, builder: ResponseBuilder, requests: list[GenerateRequest], prompt_indexes: list[int],
                        stream: bool, aliases: dict[str, str], echo: list[str] | None = None) -> Response:
        """`echo`: per request, text the choice starts with (the prompt, for completions' echo)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.request_timeout_s
        fan_out = len(requests) > 1
        streams = [self._stream(r, str(i) if fan_out else "") for i, r in enumerate(requests)]
        async with asyncio.timeout_at(deadline):
            firsts = await start_all(streams)  # errors (400, 503, ...) surface here, before any byte is sent
        if echo is not None:
            firsts = [dataclasses.replace(f, text=e + f.text) for f, e in zip(firsts, echo, strict=True)]
        choices = [builder.new_choice(p) for p in prompt_indexes]
        for choice, first in zip(choices, firsts, strict=True):
            choice.add(first)
        pump = ChoicePump(streams, self.config.max_stream_buffer_tokens if stream else None).start()
        if stream:
            events = self._events(builder, choices, firsts, pump, deadline, aliases)
            return _ClosingStreamingResponse(events, pump.close, media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while (batch := await pump.next_batch(deadline - loop.time())) is not None:
                for index, chunk in batch:
                    choices[index].add(chunk)
        finally:
            await asyncio.shield(pump.close())
        return JSONResponse(builder.full(choices))

    async def _events(self, builder: ResponseBuilder, choices: list[ChoiceState], firsts, pump: ChoicePump,
                      deadline: float, aliases: dict[str, str]) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        keepalive_s = self.config.stream_keepalive_s
        try:
            out = builder.opening_events(len(choices)) + "".join(builder.chunk_event(i, c, choices) for i, c in enumerate(firsts))
            if out:
                yield out
            while True:
                try:  # wait for chunks at most keepalive_s at a time: an SSE comment keeps idle proxies from cutting a queued stream
                    batch = await pump.next_batch(min(keepalive_s, deadline - loop.time()))
                except TimeoutError:
                    if loop.time() >= deadline:
                        raise
                    yield KEEPALIVE_EVENT
                    continue
                if batch is None:
                    break
                parts = []
                for index, chunk in batch:
                    choices[index].add(chunk)
                    parts.append(builder.chunk_event(index, chunk, choices))
                if out := "".join(parts):
                    yield out
            yield builder.usage_event(choices) + DONE_EVENT
        except Exception as exc:  # noqa: BLE001 - the 200 is sent: report the error in the stream
            yield to_api_error(exc, retry_after_s=self.config.retry_after_s, param_aliases=aliases).sse_event() + DONE_EVENT


def build_fastapi_app(api: OpenAIAPI, api_key: str = "", record: Callable[[str, int], None] | None = None) -> FastAPI:
    """The ASGI app: routes + OpenAI error bodies for every failure + API keys + body-size limit; with
    `openapi_docs` also the API's OpenAPI schema (/openapi.json) and its Swagger UI (/docs).

    The keys are `api.keyring`, or else one key `api_key` (tenant `default`); neither: an open API.
    `record(tenant, status)` is called once per response (the API metrics)."""
    docs = api.config.openapi_docs
    app = FastAPI(title="serve_app OpenAI-compatible API", docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code,
                        headers=dict(exc.headers or {})).response()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return await api.health()

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(api.models())

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> Response:
        try:
            return JSONResponse(api.model(name))
        except Exception as exc:  # noqa: BLE001
            return api.error(exc)

    async def generate(handler: Callable[[Any, str | None], Awaitable[Response]], body, request: Request) -> Response:
        """A generation route: `handler(body, cache salt)`, the salt from the caller's tenant; any
        failure an OpenAI error body naming the request's own field names."""
        tenant = getattr(request.state, "tenant", None)
        logger.info("%s request from tenant %s", request.url.path.rsplit("/", 1)[-1], tenant or ANONYMOUS)
        try:
            return await handler(body, api.cache_salt(tenant, request.headers.get("authorization"), body.cache_salt))
        except Exception as exc:  # noqa: BLE001
            return api.error(exc, body.param_aliases())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(api.completions, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(api.chat_completions, body, request)

    if api.keyring is None and api_key:
        api.keyring = Keyring(env_key=api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=api.config.max_request_bytes)
    # added later = runs earlier: probe methods, then the key, then the body
    app.add_middleware(APIKeyMiddleware, keyring=api.keyring, record=record)
    app.add_middleware(ProbeMethodMiddleware)
    enabled = api.keyring is not None and api.keyring.enabled
    logger.info("API routes ready (model %r, API keys %s)", api.info.name,
                f"required ({api.keyring.num_tenants} tenant(s))" if enabled else "not required")
    return app
