"""Leg 2 of a PD request: send the client's request to the chosen decode worker and relay.

Failure rules: until the first byte reaches the client, a failed worker (connect error,
timeout, 5xx, an empty or broken stream, an error as the stream's first event) is marked
unhealthy and the request goes to another eligible worker. After that, the stream ends with an
error event and ``[DONE]`` so the client can tell a truncated answer from a complete one.

A KV hand-off can be used once. A worker that received the request may already have pulled the
prompt's KV blocks, after which the prefill worker frees them; a second decode reading the same
block ids would read whatever reuses them (NIXL reads are one-sided, nothing checks). So a
retry after such a failure runs the prefill again for a fresh hand-off (a prefix-cache hit on
the same prefill worker); only a request that never got through (connect error) keeps its
hand-off, which the next worker then consumes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import aiohttp
import anyio
import orjson
from starlette.responses import Response

from stages.serve.decode_router import Features
from stages.serve.payloads import decode_body
from stages.serve.responses import ProxyError, RelayResponse, UpstreamClientError
from stages.serve.sse import DONE_EVENT, IncompleteEvent, error_event, is_done, whole_events
from stages.serve.state import ProxyState
from stages.serve.upstream import NOT_DELIVERED, UPSTREAM_ERRORS
from stages.serve.workers import Lease

log = logging.getLogger(__name__)

_STREAM_ERRORS = (*UPSTREAM_ERRORS, IncompleteEvent)

KvTransferParams = dict[str, Any] | None
Refresh = Callable[[], Awaitable[KvTransferParams]]


@dataclass(frozen=True)
class Failure:
    reason: str
    delivered: bool  # the worker got the request, so the KV hand-off may be spent


async def run_decode(
    state: ProxyState,
    path: str,
    body: dict[str, Any],
    kv: KvTransferParams,
    refresh: Refresh,
    features: Features,
    feature_seconds: float,
    headers: dict[str, str],
    reply_headers: dict[str, str],
) -> Response:
    """Decode on the policy's worker, retrying elsewhere until something reached the client.

    ``refresh`` re-runs the prefill and returns a fresh hand-off (see the module docstring).
    """
    pool, router, metrics = state.decode, state.router, state.metrics
    stream = bool(body.get("stream", False))
    payload = orjson.dumps(decode_body(body, kv))
    tried: list[int] = []
    failures: list[str] = []
    attempts = state.config.max_attempts
    for attempt in range(attempts):
        eligible = pool.eligible(exclude=tried)
        if not eligible.any():
            break
        t0 = perf_counter()
        worker = router.choose(features.vector, pool.loads(), eligible)
        # The first decision also paid for the signature transform; retries reuse it.
        metrics.decision_seconds.observe(
            perf_counter() - t0 + (feature_seconds if not attempt else 0)
        )
        metrics.decisions.labels(router.policy_name, pool.name(worker)).inc()
        if attempt:
            metrics.retries.labels("decode").inc()
        lease = pool.acquire(worker, router.on_complete)
        outcome = await _attempt(state, lease, path, payload, stream, headers, reply_headers)
        if isinstance(outcome, Response):
            return outcome
        log.warning("decode worker %s failed before streaming: %s", lease.url, outcome.reason)
        pool.mark_unhealthy(worker, outcome.reason)
        tried.append(worker)
        failures.append(f"{lease.url}: {outcome.reason}")
        if outcome.delivered and attempt + 1 < attempts and pool.eligible(exclude=tried).any():
            payload = orjson.dumps(decode_body(body, await refresh()))
    if not tried:
        raise ProxyError(503, "no healthy decode worker", "no_decode_worker")
    raise ProxyError(
        502, "decode failed on every worker tried: " + "; ".join(failures), "decode_failed"
    )


async def _attempt(
    state: ProxyState,
    lease: Lease,
    path: str,
    payload: bytes,
    stream: bool,
    headers: dict[str, str],
    reply_headers: dict[str, str],
) -> Response | Failure:
    """A response for the client, or why this worker failed (then nothing was sent)."""
    upstream: aiohttp.ClientResponse | None = None
    events: AsyncIterator[bytes] | None = None
    handed_off = False
    try:
        try:
            upstream = await state.session.post(
                lease.url + path, data=payload, headers=headers, timeout=state.decode_timeout
            )
            if upstream.status >= 500:
                text = (await upstream.read())[:500].decode(errors="replace")
                return Failure(f"answered {upstream.status}: {text}", delivered=True)
            if upstream.status >= 400:
                raise UpstreamClientError(
                    upstream.status,
                    await upstream.read(),
                    upstream.headers.get("Content-Type"),
                )
            content_type = upstream.headers.get("Content-Type", "application/json")
            if not stream:
                content = await upstream.read()
                return Response(
                    content, upstream.status, media_type=content_type, headers=reply_headers
                )
            events = whole_events(upstream.content.iter_any())
            first = await anext(events)
        except StopAsyncIteration:
            return Failure("stream ended before its first event", delivered=True)
        except NOT_DELIVERED as exc:
            return Failure(f"request failed: {exc!r}", delivered=False)
        except _STREAM_ERRORS as exc:
            return Failure(f"request failed: {exc!r}", delivered=True)
        if first.startswith(b'data: {"error"'):
            # vLLM reports a failed KV load this way once the stream has started; nothing of
            # it reached the client yet, so it is still a clean retry.
            reason = first[:500].decode(errors="replace").strip()
            return Failure(f"stream opened with an error: {reason}", delivered=True)
        on_broken = _on_broken(state, lease)
        handed_off = True
        return RelayResponse(
            _relay(first, events, on_broken, lease),
            on_close=_closer(upstream, events, lease),
            media_type=content_type,
            headers=reply_headers,
        )
    finally:
        if not handed_off:
            with anyio.CancelScope(shield=True):
                await _closer(upstream, events, lease)()


def _closer(
    upstream: aiohttp.ClientResponse | None, events: AsyncIterator[bytes] | None, lease: Lease
) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        try:
            if events is not None:
                await events.aclose()  # type: ignore[attr-defined]
            if upstream is not None:
                # A body read to its end frees the connection for reuse; one cut short closes
                # it, which is how vLLM learns the client left: it aborts the request and frees
                # its KV blocks.
                upstream.release()
        finally:
            lease.release()

    return close


def _on_broken(state: ProxyState, lease: Lease) -> Callable[[BaseException | str], None]:
    def report(cause: BaseException | str) -> None:
        state.metrics.request_errors.labels("decode_stream_broken").inc()
        log.warning("decode stream from %s broke mid-way: %r", lease.url, cause)
        if isinstance(cause, UPSTREAM_ERRORS):
            state.decode.mark_unhealthy(lease.index, f"stream broke: {cause!r}")

    return report


async def _relay(
    first: bytes,
    events: AsyncIterator[bytes],
    on_broken: Callable[[BaseException | str], None],
    lease: Lease,
) -> AsyncIterator[bytes]:
    done = is_done(first)
    yield first
    try:
        async for block in events:
            done = is_done(block)
            yield block
    except _STREAM_ERRORS as exc:
        on_broken(exc)
        lease.release()
        yield error_event(f"decode worker failed mid-stream: {exc!r}") + DONE_EVENT
        return
    # The worker is done once its last event went out; releasing here (before the response's
    # closing frame) means a client that saw the end never sees its request still in flight.
    lease.release()
    if not done:
        on_broken("stream ended without [DONE]")
        yield error_event("decode worker ended the stream without [DONE]") + DONE_EVENT
