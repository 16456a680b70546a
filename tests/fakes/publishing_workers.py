"""A fake prefill worker and two fake decode workers that publish their batches as eldr's
connector does, for the proxy tests that read those batches (recording, readiness, ids)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from stages.capture.batch_publisher import BatchPublisher
from tests.conftest import free_port
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker

Workers = tuple[list[FakeBehavior], list[BackgroundServer], list[str]]


def publisher(endpoint: str) -> BatchPublisher:
    """A decode worker's publisher, quick to send and to beat."""
    return BatchPublisher(endpoint, min_interval_s=0.002, heartbeat_s=0.2)


@contextmanager
def publishing_workers(signature: Callable[[dict], np.ndarray],
                       decode_counts: Callable[[dict, int], np.ndarray], publish: bool = True,
                       **decode: Any) -> Iterator[Workers]:
    """Prefill ``p0`` and decode ``d0``, ``d1`` (``decode``: their other behaviour) and the
    decode workers' batch endpoints; ``publish`` False leaves the publishers to the test (a
    worker whose plugin is still starting, or attached without it)."""
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    behaviors = [FakeBehavior("p0", signature=signature)] + [
        FakeBehavior(f"d{i}", decode_counts=decode_counts,
                     publisher=publisher(e) if publish else None, **decode)
        for i, e in enumerate(endpoints)]
    servers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    try:
        yield behaviors, servers, endpoints
    finally:
        for server, behavior in zip(servers, behaviors, strict=True):
            server.stop()
            if behavior.publisher is not None:
                behavior.publisher.close()
