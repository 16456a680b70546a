"""Active health probes: every worker's ``/health``, healthy or not, every interval.

A worker leaves routing as soon as it is known down, not when a request next fails on it, and
rejoins once it answers again (a restarted worker, an attached one that came back) and, when the
proxy knows the served model, passed the self-check again (proxy.ops.rejoin). Known down
means: nothing accepts the connection (the process is gone), or vLLM answers something other
than 200 (its engine died). A probe that only times out counts as down after a few in a row: a
worker busy decoding on a saturated machine may answer late without being broken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from stages.serve.proxy.client.http1 import Http1Client, Timeouts
from stages.serve.proxy.client.upstream import NOT_DELIVERED, UPSTREAM_ERRORS, fetch
from stages.serve.proxy.ops.rejoin import SelfChecks
from stages.serve.proxy.view.workers import WorkerPool

log = logging.getLogger(__name__)

SLOW_PROBES_BEFORE_DOWN = 2


def _take_out(pool: WorkerPool, index: int, reason: str) -> None:
    # Only a worker in rotation: once out, the reason that took it out (a request's error,
    # often) stays its last_error rather than the probe's restatement every second.
    if pool.healthy(index):
        pool.mark_unhealthy(index, reason)


@dataclass
class Prober:
    client: Http1Client
    timeout: Timeouts
    slow_limit: int = SLOW_PROBES_BEFORE_DOWN
    # None: a worker rejoins at its first 200 (a proxy that does not know the served model).
    checks: SelfChecks | None = None
    # Probes in a row that got no answer in time, per (role, worker index).
    _slow: dict[tuple[str, int], int] = field(default_factory=dict)

    async def probe(self, pool: WorkerPool, index: int) -> None:
        url = pool.urls[index]
        key = (pool.role, index)
        downs = pool.downs(index)
        try:
            status = (await fetch(self.client, "GET", url, "/health", self.timeout)).status
        except NOT_DELIVERED as exc:
            self._slow.pop(key, None)
            self._down(pool, index, f"health probe: no connection ({exc.__class__.__name__})")
            return
        except UPSTREAM_ERRORS as exc:
            self._slow[key] = self._slow.get(key, 0) + 1
            if self._slow[key] >= self.slow_limit:
                self._down(
                    pool, index, f"health probe: {self._slow[key]} probes in a row failed ({exc!r})"
                )
            return
        self._slow.pop(key, None)
        if status != 200:
            self._down(pool, index, f"health probe: /health answered {status}")
        elif pool.ejected(index):
            pass  # it waits out its ejection, however well it answers
        elif pool.downs(index) != downs:
            pass  # a request failed on it while this probe was out: the 200 is older news
        elif self.checks is None:
            pool.mark_healthy(index)
        elif not self.checks.trusted(pool, index):
            self.checks.admit(self.client, pool, index)  # rejoins once it passes

    def _down(self, pool: WorkerPool, index: int, reason: str) -> None:
        _take_out(pool, index, reason)
        if self.checks is not None:
            self.checks.forget(pool, index)

    async def probe_all(self, pools: list[WorkerPool]) -> None:
        # Concurrent, so one hanging worker cannot delay news of another.
        await asyncio.gather(*(self.probe(pool, i) for pool in pools for i in range(len(pool))))


async def health_loop(
    client: Http1Client,
    pools: list[WorkerPool],
    interval_s: float,
    timeout: Timeouts,
    checks: SelfChecks | None = None,
) -> None:
    prober = Prober(client, timeout, checks=checks)
    try:
        while True:
            started = time.monotonic()
            await prober.probe_all(pools)
            # A fixed cadence: a round that waited on a slow worker does not delay the next one.
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
    finally:
        if checks is not None:
            await checks.close()  # no self-check may outlive the client it runs on
