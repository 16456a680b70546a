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

A request a proxy marked with ``RECORD_KEY`` also comes back, once it has finished, with its
decode counts per expert as this worker measured them (``FinishedRequest``), in the next
message: that is how ``eldr serve --record`` learns what a request's decode read. Finished
requests waiting to be sent are bounded (``max_pending``); past it they are dropped and
counted, never queued without end.

A PUB socket drops a message for a subscriber that is behind (past its high-water mark), so the
messages that carried finished requests are also kept (up to ``replay_bytes``) and served again
on a ROUTER socket, as vLLM's KV-event publisher does (``vllm/distributed/kv_events.py``): each
message names the publisher (``epoch``, new at each start) and the replay socket's port
(``replay``, on the PUB endpoint's address); a proxy that sees a jump in ``seq`` asks for the
messages it missed (``ReplayRequest``) and counts the gap, and what the buffer no longer holds.

A request that arrived with its prefill signature (the proxies leave it in ``kv_transfer_params``
for a worker that publishes) has the signature sent once, in the first message that lists the
request (``signatures``): every proxy can then weigh the experts of the requests the others
sent, not only their number. Sent once, not with every message: a signature is up to 16 KiB of
base64. A message lost on the way loses the signatures it carried, and those requests count as
load only for the proxies that missed it.

What is published (every request's id, and its prompt's signature) is for the proxies only:
bind a loopback or private address (``eldr serve`` binds its workers' on 127.0.0.1). An
endpoint on every interface (``tcp://*:port``, ``0.0.0.0``, ``[::]``) is allowed, told
otherwise, with a warning.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import zmq

from stages.signature import wire

log = logging.getLogger(__name__)

# The key of kv_transfer_params under which a proxy names its request to the decode worker.
REQUEST_TAG = "eldr_request_id"
# kv_transfer_params[RECORD_KEY] = True: publish the request's decode counts when it finishes.
RECORD_KEY = "eldr_record"
WIRE_VERSION = 1


@dataclass(frozen=True)
class FinishedRequest:
    """A recorded request's decode as its decode worker measured it: ``decode_counts`` holds
    ``[l, e]``, the generated tokens (those this worker ran forward) that picked expert ``e`` in
    MoE layer ``l``, packed as ``wire.encode`` packs a signature (a proxy hands them to its
    writer process as they came, and they are decoded there); the lengths are vLLM's, in
    tokens."""

    name: str
    prompt_tokens: int
    output_tokens: int
    decode_counts: dict[str, Any]

    @classmethod
    def measured(cls, name: str, prompt_tokens: int, output_tokens: int,
                 counts: np.ndarray) -> FinishedRequest:
        return cls(name, prompt_tokens, output_tokens, wire.encode(counts))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "decode_counts": self.decode_counts}

    @classmethod
    def from_json(cls, data: Any) -> FinishedRequest:
        """Raises ValueError on a malformed entry (the counts' contents are checked where they
        are decoded: ``recorded_row.build_record``)."""
        if not isinstance(data, dict):
            raise ValueError("a finished request must be an object")
        name, lengths = data.get("name"), (data.get("prompt_tokens"), data.get("output_tokens"))
        if not isinstance(name, str) or not all(type(n) is int and n >= 0 for n in lengths):
            raise ValueError("a finished request needs a name and its lengths in tokens")
        counts = data.get("decode_counts")
        if not isinstance(counts, dict) or not isinstance(counts.get(wire.SIGNATURE_KEY), str):
            raise ValueError(f"finished request {name!r} has no decode counts")
        return cls(name, lengths[0], lengths[1], counts)


@dataclass(frozen=True)
class BatchMessage:
    """What a decode worker holds, as published: ``seq`` counts messages from one publisher
    (a restarted worker starts again at 0), ``requests`` are the ids it holds now."""

    seq: int
    requests: frozenset[str]
    finished: tuple[FinishedRequest, ...] = ()
    # name -> the signature's kv_transfer_params entries (``wire``), for requests new since the
    # previous message; decoded by whoever routes on them, as the prefill's are.
    signatures: dict[str, dict[str, Any]] = field(default_factory=dict)
    epoch: str = ""  # the publisher's, new at each start: a seq from another epoch is no gap
    replay: int | None = None  # the port of its replay socket (None: it has none)

    def encode(self) -> bytes:
        message: dict[str, Any] = {"v": WIRE_VERSION, "seq": self.seq,
                                   "requests": sorted(self.requests)}
        # Each absent when empty: proxies of the previous release read the rest.
        if self.finished:
            message["finished"] = [f.to_json() for f in self.finished]
        if self.signatures:
            message["signatures"] = self.signatures
        if self.epoch:
            message["epoch"] = self.epoch
        if self.replay is not None:
            message["replay"] = self.replay
        return orjson.dumps(message)

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
        finished = data.get("finished", [])
        if not isinstance(finished, list):
            raise ValueError("a batch message's finished requests must be a list")
        signatures = data.get("signatures", {})
        if not isinstance(signatures, dict) or not all(
                isinstance(v, dict) for v in signatures.values()):
            raise ValueError("a batch message's signatures must map request ids to objects")
        epoch, replay = data.get("epoch", ""), data.get("replay")
        if not isinstance(epoch, str) or not (replay is None or type(replay) is int):
            raise ValueError("a batch message's epoch is a string and its replay port an integer")
        return cls(seq, frozenset(requests), tuple(FinishedRequest.from_json(f) for f in finished),
                   signatures, epoch, replay)


@dataclass(frozen=True)
class ReplayRequest:
    """A proxy's ask on the replay socket: the messages ``first`` to ``last`` (inclusive) of
    publisher ``epoch``. The answer is a header (``{"complete": bool}``: False when the buffer
    no longer held all that carried finished requests) and the kept messages in that range."""

    epoch: str
    first: int
    last: int

    def encode(self) -> bytes:
        return orjson.dumps({"epoch": self.epoch, "first": self.first, "last": self.last})

    @classmethod
    def decode(cls, raw: bytes) -> ReplayRequest:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("epoch"), str) or not all(
                type(data.get(k)) is int for k in ("first", "last")):
            raise ValueError("a replay request needs an epoch and the first and last seq")
        return cls(data["epoch"], data["first"], data["last"])


class _ReplayBuffer:
    """The last messages that carried finished requests, up to ``max_bytes`` (oldest out
    first); ``floor``: every such message from this seq on is still here."""

    def __init__(self, max_bytes: int) -> None:
        self._kept: deque[tuple[int, bytes]] = deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self.floor = 0
        self._lock = threading.Lock()

    def keep(self, seq: int, raw: bytes) -> None:
        with self._lock:
            self._kept.append((seq, raw))
            self._bytes += len(raw)
            while self._kept and self._bytes > self._max_bytes:
                old, dropped = self._kept.popleft()
                self._bytes -= len(dropped)
                self.floor = old + 1

    def between(self, first: int, last: int) -> tuple[bool, list[bytes]]:
        """Whether every message from ``first`` is still known, and those kept up to ``last``."""
        with self._lock:
            return first >= self.floor, [raw for seq, raw in self._kept if first <= seq <= last]


_EVERY_INTERFACE = frozenset({"*", "0.0.0.0", "::", "[::]", "[*]"})


def binds_every_interface(endpoint: str) -> bool:
    """Whether a ZMQ ``tcp://`` endpoint binds every interface of the machine."""
    scheme, _, address = endpoint.partition("://")
    host = address.rpartition(":")[0]
    return scheme == "tcp" and host in _EVERY_INTERFACE


def request_name(request_id: str, kv_transfer_params: dict[str, Any] | None) -> str:
    """The name a proxy knows a request by: its tag, else vLLM's id."""
    tag = (kv_transfer_params or {}).get(REQUEST_TAG)
    return tag if isinstance(tag, str) and tag else request_id


class BatchPublisher:
    """Publishes the set of requests a decode worker holds on ``endpoint``
    (``tcp://127.0.0.1:port``)."""

    def __init__(self, endpoint: str, min_interval_s: float = 0.005,
                 heartbeat_s: float = 0.5, max_pending: int = 4096,
                 replay_bytes: int = 16 << 20) -> None:
        self._held: dict[str, str] = {}  # vLLM's request id -> the name published
        self._new_signatures: dict[str, dict[str, Any]] = {}  # name -> signature, not yet sent
        self._finished: list[tuple[str, int, int, np.ndarray]] = []
        self._max_pending = max_pending
        self.dropped = 0  # finished requests not sent: more than max_pending were waiting
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
        if "://[" in endpoint:
            self._socket.setsockopt(zmq.IPV6, 1)
        self._socket.bind(endpoint)
        if binds_every_interface(endpoint):
            log.warning("eldr: the batch publisher binds %s, every interface: anyone who reaches"
                        " the port sees every request's id and prompt signature; bind"
                        " tcp://127.0.0.1:PORT or a private address", endpoint)
        self._epoch = secrets.token_hex(8)
        self._buffer = _ReplayBuffer(replay_bytes)
        self._replay_socket, self._replay_port = self._bind_replay(endpoint)
        self._thread = threading.Thread(target=self._run, name="eldr-batch-publisher",
                                        daemon=True)
        self._thread.start()
        self._replay_thread: threading.Thread | None = None
        if self._replay_socket is not None:
            self._replay_thread = threading.Thread(target=self._serve_replays,
                                                   name="eldr-batch-replay", daemon=True)
            self._replay_thread.start()

    def _bind_replay(self, endpoint: str) -> tuple[zmq.Socket | None, int | None]:
        """A ROUTER socket on the PUB endpoint's address, on a port of the kernel's choice
        (sent in every message); none for an endpoint that is not ``tcp://``."""
        if not endpoint.startswith("tcp://"):
            return None, None
        host = endpoint.removeprefix("tcp://").rpartition(":")[0]
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        if host.startswith("["):
            router.setsockopt(zmq.IPV6, 1)
        port = router.bind_to_random_port(f"tcp://{host}")
        return router, port

    def add(self, request_id: str, name: str,
            signature: dict[str, Any] | None = None) -> None:
        """``signature``: the request's ``wire`` entries, sent with the first message that
        lists it."""
        with self._lock:
            if self._held.get(request_id) == name:
                return
            self._held[request_id] = name
            if signature:
                self._new_signatures[name] = signature
        self._changed.set()

    def remove(self, request_id: str) -> None:
        with self._lock:
            name = self._held.pop(request_id, None)
            if name is None:
                return
            self._new_signatures.pop(name, None)  # gone before it was sent: nobody needs it
        self._changed.set()

    def finished(self, name: str, prompt_tokens: int, output_tokens: int,
                 decode_counts: np.ndarray) -> None:
        """A recorded request ended (``FinishedRequest``); its counts are packed in the
        publisher's thread, off the scheduler's path."""
        request = (name, prompt_tokens, output_tokens, decode_counts)
        with self._lock:
            if len(self._finished) >= self._max_pending:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("eldr: more than %d recorded requests waiting to be published;"
                                " dropping the newest (no proxy reading?)", self._max_pending)
                return
            self._finished.append(request)
        self._changed.set()

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        self._thread.join(timeout=2)
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)

    def _serve_replays(self) -> None:
        router = self._replay_socket
        assert router is not None
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frames = router.recv_multipart()
                try:
                    ask = ReplayRequest.decode(frames[-1])
                except ValueError as exc:
                    log.warning("eldr: a replay request the batch publisher cannot read: %s", exc)
                    continue
                if ask.epoch != self._epoch:  # asked of the publisher before a restart
                    complete, kept = False, []
                else:
                    complete, kept = self._buffer.between(ask.first, ask.last)
                router.send_multipart([frames[0], orjson.dumps({"complete": complete}), *kept])
        finally:
            router.close()

    def _run(self) -> None:
        seq = 0
        try:
            while not self._stop.is_set():
                self._changed.wait(self._heartbeat_s)
                self._changed.clear()
                with self._lock:
                    names = frozenset(self._held.values())
                    measured, self._finished = self._finished, []
                    signatures, self._new_signatures = self._new_signatures, {}
                # A PUB socket never blocks: past its high-water mark it drops the message for
                # that subscriber, which the next message (the whole set again) makes good;
                # the finished requests it carried are replayed to a proxy that asks.
                finished = tuple(FinishedRequest.measured(*m) for m in measured)
                raw = BatchMessage(seq, names, finished, signatures, self._epoch,
                                   self._replay_port).encode()
                if finished and self._replay_socket is not None:
                    self._buffer.keep(seq, raw)
                self._socket.send(raw, zmq.NOBLOCK)
                seq += 1
                # Changes in the next moments go out together, in the next message.
                self._stop.wait(self._min_interval_s)
        finally:
            self._socket.close()
