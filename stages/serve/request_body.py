"""Reading a client's JSON body with a size limit and clear 400/413 errors."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from stages.serve.responses import ProxyError


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProxyError(413, f"request body over the {limit}-byte limit", "too_large")
    chunks: list[bytes] = []
    size = 0
    # Count while reading: a chunked body has no content-length to trust.
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProxyError(413, f"request body over the {limit}-byte limit", "too_large")
        chunks.append(chunk)
    try:
        body = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}", "bad_request") from exc
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", "bad_request")
    return body
