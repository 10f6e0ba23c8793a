"""Pure-ASGI guards in front of the API routes (streaming responses pass through untouched).

- `ProbeMethodMiddleware` (outermost): the open probe (`/health`) answers GET and HEAD only; any
  other method gets 405 at once, before authentication and before a byte of its body is read.
- `APIKeyMiddleware`: with API keys configured (`api_keys.Keyring`), every HTTP request needs
  `Authorization: Bearer <key>` of some tenant, whatever its path, unknown routes included;
  otherwise 401 with an OpenAI error body and `WWW-Authenticate: Bearer`. The tenant's name goes
  into `scope["state"]["tenant"]` (routes read it as `request.state.tenant`); the key itself is
  never stored or logged. Only the probe stays open. The mount point matters: Ray Serve keeps an
  application's `route_prefix` in `scope["path"]` and states it in `scope["root_path"]`, so
  `/llm/v1/models` is the app's `/v1/models` under `route_prefix: /llm`; anything that is not
  exactly the probe is checked, so a prefix can never open a route. Without keys every request's
  tenant is `anonymous`. `record(tenant, status)`, when given, is called once per response (a
  rejected key counts as tenant `unauthenticated`).
- `BodySizeLimitMiddleware`: a body larger than `max_bytes` is answered 413 before any route runs:
  at once when `Content-Length` says so, otherwise (chunked uploads) as soon as the received bytes
  pass the limit. The body is buffered (requests are small JSON) and replayed to the app.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.serving.api_keys import Keyring
from serve_app.serving.errors import APIError

ANONYMOUS = "anonymous"
UNAUTHENTICATED = "unauthenticated"
PROBE_PATHS = ("/health",)
PROBE_METHODS = ("GET", "HEAD")


async def _send_error(send: Send, error: APIError) -> None:
    response = error.response()
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - a Response never reads the request
    return {"type": "http.disconnect"}


def app_path(scope: Scope) -> str:
    """The request's path relative to where the app is mounted (its `route_prefix`)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path


class ProbeMethodMiddleware:
    def __init__(self, app: ASGIApp, probe_paths: tuple[str, ...] = PROBE_PATHS) -> None:
        self.app = app
        self._probe_paths = frozenset(probe_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in PROBE_METHODS and app_path(scope) in self._probe_paths:
            await _send_error(send, APIError(405, f"{scope['method']} {scope['path']}: Method Not Allowed",
                                             code="method_not_allowed", headers={"Allow": ", ".join(PROBE_METHODS)}))
            return
        await self.app(scope, receive, send)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keyring: Keyring | None = None, open_paths: tuple[str, ...] = PROBE_PATHS,
                 record: Callable[[str, int], None] | None = None) -> None:
        self.app = app
        self._keyring = keyring if keyring is not None and keyring.enabled else None
        self._open_paths = frozenset(open_paths)
        self._record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = ANONYMOUS
        if self._keyring is not None and app_path(scope) not in self._open_paths:
            supplied = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    supplied = value
                    break
            found = self._keyring.tenant_for(supplied)
            if found is None:
                message = "missing API key: send 'Authorization: Bearer <key>'" if not supplied else "invalid API key"
                await _send_error(send, APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
                self._count(UNAUTHENTICATED, 401)
                return
            tenant = found
        scope.setdefault("state", {})["tenant"] = tenant
        if self._record is None:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._count(tenant, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)

    def _count(self, tenant: str, status: int) -> None:
        if self._record is not None:
            try:
                self._record(tenant, status)
            except Exception:  # noqa: BLE001 - metrics never fail a request
                pass


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
