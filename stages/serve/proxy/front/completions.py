"""``/v1/completions`` and ``/v1/chat/completions``: prefill, route, decode, relay.

A request for one sequence (one prompt, one choice) goes through as it is; one for several is
split into sub-requests of one sequence each (:mod:`.batch_split`), since a KV
hand-off carries one prompt once.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from stages.serve.proxy.front.admission import (
    RETRY_AFTER_S,
    Admission,
    ConnectionsExhausted,
    Shed,
    admit,
)
from stages.serve.proxy.front.answer import Answer, to_response
from stages.serve.proxy.front.answer_ids import for_client
from stages.serve.proxy.front.batch import serve_batch
from stages.serve.proxy.front.batch_split import split
from stages.serve.proxy.front.disconnect import unless_client_leaves
from stages.serve.proxy.front.request_body import (
    JsonBody,
    RequestFields,
    check_request_body,
    read_body,
)
from stages.serve.proxy.front.request_context import RequestContext, request_context
from stages.serve.proxy.front.responses import ProxyError, UpstreamClientError
from stages.serve.proxy.legs.decode import hand_off, run_decode, run_local
from stages.serve.proxy.legs.http1 import PoolExhausted
from stages.serve.proxy.legs.prefill import run_prefill
from stages.serve.proxy.state import ProxyState

log = logging.getLogger(__name__)


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


async def serve_one(ctx: RequestContext) -> Answer:
    if ctx.prompt is not None:  # KV-aware: a decode worker may hold nearly all of it
        answer, ctx = await run_local(ctx)
        if answer is not None:
            return answer
    kv = await run_prefill(ctx)
    return await run_decode(ctx, hand_off(ctx, kv))


async def _handle(request: Request, chat: bool) -> Response:
    state: ProxyState = request.app.state.proxy
    metrics = state.metrics
    # eldr's own id keys the request everywhere (the legs' X-Request-Id, the decode tag, the
    # recorder, the published views): a client's id need not be unique, so it is only echoed.
    request_id = uuid.uuid4().hex
    client_id = request.headers.get("x-request-id") or request_id
    reply_headers = {"X-Request-Id": client_id}
    admission: Admission | None = None
    try:
        admission = admit(state)  # before reading the body: shedding must cost next to nothing
        read = await read_body(request, state.config.max_body_bytes)
        fields = check_request_body(read.body, chat)
        if state.config.model is not None:
            read.body.setdefault("model", state.config.model)
        work = _plan(request, request_id, client_id, read, chat, fields, admission)
        answer = await unless_client_leaves(request.receive, work)
        if answer is None:
            metrics.request_errors.labels("client_disconnect").inc()
            log.info("request %s: client left before the answer was ready",
                 _named(request_id, client_id))
            return Response(status_code=499, headers=reply_headers)
        return to_response(answer, reply_headers)
    except PoolExhausted as exc:
        # Not the workers' failure (the legs let it through unrecorded): the proxy's own 503.
        metrics.connection_pool_exhausted.inc()
        shed = ConnectionsExhausted(str(exc))
        metrics.request_errors.labels(shed.kind).inc()
        log.warning("request %s: %s", _named(request_id, client_id), exc)
        return shed.response({**reply_headers, "Retry-After": str(RETRY_AFTER_S)})
    except Shed as exc:
        metrics.request_errors.labels(exc.kind).inc()
        return exc.response({**reply_headers, "Retry-After": str(RETRY_AFTER_S)})
    except ProxyError as exc:
        metrics.request_errors.labels(exc.kind).inc()
        log.warning("request %s: %s", _named(request_id, client_id), exc.message)
        return exc.response(reply_headers)
    except UpstreamClientError as exc:
        metrics.request_errors.labels("upstream_rejected").inc()
        return exc.response(reply_headers)
    except ClientDisconnect:
        # Gone while sending its body: nobody reads an answer, but the count shows it.
        metrics.request_errors.labels("client_disconnect").inc()
        return Response(status_code=499, headers=reply_headers)
    finally:
        if admission is not None:  # ended before leasing a worker (refused, failed, gone)
            admission.settle()


def _plan(
    request: Request, request_id: str, client_id: str, read: JsonBody, chat: bool,
    fields: RequestFields, admission: Admission,
) -> Callable[[], Awaitable[Answer]]:
    state: ProxyState = request.app.state.proxy
    config = state.config
    # The bytes a split may repeat upstream: a few bodies' worth.
    parts = split(read.body, chat, fields, config.max_fanout, 4 * config.max_body_bytes)
    if parts is None:
        ctx = request_context(
            request, request_id, read.body, chat, read.lax, admission, client_id
        )
        if client_id == request_id:  # the client sent no id: the answer is relayed as it is
            return lambda: serve_one(ctx)
        return lambda: _for_client(serve_one(ctx), request_id, client_id)
    # Each sequence leases a worker of its own: all are let in, or none.
    seats = admission.reserve(len(parts))
    subs = [
        request_context(
            request, f"{request_id}-{k}", part.body, chat, read.lax, seat, client_id
        )
        for k, (part, seat) in enumerate(zip(parts, seats, strict=True))
    ]
    return lambda: serve_batch(subs, parts, client_id)


async def _for_client(answer: Awaitable[Answer], request_id: str, client_id: str) -> Answer:
    return for_client(await answer, request_id, client_id)


def _named(request_id: str, client_id: str) -> str:
    """A request as a log line names it: eldr's id, and the client's where it sent one."""
    return request_id if client_id == request_id else f"{request_id} (client id {client_id!r})"
