"""The errors a request can end with, and the OpenAI shape they answer in.

Every error the proxy itself answers has vLLM's ``ErrorResponse`` shape,
``{"error": {"message", "type", "param", "code"}}`` (``json_error``). Here, below every
subsystem, because the legs raise them and the front and the admin routes answer them
(``front.responses`` turns the router's refusals and unexpected exceptions into the same shape).
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from starlette.responses import Response


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
