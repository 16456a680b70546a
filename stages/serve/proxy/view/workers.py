"""A pool of backend workers: in-flight counters, health and outlier ejection, owned by one
proxy.

Counters change only through a ``Lease`` whose ``release`` is idempotent, so every exit path
(success, upstream error, client disconnect, cancellation) can call it in ``finally`` without
double-decrementing.

Outlier ejection, as Envoy does it: a failed request takes its worker out of rotation until the
health probes bring it back (often a second later). A worker that fails ``after_failures``
requests in a row while answering ``/health`` is ejected instead: it stays out for
``base_s``, doubling with each ejection that follows within ``max_s`` of the last, up to
``max_s``. It then rejoins on probation (after the self-check), where one more failure ejects it
again at once; its first success ends the probation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from stages.serve.proxy.config import Ejection
from stages.serve.proxy.view.published_batches import PublishedBatches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerView:
    index: int
    url: str
    in_flight: int
    healthy: bool
    last_error: str | None
    consecutive_failures: int
    ejections: int
    ejected_for_s: float  # 0 when not ejected
    probation: bool
    draining: bool


class WorkerPool:
    """``published``: the other proxies' requests on these workers, as the workers publish
    them (decode workers of several proxies); routing sees them added to this proxy's own."""

    def __init__(self, urls: Iterable[str], role: str, ejection: Ejection | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 published: PublishedBatches | None = None) -> None:
        self.urls: tuple[str, ...] = tuple(urls)
        self.role = role
        self.published = published
        self.ejection = ejection or Ejection()
        self._clock = clock
        n = len(self.urls)
        self._inflight = np.zeros(n, dtype=np.int64)
        self._healthy = np.ones(n, dtype=bool)
        self._downs = np.zeros(n, dtype=np.int64)  # times taken out of rotation (``downs``)
        self._last_error: list[str | None] = [None] * n
        self._failures = [0] * n  # request failures in a row
        self._ejections = [0] * n  # ever (the metric)
        self._streak = [0] * n  # ejections in a row, each within max_s of the last's end
        self._ejected_until = [-float("inf")] * n
        self._probation = [False] * n
        self._draining = np.zeros(n, dtype=bool)  # out of rotation by an operator (admin API)

    def __len__(self) -> int:
        return len(self.urls)

    def name(self, index: int) -> str:
        """Short, stable label for metrics and logs, e.g. ``decode-0``."""
        return f"{self.role}-{index}"

    def loads(self) -> np.ndarray:
        """Requests on each worker as routing sees them: this proxy's, and the others' where
        the workers publish them."""
        if self.published is None:
            return self._inflight.copy()
        return self._inflight + self.published.others

    def own_loads(self) -> np.ndarray:
        """Requests this proxy has in flight on each worker."""
        return self._inflight.copy()

    def in_flight(self, index: int) -> int:
        """This proxy's requests on the worker."""
        return int(self._inflight[index])

    def healthy(self, index: int) -> bool:
        return bool(self._healthy[index])

    def eligible(self, exclude: Iterable[int] = ()) -> np.ndarray:
        mask = self._healthy & ~self._draining
        for i in exclude:
            mask[i] = False
        return mask

    def acquire(self, index: int, on_release: Callable[[int], None] | None = None,
                name: str | None = None) -> Lease:
        """``name``: what the worker publishes the request as (its tag), so it is not counted
        again among the others'."""
        self._inflight[index] += 1
        if name is not None and self.published is not None:
            self.published.sent(name)
        return Lease(self, index, on_release, name)

    def _release(self, index: int, name: str | None) -> None:
        self._inflight[index] -= 1
        if name is not None and self.published is not None:
            self.published.ended(name)

    def mark_unhealthy(self, index: int, reason: str) -> None:
        if self._healthy[index]:
            log.warning("%s worker %s marked unhealthy: %s", self.role, self.urls[index], reason)
        self._healthy[index] = False
        self._last_error[index] = reason
        self._downs[index] += 1

    def downs(self, index: int) -> int:
        """How many times it was taken out of rotation: a health probe whose 200 was sent
        before the latest of them is older news than the failure (``ops.health``)."""
        return int(self._downs[index])

    def mark_healthy(self, index: int) -> None:
        """Back in rotation, unless it is ejected: then it waits out its time."""
        if self.ejected(index):
            return
        if not self._healthy[index]:
            log.info("%s worker %s healthy again%s", self.role, self.urls[index],
                     " (on probation)" if self._probation[index] else "")
        self._healthy[index] = True

    def record_failure(self, index: int, reason: str) -> None:
        """A request failed on this worker (nothing of it reached the client, or its stream
        broke): out of rotation now, and ejected after too many in a row."""
        self.mark_unhealthy(index, reason)
        if self.ejected(index):
            return  # requests that were running on it when it was ejected
        self._failures[index] += 1
        if self._probation[index] or self._failures[index] >= self.ejection.after_failures:
            self._eject(index, reason)

    def record_error_answer(self, index: int, reason: str) -> None:
        """The worker answered an error of its own for one request and still answers its
        health probe (vLLM's 500 on a body it mishandles): it stays in rotation, since the next
        request may well be fine, but counts toward its ejection like any failure."""
        if self.ejected(index):
            return
        self._failures[index] += 1
        self._last_error[index] = reason
        if self._probation[index] or self._failures[index] >= self.ejection.after_failures:
            self._eject(index, reason)

    def record_success(self, index: int) -> None:
        self._failures[index] = 0
        if self._probation[index]:
            log.info("%s worker %s passed its probation", self.role, self.urls[index])
        self._probation[index] = False

    def set_draining(self, index: int, draining: bool) -> None:
        """Take the worker out of rotation for new requests (those on it finish), or back."""
        if bool(self._draining[index]) != draining:
            log.info("%s worker %s %s", self.role, self.urls[index],
                     "draining" if draining else "back in rotation after a drain")
        self._draining[index] = draining

    def draining(self, index: int) -> bool:
        return bool(self._draining[index])

    def index_of(self, name: str) -> int | None:
        """The worker called ``name`` (``decode-0``) in this pool, if any."""
        return next((i for i in range(len(self.urls)) if self.name(i) == name), None)

    def ejected(self, index: int) -> bool:
        return self._clock() < self._ejected_until[index]

    def ejections(self, index: int) -> int:
        return self._ejections[index]

    def _eject(self, index: int, reason: str) -> None:
        rule, now = self.ejection, self._clock()
        if now - self._ejected_until[index] > rule.max_s:
            self._streak[index] = 0  # long enough in rotation since the last ejection
        duration = min(rule.base_s * 2 ** self._streak[index], rule.max_s)
        self._streak[index] += 1
        self._ejections[index] += 1
        self._ejected_until[index] = now + duration
        self._probation[index] = True
        failures, self._failures[index] = self._failures[index], 0
        log.warning("%s worker %s ejected for %.0f s after %d failed request(s) in a row: %s",
                    self.role, self.urls[index], duration, failures, reason)

    def views(self) -> list[WorkerView]:
        now = self._clock()
        return [
            WorkerView(i, url, int(self._inflight[i]), bool(self._healthy[i]),
                       self._last_error[i], self._failures[i], self._ejections[i],
                       max(0.0, self._ejected_until[i] - now), self._probation[i],
                       bool(self._draining[i]))
            for i, url in enumerate(self.urls)
        ]


class Lease:
    """One in-flight request on one worker."""

    __slots__ = ("_name", "_on_release", "_pool", "_released", "index")

    def __init__(
        self, pool: WorkerPool, index: int, on_release: Callable[[int], None] | None,
        name: str | None = None,
    ) -> None:
        self._pool = pool
        self.index = index
        self._on_release = on_release
        self._name = name
        self._released = False

    @property
    def url(self) -> str:
        return self._pool.urls[self.index]

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._pool._release(self.index, self._name)
        if self._on_release is not None:
            self._on_release(self.index)
