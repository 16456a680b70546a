"""The bench's fake vLLM workers on a bare HTTP/1.1 server: asyncio (uvloop) and httptools.

Why: examples/bench_proxy.py measures a router's capacity with its fake workers, the router and
the load generator on the same few cores, so every millisecond a fake spends on a request is
taken from the router under test. Starlette under uvicorn (tests.fakes.worker) cost about a third
of a millisecond per request; this server answers the same bytes for a fraction of that.

It answers as ``create_fake_worker(behavior)`` does (its helpers build every body) for what the
bench sends: completions and chat completions (prefill, decode as JSON, decode streamed with
``behavior.token_delay_s`` between events), /health, /v1/models, the self-check prompt, and the
publisher's messages. No other knob of ``FakeBehavior`` (failures, delays, recording) is served.
The prompt's signature is computed once per prompt text (``behavior.signature`` must depend on
the prompt only). One request at a time per connection: no pipelining.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import httptools
import orjson

from stages.serve.proxy.ops.self_check import PROBE_PROMPT
from tests.fakes.kv_publisher import FakeKVPublisher
from tests.fakes.worker import (
    FakeBehavior,
    _chunk,
    _completion,
    _hold,
    _kv_transfer_params,
    _publish_finished,
    _self_check_answer,
    prompt_text,
)

K = TypeVar("K")
V = TypeVar("V")
_CACHE_MAX = 4096  # entries per cache; cleared when full (the bench sends 16 prompts)
_JSON = b"application/json"
_DONE = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"  # the last event as its own chunk, then the end
_MODELS = orjson.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
_REASONS = {200: b"OK", 404: b"Not Found", 500: b"Internal Server Error",
            503: b"Service Unavailable"}


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _cached(cache: dict[K, V], key: K, make: Callable[[], V]) -> V:
    """``cache[key]``, made on a miss; the cache is emptied when it holds ``_CACHE_MAX``."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        value = cache[key] = make()
    return value


class LeanWorker:
    """One fake worker: its answers and caches, its listening socket's connections."""

    def __init__(self, behavior: FakeBehavior, kv: FakeKVPublisher | None = None) -> None:
        unsupported = (behavior.delay_s or behavior.fail_status is not None or behavior.record
                       or behavior.drop_after is not None or behavior.stream_error
                       or behavior.sick_after_request or behavior.self_check_reply is not None)
        if unsupported:
            raise ValueError("the lean fake serves no failures, delays nor recording: use "
                             "tests.fakes.worker.create_fake_worker (and record=False)")
        self.behavior = behavior
        self.kv = kv  # publishes the blocks of every prompt it runs, as vLLM's KV events
        self.server: asyncio.Server | None = None
        self.connections: set[_Connection] = set()
        self._kv: dict[str, dict[str, Any]] = {}  # prompt text -> kv_transfer_params
        self._json: dict[tuple[bool, str, int], bytes] = {}  # (chat, model, n) -> decode body
        self._frames: dict[tuple[bool, int], list[bytes]] = {}  # (chat, n) -> chunked events

    async def listen(self, sock: socket.socket) -> None:
        self.server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), sock=sock, backlog=4096)

    def close(self) -> None:
        """Stop listening and close every connection."""
        if self.server is not None:
            self.server.close()
        for conn in list(self.connections):
            conn.transport.close()

    def prefill(self, body: dict[str, Any], text: str, chat: bool) -> bytes:
        b = self.behavior
        b.handed_off += 1
        kv = _cached(self._kv, text, lambda: _kv_transfer_params(b, body))
        data = _completion(b, body, chat, 1)
        data["kv_transfer_params"] = {**kv, "remote_block_ids": [b.handed_off, 1, 2]}
        return orjson.dumps(data)

    def decoded(self, body: dict[str, Any], chat: bool, n: int) -> bytes:
        model = body.get("model", "fake")
        if not isinstance(model, str):
            return orjson.dumps(_completion(self.behavior, body, chat, n))
        return _cached(self._json, (chat, model, n),
                       lambda: orjson.dumps(_completion(self.behavior, body, chat, n)))

    def frames(self, chat: bool, n: int) -> list[bytes]:
        return _cached(self._frames, (chat, n),
                       lambda: [_frame(_chunk(self.behavior, chat, i)) for i in range(n)])


