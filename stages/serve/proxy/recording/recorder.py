"""`eldr serve --record`: the proxy's own traffic, kept as a signature dataset `eldr fit` reads.

For a sampled request (``RecordConfig.rate``) the proxy keeps what it knows when the prefill
answers: the prompt's signature (the counts it routes on), the prompt (its sha256 is stored, its
text only with ``prompts``), when it arrived. It asks the decode worker to measure the decode
(``batch_publisher.RECORD_KEY``); the worker publishes the request's decode counts per expert
and its lengths when it ends, beside its batch (``FinishedRequest``), and the row is complete.
Complete rows go to a writer process (``DatasetAppender``) every ``handover_s`` (``run``) or
``handover_rows``, whichever comes first, and each hand-over is one append. Nothing here
waits on a disk or a worker, or decodes: the request path only files the entries it was sent,
and the writer decodes and hashes them (``recorded_row``).

A message a proxy missed is replayed from the worker's buffer (``batch_replay``); a gap it can
no longer fill is counted at once (``eldr_router_decode_batch_messages_lost_total``, and
``messages_lost`` per decode worker in ``/admin/state``). A request that fails on its way (a
4xx, the client gone, a retry whose prefill failed, every worker failed) has its entry dropped
there (``dropped``): no worker will report it finished. Bounded: entries whose request never
comes back all the same (a worker that died mid-request) are forgotten after
``forget_after_s``, and at most ``max_pending`` wait; both are counted. A new dataset's model
identity is ``recorded_row.identity_of``'s.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from stages.capture.batch_publisher import FinishedRequest
from stages.errors import EldrError
from stages.serve.proxy.recording.row import RecordedRow, build_record, identity_of
from stages.signature import wire
from stages.signature.appender import DatasetAppender
from stages.signature.dataset import ModelIdentity


@dataclass(frozen=True)
class RecordConfig:
    path: Path  # the signature dataset to append to (created if absent)
    rate: float = 1.0  # the fraction of requests recorded
    prompts: bool = False  # keep the prompt text; otherwise only its sha256

    def __post_init__(self) -> None:
        if not 0 < self.rate <= 1:
            raise EldrError(f"--record-rate must be in (0, 1], not {self.rate:g}")


@dataclass
class _Pending:
    prefill: dict[str, Any]  # the signature's entries, as the prefill sent them
    prompt: bytes
    arrival_unix_s: float
    arrived: float  # time.monotonic()
    ttft_s: float = math.nan


class TrafficRecorder:
    def __init__(self, config: RecordConfig, identity: ModelIdentity | None, model_name: str,
                 vllm_version: str, seed: int = 0, max_pending: int = 65536,
                 forget_after_s: float = 600.0, handover_s: float = 2.0,
                 handover_rows: int = 4096) -> None:
        self.config = config
        self._appender = DatasetAppender(config.path, vllm_version, build_record,
                                         partial(identity_of, model_name, identity))
        stored = self._appender.store_identity
        if stored is not None and identity is not None and stored != identity:
            self._appender.close()
            raise EldrError(f"{config.path} holds signatures of {stored.describe()}, not of the"
                            f" served {identity.describe()}; record into another path")
        self._rng = random.Random(seed)
        self._pending: OrderedDict[str, _Pending] = OrderedDict()  # oldest first
        self._max_pending = max_pending
        self._forget_after_s = forget_after_s
        self._rows: list[RecordedRow] = []  # complete, not yet handed to the writer
        self._handover_s = handover_s
        self._handover_rows = handover_rows
        self.unmatched = 0  # finished requests this proxy did not record (other proxies')
        self.forgotten = 0  # recorded requests whose decode counts never came
        self.no_signature = 0  # sampled requests whose prefill sent no signature

    # -- the request path (event loop) ---------------------------------------------------
    def begin(self, name: str, kv_transfer_params: dict[str, Any] | None, prompt_key: bytes,
              arrived: float) -> bool:
        """Whether to record this request (sampled, and its prefill sent a signature); if so
        its entry waits under ``name`` for the decode worker's counts."""
        if self.config.rate < 1 and self._rng.random() >= self.config.rate:
            return False
        entries = wire.entries(kv_transfer_params, with_layers=True)
        if entries is None:
            self.no_signature += 1
            return False
        now = time.monotonic()
        self._forget(now)
        if len(self._pending) >= self._max_pending:
            self._pending.popitem(last=False)
            self.forgotten += 1
        self._pending[name] = _Pending(entries, prompt_key, time.time() - (now - arrived), arrived)
        return True

    def renamed(self, old: str, new: str) -> None:
        """A retry goes by a name of its own (a fresh hand-off)."""
        entry = self._pending.pop(old, None)
        if entry is not None:
            self._pending[new] = entry

    def answered(self, name: str) -> None:
        """The decode worker's first bytes (a stream's first event, or a whole answer)."""
        entry = self._pending.get(name)
        if entry is not None and math.isnan(entry.ttft_s):
            entry.ttft_s = time.monotonic() - entry.arrived

    def dropped(self, name: str) -> None:
        """The request will not come back to be recorded (it failed, or its client left)."""
        self._pending.pop(name, None)

    # -- the worker's side (the batch subscription) -----------------------------------------
    def finished(self, done: FinishedRequest) -> None:
        entry = self._pending.pop(done.name, None)
        if entry is None:
            self.unmatched += 1
            return
        self._rows.append(RecordedRow(
            id=done.name, prefill=entry.prefill, decode=done.decode_counts, prompt=entry.prompt,
            keep_prompt=self.config.prompts, prompt_tokens=done.prompt_tokens,
            output_tokens=done.output_tokens, arrival_unix_s=entry.arrival_unix_s,
            ttft_s=entry.ttft_s, latency_s=time.monotonic() - entry.arrived,
        ))
        if len(self._rows) >= self._handover_rows:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._rows:
            self._appender.put(self._rows)
            self._rows = []

    # -- lifetime ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Hand complete rows to the writer every ``handover_s`` (runs until cancelled)."""
        while True:
            await asyncio.sleep(self._handover_s)
            self._hand_over()

    async def settle(self, timeout_s: float) -> int:
        """Wait (up to ``timeout_s``) for the counts of requests that already ended; returns
        how many never came. Those are counted as never finished: their rows are lost, and the
        summary and the caller say so."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = len(self._pending)
        self.forgotten += left
        self._pending.clear()
        return left

    def close(self) -> None:
        """Write every complete row (the event loop no longer runs ``finished``)."""
        self._hand_over()
        self._appender.close()

    def summary(self) -> dict[str, Any]:
        counts = self._appender.counts
        return {
            "path": str(self.config.path), "rate": self.config.rate,
            "appended": counts.appended, "waiting": len(self._pending),
            "unwritten": len(self._rows),
            "dropped": {"writer_behind": counts.dropped_full, "wrong_shape": counts.dropped_shape,
                        "malformed": counts.malformed,
                        "write_failed": counts.failed, "never_finished": self.forgotten,
                        "no_signature": self.no_signature},
            "errors": list(counts.errors),
        }

    def _forget(self, now: float) -> None:
        pending = self._pending
        while pending:
            entry = next(iter(pending.values()))
            if now - entry.arrived < self._forget_after_s:
                break
            pending.popitem(last=False)
            self.forgotten += 1
