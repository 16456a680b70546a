"""Error responses in the OpenAI shape, and the streaming response that always cleans up.

Every error the proxy itself answers has vLLM's ``ErrorResponse`` shape,
``{"error": {"message", "type", "param", "code"}}``, whatever route or layer produced it:
handlers (``ProxyError``), the router's 404/405 (``http_error``) and unexpected exceptions
(``InternalErrorMiddleware``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from http import HTTPStatus

import anyio
import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stages.serve.proxy.front.disconnect import unless_client_leaves

log = logging.getLogger(__name__)


class ProxyError(Exception):
    """A request failure with the HTTP status and metric kind it maps to.

    ``param`` names the offending request field, as vLLM's ``ErrorInfo.param`` does.
    """

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param

    def response(self, headers: Mapping[str, str] | None = None) -> Response:
        return json_error(self.status, self.message, self.kind, headers, param=self.param)


class UpstreamClientError(Exception):
    """A worker rejected the request itself (4xx): the client gets that answer unchanged."""

    def __init__(self, status: int, content: bytes, content_type: str | None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.content = content
        self.content_type = content_type or "application/json"

    def response(self, headers: Mapping[str, str]) -> Response:
        return Response(
            self.content, status_code=self.status, media_type=self.content_type, headers=headers
        )


def json_error(
    status: int,
    message: str,
    kind: str,
    headers: Mapping[str, str] | None = None,
    *,
    param: str | None = None,
) -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


def _kind_of(status: int) -> str:
    # The proxy's kinds are snake_case words ("bad_request"); the status phrase gives one.
    return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")


async def http_error(request: Request, exc: HTTPException) -> Response:
    """The router's own refusals (404 unknown route, 405 wrong method) in the error shape.

    vLLM answers these with FastAPI's ``{"detail": ...}``; the proxy keeps one shape for every
    error so a client needs one parser. ``Allow`` (on a 405) is kept.
    """
    return json_error(exc.status_code, exc.detail, _kind_of(exc.status_code), exc.headers)


class InternalErrorMiddleware:
    """Turns an exception no handler expected into a 500 in the error shape, after logging it.

    Starlette's own last resort answers ``text/plain``. The traceback is logged here because
    this middleware ends the exception; once a response has started, nothing can replace it,
    so the exception goes on to the server, which logs it and closes the connection.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:
                raise
            log.exception("unexpected error answering %s %s", scope["method"], scope["path"])
            response = json_error(
                500, "internal error in the proxy (details are in its log)", "internal_error"
            )
            await response(scope, receive, send)


def json_response(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


# Where the app leaves the server's own ``send`` in the scope (``ProxyApp``): a relayed stream
# writes its body there, past the middlewares' wrappers (below).
SERVER_SEND = "eldr.server_send"


class RelayResponse(StreamingResponse):
    """A relayed SSE stream that runs ``on_close`` however it ends, and stops when the client
    leaves.

    Starlette's own ``__call__`` does not fit: it never closes the body iterator when the
    client disconnects (the in-flight count and the upstream connection would leak), watches
    for the disconnect with an anyio task group, and sends every chunk through each
    middleware's ``send`` wrapper. Those wrappers only watch for the response's start, so the
    start goes through them and the body goes to the server's ``send`` directly: at 1,024
    paced streams the wrappers were about a tenth of the proxy's CPU.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        media_type: str,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code,
                 "headers": self.raw_headers}
            )
            await unless_client_leaves(receive, lambda: self._pump(scope.get(SERVER_SEND, send)))
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._on_close()

    async def _pump(self, send: Send) -> None:
        async for block in self.body_iterator:
            await send({"type": "http.response.body", "body": block, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
