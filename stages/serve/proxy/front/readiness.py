"""Whether the proxy has heard the streams it records and routes by: ``/health``'s "warming".

ZeroMQ SUB sockets are slow joiners: what a worker publishes before this proxy's subscription
has joined is never delivered. A request that finishes on a decode worker then has its decode
counts lost (``eldr serve --record`` waits for its row, and drops it at shutdown), and routing
reads an empty view meanwhile. A stream heard once has joined: what follows arrives, or shows
as a gap in its numbers that a replay fills or counts.

So the proxy is ready once, for every worker in rotation, it heard:

- the worker's published batches (a heartbeat every 0.5 s), when it follows them;
- when the active policy reads KV, the worker's KV events (live, or replayed from what the
  worker buffered before this proxy listened: a replay that answered, even with nothing, is
  heard, since a batch missed after it shows as a gap a replay repairs), unless that view
  already marked it untrusted (routed on load alone, so nothing waits on it).

A stream is waited for at most its silence bound (``batch_stale_after_s``, the KV view's
``silent_after_s``), counted from the app's creation: one attached without eldr's plugin never
publishes batches, and one without a replay socket that filled no KV block since it started
has no KV event to send. Past it the proxy is ready; ``/health`` names the streams never
heard, and a warning the batch streams among them (rows will be lost; a silent KV stream is no
fault).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
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
    # Streams of workers in rotation not heard yet (once ready: never heard within their
    # bound), batches then KV events.
    batches: list[str]
    kv: list[str]

    @property
    def unheard(self) -> list[str]:
        return self.batches + self.kv


class Readiness:
    def __init__(self, config: ProxyConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._batch_bound_s = config.batch_stale_after_s
        self._kv_bound_s = config.kv.silent_after_s if config.kv else DEFAULT_SILENT_AFTER_S
        self._clock = clock
        self._since = clock()

    def check(self, state: ProxyState) -> Verdict:
        waited = self._clock() - self._since
        batches, kv = self._unheard_batches(state), self._unheard_kv(state)
        waiting = (bool(batches) and waited < self._batch_bound_s) or (
            bool(kv) and waited < self._kv_bound_s)
        return Verdict(not waiting, batches, kv)

    @staticmethod
    def _unheard_batches(state: ProxyState) -> list[str]:
        decode, published = state.decode, state.decode.published
        if published is None:
            return []
        endpoints = state.config.decode_batch_endpoints
        return [f"batches of decode worker {decode.urls[w]}"
                for w in np.flatnonzero(decode.eligible())
                if endpoints[w] is not None and published.age_s(w) is None]

    @staticmethod
    def _unheard_kv(state: ProxyState) -> list[str]:
        kv = state.kv
        if kv is None or not state.kv_active:
            return []
        unheard = []
        for pool, view, endpoints in ((state.prefill, kv.prefill, kv.config.prefill_events),
                                      (state.decode, kv.decode, kv.config.decode_events)):
            trusted = view.trusted()
            unheard += [f"KV events of {pool.role} worker {pool.urls[w]}"
                        for w in np.flatnonzero(pool.eligible())
                        if endpoints[w] is not None and view.last_seq[w] is None
                        and not view.replied[w] and trusted[w]]
        return unheard


async def announce_ready(readiness: Readiness, state: ProxyState) -> None:
    """Log once the proxy turns ready: a warning naming the batch streams it never heard."""
    started = time.monotonic()
    while not (verdict := readiness.check(state)).ready:
        await asyncio.sleep(ANNOUNCE_POLL_S)
    if verdict.batches:
        log.warning("ready without hearing %s: a decode worker attached without eldr's plugin"
                    " publishes none (recorded requests it decodes lose their rows; the other"
                    " proxies' requests on it are not counted)", ", ".join(verdict.batches))
    if verdict.kv:
        # Not a fault: a worker that filled no KV block since it started has sent no event
        # (nor has any to replay), and one that never publishes is routed on load alone as
        # soon as it owes events (kv_events).
        log.info("ready without hearing %s yet", ", ".join(verdict.kv))
    if not verdict.unheard:
        log.info("ready: every stream followed was heard (%.1f s)", time.monotonic() - started)