class _Connection(asyncio.Protocol):
    """One client connection: parses its requests, answers each, streams at most one."""

    transport: asyncio.Transport  # from connection_made on

    def __init__(self, worker: LeanWorker) -> None:
        self.worker = worker
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.streaming = False
        self.timer: asyncio.TimerHandle | None = None
        self.url = b""
        self.request_id: bytes | None = None
        self.body: list[bytes] = []
        self.keep_alive = True
        # The stream being paced: its events, how many went out, what ends it.
        self.frames: list[bytes] = []
        self.sent = 0
        self.finish: tuple[dict[str, Any], int, str] | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.worker.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.closed = True
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.worker.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.streaming:  # the client left mid-stream: nothing published as finished
            self._end_stream(finished=False)

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url, self.request_id, self.body = b"", None, []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.request_id is None and len(name) == 12 and name.lower() == b"x-request-id":
            self.request_id = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.streaming:  # a pipelined request: not served
            self.closed = True
            self.transport.close()
            return
        self.keep_alive = self.parser.should_keep_alive()
        path = self.url.partition(b"?")[0]
        try:
            if path in (b"/v1/completions", b"/v1/chat/completions"):  # any method
                self._completion(path == b"/v1/chat/completions")
            elif path == b"/health":
                self._send(200 if self.worker.behavior.healthy else 503, b"", None)
            elif path == b"/v1/models":
                self._send(200, _MODELS, _JSON)
            else:
                self._send(404, b"Not Found", b"text/plain; charset=utf-8")
        except Exception:  # a malformed body, as uvicorn answers an app's exception
            self.keep_alive = False
            self._send(500, b"Internal Server Error", b"text/plain; charset=utf-8")

    # -- answers ----------------------------------------------------------------------------

    def _send(self, status: int, data: bytes, content_type: bytes | None,
              request_id: bytes | None = None) -> None:
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
        if request_id is not None:
            head += b"x-request-id: %s\r\n" % request_id
        head += b"content-length: %d\r\n" % len(data)
        if content_type is not None:
            head += b"content-type: %s\r\n" % content_type
        if not self.keep_alive:
            head += b"connection: close\r\n"
        self.transport.write(head + b"\r\n" + data)
        if not self.keep_alive:
            self.transport.close()

    def _completion(self, chat: bool) -> None:
        worker, b = self.worker, self.worker.behavior
        body = orjson.loads(b"".join(self.body))
        text = prompt_text(body)
        rid = self.request_id or b""
        if text == PROBE_PROMPT:
            answer = _self_check_answer(b, body)
            self._send(answer.status_code, bytes(answer.body), _JSON)
            return
        if worker.kv is not None:
            worker.kv.ran(body, chat)
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            self._send(200, worker.prefill(body, text, chat), _JSON, rid)
            return
        n = int(body.get("max_tokens") or b.tokens)
        held = rid.decode("latin-1") + f"-{id(body)}"
        if b.publisher is not None:
            _hold(b, held, body)
        if not body.get("stream"):
            self._send(200, worker.decoded(body, chat, n), _JSON, rid)
            # After the answer, as worker.py's background task: vLLM reports it finished then.
            _publish_finished(b, body, n)
            if b.publisher is not None:
                b.publisher.remove(held)
            return
        head = (b"HTTP/1.1 200 OK\r\nx-request-id: %s\r\ncontent-type: text/event-stream;"
                b" charset=utf-8\r\ntransfer-encoding: chunked\r\n" % rid)
        if not self.keep_alive:
            head += b"connection: close\r\n"
        self.streaming, self.finish = True, (body, n, held)
        frames = worker.frames(chat, n)
        if not b.token_delay_s:
            self.transport.write(b"".join([head, b"\r\n", *frames, _DONE]))
            self._end_stream(finished=True)
            return
        self.transport.write(head + b"\r\n")
        self.frames, self.sent = frames, 0
        self.timer = self.loop.call_later(b.token_delay_s, self._tick)

    def _tick(self) -> None:
        """One paced event (the last with the end of the stream), as worker.py sleeps first."""
        self.timer = None
        if self.closed:
            return
        i, frames = self.sent, self.frames
        if i + 1 < len(frames):
            self.sent = i + 1
            self.transport.write(frames[i])
            self.timer = self.loop.call_later(self.worker.behavior.token_delay_s, self._tick)
            return
        self.transport.write(frames[i] + _DONE if frames else _DONE)
        self._end_stream(finished=True)

    def _end_stream(self, finished: bool) -> None:
        b = self.worker.behavior
        body, n, held = self.finish  # type: ignore[misc]
        self.streaming, self.finish, self.frames = False, None, []
        if finished:
            _publish_finished(b, body, n)
        if b.publisher is not None:
            b.publisher.remove(held)
        if finished and not self.keep_alive and not self.closed:
            self.transport.close()


def listening_socket(port: int, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def start(socks: Sequence[socket.socket], behaviors: Sequence[FakeBehavior],
                kv: Sequence[FakeKVPublisher | None] = ()) -> list[LeanWorker]:
    """A fake worker on each bound socket, with the behavior (and KV event publisher, if
    any) at the same index."""
    workers = [LeanWorker(behavior, kv[i] if kv else None)
               for i, behavior in enumerate(behaviors)]
    for sock, worker in zip(socks, workers, strict=True):
        await worker.listen(sock)
    return workers


def serve(socks: Sequence[socket.socket], behaviors: Sequence[FakeBehavior],
          kv: Sequence[FakeKVPublisher | None] = ()) -> None:
    """Serve until the process ends, on uvloop where it is installed."""

    async def forever() -> None:
        await start(socks, behaviors, kv)
        await asyncio.Event().wait()

    try:
        import uvloop
    except ImportError:
        asyncio.run(forever())
    else:
        uvloop.run(forever())
