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

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NamedTuple

from stages.serve.proxy.client.http1 import Response
from stages.serve.proxy.client.upstream import NOT_DELIVERED, UPSTREAM_ERRORS, start_at_connection
from stages.serve.proxy.errors import ProxyError, UpstreamClientError
from stages.serve.proxy.legs.answer import Answer, Stream, Whole
from stages.serve.proxy.legs.context import RequestContext
from stages.serve.proxy.legs.prefill import prefill_request, run_prefill
from stages.serve.proxy.legs.sse import (
    DONE_EVENT,
    IncompleteEvent,
    error_event,
    is_done,
    whole_events,
)
from stages.serve.proxy.router.decode_router import NO_KV, Decision, Features, KVInputs
from stages.serve.proxy.state import ProxyState
from stages.serve.proxy.view.workers import Lease

log = logging.getLogger(__name__)

_STREAM_ERRORS = (*UPSTREAM_ERRORS, IncompleteEvent)


@dataclass(frozen=True)
class Handoff:
    """A prefill's result: where the prompt's KV blocks are, and what routing reads from it."""

    kv: dict[str, Any] | None  # kv_transfer_params as the prefill sent them; None: no hand-off
    features: Features
    feature_seconds: float  # time spent reading the signature (part of the routing decision)


def hand_off(ctx: RequestContext, kv: dict[str, Any] | None) -> Handoff:
    t0 = perf_counter()
    features = ctx.state.router.features(kv)
    feature_seconds = perf_counter() - t0
    if features.missing:
        ctx.state.metrics.missing_signature.inc()
    return Handoff(kv, features, feature_seconds)


class Local(NamedTuple):
    """What ``run_local`` came to."""

    answer: Answer | None  # the worker's answer; None: the PD path takes the request
    ctx: RequestContext  # the request as the PD path takes it
    # What the decode workers held of the prompt as matched for the local choice, for the
    # arrival choice to reuse; None: not matched, or a worker was sent the request since.
    kv: KVInputs | None = None


async def run_local(ctx: RequestContext) -> Local:
    """Conditional disaggregation: where the policy sends the request at arrival to a decode
    worker that holds nearly all of its prompt, that worker prefills it itself (no prefill
    worker, no hand-off: the request goes to it as it came). No answer when it does not, or
    when that worker failed before anything reached the client: the PD path takes the
    request then, under a request id of its own if the worker had it."""
    state = ctx.state
    if not state.router.policy.prefills_locally:
        return Local(None, ctx)
    pool = state.decode
    kv = kv_inputs(ctx)
    eligible = pool.eligible()
    prefill = prefill_request(ctx, state.prefill.eligible())
    if kv.cached_tokens is None or prefill is None or not eligible.any():
        return Local(None, ctx, kv)
    decision = state.router.choose_local(pool.loads(), eligible, kv, prefill)
    if decision is None:
        return Local(None, ctx, kv)
    worker = decision.worker
    assert ctx.prompt is not None and state.kv is not None  # kv_inputs found both
    # It computes and stores what it lacks.
    state.kv.decode.sent(worker, ctx.prompt.hashes, ctx.prompt.unhashed)
    state.metrics.local_prefills.inc()
    state.metrics.decisions.labels(state.router.policy_name, pool.name(worker)).inc()
    tag = ctx.request_id if pool.published is not None else None
    lease = pool.acquire(worker, decision.on_complete, tag)
    outcome = await _attempt(ctx, lease, ctx.legs.decode_payload(None, tag))
    if not isinstance(outcome, Failure):
        pool.record_success(worker)
        return Local(outcome, ctx)
    log.warning("request %s: decode worker %s failed a local prefill (%.1f s in): %s; taking"
                " the PD path", ctx.request_id, lease.url, ctx.elapsed(), outcome.reason)
    pool.record_failure(worker, outcome.reason)
    if outcome.delivered:
        ctx = ctx.with_request_id(f"{ctx.request_id}-pd")
    # The worker was sent the prompt (its view now owes events): the next choice matches anew.
    return Local(None, ctx)


