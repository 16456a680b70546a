"""Each worker's KV cache, as its own vLLM KV events tell, and the task that follows them.

vLLM's ``ZmqEventPublisher`` sends ``(topic, seq, msgpack batch)`` on a PUB socket and keeps its
last batches for replay on a ROUTER socket. Every proxy process subscribes to every worker
itself (no state passes between proxies): it asks for the buffered history when it starts, and
again from the first missing number whenever the sequence jumps. A gap the replay cannot fill
(the buffer moved on), or a publisher that restarted (its numbers start over, its cache is
empty), clears that worker's blocks: knowing less only costs a hit, a block the worker no
longer holds would send requests where their KV is not.

Batches from a worker's stream are applied when the view is next read, or once the event loop
has had ``FLUSH_DELAY_S`` to spare, not as each arrives: a worker publishes a request's blocks
as it answers it (a prefill's blocks with its answer, a decode's with its first token), so a
batch applied on arrival is applied on that request's critical path, between its answer and
the proxy's next step. Every read applies what has come first, so a decision sees all the
batches received before it, as before.

Trust is judged when the view is read. A worker is untrusted (its index counts as holding
nothing, so it is routed on load alone; ``/metrics`` and ``/admin/state`` say so) while a
request that should have made it store blocks was sent there more than ``silent_after_s`` ago
and no valid message came since, or while what it sends cannot be decoded. An idle worker
publishes nothing and stays trusted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from stages.routing.kv.block_experts import ExpertEventsView
from stages.routing.kv.block_index import BlockIndex
from stages.routing.kv.endpoints import replay_endpoint
from stages.routing.kv.event_messages import (
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    decode_batch,
    external_hashes,
)
from stages.serve.proxy.config import DEFAULT_SILENT_AFTER_S
from stages.serve.proxy.view.zmq_inbox import ZmqInbox

log = logging.getLogger(__name__)

END_SEQ = -1  # the replay socket's end-of-replay marker
# vLLM's replay buffer holds 10,000 batches and a subscription queues 1,000: a batch numbered
# further back than that is a restarted publisher's, not a late duplicate.
RESTART_DISTANCE = 20_000
# The most blocks a worker's index holds before it starts over. vLLM evicts as it stores, so a
# worker's events never hold more than its cache (an H200 serving a small model: ~300,000
# blocks of 16 tokens); an index past this bound has missed removals (a publisher that does
# not send them) and would otherwise grow with every prompt the worker ever saw: ~70 MB a
# million blocks, in every proxy process.
MAX_BLOCKS_PER_WORKER = 1 << 21
# How long a received batch may wait for a read of the view before it is applied anyway (when
# the proxy is idle, or reads only the other pool's view).
FLUSH_DELAY_S = 0.005


@dataclass(frozen=True)
class KVEventSource:
    """Where one worker publishes: its PUB endpoint and its replay (ROUTER) endpoint."""

    endpoint: str
    replay: str | None

    @classmethod
    def parse(cls, endpoint: str) -> KVEventSource:
        """A worker's ``--kv-events-config`` endpoint; its replay endpoint follows eldr's
        convention (``replay_endpoint``)."""
        replay = replay_endpoint(endpoint)
        return cls(endpoint.replace("*", "127.0.0.1", 1), replay.replace("*", "127.0.0.1", 1))


class KVView:
    """The KV blocks each worker of one pool holds (HTTP-free; the follower feeds it)."""

    def __init__(self, num_workers: int, silent_after_s: float = DEFAULT_SILENT_AFTER_S,
                 clock: Callable[[], float] = time.monotonic,
                 first_blocks: Callable[[BlockStored], None] | None = None,
                 max_blocks: int = MAX_BLOCKS_PER_WORKER) -> None:
        """``first_blocks``: told every ``BlockStored`` (it reads a sequence's first block's
        token ids, the only ones the proxy reads); ``max_blocks``: a worker's index starts
        over past this many (``MAX_BLOCKS_PER_WORKER``)."""
        self.index = BlockIndex(num_workers)
        self.max_blocks = max_blocks
        self._first_blocks = first_blocks
        self.block_size: int | None = None  # learned from the first stored block
        self.silent_after_s = silent_after_s
        self._clock = clock
        self.last_seq: list[int | None] = [None] * num_workers
        # Since when a worker owes a valid message (a request sent that stores blocks, or an
        # undecodable message); None: it owes none.
        self._owed_since: list[float | None] = [None] * num_workers
        # Batches received from the streams, not applied yet (``receive``), and the number of
        # each worker's last one.
        self._pending: list[tuple[int, int, bytes]] = []
        self._pending_seq: list[int | None] = [None] * num_workers
        # Whose replay socket answered (its buffer, perhaps empty): what the worker stored up
        # to then is known, and anything missed after shows as a gap a replay repairs.
        self.replied = [False] * num_workers
        self._flush_at: asyncio.TimerHandle | None = None
        self.events = np.zeros(num_workers, dtype=np.int64)
        self.gaps = np.zeros(num_workers, dtype=np.int64)  # sequence jumps seen
        self.lost = np.zeros(num_workers, dtype=np.int64)  # of them, not repaired by a replay
        self.undecodable = np.zeros(num_workers, dtype=np.int64)
        self.overflows = np.zeros(num_workers, dtype=np.int64)  # indexes started over

    @property
    def num_workers(self) -> int:
        return self.index.num_workers

    # --- reading ---

    def trusted(self) -> np.ndarray:
        self.flush()
        owed_since = self._owed_since
        if owed_since.count(None) == len(owed_since):
            return np.ones(len(owed_since), dtype=bool)  # the usual case, read per request
        now = self._clock()
        return np.array([owed is None or now - owed < self.silent_after_s
                         for owed in owed_since])

    def cached_tokens(self, hashes: Sequence[int]) -> np.ndarray:
        """int64 [W]: prompt tokens each worker holds as a cached prefix (0 where untrusted)."""
        self.flush()
        if self.block_size is None or not hashes:
            return np.zeros(self.num_workers, dtype=np.int64)
        blocks = self.index.leading_blocks(hashes)
        blocks[~self.trusted()] = 0
        return blocks * self.block_size

    # --- what the proxy did ---

    def sent(self, worker: int, hashes: Sequence[int], unhashed: bool = False) -> None:
        """A prompt whose full blocks are ``hashes`` was sent to ``worker``: if it lacks any,
        it will store them, and owes their events. ``unhashed``: more full blocks follow that
        no worker holds (a prompt matched from its head alone), so it owes events whatever it
        holds of ``hashes``; without it, a worker whose stream died would stay trusted under
        traffic of new prompts, which are all matched so."""
        self.flush()
        if self._owed_since[worker] is None and (
                unhashed or not self.index.holds_all(worker, hashes)):
            self._owed_since[worker] = self._clock()

    # --- what the worker published ---

    def receive(self, worker: int, seq: int, payload: bytes) -> None:
        """One ``(seq, payload)`` from ``worker``'s stream, applied at the next read of the
        view, or ``FLUSH_DELAY_S`` from now (from the event loop's thread)."""
        last = self.latest_seq(worker)
        if last is not None and last - RESTART_DISTANCE < seq <= last and seq != 0:
            return  # a batch already received (the replay and the stream overlap)
        self._pending.append((worker, seq, payload))
        self._pending_seq[worker] = seq
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_DELAY_S, self.flush)

    def latest_seq(self, worker: int) -> int | None:
        """The number of the last batch received from ``worker``, applied or not."""
        pending = self._pending_seq[worker]
        return self.last_seq[worker] if pending is None else pending

    def flush(self) -> None:
        """Applies the batches received and not applied yet, in the order they came."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._pending_seq = [None] * self.num_workers
        for worker, seq, payload in pending:
            self.apply(worker, seq, payload)

    def apply(self, worker: int, seq: int, payload: bytes) -> None:
        """One ``(seq, payload)`` from ``worker``'s stream or its replay."""
        last = self.last_seq[worker]
        if last is not None and seq <= last:
            # Numbers started over (a new engine, an empty cache): a duplicate is never older
            # than what the replay buffer and the subscription's queue hold together.
            if seq != 0 and seq > last - RESTART_DISTANCE:
                return  # a batch already applied (the replay and the stream overlap)
            log.info("KV events of worker %d restarted at %d (was %d)", worker, seq, last)
            self.index.cleared(worker)
        try:
            events = decode_batch(payload).events
        except msgspec.DecodeError as exc:
            self.malformed(worker, repr(exc))
            return
        for event in events:
            self._event(worker, event)
        self.last_seq[worker] = seq
        self.events[worker] += 1
        self._owed_since[worker] = None

    def malformed(self, worker: int, why: str) -> None:
        self.flush()  # what came before it was valid, and must not clear what this owes
        self.undecodable[worker] += 1
        if self._owed_since[worker] is None:
            self._owed_since[worker] = self._clock()
        log.warning("worker %d sent an undecodable KV event message: %s", worker, why)

    def gap(self, worker: int, repaired: bool) -> None:
        self.gaps[worker] += 1
        if not repaired:
            self.lost[worker] += 1
            self.index.cleared(worker)

    def _overflow(self, worker: int) -> None:
        self.overflows[worker] += 1
        self.index.cleared(worker)
        log.warning("worker %d's KV index passed %d blocks: its events miss removals, or its"
                    " cache is larger than the bound; started over (%d times so far)", worker,
                    self.max_blocks, self.overflows[worker])

    def _event(self, worker: int, event: KVEvent) -> None:
        if type(event) is AllBlocksCleared:
            self.index.cleared(worker)
        elif event.group_idx not in (None, 0):
            return  # another KV cache group (a hybrid model's): prefix hits follow group 0
        elif type(event) is BlockStored:
            self.block_size = event.block_size
            self.index.stored(worker, external_hashes(event.block_hashes))
            if self.index.held(worker) > self.max_blocks:
                self._overflow(worker)
            if self._first_blocks is not None:
                self._first_blocks(event)
        else:
            self.index.removed(worker, external_hashes(event.block_hashes))

    def state(self) -> list[dict[str, Any]]:
        trusted = self.trusted()  # applies what was received
        return [
            {"trusted": bool(trusted[w]), "blocks": self.index.held(w),
             "events": int(self.events[w]), "gaps": int(self.gaps[w]),
             "lost": int(self.lost[w]), "undecodable": int(self.undecodable[w]),
             "overflows": int(self.overflows[w])}
            for w in range(self.num_workers)
        ]


