"""Pure-ASGI guards in front of the API routes (streaming responses pass through untouched).

- `APIKeyMiddleware`: with a key configured, every HTTP request needs `Authorization: Bearer <key>`
  (constant-time comparison), whatever its path, unknown routes included; otherwise 401 with an
  OpenAI error body and `WWW-Authenticate: Bearer`. Only the health probe (`/health` below the app's
  mount point) stays open. The mount point matters: Ray Serve keeps an application's
  `route_prefix` in `scope["path"]` and states it in `scope["root_path"]`, so `/llm/v1/models` is
  the app's `/v1/models` under `route_prefix: /llm`; anything that is not exactly the probe is
  checked, so a prefix can never open a route.
- `BodySizeLimitMiddleware`: a body larger than `max_bytes` is answered 413 before any route runs:
  at once when `Content-Length` says so, otherwise (chunked uploads) as soon as the received bytes
  pass the limit. The body is buffered (requests are small JSON) and replayed to the app.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.serving.errors import APIError


async def _send_error(send: Send, error: APIError) -> None:
    response = error.response()
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - a Response never reads the request
    return {"type": "http.disconnect"}


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = ("/health",)) -> None:
        if not api_key:
            raise ValueError("api_key: must not be empty when authentication is enabled")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open_paths = frozenset(open_paths)

    def _is_open(self, scope: Scope) -> bool:
        """The request is for an open path of this app, relative to where the app is mounted."""
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return path in self._open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._is_open(scope):
            supplied = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    supplied = value
                    break
            if not hmac.compare_digest(supplied, self._expected):
                message = "missing API key: send 'Authorization: Bearer <key>'" if not supplied else "invalid API key"
                await _send_error(send, APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds the limit of {self.max_bytes} bytes", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_error(send, APIError(400, "invalid Content-Length header", code="invalid_request"))
                    return
                if declared > self.max_bytes:
                    await _send_error(send, self._too_large())
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(send, self._too_large())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the client's disconnect, as servers do

        await self.app(scope, replay, send)