def choose_at_arrival(ctx: RequestContext, kv: KVInputs | None = None) -> Decision | None:
    """``decode_choice = "arrival"``: the decode worker chosen before the prefill, on the
    prompt's signature at arrival, what each worker holds of it (``kv``, where ``run_local``
    matched it already) and its load; the policy weighs the request on it from now on. None:
    the policy chooses after the prefill (its default), or the prompt is not known as tokens."""
    state, prompt = ctx.state, ctx.prompt
    router = state.router
    if not router.policy.decodes_at_arrival or prompt is None:
        return None
    eligible = state.decode.eligible()
    if not eligible.any():
        return None
    t0 = perf_counter()
    experts = state.block_experts.index if state.block_experts is not None else None
    features = router.arrival_features(prompt.ids, prompt.hashes, prompt.block_size, experts)
    if features.missing:
        state.metrics.missing_signature.inc()
    decision = router.choose(features, state.decode.loads(), eligible,
                             kv if kv is not None else kv_inputs(ctx))
    state.metrics.decision_seconds.observe(perf_counter() - t0)
    return decision


def kv_inputs(ctx: RequestContext) -> KVInputs:
    """What the decode workers hold of the prompt, for KV-aware policies."""
    prompt, kv = ctx.prompt, ctx.state.kv
    if prompt is None or kv is None:
        return NO_KV
    body = ctx.legs.body
    wanted = body.get("max_tokens", body.get("max_completion_tokens"))
    return KVInputs(prompt.tokens, kv.decode.cached_tokens(prompt.reusable),
                    wanted if isinstance(wanted, int) and wanted > 0 else 0)


@dataclass(frozen=True)
class Failure:
    reason: str
    delivered: bool  # the worker got the request, so the KV hand-off may be spent


async def run_decode(ctx: RequestContext, handoff: Handoff,
                     chosen: Decision | None = None) -> Answer:
    """Decode on the policy's worker (``chosen`` at arrival, else chosen now), retrying
    elsewhere until something reached the client."""
    state = ctx.state
    pool, router, metrics = state.decode, state.router, state.metrics
    # The name the request goes by on a decode worker that publishes its batch (None: no
    # worker does): each hand-off's request id, as a retry's is its own.
    tag = ctx.request_id if pool.published is not None else None
    recorder = state.recorder
    record = recorder is not None and tag is not None and recorder.begin(
        tag, handoff.kv, ctx.legs.key, ctx.arrived)
    payload = ctx.legs.decode_payload(handoff.kv, tag, record)
    tried: list[int] = []
    failures: list[str] = []
    refreshes = 0
    attempts = state.config.max_attempts
    # The first decision made here also paid for the signature transform; later ones reuse it.
    feature_seconds = handoff.feature_seconds
    try:
        for attempt in range(attempts):
            eligible = pool.eligible(exclude=tried)
            if not eligible.any():
                break
            t0 = perf_counter()
            if chosen is not None and eligible[chosen.worker]:
                # What the workers held at arrival, as the choice weighed it: the prompt is
                # matched against their caches once per decision, and the decision was timed
                # where it was made (choose_at_arrival).
                worker, on_complete, kv, on_signature = chosen
                if on_signature is not None:  # the prefill's signature replaces the estimate
                    on_signature(handoff.features)
                decided_here = False
            else:
                if chosen is not None:  # its worker left while the prefill ran
                    chosen.on_complete(chosen.worker)
                kv = kv_inputs(ctx)
                worker, on_complete, _, _ = router.choose(handoff.features, pool.loads(),
                                                          eligible, kv)
                decided_here = True
            chosen = None
            if kv.cached_tokens is not None and state.kv is not None and ctx.prompt is not None:
                # It pulls and stores what it lacks.
                state.kv.decode.sent(worker, ctx.prompt.hashes, ctx.prompt.unhashed)
                metrics.routed_by_kv("decode", kv.prompt_tokens, int(kv.cached_tokens[worker]))
            if decided_here:  # each decision is timed once, where it is made
                metrics.decision_seconds.observe(perf_counter() - t0 + feature_seconds)
                feature_seconds = 0.0
            metrics.decisions.labels(router.policy_name, pool.name(worker)).inc()
            if attempt:
                metrics.retries.labels("decode").inc()
            lease = pool.acquire(worker, on_complete, tag)
            outcome = await _attempt(ctx, lease, payload)
            if not isinstance(outcome, Failure):
                pool.record_success(worker)
                if record:
                    recorder.answered(tag)
                return outcome
            log.warning(
                "request %s: decode worker %s failed before streaming (%.1f s in): %s",
                ctx.request_id, lease.url, ctx.elapsed(), outcome.reason,
            )
            pool.record_failure(worker, outcome.reason)
            tried.append(worker)
            failures.append(f"{lease.url}: {outcome.reason}")
            if (outcome.delivered and attempt + 1 < attempts
                    and pool.eligible(exclude=tried).any()):
                # A request id of its own: the first hand-off may still be registered on the
                # prefill worker under the original id, and NIXL tracks hand-offs by request id.
                refreshes += 1
                retry = ctx.with_request_id(f"{ctx.request_id}-retry{refreshes}")
                if tag is not None:
                    if record:
                        recorder.renamed(tag, retry.request_id)
                    tag = retry.request_id
                payload = ctx.legs.decode_payload(await run_prefill(retry), tag, record)
    except BaseException:
        # A 4xx from the worker, the client gone (a cancel), a retry whose prefill
        # failed: no worker will report this request finished, so no entry waits.
        if record:
            recorder.dropped(tag)
        raise
    if record:
        recorder.dropped(tag)
    if not tried:
        raise ProxyError(503, "no healthy decode worker", "no_decode_worker")
    raise ProxyError(
        502, "decode failed on every worker tried: " + "; ".join(failures), "decode_failed"
    )


