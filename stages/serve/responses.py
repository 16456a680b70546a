"""Error responses in the OpenAI shape, and the streaming response that always cleans up."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send


class ProxyError(Exception):
    """A request failure with the HTTP status and metric kind it maps to."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


class UpstreamClientError(Exception):
    """A worker rejected the request itself (4xx): the client gets that answer unchanged."""

    def __init__(self, status: int, content: bytes, content_type: str | None) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.content = content
        self.content_type = content_type or "application/json"

    def response(self, headers: dict[str, str]) -> Response:
        return Response(
            self.content, status_code=self.status, media_type=self.content_type, headers=headers
        )


def json_error(
    status: int, message: str, kind: str, headers: dict[str, str] | None = None
) -> Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


def json_response(data: object, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


class RelayResponse(StreamingResponse):
    """A streaming response that runs ``on_close`` however the stream ends.

    Starlette cancels a stream when the client disconnects and never closes the body iterator,
    so without this the in-flight counter and the upstream connection would leak.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        on_close: Callable[[], Awaitable[None]],
        media_type: str,
        headers: dict[str, str],
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self._on_close()
