"""The other proxies' requests on each decode worker, from what the workers publish.

A proxy counts the requests it sent itself (``WorkerPool``). With several proxies in front of
the same workers, each decode worker publishes the set of requests it holds
(``stages.capture.batch_publisher``), every request named by the id its proxy tagged it with.
A request published by a worker that this proxy did not send, or did not send recently, is
another proxy's (or another client's): routing adds those to its own counts. Its own requests
are never counted twice: one it sent is its own whether or not the worker has published it
yet, and one that ended here is still its own for ``forget_after_s``, while publications made
before it ended may still list it.

The others' requests also come with their prefill signatures, each sent once by the worker
(``BatchMessage.signatures``): a ``listener`` (the decode router) hears which of them joined and
left each worker, so eldr-union weighs their experts as it weighs its own. One whose signature
this proxy missed (a message lost, or sent before it subscribed) counts as load only.

A worker that has published no valid message for ``stale_after_s`` (the publisher's heartbeat
is 0.5 s) is taken to hold none of the others' requests: a proxy whose subscription broke routes
on its own counts, as a lone proxy does, rather than on a frozen view. Staleness is judged when
the view is read (``others``, ``published``), from the last valid message: neither a publisher
that keeps sending what this proxy cannot decode (another wire version mid-rollout) nor a
follow task that died can freeze it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from stages.capture.batch_publisher import BatchMessage, FinishedRequest
from stages.serve.proxy.view.batch_replay import GapFiller

log = logging.getLogger(__name__)


class OthersListener(Protocol):
    """Hears of the other proxies' requests whose signatures came, as they join and leave."""

    def peer_joined(self, worker: int, name: str, signature: dict[str, Any]) -> None: ...

    def peer_left(self, worker: int, name: str) -> None: ...


