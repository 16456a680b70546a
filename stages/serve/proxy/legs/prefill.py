"""Leg 1 of a PD request: run the prompt on a prefill worker, return its KV hand-off."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from stages.routing.policies import PrefillRequest
from stages.serve.proxy.client.upstream import NOT_DELIVERED, UPSTREAM_ERRORS, fetch
from stages.serve.proxy.errors import ProxyError, UpstreamClientError
from stages.serve.proxy.legs.context import RequestContext
from stages.serve.proxy.state import ProxyState


async def run_prefill(ctx: RequestContext) -> dict[str, Any] | None:
    """The prefill response's ``kv_transfer_params`` (None if it sent none).

    A worker that refuses the connection, times out, breaks the connection or answers 5xx
    leaves rotation (``WorkerPool.record_failure``) and the next one is tried: nothing reached
    the client yet. A hung worker may still hold the prompt's KV blocks until vLLM's hand-off
    timeout frees them; a client error (4xx) is the client's, answered as it is.
    """
    state, legs = ctx.state, ctx.legs
    pool, metrics = state.prefill, state.metrics
    tried: list[int] = []
    failures: list[str] = []
    for attempt in range(state.config.max_attempts):
        eligible = pool.eligible(exclude=tried)
        if not eligible.any():
            break
        if attempt:
            metrics.retries.labels("prefill").inc()
        worker, queued = choose_prefill(ctx, eligible)
        url = pool.urls[worker]
        lease = pool.acquire(worker)
        status, content, content_type, failure = 0, b"", None, None
        try:
            resp = await state.leg_client.post(
                url, ctx.path, legs.prefill, ctx.headers, state.prefill_limits
            )
            try:
                status = resp.status
                content_type = resp.headers.get("Content-Type")
                content = await resp.read()
            finally:
                resp.release()  # read to its end: pooled; cut short (cancelled): closed
        except NOT_DELIVERED as exc:
            failure = f"connect failed: {exc!r}"
        except UPSTREAM_ERRORS as exc:  # a timeout (it took the prompt and hangs) or a reset
            failure = f"request failed: {exc!r}"
        finally:
            lease.release()
            if state.kv is not None:
                state.kv.prefill_queued[worker] -= queued
        if failure is None and status == 500 and await answers_health(state, url):
            # vLLM failed this request, not itself (one fuzzed chat body made it raise): its
            # answer goes to the client as vLLM gives it, and no other worker is tried with it.
            reason = f"answered 500: {content[:500].decode(errors='replace')}"
            pool.record_error_answer(worker, reason)
            raise UpstreamClientError(status, content, content_type)
        if failure is None and status >= 500:
            failure = f"answered {status}: {content[:500].decode(errors='replace')}"
        if failure is not None:  # nothing reached the client yet: the next worker is tried
            failures.append(f"{url}: {failure}")
            pool.record_failure(worker, failure)
            tried.append(worker)
            continue
        if status >= 400:
            raise UpstreamClientError(status, content, content_type)
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise ProxyError(
                502, f"prefill worker {url} answered invalid JSON: {exc}", "prefill_failed"
            ) from exc
        pool.record_success(worker)
        kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
        return kv if isinstance(kv, dict) else None
    if not tried:
        raise ProxyError(503, "no healthy prefill worker", "no_prefill_worker")
    raise ProxyError(502, "prefill failed on every worker tried: " + "; ".join(failures),
                     "prefill_failed")


async def answers_health(state: ProxyState, url: str) -> bool:
    """Whether the worker at ``url`` answers its health probe now (vLLM: 200 while its engine
    runs)."""
    try:
        reply = await fetch(state.control_client, "GET", url, "/health", state.health_timeout)
        return reply.status == 200
    except (*NOT_DELIVERED, *UPSTREAM_ERRORS):
        return False


def prefill_request(ctx: RequestContext, eligible: np.ndarray) -> PrefillRequest | None:
    """What a KV-aware policy sees of the prefill workers for this request (None: its
    prompt's blocks are not known)."""
    state, prompt = ctx.state, ctx.prompt
    if prompt is None or state.kv is None:
        return None
    loads, queued = state.kv.prefill_queue(state.prefill.loads())
    return PrefillRequest(loads=loads, eligible=eligible, prompt_tokens=prompt.tokens,
                          cached_tokens=state.kv.prefill.cached_tokens(prompt.reusable),
                          queued_tokens=queued, compute_groups=state.kv.prefill_groups)


def choose_prefill(ctx: RequestContext, eligible: np.ndarray) -> tuple[int, int]:
    """The prefill worker, and the prompt tokens it is counted to compute (queued on it until
    it answers): the policy's KV-aware choice where it makes one and the prompt's blocks are
    known, else the prefix hash with its bounded-load gate."""
    state, prompt = ctx.state, ctx.prompt
    pool, kv = state.prefill, state.kv
    request = prefill_request(ctx, eligible)
    if request is not None and prompt is not None and kv is not None:
        cached = request.cached_tokens
        worker = state.router.policy.choose_prefill(request)
        if worker is not None:
            lacking = max(prompt.tokens - int(cached[worker]), 0)
            kv.prefill_queued[worker] += lacking
            state.metrics.routed_by_kv("prefill", prompt.tokens, prompt.tokens - lacking)
            kv.prefill.sent(worker, prompt.hashes, prompt.unhashed)
            return worker, lacking
    return state.prefill_router.choose(ctx.legs.key, pool.loads(), eligible), 0
