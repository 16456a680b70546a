"""Rows appended to a signature dataset by a process of its own, in batches.

A live process (the routing proxy recording its traffic) must never wait on zarr: rows are
handed over in batches with ``put`` (never blocks; past ``max_rows`` waiting the batch is
dropped and counted) and a writer process appends each batch, in order, as one append. Rows are
handed over raw (whatever the live process had at hand) and the writer builds the dataset's
rows from them (``build``), so decoding and hashing leave the live process too. A
process, not a thread: an append is about 45-80 ms of zarr work that holds the GIL in pieces
(its own event loop, a thread pool, codecs). In a thread it raised the proxy's p99 at
concurrency 1 from 1.6-1.7 ms to 2.7-3.0 ms; from a process, to 2.1-2.2 ms (``examples.
bench_proxy``, ``eldr-union-pub`` against ``eldr-union-rec``), and with the process at the
lowest CPU priority, 19 (it yields a short machine's cores to serving), 1.7-2.5 ms with the p50
1.21-1.22 ms against 1.17-1.22. The live process pays for pickling the raw rows (about 5 us a
row). Low priority, not the lowest: see ``WRITER_NICE``.

Each append commits (``SignatureDataset.append`` bumps the commit pointer last), so a kill -9
of the live process loses at most the rows not yet handed over (the writer watches its parent
and exits once the append under way ends); ``close`` appends everything handed over before it
returns.

The live process holds the dataset's writer lock from the start of the recording to its
``close`` (a second recorder, or a capture, is refused at its start); the writer process appends
under its parent's lock, and under one of its own if the parent died mid-append.

The dataset is created with the model identity ``identity`` gives for the first row unless it
exists; a row ``build`` refuses, or of another shape than the store's, is dropped and counted,
never written.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from stages.errors import EldrError
from stages.signature.dataset import (
    CaptureRecord,
    ModelIdentity,
    SignatureDataset,
    store_exists,
)
from stages.signature.writer_lock import WriterLock

log = logging.getLogger(__name__)


@dataclass
class AppenderCounts:
    appended: int = 0
    dropped_full: int = 0  # the queue was full: the writer fell behind
    dropped_shape: int = 0  # counts of another shape than the store's
    malformed: int = 0  # rows ``build`` refused (counts that do not decode)
    failed: int = 0  # rows lost to a failed write (the error is logged)
    errors: list[str] = field(default_factory=list)  # the first few, for /admin/state

    def lost(self, rows: int, error: str) -> None:
        """``rows`` not written, for ``error`` (kept among the first few)."""
        self.failed += rows
        if len(self.errors) < 5:
            self.errors.append(error)


@dataclass(frozen=True)
class _Appended:
    """What one append did, sent back from the writer process."""

    appended: int
    dropped_shape: int
    malformed: int = 0
    error: str | None = None


# The writer's niceness. An append costs about 50 ms of CPU every ``handover_s`` (2 s), 2.5% of
# a core. At 10 (CFS weight 110 against 1,024 at 0) the writer still gets about 5% of a core
# beside two busy processes on each core, so it keeps up on a saturated machine. At 19 (weight
# 15) it got 0.7% and fell behind for good: with four busy loops on two cores an append of 8
# rows took 19-47 s (at 10: 2.5-7 s; at 0: 0.4-2.7 s), and a recording proxy stopped under CI's
# load lost the rows still queued at its close.
WRITER_NICE = 10

# Held by the writer process while it appends, so a writer whose parent died ends the append
# under way (it commits) before it exits.
_APPENDING = threading.Lock()


def _exit_with_parent(*warm: object) -> None:
    """The writer's initializer: a thread that ends the writer once its parent is gone. A pool
    worker blocked on its call queue never sees a killed parent's pipe close (it holds both
    ends), so without it a kill -9 of the proxy would leave the writer behind.

    ``warm``: the row builder and identity function, unused here: unpickling them imports their
    modules now, at the writer's normal priority."""
    # Recording is background work: where cores are short it yields them to the serving
    # processes beside it (the proxy, the engines) instead of taking its share. Only after the
    # imports: a writer niced from its first instruction took minutes to start on a saturated
    # machine.
    os.nice(WRITER_NICE)
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        with _APPENDING:
            os._exit(0)

    threading.Thread(target=watch, name="eldr-writer-parent-watch", daemon=True).start()


# What the writer does with a raw row: the dataset's row (ValueError: a row it cannot build).
RowBuilder = Callable[[Any], CaptureRecord]
# The model a new dataset is created for, from the first raw row and the row built from it.
IdentityOf = Callable[[Any, CaptureRecord], ModelIdentity]


def _append(path: Path, vllm_version: str, build: RowBuilder, identity: IdentityOf,
            owner: int, rows: list[Any]) -> _Appended:
    """One append, in the writer process, under the writer lock of ``owner`` (the live
    process). The store is opened each time (a few ms against an append's tens): the writer
    keeps no state between batches."""
    with _APPENDING:
        return _append_now(path, vllm_version, build, identity, owner, rows)


