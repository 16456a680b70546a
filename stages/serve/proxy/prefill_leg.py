"""Leg 1 of a PD request: run the prompt on a prefill worker, return its KV hand-off."""

from __future__ import annotations

from typing import Any

import orjson

from stages.serve.proxy.request_context import RequestContext
from stages.serve.proxy.responses import ProxyError, UpstreamClientError
from stages.serve.proxy.upstream import NOT_DELIVERED, UPSTREAM_ERRORS


async def run_prefill(ctx: RequestContext) -> dict[str, Any] | None:
    """The prefill response's ``kv_transfer_params`` (None if it sent none).

    A worker that refuses connections cannot have started the request, so the next one is
    tried; any other failure is a 502 because the prompt may already hold KV blocks there.
    """
    state, legs = ctx.state, ctx.legs
    pool, metrics = state.prefill, state.metrics
    tried: list[int] = []
    for attempt in range(state.config.max_attempts):
        eligible = pool.eligible(exclude=tried)
        if not eligible.any():
            break
        if attempt:
            metrics.retries.labels("prefill").inc()
        worker = state.prefill_router.choose(legs.key, pool.loads(), eligible)
        url = pool.urls[worker]
        lease = pool.acquire(worker)
        try:
            async with state.session.post(
                url + ctx.path, data=legs.prefill, headers=ctx.headers,
                timeout=state.prefill_timeout,
            ) as resp:
                status = resp.status
                content = await resp.read()
                content_type = resp.headers.get("Content-Type")
        except NOT_DELIVERED as exc:
            pool.record_failure(worker, f"connect failed: {exc!r}")
            tried.append(worker)
            continue
        except UPSTREAM_ERRORS as exc:
            pool.record_failure(worker, f"request failed: {exc!r}")
            raise ProxyError(
                502, f"prefill worker {url} failed: {exc!r}", "prefill_failed"
            ) from exc
        finally:
            lease.release()
        if status >= 500:
            text = content[:500].decode(errors="replace")
            pool.record_failure(worker, f"answered {status}: {text[:200]}")
            raise ProxyError(
                502, f"prefill worker {url} answered {status}: {text}", "prefill_failed"
            )
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
    raise ProxyError(502, f"no prefill worker reachable (tried {len(tried)})", "prefill_failed")
