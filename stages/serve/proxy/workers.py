"""A pool of backend workers: in-flight counters and health, owned by one proxy.

Counters change only through a ``Lease`` whose ``release`` is idempotent, so every exit path
(success, upstream error, client disconnect, cancellation) can call it in ``finally`` without
double-decrementing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerView:
    index: int
    url: str
    in_flight: int
    healthy: bool
    last_error: str | None


class WorkerPool:
    def __init__(self, urls: Iterable[str], role: str) -> None:
        self.urls: tuple[str, ...] = tuple(urls)
        self.role = role
        self._inflight = np.zeros(len(self.urls), dtype=np.int64)
        self._healthy = np.ones(len(self.urls), dtype=bool)
        self._last_error: list[str | None] = [None] * len(self.urls)

    def __len__(self) -> int:
        return len(self.urls)

    def name(self, index: int) -> str:
        """Short, stable label for metrics and logs, e.g. ``decode-0``."""
        return f"{self.role}-{index}"

    def loads(self) -> np.ndarray:
        return self._inflight.copy()

    def in_flight(self, index: int) -> int:
        return int(self._inflight[index])

    def healthy(self, index: int) -> bool:
        return bool(self._healthy[index])

    def eligible(self, exclude: Iterable[int] = ()) -> np.ndarray:
        mask = self._healthy.copy()
        for i in exclude:
            mask[i] = False
        return mask

    def acquire(self, index: int, on_release: Callable[[int], None] | None = None) -> Lease:
        self._inflight[index] += 1
        return Lease(self, index, on_release)

    def _release(self, index: int) -> None:
        self._inflight[index] -= 1

    def mark_unhealthy(self, index: int, reason: str) -> None:
        if self._healthy[index]:
            log.warning("%s worker %s marked unhealthy: %s", self.role, self.urls[index], reason)
        self._healthy[index] = False
        self._last_error[index] = reason

    def mark_healthy(self, index: int) -> None:
        if not self._healthy[index]:
            log.info("%s worker %s healthy again", self.role, self.urls[index])
        self._healthy[index] = True

    def unhealthy_indices(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self._healthy)]

    def views(self) -> list[WorkerView]:
        return [
            WorkerView(i, url, int(self._inflight[i]), bool(self._healthy[i]), self._last_error[i])
            for i, url in enumerate(self.urls)
        ]


class Lease:
    """One in-flight request on one worker."""

    __slots__ = ("_on_release", "_pool", "_released", "index")

    def __init__(
        self, pool: WorkerPool, index: int, on_release: Callable[[int], None] | None
    ) -> None:
        self._pool = pool
        self.index = index
        self._on_release = on_release
        self._released = False

    @property
    def url(self) -> str:
        return self._pool.urls[self.index]

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._pool._release(self.index)
        if self._on_release is not None:
            self._on_release(self.index)