def _append_now(path: Path, vllm_version: str, build: RowBuilder, identity: IdentityOf,
                owner: int, rows: list[Any]) -> _Appended:
    built: list[tuple[Any, CaptureRecord]] = []
    refused: list[str] = []
    for raw in rows:
        try:
            built.append((raw, build(raw)))
        except ValueError as exc:
            refused.append(str(exc))
    if refused:  # once a batch: a worker that sends bad counts sends them all the time
        log.warning("recording: %d rows dropped, the first: %s", len(refused), refused[0])
    if not built:
        return _Appended(0, 0, len(refused))
    try:
        # An existing store keeps its identity (the live process checked it at its start).
        dataset = (
            SignatureDataset.open(path, writable=True, on_behalf_of=owner)
            if store_exists(path) else SignatureDataset.create_or_open(
                path, identity(*built[0]), vllm_version, on_behalf_of=owner))
        try:
            shape = dataset.identity.shape
            good = [r for _, r in built
                    if r.prefill_counts.shape == shape and r.decode_counts.shape == shape]
            dataset.append(good)
        finally:
            dataset.close()
        return _Appended(len(good), len(built) - len(good), len(refused))
    except (EldrError, OSError, ValueError) as exc:
        # The writer lives on: a full disk may clear, and the proxy keeps serving.
        return _Appended(0, 0, len(refused), str(exc))


def _start_writer(build: RowBuilder, identity: IdentityOf) -> ProcessPoolExecutor:
    # spawn: the live process has threads (event loop, ZMQ), which fork would copy half-way.
    # One worker keeps the appends in the order they were handed over.
    return ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_exit_with_parent, initargs=(build, identity))


class DatasetAppender:
    def __init__(self, path: Path, vllm_version: str, build: RowBuilder, identity: IdentityOf,
                 max_rows: int = 65536) -> None:
        """``build`` and ``identity`` run in the writer process: module-level functions (or
        partials of them), so they can be sent there."""
        self.path = Path(path)
        self.counts = AppenderCounts()
        self._vllm_version = vllm_version
        self._build = build
        self._identity = identity
        self._max_rows = max_rows
        self._waiting = 0  # rows handed over, not yet appended
        self._given_up = False  # ``close`` timed out and counted the waiting rows as failed
        self._lock = threading.Lock()  # the counts change in the executor's thread
        self._store_identity: ModelIdentity | None = None
        exists = store_exists(self.path)
        if exists:  # opened now: a store that is not a dataset fails the start
            self._store_identity = SignatureDataset.open(self.path).identity
        # Held until close: the writer process appends under it.
        self._writer_lock = WriterLock.take(self.path)
        if exists:  # trims what a killed writer left past the commit mark
            SignatureDataset.open(self.path, writable=True, on_behalf_of=os.getpid()).close()
        self._writer = _start_writer(self._build, self._identity)

    @property
    def store_identity(self) -> ModelIdentity | None:
        """The model of the dataset as it was when recording started (None: a new one)."""
        return self._store_identity

    def put(self, rows: list[Any]) -> bool:
        """Hand rows over; False if they were dropped (the writer is ``max_rows`` behind)."""
        if not rows:
            return True
        with self._lock:
            if self._waiting + len(rows) > self._max_rows:
                self.counts.dropped_full += len(rows)
                return False
            self._waiting += len(rows)
        job = (_append, self.path, self._vllm_version, self._build, self._identity,
               os.getpid(), rows)
        try:
            future = self._writer.submit(*job)
        except BrokenProcessPool as exc:  # the writer died (killed, out of memory): a new one
            log.error("recording: the writer process died (%s); starting another", exc)
            self._writer = _start_writer(self._build, self._identity)
            future = self._writer.submit(*job)
        future.add_done_callback(partial(self._appended, rows=len(rows)))
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Append every row handed over, then stop the writer."""
        done = threading.Thread(target=self._writer.shutdown, daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            # Counted, not only logged: the rows still waiting are reported as failed (a
            # writer that finishes later may yet write some; what it reports then is ignored).
            with self._lock:
                lost, self._waiting, self._given_up = self._waiting, 0, True
                self.counts.lost(lost, f"the writer did not finish within {timeout_s:g} s")
            log.error("recording: the writer did not finish within %g s; %d rows counted as"
                      " not written", timeout_s, lost)
        self._writer_lock.release()

    def _appended(self, done: Future[_Appended], rows: int) -> None:
        exc = done.exception()
        outcome = _Appended(0, 0, error=repr(exc)) if exc is not None else done.result()
        with self._lock:
            if self._given_up:
                return  # ``close`` already counted these rows as not written
            self._waiting -= rows
            self.counts.appended += outcome.appended
            self.counts.dropped_shape += outcome.dropped_shape
            self.counts.malformed += outcome.malformed
            lost = rows - outcome.malformed  # those refused are counted as such
            if outcome.error is not None:
                self.counts.lost(lost, outcome.error)
        if outcome.error is not None:
            log.error("recording: %d rows not written to %s: %s", lost, self.path,
                      outcome.error)