async def _attempt(ctx: RequestContext, lease: Lease, payload: bytes) -> Answer | Failure:
    """The worker's answer, or why this worker failed (then nothing was sent to the client)."""
    state = ctx.state
    upstream: Response | None = None
    events: AsyncIterator[bytes] | None = None
    handed_off = False
    # A stream's first event must come in time (a worker that took the connection and hangs
    # fails over); a whole answer comes only when the decode is done, under decode_timeout_s.
    # The time runs from when the proxy holds a connection: waiting for one of its own is no
    # worker's doing (that wait has its own limit, http1.PoolExhausted).
    # asyncio's own timeout: an anyio cancel scope costs several times more per request.
    limit = state.config.first_token_timeout_s
    deadline = asyncio.timeout(None)
    on_connection = start_at_connection(deadline, limit) if ctx.stream else None
    try:
        try:
            async with deadline:
                upstream = await state.leg_client.post(
                    lease.url, ctx.path, payload, ctx.headers, state.decode_limits, on_connection
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
                if not ctx.stream:
                    return Whole(await upstream.read(), upstream.status, content_type)
                events = whole_events(upstream.iter_chunks())
                first = await anext(events)
        except StopAsyncIteration:
            return Failure("stream ended before its first event", delivered=True)
        except NOT_DELIVERED as exc:
            return Failure(f"request failed: {exc!r}", delivered=False)
        except _STREAM_ERRORS as exc:
            if deadline.expired():
                return Failure(f"no first token within {limit:g} s", delivered=True)
            return Failure(f"request failed: {exc!r}", delivered=True)
        if first.startswith(b'data: {"error"'):
            # vLLM reports a failed KV load this way once the stream has started; nothing of
            # it reached the client yet, so it is still a clean retry.
            reason = first[:500].decode(errors="replace").strip()
            return Failure(f"stream opened with an error: {reason}", delivered=True)
        handed_off = True
        relay = _relay(first, events, _on_broken(state, lease), lease)
        return Stream(relay, _closer(upstream, events, lease, relay), content_type)
    finally:
        if not handed_off:
            # Not shielded: closing never waits on the network (the events generator is
            # closed where it stopped, the connection released), so a cancel cannot cut it.
            await _closer(upstream, events, lease)()


def _closer(
    upstream: Response | None,
    events: AsyncIterator[bytes] | None,
    lease: Lease,
    relay: AsyncIterator[bytes] | None = None,
) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        try:
            if relay is not None:
                await relay.aclose()  # type: ignore[attr-defined]
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
            state.decode.record_failure(lease.index, f"stream broke: {cause!r}")

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