class PublishedBatches:
    def __init__(self, num_workers: int, stale_after_s: float = 2.0,
                 forget_after_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._others = np.zeros(num_workers, dtype=np.int64)
        self._published = np.zeros(num_workers, dtype=np.int64)  # as last published, all proxies
        # Per worker, the others' requests the listener was told of (their experts weighed).
        self.weighed: list[set[str]] = [set() for _ in range(num_workers)]
        self.listener: OthersListener | None = None
        # Messages a jump in a worker's seq showed missed, and of them those not replayed.
        self.missed = np.zeros(num_workers, dtype=np.int64)
        self.lost = np.zeros(num_workers, dtype=np.int64)
        self._heard = np.full(num_workers, -np.inf)
        self._own: set[str] = set()  # sent by this proxy, not ended
        self._ended: dict[str, float] = {}  # ended here -> when (oldest first)
        self._stale_after_s = stale_after_s
        self._forget_after_s = forget_after_s
        self._clock = clock
        # The earliest moment a worker's view may go stale (inf: none to expire): a read before
        # it costs one clock call.
        self._next_stale = np.inf

    @property
    def others(self) -> np.ndarray:
        """The others' requests on each worker (read by ``WorkerPool.loads``); 0 on a worker
        whose last valid message is older than ``stale_after_s``."""
        self._expire()
        return self._others

    @property
    def published(self) -> np.ndarray:
        """Each worker's requests as last published, all proxies' (0 once stale)."""
        self._expire()
        return self._published

    def sent(self, name: str) -> None:
        self._own.add(name)

    def ended(self, name: str) -> None:
        if name in self._own:
            self._own.discard(name)
            self._ended[name] = self._clock()

    def heard(self, worker: int, requests: frozenset[str],
              signatures: dict[str, dict[str, Any]] | None = None) -> None:
        """Worker ``worker`` published (a valid message) that it holds ``requests``;
        ``signatures`` are those of the requests it lists for the first time."""
        now = self._clock()
        self._forget(now)
        self._heard[worker] = now
        self._next_stale = min(self._next_stale, now + self._stale_after_s)
        self._published[worker] = len(requests)
        own, ended = self._own, self._ended
        if self.listener is None:
            self._others[worker] = sum(1 for r in requests if r not in own and r not in ended)
            return
        others = {r for r in requests if r not in own and r not in ended}
        self._others[worker] = len(others)
        self._tell(worker, others, signatures or {})

    def gap(self, worker: int, missed: int, lost: int) -> None:
        """``missed`` messages of worker ``worker`` did not come; ``lost`` of them were not
        replayed either (the finished requests they carried will not be recorded)."""
        self.missed[worker] += missed
        self.lost[worker] += lost
        if lost:
            log.warning("decode worker %d: %d batch messages lost (not replayed); recorded"
                        " requests they finished are not written", worker, lost)

    def _expire(self) -> None:
        """Count none of the others' requests on a worker silent for ``stale_after_s``."""
        now = self._clock()
        if now < self._next_stale:
            return
        stale = now - self._heard >= self._stale_after_s
        for worker in np.flatnonzero(stale):
            if self._others[worker] or self._published[worker] or self.weighed[worker]:
                self._others[worker] = 0
                self._published[worker] = 0
                self._tell(int(worker), set(), {})
        fresh = self._heard[~stale]
        self._next_stale = float(fresh.min()) + self._stale_after_s if fresh.size else np.inf

    def _tell(self, worker: int, others: set[str], signatures: dict[str, dict[str, Any]]) -> (
        None
    ):
        listener, weighed = self.listener, self.weighed[worker]
        if listener is None:
            return
        for name in weighed - others:
            weighed.discard(name)
            listener.peer_left(worker, name)
        for name, signature in signatures.items():
            if name in others and name not in weighed:
                weighed.add(name)
                listener.peer_joined(worker, name, signature)

    def age_s(self, worker: int) -> float | None:
        """Seconds since ``worker`` last published; None if it never did."""
        heard = self._heard[worker]
        return None if heard == -np.inf else self._clock() - float(heard)

    def _forget(self, now: float) -> None:
        ended = self._ended
        while ended:
            name, when = next(iter(ended.items()))
            if now - when < self._forget_after_s:
                break
            del ended[name]


class BatchGapCounts(Collector):
    """``eldr_router_decode_batch_messages_missed_total`` and ``..._lost_total`` per decode
    worker (named ``names``), read from ``PublishedBatches`` at scrape time."""

    def __init__(self, batches: PublishedBatches, names: list[str]) -> None:
        self._batches, self._names = batches, names

    def collect(self) -> Iterator[CounterMetricFamily]:
        missed = CounterMetricFamily(
            "eldr_router_decode_batch_messages_missed", "Batch messages of a decode worker that"
            " did not come (a jump in its seq); replayed when the worker still held them.",
            labels=["worker"])
        lost = CounterMetricFamily(
            "eldr_router_decode_batch_messages_lost", "Of them, the ones not replayed either:"
            " recorded requests they finished are not written.", labels=["worker"])
        for i, name in enumerate(self._names):
            missed.add_metric([name], float(self._batches.missed[i]))
            lost.add_metric([name], float(self._batches.lost[i]))
        yield missed
        yield lost


OnFinished = Callable[[FinishedRequest], None]


async def follow_batches(endpoints: tuple[str | None, ...], batches: PublishedBatches,
                         stale_after_s: float, on_finished: OnFinished | None = None) -> None:
    """Subscribe to every decode worker's batch and keep ``batches`` up to date (runs until
    cancelled); recorded requests the workers report finished go to ``on_finished``. ZMQ
    reconnects by itself, so a restarted worker is followed again."""
    context = zmq.asyncio.Context()
    try:
        await asyncio.gather(*(
            _follow(context, worker, endpoint, batches, stale_after_s, on_finished)
            for worker, endpoint in enumerate(endpoints) if endpoint is not None
        ))
    finally:
        context.destroy(linger=0)


async def _follow(context: zmq.asyncio.Context, worker: int, endpoint: str,
                  batches: PublishedBatches, stale_after_s: float,
                  on_finished: OnFinished | None) -> None:
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.RCVHWM, 16)
    socket.connect(endpoint)
    gaps = GapFiller(context, endpoint)
    warned = False
    try:
        while True:
            raw = await socket.recv()
            try:
                message = BatchMessage.decode(raw)
            except ValueError as exc:
                if not warned:  # once per worker: a wrong publisher on the port, or a release
                    log.warning("decode worker %d's batch publisher at %s sent %s; ignored"
                                " (its view goes stale %g s after its last valid message)",
                                worker, endpoint, exc, stale_after_s)
                    warned = True
                continue
            missed, lost, replayed = await gaps.missed(message)
            if missed:
                batches.gap(worker, missed, lost)
            batches.heard(worker, message.requests, message.signatures)
            if on_finished is not None:
                for finished in (*(f for m in replayed for f in m.finished), *message.finished):
                    on_finished(finished)
    finally:
        gaps.close()
        socket.close(linger=0)
