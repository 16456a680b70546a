"""Background re-admission: poll ``/health`` of workers taken out of rotation."""

from __future__ import annotations

import asyncio
import logging

import httpx

from stages.serve.workers import WorkerPool

log = logging.getLogger(__name__)


async def probe(client: httpx.AsyncClient, pool: WorkerPool, index: int, timeout: float) -> None:
    url = pool.urls[index]
    try:
        resp = await client.get(url + "/health", timeout=timeout)
    except httpx.HTTPError as exc:
        log.debug("%s worker %s still down: %r", pool.role, url, exc)
        return
    if resp.status_code == 200:
        pool.mark_healthy(index)


async def health_loop(
    client: httpx.AsyncClient, pools: list[WorkerPool], interval_s: float, timeout_s: float
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        # Probes run concurrently so one hanging worker cannot delay another's return.
        await asyncio.gather(
            *(probe(client, pool, i, timeout_s) for pool in pools for i in pool.unhealthy_indices())
        )
