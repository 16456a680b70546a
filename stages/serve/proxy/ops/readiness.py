"""Whether the proxy has heard the streams it records and routes by: ``/health``'s "warming".

ZeroMQ SUB sockets are slow joiners: what a worker publishes before this proxy's subscription
has joined is never delivered. A request that finishes on a decode worker then has its decode
counts lost (``eldr serve --record`` waits for its row, and drops it at shutdown), and routing
reads an empty view meanwhile. A stream heard once has joined: what follows arrives, or shows
as a gap in its numbers that a replay fills or counts.

So the proxy is ready once, for every worker in rotation, it heard:

- the worker's published batches (a heartbeat every 0.5 s), when it follows them;
- when the active policy reads KV, the worker's KV events (live, or replayed from what the
  worker buffered before this proxy listened), unless that view already marked it untrusted
  (routed on load alone, so nothing waits on it).

A stream is waited for at most its silence bound (``batch_stale_after_s``, the KV view's
``silent_after_s``), counted from the app's creation: one attached without eldr's plugin never
publishes batches, and one that stored no KV block since it started has none to replay. Past
it the proxy is ready, and ``/health`` and a warning name the streams never heard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from stages.serve.proxy.config import DEFAULT_SILENT_AFTER_S, ProxyConfig
from stages.serve.proxy.state import ProxyState

log = logging.getLogger(__name__)

# How often the start-up announcement looks again while the proxy warms up.
ANNOUNCE_POLL_S = 0.1


@dataclass(frozen=True)
class Verdict:
    ready: bool
    # Streams of workers in rotation not heard yet (once ready: never heard within their bound).
    unheard: list[str]


class Readiness:
    def __init__(self, config: ProxyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._batch_bound_s = config.batch_stale_after_s
        self._kv_bound_s = config.kv.silent_after_s if config.kv else DEFAULT_SILENT_AFTER_S
        self._clock = clock
        self._since = clock()

    def check(self, state: ProxyState) -> Verdict:
        waited = self._clock() - self._since
        unheard, waiting = [], False
        for name, bound_s in self._unheard(state):
            unheard.append(name)
            waiting = waiting or waited < bound_s
        return Verdict(not waiting, unheard)

    def _unheard(self, state: ProxyState) -> Iterator[tuple[str, float]]:
        decode, published = state.decode, state.decode.published
        if published is not None:
            for w in np.flatnonzero(decode.eligible()):
                if state.config.decode_batch_endpoints[w] is not None and published.age_s(
                        w) is None:
                    yield f"batches of decode worker {decode.urls[w]}", self._batch_bound_s
        if state.kv is None or not state.kv_active:
            return
        kv = state.kv
        for pool, view, endpoints in ((state.prefill, kv.prefill, kv.config.prefill_events),
                                      (state.decode, kv.decode, kv.config.decode_events)):
            trusted = view.trusted()
            for w in np.flatnonzero(pool.eligible()):
                if endpoints[w] is not None and view.last_seq[w] is None and trusted[w]:
                    yield f"KV events of {pool.role} worker {pool.urls[w]}", self._kv_bound_s


async def announce_ready(readiness: Readiness, state: ProxyState) -> None:
    """Log once the proxy turns ready; a warning naming the streams it never heard."""
    started = time.monotonic()
    while not (verdict := readiness.check(state)).ready:
        await asyncio.sleep(ANNOUNCE_POLL_S)
    if verdict.unheard:
        log.warning(
            "ready without hearing %s: a decode worker attached without eldr's plugin publishes"
            " no batches (recorded requests it decodes lose their rows, the others' requests"
            " on it are not counted), and one that stored no KV block has no events to replay",
            ", ".join(verdict.unheard))
    else:
        log.info("ready: every stream followed was heard (%.1f s)", time.monotonic() - started)
