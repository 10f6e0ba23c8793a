"""Every failure becomes an `APIError`, answered with a status and an OpenAI-style error body.

| cause                                               | status | type                  | code               |
|-----------------------------------------------------|--------|-----------------------|--------------------|
| malformed JSON, missing/mistyped field, bad value   | 400    | invalid_request_error | invalid_value ...  |
| a parameter this server does not implement          | 400    | invalid_request_error | unsupported_parameter |
| missing or wrong API key                            | 401    | authentication_error  | invalid_api_key    |
| unknown model                                       | 404    | invalid_request_error | model_not_found    |
| unknown route / method                              | 404/405| invalid_request_error | not_found ...      |
| request body over the size limit                    | 413    | invalid_request_error | request_too_large  |
| overload (Serve backpressure)                       | 503    | server_error          | server_overloaded  |
| the replica died / is unreachable                   | 503    | server_error          | replica_unavailable|
| request timeout                                     | 504    | timeout_error         | request_timeout    |
| a slow reader let its stream's buffer overflow      | (stream) | server_error        | stream_buffer_overflow |
| one request failed in the engine (it alone aborted) | 500    | server_error          | request_failed     |
| engine failure, anything unexpected                 | 500    | server_error          | engine_error ...   |

Exceptions raised inside a replica arrive wrapped in Ray's `RayTaskError`; `unwrap` recovers the
original so that a `ValueError("max_tokens: ...")` from the engine is a 400 with `param="max_tokens"`
and no traceback reaches the client. 503s carry `Retry-After`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.responses import Response

from serve_app.backends.base import BackendDeadError
from serve_app.serving.delta_channel import ChannelClosed
from serve_app.serving.openai_protocol import UnsupportedParameterError
from serve_app.types import RequestFailedError

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                   405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error",
                   504: "timeout_error"}
# pydantic adds union-member tags to error locations ("prompt", "str"); they are not parameters
_LOC_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error answer: HTTP status + OpenAI error body (+ headers such as Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers, media_type="application/json")

    def sse_event(self) -> str:
        """The error as a streamed event (once a 200 stream has started, the status cannot change)."""
        return f"data: {json.dumps(self.body())}\n\n"


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's task-error wrappers."""
    seen = 0
    while isinstance(exc, RayTaskError) and seen < 8:
        cause = getattr(exc, "cause", None)
        if cause is None:
            break
        exc, seen = cause, seen + 1
    return exc


def is_replica_failure(exc: BaseException) -> bool:
    """The replica (actor) died or is unreachable: the request may be retried on another one."""
    return isinstance(unwrap(exc), RayActorError | ReplicaUnavailableError)


def is_retriable(exc: BaseException) -> bool:
    """Safe to send again to another replica if nothing was streamed yet: the replica is gone, or its
    engine died (Serve replaces it after its next failed health check)."""
    return is_replica_failure(exc) or isinstance(unwrap(exc), BackendDeadError | ChannelClosed)


def invalid_value(exc: ValueError, param_aliases: dict[str, str] | None = None) -> APIError:
    """A ValueError whose message starts with the field name ("top_p: must be in (0, 1]")."""
    message = str(exc.args[0]) if exc.args else str(exc)
    param = getattr(exc, "param", None)
    if param is None:
        head, sep, _ = message.partition(":")
        param = head.strip() if sep and head and " " not in head.strip() else None
    if param is not None and param_aliases:
        first, dot, rest = param.partition(".")
        param = param_aliases.get(first, first) + dot + rest
    code = "unsupported_parameter" if isinstance(exc, UnsupportedParameterError) else "invalid_value"
    return APIError(400, message, param=param, code=code)


def validation_error(errors: Sequence[dict]) -> APIError:
    """FastAPI's RequestValidationError (malformed JSON, missing or mistyped fields) as a 400."""
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}", code="invalid_json")
    if not loc:
        return APIError(400, "the request body must be a JSON object (Content-Type: application/json)", code="invalid_json")
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and (p in _LOC_TAGS or "[" in p):
            break
        parts.append(str(p))
    param = ".".join(parts) or None
    kind = first.get("type", "")
    code = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}.get(kind, "invalid_type")
    msg = first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        msg = "unrecognized request argument"
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code=code)


def overloaded(retry_after_s: int, message: str = "the server is overloaded; retry later") -> APIError:
    return APIError(503, message, code="server_overloaded", headers={"Retry-After": str(retry_after_s)})


def to_api_error(exc: BaseException, *, retry_after_s: int = 1, param_aliases: dict[str, str] | None = None) -> APIError:
    """Map any exception from the request path to the error the client gets."""
    exc = unwrap(exc)
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return invalid_value(exc, param_aliases)
    if isinstance(exc, BackPressureError):
        return overloaded(retry_after_s)
    if isinstance(exc, ChannelClosed):
        return APIError(503, "the model replica lost its connection to this server; retry", code="replica_unavailable",
                        headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, RayActorError | ReplicaUnavailableError | DeploymentUnavailableError):
        return APIError(503, "the model replica serving this request became unavailable; retry", code="replica_unavailable",
                        headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return APIError(504, "the request did not finish within the server's time limit", code="request_timeout")
    if isinstance(exc, RequestFailedError):  # the detail stays in the replica's log
        return APIError(500, f"this request failed in the engine ({exc.stage or 'unknown stage'}) and was aborted; "
                        "other requests are not affected", code="request_failed")
    if isinstance(exc, BackendDeadError):
        return APIError(500, "the inference engine failed; the replica is being replaced", code="engine_error")
    if isinstance(exc, TaskCancelledError):
        return APIError(503, "the request was cancelled by the server", code="cancelled", headers={"Retry-After": str(retry_after_s)})
    logger.error("unexpected error while serving a request: %s", type(exc).__name__, exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__})", code="internal_error")
