"""Background re-admission: poll ``/health`` of workers taken out of rotation."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from stages.serve.upstream import UPSTREAM_ERRORS
from stages.serve.workers import WorkerPool

log = logging.getLogger(__name__)


async def probe(
    session: aiohttp.ClientSession, pool: WorkerPool, index: int, timeout: aiohttp.ClientTimeout
) -> None:
    url = pool.urls[index]
    try:
        async with session.get(url + "/health", timeout=timeout) as resp:
            await resp.read()  # read to the end so the connection can be reused
            status = resp.status
    except UPSTREAM_ERRORS as exc:
        log.debug("%s worker %s still down: %r", pool.role, url, exc)
        return
    if status == 200:
        pool.mark_healthy(index)


async def health_loop(
    session: aiohttp.ClientSession,
    pools: list[WorkerPool],
    interval_s: float,
    timeout: aiohttp.ClientTimeout,
) -> None:
    while True:
        await asyncio.sleep(interval_s)
        # Probes run concurrently so one hanging worker cannot delay another's return.
        await asyncio.gather(
            *(probe(session, pool, i, timeout) for pool in pools for i in pool.unhealthy_indices())
        )
