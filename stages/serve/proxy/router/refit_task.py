"""The proxy's online-refit loop: snapshot on the event loop, fit in a thread, swap back."""

from __future__ import annotations

import asyncio
import logging
import time

from stages.serve.proxy.ops.metrics import ProxyMetrics
from stages.serve.proxy.router.decode_router import DecodeRouter

log = logging.getLogger(__name__)


async def refit_loop(router: DecodeRouter, metrics: ProxyMetrics, interval_s: float) -> None:
    # Check often; the refitter's own schedule decides when a fit is due.
    tick = min(interval_s, 0.25)
    while True:
        await asyncio.sleep(tick)
        job = router.refit_job(time.monotonic())
        if job is None:
            continue
        try:
            result = await asyncio.to_thread(router.run_refit, job)
        except Exception:
            # Keep serving on the current centroids; the next window gets another chance.
            log.exception("online refit on %d samples failed", job.samples.shape[0])
            router.defer_refit(time.monotonic())
            continue
        if router.apply_refit(job, result, time.monotonic()):
            metrics.refits.inc()
            log.info("online refit on %d samples applied", result.num_samples)
