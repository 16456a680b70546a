"""A worker (re)joins rotation only once it passed the self-check since it came back.

A supervised worker that restarted, or an attached one that came back, may come back without
eldr's recording hook (another install, a stale compile cache): routing on it would be blind.
The health prober (proxy.ops.health) hands every worker that answers ``/health`` 200 but is
not trusted (out of rotation, or not verified since it was last seen down or restarted) to
``admit``, which runs ``proxy.ops.self_check`` on it (the model name it serves, then the
probe) and puts it in rotation only if it passes. A failure keeps it out, with the reason as
its ``last_error``; the next probe tries again (it may have been warming up). Each check runs
as a task of its own: a slow answer must never hold up the probe round that watches the other
workers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from stages.errors import EldrError
from stages.serve.proxy.client.http1 import Http1Client, Timeouts
from stages.serve.proxy.ops.self_check import (
    check_records_signatures_async,
    read_served_name_async,
)
from stages.serve.proxy.view.workers import WorkerPool
from stages.signature.dataset import ModelIdentity

log = logging.getLogger(__name__)


# Restarts so far of the worker at a URL (eldr serve's supervisor counts them).
RestartCounts = Callable[[str], int]


def no_restarts(url: str) -> int:
    """For workers nobody restarts: attached ones, or a proxy started on its own."""
    return 0


@dataclass
class CheckRecord:
    """One worker's self-checks."""

    verified: bool = False  # passed since it was last seen down
    passed: int = 0
    failed: int = 0
    restarts: int = 0  # its restart count when it last passed: a restart makes it unverified
    failing: bool = False  # in a failure episode (warned once, until it passes)
    task: asyncio.Task[None] | None = None


class SelfChecks:
    def __init__(
        self,
        identity: ModelIdentity,
        model_name: str | None,
        timeout: Timeouts,
        pools: Iterable[WorkerPool],
        restarts: RestartCounts,
        verified_at_start: bool = False,
    ) -> None:
        self.identity = identity
        self._model_name = model_name
        self._timeout = timeout
        self._restarts = restarts
        # eldr serve's start-up check passed for every worker: counted, and trusted until the
        # worker is next seen down.
        self._records = {
            (pool.role, i): CheckRecord(
                verified=verified_at_start, passed=int(verified_at_start), restarts=restarts(url)
            )
            for pool in pools
            for i, url in enumerate(pool.urls)
        }

    def record(self, role: str, index: int) -> CheckRecord:
        return self._records[(role, index)]

    def trusted(self, pool: WorkerPool, index: int) -> bool:
        """In rotation and verified since its last (re)start: nothing to check."""
        rec = self._records[(pool.role, index)]
        return (
            pool.healthy(index)
            and rec.verified
            # A restart the probes missed (it came back between two of them) still counts.
            and rec.restarts == self._restarts(pool.urls[index])
        )

    def admit(self, client: Http1Client, pool: WorkerPool, index: int) -> None:
        """Self-check a worker that answers ``/health`` (unless a check of it runs already);
        it rejoins rotation when the check passes."""
        rec = self._records[(pool.role, index)]
        if rec.task is None or rec.task.done():
            rec.task = asyncio.create_task(
                self._check(client, pool, index), name=f"eldr-self-check-{pool.name(index)}"
            )

    def forget(self, pool: WorkerPool, index: int) -> None:
        """The worker was seen down: whatever comes back at its URL must pass again."""
        rec = self._records[(pool.role, index)]
        rec.verified = False
        if rec.task is not None:
            rec.task.cancel()  # an answer from before it went down proves nothing
            rec.task = None

    async def close(self) -> None:
        tasks = [r.task for r in self._records.values() if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _check(self, client: Http1Client, pool: WorkerPool, index: int) -> None:
        url = pool.urls[index]
        # Read before asking: a restart while the check runs shows as a new count later.
        restarts = self._restarts(url)
        try:
            if self._model_name is not None:
                await self._check_served_name(client, url)
            await check_records_signatures_async(
                client, url, self.identity, self._model_name, self._timeout
            )
        except EldrError as exc:
            self._failed(pool, index, str(exc))
            return
        except Exception as exc:  # any odd answer is a failed check, never a dead task
            log.debug("self-check of %s raised", url, exc_info=True)
            self._failed(pool, index, f"self-check of worker {url} failed: {exc!r}")
            return
        rec = self._records[(pool.role, index)]
        rec.verified, rec.restarts, rec.failing = True, restarts, False
        rec.passed += 1
        pool.mark_healthy(index)

    async def _check_served_name(self, client: Http1Client, url: str) -> None:
        """A worker back under another name would answer every request 404: say so."""
        name = await read_served_name_async(client, url, self._timeout)
        if name != self._model_name:
            raise EldrError(
                f"worker {url} serves the model as {name!r}, the proxy forwards it as"
                f" {self._model_name!r}; restart it with --served-model-name"
                f" {self._model_name}"
            )

    def _failed(self, pool: WorkerPool, index: int, reason: str) -> None:
        rec = self._records[(pool.role, index)]
        rec.verified = False
        rec.failed += 1
        in_rotation = pool.healthy(index)
        pool.mark_unhealthy(index, f"self-check: {reason}")  # warns itself if it was in
        if not rec.failing and not in_rotation:
            # Once per episode: the probes retry every second, the log must not.
            log.warning(
                "%s worker %s stays out of rotation: %s (checked again at each probe)",
                pool.role, pool.urls[index], reason,
            )
        rec.failing = True
