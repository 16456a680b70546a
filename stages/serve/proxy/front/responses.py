"""Responses in the OpenAI shape beyond a handler's own errors.

Every error the proxy itself answers has vLLM's ``ErrorResponse`` shape, whatever route or
layer produced it: handlers (``errors.ProxyError``), the router's 404/405 (``http_error``) and
unexpected exceptions (``InternalErrorMiddleware``).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stages.serve.proxy.errors import json_error

log = logging.getLogger(__name__)


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
