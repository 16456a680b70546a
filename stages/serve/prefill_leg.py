"""Leg 1 of a PD request: run the prompt on a prefill worker, return its KV hand-off."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from stages.serve.payloads import prefill_body, prompt_key
from stages.serve.responses import ProxyError, UpstreamClientError
from stages.serve.state import ProxyState


async def run_prefill(
    state: ProxyState, path: str, body: dict[str, Any], chat: bool, headers: dict[str, str]
) -> dict[str, Any] | None:
    """The prefill response's ``kv_transfer_params`` (None if it sent none).

    A worker that refuses connections cannot have started the request, so the next one is
    tried; any other failure is a 502 because the prompt may already hold KV blocks there.
    """
    pool, metrics = state.prefill, state.metrics
    payload = orjson.dumps(prefill_body(body, chat))
    key = prompt_key(body, chat)
    tried: list[int] = []
    for attempt in range(state.config.max_attempts):
        eligible = pool.eligible(exclude=tried)
        if not eligible.any():
            break
        if attempt:
            metrics.retries.labels("prefill").inc()
        worker = state.prefill_router.choose(key, pool.loads(), eligible)
        url = pool.urls[worker]
        lease = pool.acquire(worker)
        try:
            resp = await state.client.post(
                url + path, content=payload, headers=headers, timeout=state.prefill_timeout()
            )
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            pool.mark_unhealthy(worker, f"connect failed: {exc!r}")
            tried.append(worker)
            continue
        except httpx.HTTPError as exc:
            raise ProxyError(
                502, f"prefill worker {url} failed: {exc!r}", "prefill_failed"
            ) from exc
        finally:
            lease.release()
        if resp.status_code >= 500:
            raise ProxyError(
                502,
                f"prefill worker {url} answered {resp.status_code}: {resp.text[:500]}",
                "prefill_failed",
            )
        if resp.status_code >= 400:
            raise UpstreamClientError(
                resp.status_code, resp.content, resp.headers.get("content-type")
            )
        try:
            data = orjson.loads(resp.content)
        except orjson.JSONDecodeError as exc:
            raise ProxyError(
                502, f"prefill worker {url} answered invalid JSON: {exc}", "prefill_failed"
            ) from exc
        kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
        return kv if isinstance(kv, dict) else None
    if not tried:
        raise ProxyError(503, "no healthy prefill worker", "no_prefill_worker")
    raise ProxyError(502, f"no prefill worker reachable (tried {len(tried)})", "prefill_failed")