async def follow_kv_events(sources: Sequence[KVEventSource | None],
                           view: KVView | ExpertEventsView) -> None:
    """Follow every worker's KV events (or expert events) into ``view`` until cancelled."""
    context = zmq.Context.instance()
    tasks = [asyncio.create_task(_follow(context, w, s, view), name=f"eldr-kv-{w}")
             for w, s in enumerate(sources) if s is not None]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


REPLAY_TIMEOUT_S = 2.0


async def _follow(context: zmq.Context, worker: int, source: KVEventSource,
                  view: KVView | ExpertEventsView) -> None:
    sub = zmq.Socket(context, zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(source.endpoint)
    stream = _Stream(worker, sub, view)
    try:
        # What the worker stored before this proxy listened, as far as its buffer reaches.
        await _replay(context, worker, source, view, 0)
        stream.start()
        while True:
            # The stream's batches go to the view from the loop's reader callback; this task
            # wakes only for a gap, which a replay repairs.
            start = await stream.gap()
            repaired = await _replay(context, worker, source, view, start)
            view.gap(worker, repaired)
            stream.start()
    finally:
        stream.close()


class _Stream:
    """A worker's PUB socket read by the event loop's reader callback: each wake-up hands every
    queued batch to the view, with no task switch a message (a follower gets one a request the
    worker runs). At a sequence gap it stops, holding the batch after the gap, until ``start``
    (after the replay) hands that batch on and reads what queued meanwhile."""

    def __init__(self, worker: int, socket: zmq.Socket, view: KVView | ExpertEventsView) -> None:
        self.worker = worker
        self.view = view
        self._inbox = ZmqInbox(socket, on_readable=self._read)
        self._inbox.pause()  # until the first replay has run
        self._after_gap: tuple[int, bytes] | None = None
        self._gap: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def start(self) -> None:
        """Reads the stream from where it stopped (the batch held at a gap first)."""
        held, self._after_gap = self._after_gap, None
        if held is not None:
            self.view.receive(self.worker, *held)  # a duplicate of the replay's is skipped
        self._gap = asyncio.get_running_loop().create_future()
        self._inbox.resume()
        self._read()  # what queued while paused: the descriptor may not tell of it again

    async def gap(self) -> int:
        """The first batch number the stream skipped; raises what reading it raised."""
        return await self._gap

    def _read(self) -> None:
        try:
            self._take_queued()
        except Exception as exc:  # handed to the follower's task, which dies of it
            self._inbox.pause()
            if not self._gap.done():
                self._gap.set_exception(exc)

    def _take_queued(self) -> None:
        inbox, view, worker = self._inbox, self.view, self.worker
        while inbox.queued():
            frames = inbox.recv()
            if len(frames) != 3 or len(frames[1]) != 8:
                view.malformed(worker, f"{len(frames)} frames")
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            last = view.latest_seq(worker)
            if last is not None and seq > last + 1:
                view.flush()  # what came before the hole, then the replay's batches
                inbox.pause()
                self._after_gap = (seq, frames[2])
                self._gap.set_result(last + 1)
                return
            view.receive(worker, seq, frames[2])

    def close(self) -> None:
        self._inbox.close()


async def _replay(context: zmq.Context, worker: int, source: KVEventSource,
                  view: KVView | ExpertEventsView, start: int) -> bool:
    """Ask ``source`` for every batch from ``start``; whether the replay began there."""
    if source.replay is None:
        return False
    dealer = zmq.Socket(context, zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    # No limit on this side: a ROUTER drops what a full pipe cannot take, and a replay is
    # every batch the worker buffered at once.
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.connect(source.replay)
    inbox = ZmqInbox(dealer)
    first: int | None = None
    previous: int | None = None
    try:
        # A DEALER that connected queues the request until the connection is up.
        dealer.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
        while True:
            if not await inbox.wait(REPLAY_TIMEOUT_S):
                log.warning("worker %d: no KV event replay from %s", worker, source.replay)
                return False
            frames = inbox.recv()
            if len(frames) != 4 or len(frames[2]) != 8:
                view.malformed(worker, "replay frames")
                return False
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                view.replied[worker] = True
                break
            first = seq if first is None else first
            if previous is not None and seq != previous + 1:
                # Batches the replay lost on the way (a full pipe): what they removed is still
                # in the index, so it starts over from what follows.
                log.warning("worker %d: KV event replay skipped %d..%d", worker, previous + 1,
                            seq - 1)
                view.gap(worker, repaired=False)
            previous = seq
            view.apply(worker, seq, frames[3])
    finally:
        inbox.close()
    return first == start or (first is None and start == 0)
