"""The front door: ``/v1/completions`` and ``/v1/chat/completions``, from a client's request to
its answer.

``_handle`` reads top to bottom: admission (a request that would wait behind too many others,
or that comes while the proxy drains, gets 503 at once with ``Retry-After``), the body read and
checked (:mod:`.request`), then the legs (:mod:`stages.serve.proxy.legs`) under a watch that
stops them if the client leaves. A request for one sequence (one prompt, one choice) goes
through as it is; one for several is split into sub-requests of one sequence each
(:mod:`.batch_split`), since a KV hand-off carries one prompt once.

In flight means prefilling or decoding on a worker (the pools' leases): past the decode
workers' batch slots, a request waits in a vLLM scheduler queue, and ``max_queued`` bounds how
many may wait there. A request for several sequences counts as many: each leases a worker.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from stages.serve.proxy.client.http1 import PoolExhausted
from stages.serve.proxy.errors import ProxyError, UpstreamClientError
from stages.serve.proxy.front.batch import serve_batch
from stages.serve.proxy.front.batch_split import split
from stages.serve.proxy.front.request import (
    JsonBody,
    RequestFields,
    check_request_body,
    read_body,
    request_context,
)
from stages.serve.proxy.front.responses import SERVER_SEND
from stages.serve.proxy.legs.answer import Answer, Whole, for_client
from stages.serve.proxy.legs.context import RequestContext
from stages.serve.proxy.legs.decode import choose_at_arrival, hand_off, run_decode, run_local
from stages.serve.proxy.legs.prefill import run_prefill
from stages.serve.proxy.state import ProxyState

T = TypeVar("T")

log = logging.getLogger(__name__)


async def completions(request: Request) -> Response:
    return await _handle(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, chat=True)


async def serve_one(ctx: RequestContext) -> Answer:
    # The request counts through its first lease from here: the legs take one before they
    # first wait, so no other request sees it counted twice, or not at all.
    ctx.admission.settle()
    if ctx.prompt is None:
        chosen = None
    else:  # KV-aware: a decode worker may hold nearly all of it
        answer, ctx, held = await run_local(ctx)
        if answer is not None:
            return answer
        chosen = choose_at_arrival(ctx, held)  # the decode workers' caches matched once
    try:
        kv = await run_prefill(ctx)
    except BaseException:
        if chosen is not None:  # no decode will run: the policy forgets the request
            chosen.on_complete(chosen.worker)
        raise
    return await run_decode(ctx, hand_off(ctx, kv), chosen)


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
    parts = (split(read.body, chat, fields, config.max_fanout, 4 * config.max_body_bytes)
             if fields.sequences > 1 else None)
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


# -- admission ------------------------------------------------------------------------------------

RETRY_AFTER_S = 1


class Shed(ProxyError):
    """A request refused before any work, with a 503 the client may retry (Retry-After)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(503, message, kind)


class Overloaded(Shed):
    def __init__(self, in_flight: int, limit: int, asked: int = 1) -> None:
        asks = f": this request asks for {asked}" if asked > 1 else ""
        super().__init__(f"the cluster is at capacity ({in_flight} in flight, at most"
                         f" {limit}{asks}): retry shortly", "overloaded")


class Draining(Shed):
    def __init__(self) -> None:
        super().__init__("the proxy is stopping: send this request to another one, or retry"
                         " once it is back", "draining")


class ConnectionsExhausted(Shed):
    """Every upstream connection of this proxy was in use until the request gave up waiting:
    the proxy's own limit, reported as its own (no worker is blamed)."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"the proxy has no free connection to its workers ({detail}): retry"
                         " shortly", "proxy_connections_exhausted")


class Admission:
    """A request let in that holds no worker lease yet.

    It counts in ``ProxyState.cluster_load`` from the check until its first lease is taken (or
    it ends without one). Leases are taken only after the body is read, so without it a burst
    arriving together would all pass the check before any of them counted. A request split
    into several sequences takes a place for each (``reserve``): each leases a worker.
    """

    __slots__ = ("_counted", "_seats", "_state")

    def __init__(self, state: ProxyState) -> None:
        self._state = state
        self._counted = True
        self._seats: tuple[Admission, ...] = ()
        state.admitting += 1

    def reserve(self, sequences: int) -> list[Admission]:
        """A place for each of this request's ``sequences`` (its sub-requests, each settled
        by its own first lease), in place of its own; ``Overloaded`` when they would pass the
        admission limit, a 400 when they never could. ``settle`` lets go of them all."""
        state = self._state
        limit = state.config.admission_limit
        if limit is not None and self._counted:
            if sequences > limit:
                raise ProxyError(
                    400, f"this request asks for {sequences} sequences (prompts times n), and"
                    f" this proxy lets at most {limit} in flight at once: send them in smaller"
                    " requests", "bad_request")
            others = state.cluster_load() - 1
            if others + sequences > limit:
                raise Overloaded(others, limit, sequences)
        seats = tuple(Admission(state) for _ in range(sequences))
        self._seats = seats
        self._settle_own()
        return list(seats)

    def settle(self) -> None:
        """The request now counts through its lease, or is over (its sequences too, that took
        no lease yet); idempotent."""
        self._settle_own()
        for seat in self._seats:
            seat.settle()
        self._seats = ()

    def _settle_own(self) -> None:
        if self._counted:
            self._state.admitting -= 1
            self._counted = False


def admit(state: ProxyState) -> Admission:
    """Let a request in, or raise ``Overloaded`` when it would exceed the admission limit,
    ``Draining`` once the proxy is stopping."""
    if state.draining:
        raise Draining()
    limit = state.config.admission_limit
    if limit is not None:
        in_flight = state.cluster_load()
        if in_flight >= limit:
            raise Overloaded(in_flight, limit)
    return Admission(state)


# -- the client's watch and answer ----------------------------------------------------------------



async def unless_client_leaves(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
    """``work()``'s result, or None if the client disconnected first (``work`` is cancelled).

    Call only after the request body was read: the watch consumes ASGI receive messages.

    Plain asyncio, not an anyio task group: this runs once per request, and the task group's
    cancel scopes were a tenth of the proxy's CPU per request. The work stays in this task
    (a task of its own would cost a spawn more); the watch cancels it natively.
    """
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        left = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        # The watch can only run while this task waits inside ``work()``, so its cancel
        # always lands there, never after ``work()`` returned.
        return await work()
    except asyncio.CancelledError:
        # Ours alone (no other cancel pending on this task): the client left.
        if left and task.uncancel() == 0:
            return None
        raise
    finally:
        watcher.cancel()


def to_response(answer: Answer, headers: Mapping[str, str]) -> Response:
    if isinstance(answer, Whole):
        return Response(
            answer.content, answer.status, media_type=answer.content_type, headers=headers
        )
    return RelayResponse(
        answer.events,
        on_close=answer.close,
        media_type=answer.content_type,
        headers=headers,
    )


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
