"""A decode worker's running batch, published for the routing proxies (ZMQ PUB, as vLLM
publishes KV events).

Several proxies in front of the same decode workers each know only the requests they sent
themselves. The worker knows them all: its scheduler-side connector adds a request when the
scheduler first considers it and drops it when vLLM frees it (finished, aborted, or its
client gone), and this publisher sends the set to every subscribed proxy.

Off the forward path: the scheduler's hooks only update a set under a lock; a thread of its own
sends, at most every ``min_interval_s`` while the set changes (changes in between are sent
together) and every ``heartbeat_s`` while it does not, so a proxy can tell a quiet worker from
a gone one. Nothing here touches a device tensor, so there is no host sync.

The wire format is one JSON object per message (see ``BatchMessage``); a request is named by
the id a proxy tagged it with (``REQUEST_TAG`` in its ``kv_transfer_params``), else by vLLM's
own request id.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import orjson
import zmq

# The key of kv_transfer_params under which a proxy names its request to the decode worker.
REQUEST_TAG = "eldr_request_id"
WIRE_VERSION = 1


@dataclass(frozen=True)
class BatchMessage:
    """What a decode worker holds, as published: ``seq`` counts messages from one publisher
    (a restarted worker starts again at 0), ``requests`` are the ids it holds now."""

    seq: int
    requests: frozenset[str]

    def encode(self) -> bytes:
        return orjson.dumps({"v": WIRE_VERSION, "seq": self.seq,
                             "requests": sorted(self.requests)})

    @classmethod
    def decode(cls, raw: bytes) -> BatchMessage:
        """Raises ValueError on anything but a message of this version."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("v") != WIRE_VERSION:
            raise ValueError(f"not a version-{WIRE_VERSION} batch message")
        seq, requests = data.get("seq"), data.get("requests")
        if type(seq) is not int or not isinstance(requests, list) or not all(
                isinstance(r, str) for r in requests):
            raise ValueError("a batch message needs an integer seq and a list of request ids")
        return cls(seq, frozenset(requests))


def request_name(request_id: str, kv_transfer_params: dict[str, Any] | None) -> str:
    """The name a proxy knows a request by: its tag, else vLLM's id."""
    tag = (kv_transfer_params or {}).get(REQUEST_TAG)
    return tag if isinstance(tag, str) and tag else request_id


class BatchPublisher:
    """Publishes the set of requests a decode worker holds on ``endpoint`` (``tcp://*:port``)."""

    def __init__(self, endpoint: str, min_interval_s: float = 0.005,
                 heartbeat_s: float = 0.5) -> None:
        self._held: dict[str, str] = {}  # vLLM's request id -> the name published
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._min_interval_s = min_interval_s
        self._heartbeat_s = heartbeat_s
        self._context = zmq.Context.instance()
        # Bound here, not in the thread: a port in use fails the engine's start, loudly.
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 16)  # a slow subscriber gets the latest, not a queue
        self._socket.bind(endpoint)
        self._thread = threading.Thread(target=self._run, name="eldr-batch-publisher",
                                        daemon=True)
        self._thread.start()

    def add(self, request_id: str, name: str) -> None:
        with self._lock:
            if self._held.get(request_id) == name:
                return
            self._held[request_id] = name
        self._changed.set()

    def remove(self, request_id: str) -> None:
        with self._lock:
            if self._held.pop(request_id, None) is None:
                return
        self._changed.set()

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        seq = 0
        try:
            while not self._stop.is_set():
                self._changed.wait(self._heartbeat_s)
                self._changed.clear()
                with self._lock:
                    names = frozenset(self._held.values())
                # A PUB socket never blocks: past its high-water mark it drops the message for
                # that subscriber, which the next message (the whole set again) makes good.
                self._socket.send(BatchMessage(seq, names).encode(), zmq.NOBLOCK)
                seq += 1
                # Changes in the next moments go out together, in the next message.
                self._stop.wait(self._min_interval_s)
        finally:
            self._socket.close()
