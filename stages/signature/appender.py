"""Rows appended to a signature dataset from a thread of its own, in batches.

A live process (the routing proxy recording its traffic) must never wait on zarr: rows are
handed over with ``put`` (never blocks; a full queue drops the row and counts it) and a
thread appends them ``batch_rows`` at a time, or whatever has waited ``flush_s``. Each append
commits (``SignatureDataset.append`` bumps the commit pointer last), so a kill -9 loses at
most the rows not yet appended; ``close`` appends everything handed over before it returns.

The dataset is created with the first row's model identity unless it exists; a row of another
shape than the store's is dropped and counted, never written.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from stages.errors import EldrError
from stages.signature.dataset import CaptureRecord, ModelIdentity, SignatureDataset

log = logging.getLogger(__name__)

_CLOSE = object()


@dataclass
class AppenderCounts:
    appended: int = 0
    dropped_full: int = 0  # the queue was full: the writer fell behind
    dropped_shape: int = 0  # counts of another shape than the store's
    failed: int = 0  # rows lost to a failed write (the error is logged)
    errors: list[str] = field(default_factory=list)  # the first few, for /admin/state


class DatasetAppender:
    def __init__(self, path: Path, identity: Callable[[CaptureRecord], ModelIdentity],
                 vllm_version: str, batch_rows: int = 256, flush_s: float = 1.0,
                 max_queued: int = 16384) -> None:
        """``identity`` names the model of the first row when the store must be created."""
        self.path = Path(path)
        self.counts = AppenderCounts()
        self._identity = identity
        self._vllm_version = vllm_version
        self._batch_rows = batch_rows
        self._flush_s = flush_s
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queued)
        self._dataset: SignatureDataset | None = None
        if self.path.exists():  # opened now: a store that is not a dataset fails the start
            self._dataset = SignatureDataset.open(self.path, writable=True)
        self._thread = threading.Thread(target=self._run, name="eldr-record-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def store_identity(self) -> ModelIdentity | None:
        return None if self._dataset is None else self._dataset.identity

    def put(self, record: CaptureRecord) -> bool:
        """Hand a row over; False if it was dropped (the queue is full)."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.counts.dropped_full += 1
            return False
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Append every row handed over, then stop the thread."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("recording: the writer did not finish within %g s; rows may be lost",
                      timeout_s)

    def _run(self) -> None:
        pending: list[CaptureRecord] = []
        while True:
            try:
                item = self._queue.get(timeout=self._flush_s)
            except queue.Empty:
                item = None
            if isinstance(item, CaptureRecord):
                pending.append(item)
            if pending and (item is None or item is _CLOSE or len(pending) >= self._batch_rows):
                self._append(pending)
                pending = []
            if item is _CLOSE:
                return

    def _append(self, rows: list[CaptureRecord]) -> None:
        try:
            if self._dataset is None:
                self._dataset = SignatureDataset.create_or_open(
                    self.path, self._identity(rows[0]), self._vllm_version)
            shape = self._dataset.identity.shape
            good = [r for r in rows if r.prefill_counts.shape == shape
                    and r.decode_counts.shape == shape]
            self.counts.dropped_shape += len(rows) - len(good)
            self._dataset.append(good)
            self.counts.appended += len(good)
        except (EldrError, OSError, ValueError) as exc:
            # The thread lives on: a full disk may clear, and the proxy keeps serving.
            self.counts.failed += len(rows)
            if len(self.counts.errors) < 5:
                self.counts.errors.append(str(exc))
            log.error("recording: %d rows not written to %s: %s", len(rows), self.path, exc)
