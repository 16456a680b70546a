"""``/v1/completions`` and ``/v1/chat/completions``: prefill, route, decode, relay."""

from __future__ import annotations

import logging
import uuid
from time import perf_counter
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from stages.serve.decode_leg import run_decode
from stages.serve.disconnect import unless_client_leaves
from stages.serve.payloads import prefill_body, prompt_key
from stages.serve.prefill_leg import run_prefill
from stages.serve.request_body import check_request_body, read_json_body
from stages.serve.responses import ProxyError, UpstreamClientError
from stages.serve.state import ProxyState

log = logging.getLogger(__name__)

# Client headers worth carrying to the workers. Not Authorization: the client's key is the
# proxy's to check, and workers get the proxy's own key (upstream.worker_headers).
_FORWARDED = ("traceparent", "tracestate")


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


def _upstream_headers(request: Request, request_id: str) -> dict[str, str]:
    # identity: bytes are relayed as they come, never decompressed and re-compressed.
    headers = {
        "Content-Type": "application/json",
        "Accept-Encoding": "identity",
        "X-Request-Id": request_id,
    }
    for name in _FORWARDED:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    return headers


async def _handle(request: Request, chat: bool) -> Response:
    state: ProxyState = request.app.state.proxy
    metrics = state.metrics
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    reply_headers = {"X-Request-Id": request_id}
    path = request.url.path
    try:
        body = await read_json_body(request, state.config.max_body_bytes)
        check_request_body(body, chat)
        if state.config.model is not None:
            body.setdefault("model", state.config.model)
        headers = _upstream_headers(request, request_id)
        response = await unless_client_leaves(
            request.receive, lambda: _serve(state, path, body, chat, headers, reply_headers)
        )
        if response is None:
            metrics.request_errors.labels("client_disconnect").inc()
            log.info("request %s: client left before the answer was ready", request_id)
            return Response(status_code=499, headers=reply_headers)
        return response
    except ProxyError as exc:
        metrics.request_errors.labels(exc.kind).inc()
        log.warning("request %s: %s", request_id, exc.message)
        return exc.response(reply_headers)
    except UpstreamClientError as exc:
        metrics.request_errors.labels("upstream_rejected").inc()
        return exc.response(reply_headers)
    except ClientDisconnect:
        # Gone while sending its body: nobody reads an answer, but the count shows it.
        metrics.request_errors.labels("client_disconnect").inc()
        return Response(status_code=499, headers=reply_headers)


async def _serve(
    state: ProxyState,
    path: str,
    body: dict[str, Any],
    chat: bool,
    headers: dict[str, str],
    reply_headers: dict[str, str],
) -> Response:
    # Made once: a decode retry runs the same prefill again.
    prefill_payload = orjson.dumps(prefill_body(body, chat))
    key = prompt_key(body, chat)
    kv = await run_prefill(state, path, prefill_payload, key, headers)
    t0 = perf_counter()
    features = state.router.features(kv)
    feature_seconds = perf_counter() - t0
    if features.missing:
        state.metrics.missing_signature.inc()

    refreshes = 0

    async def refresh() -> dict[str, Any] | None:
        # A request id of its own: the first hand-off may still be registered on the prefill
        # worker under the original id, and NIXL tracks hand-offs by request id.
        nonlocal refreshes
        refreshes += 1
        retry_headers = {**headers, "X-Request-Id": f"{headers['X-Request-Id']}-retry{refreshes}"}
        return await run_prefill(state, path, prefill_payload, key, retry_headers)

    return await run_decode(
        state, path, body, kv, refresh, features, feature_seconds, headers, reply_headers
    )
