"""The proxy's one HTTP/1.1 client, pooled, for every call it makes to a worker or a peer: the
two hot legs (a POST to a prefill worker, a POST to a decode worker, its answer read whole or
relayed chunk by chunk) and the rest (health probes, self-checks, /v1/models, peers).

Why not aiohttp: every client request costs two upstream requests, and aiohttp's client was the
largest single share of the proxy's CPU per request (examples/bench_upstream_client.py measures
both). This client does only what the proxy needs: a request with a bytes body, the answer's
status, headers and body (Content-Length, chunked, or until the worker closes cleanly: a reset
cuts it), bytes passed on as they came (nothing decompressed), and keep-alive connections pooled
per worker URL.

Rules the legs rely on:
- A connection goes back to the pool only when the parser saw its answer's end and the worker
  did not say ``Connection: close``; an answer released before its end closes the connection,
  which is how vLLM learns the client left (it aborts the request and frees its KV blocks).
- A request (a leg's POST, a health or control call) is never sent twice: one that fails on a
  reused connection is reported as failed (``UpstreamError``), not retried here; the caller
  decides (for the legs, stages.serve.proxy.legs.decode).
- Idle connections close after ``keepalive_s``, below the workers' own keep-alive, so no
  request goes out on a connection the worker is closing at that moment.
- A cancelled request closes its connection and frees its slot.
"""

from __future__ import annotations

import asyncio
import math
import re
import ssl
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partialmethod
from typing import overload
from urllib.parse import urlsplit

import httptools

# Reading pauses once this much of a streamed answer waits for its reader (a slow client),
# so a worker cannot fill the proxy's memory; TCP then slows the worker down.
_HIGH_WATER = 1 << 20
# Timers may fire up to the clock's resolution early; without slack, one firing a hair early
# would re-arm itself for the same instant.
_SLACK_S = 1e-3
# Bodies up to this size are copied into the request head's buffer: one write, one syscall.
_JOIN_BODY_BYTES = 64 * 1024
# What a request target's path and query may hold (RFC 3986: pchar, "/", "?"), ASCII only: no
# space, no control character, nothing that could end the request line early.
_REQUEST_PATH = re.compile(r"/[A-Za-z0-9\-._~!$&'()*+,;=:@%/?]*")


class UpstreamError(Exception):
    """The request may have reached the worker: it failed while it was sent or while its
    answer was read (reset, closed early, no bytes in time, a malformed answer)."""


class ReadTimeout(UpstreamError):
    """The worker sent nothing for the read timeout while its answer was awaited (it took the
    request: a delivered failure, its own class so an operator reads "Timeout" in the error)."""


class NotDelivered(UpstreamError):
    """The request never left the proxy: no connection could be opened (refused, unreachable,
    not in time) or none came free in time. Retrying it elsewhere is always safe."""


class PoolExhausted(Exception):
    """No connection slot came free in time: the proxy's own limit (``max_connections``), not
    the worker's doing. Not an ``UpstreamError``: the worker never saw the request and must not
    be blamed for it; the request was not sent (safe to retry later, anywhere)."""


@dataclass(frozen=True, slots=True)
class Timeouts:
    """How long one request may wait, in seconds (``math.inf``: no limit)."""

    read_s: float  # the longest silence from the worker while its answer is awaited
    connect_s: float  # opening a TCP (and TLS) connection
    acquire_s: float  # waiting for a free connection slot and opening a connection, together


class Headers:
    """A response's headers as the worker sent them; names looked up case-insensitively."""

    __slots__ = ("_raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw = raw

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        # A scan, not a dict: an answer has a handful of headers and the legs read one or two.
        key = name.lower().encode("latin-1")
        for raw_name, value in self._raw:
            if raw_name.lower() == key:
                return value.decode("latin-1")
        return default


class _Origin:
    """One worker URL: where to connect, what every request to it starts with, its idle
    connections (oldest first)."""

    __slots__ = ("authority", "host", "idle", "port", "prefix", "server_hostname", "ssl", "timer",
                 "url")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) worker url: {url!r}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        # The Host header: an IPv6 address goes in brackets there (urlsplit drops them).
        self.authority = f"[{self.host}]:{self.port}" if ":" in self.host else (
            f"{self.host}:{self.port}")
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if parts.scheme == "https" else None
        )
        self.server_hostname = self.host if self.ssl is not None else None
        self.prefix = parts.path.rstrip("/")
        self.idle: list[_Connection] = []
        self.timer: asyncio.TimerHandle | None = None


class _Connection(asyncio.Protocol):
    """One TCP connection and the state of the answer it is reading (one at a time)."""

    def __init__(self, client: Http1Client, origin: _Origin) -> None:
        self.client = client
        self.origin = origin
        self.loop = client._loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.served = 0  # answers completed on this connection: >0 means it is a reused one
        self.idle_since = 0.0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.read_s = math.inf
        self.last_rx = 0.0
        self._reset()

    def _reset(self) -> None:
        self.active = False  # a request was sent and its answer is not released yet
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.interim = False  # a 1xx answer: the real one follows
        self.framed = False  # Content-Length or Transfer-Encoding: else the body ends at EOF
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.stray = False  # bytes after the answer's end: the connection cannot be reused
        self.error: UpstreamError | None = None

    # -- the request side -------------------------------------------------------------------

    def send(self, head: bytes, body: bytes, read_s: float) -> None:
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            # Nothing was written: the worker closed this connection as we picked it.
            raise NotDelivered(f"connection to {self.origin.url} closed before the request")
        self._reset()
        self.active = True
        if len(body) <= _JOIN_BODY_BYTES:
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        if math.isfinite(read_s):
            self.read_s = read_s
            self.last_rx = now = self.loop.time()
            self.timer = self.loop.call_at(now + read_s, self._check_silence)

    def finish(self) -> bool:
        """Stop reading this answer; True when the connection may serve another request."""
        self._stop_timer()
        self.active = False
        self.chunks = []
        reusable = (self.complete and self.keep_alive and not self.stray
                    and self.error is None and not self.closed)
        if reusable:
            self.served += 1
            if self.paused:
                self.paused = False
                self.transport.resume_reading()  # type: ignore[union-attr]
        return reusable

    def close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    async def wait(self) -> None:
        """Until the worker sent more, ended, or failed."""
        if self.paused:
            self.paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]
        waiter = self.waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check_silence(self) -> None:
        self.timer = None
        if not self.active or self.complete or self.error is not None:
            return
        now = self.loop.time()
        if self.paused:  # the reader is behind, not the worker
            self.timer = self.loop.call_at(now + self.read_s, self._check_silence)
            return
        due = self.last_rx + self.read_s
        if now + _SLACK_S >= due:
            self._fail(ReadTimeout(f"no bytes from {self.origin.url} for {self.read_s:g} s"))
        else:
            self.timer = self.loop.call_at(due, self._check_silence)

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.client._conns.add(self)

    def data_received(self, data: bytes) -> None:
        if not self.active or self.complete:
            # Bytes nobody asked for (after an answer's end, or on an idle connection): what
            # the next answer on this connection would be is unknown, so it is not reused.
            self.stray = True
            self.close()
            return
        if self.timer is not None:
            self.last_rx = self.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(UpstreamError(f"malformed answer from {self.origin.url}: {exc!r}"))
            return
        if self.stray:
            self.close()
        if self.buffered > _HIGH_WATER and not self.paused and not self.closed and (
            self.waiter is None or self.waiter.done()
        ):
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.client._conns.discard(self)
        if self.active and not self.complete and self.error is None:
            if self.headers_done and not self.framed and exc is None:
                # A body that ends when the worker closes: a clean close (FIN) is its end; a
                # reset (exc) cut it, and is a failure like any other cut below.
                self.complete = True
                self.keep_alive = False
            else:
                cause = f": {exc!r}" if exc is not None else ""
                reused = " (a reused connection)" if self.served else ""
                what = "its answer ended" if self.headers_done else "answering"
                self.error = UpstreamError(
                    f"{self.origin.url} closed the connection before {what}{reused}{cause}")
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.complete:
            self.stray = True
            return
        self.raw_headers.append((name, value))
        if len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        if self.complete:
            self.stray = True
            return
        self.status = self.parser.get_status_code()
        if self.status < 200:
            self.interim = True
        else:
            self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if self.complete:
            self.stray = True
            return
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.complete:
            self.stray = True
            return
        if self.interim:  # 100 Continue, 103 Early Hints: the answer itself comes next
            self.interim = False
            self.raw_headers = []
            self.framed = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._stop_timer()


class Response:
    """A worker's answer once its headers arrived. ``read()`` or iterating it to the end
    releases the connection; otherwise ``release()`` must be called (it may be called again)."""

    __slots__ = ("_body", "_client", "_conn", "_ended", "headers", "status")

    def __init__(self, client: Http1Client, conn: _Connection) -> None:
        self._client = client
        self._conn: _Connection | None = conn
        self._body: bytes | None = None
        self._ended = False
        self.status = conn.status
        self.headers = Headers(conn.raw_headers)

    async def read(self) -> bytes:
        """The whole body (again, if it was read before)."""
        if self._body is not None:
            return self._body
        conn = self._live()
        while not conn.complete:
            if conn.error is not None:
                raise conn.error
            await conn.wait()
        chunks = conn.chunks
        self._body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        conn.chunks = []
        self._ended = True
        self.release()
        return self._body

    def iter_chunks(self) -> Response:
        """The body's bytes as they arrive (de-chunked; any split), then the end."""
        return self

    def __aiter__(self) -> Response:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        if conn is None:
            if self._ended:
                raise StopAsyncIteration
            raise UpstreamError("the answer was released before its end")
        while True:
            chunks = conn.chunks
            if chunks:
                conn.chunks = []
                conn.buffered = 0
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if conn.complete:
                self._ended = True
                self.release()
                raise StopAsyncIteration
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    def release(self) -> None:
        """Give the connection back: to the pool if its answer ended, else closed."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            self._client._release(conn)

    def _live(self) -> _Connection:
        if self._conn is None:
            raise UpstreamError("the answer was released before its end")
        return self._conn


class Http1Client:
    """Keep-alive HTTP/1.1 connections to the workers, pooled per worker URL, at most
    ``max_connections`` in use at once. ``headers`` go on every request (the worker key).
    Open and use it inside one event loop; ``close()`` (or ``async with``) when done."""

    def __init__(
        self, max_connections: int, keepalive_s: float, headers: Mapping[str, str] | None = None
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._loop = asyncio.get_running_loop()
        self._limit = max_connections
        self._keepalive_s = keepalive_s
        self._fixed_headers = dict(headers or {})
        self._fixed = _header_lines(self._fixed_headers)
        self._fixed_names = frozenset(name.lower() for name in self._fixed_headers)
        self._in_use = 0  # connections held by requests, opening ones included
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._origins: dict[str, _Origin] = {}
        self._conns: set[_Connection] = set()
        self._closed = False

    async def __aenter__(self) -> Http1Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def in_use(self) -> int:
        """Connection slots held by requests now."""
        return self._in_use

    def idle(self, url: str) -> int:
        """Pooled idle connections to ``url`` now."""
        origin = self._origins.get(url)
        return 0 if origin is None else sum(not c.closed for c in origin.idle)

    async def request(
        self, method: str, url: str, path: str, body: bytes, headers: Mapping[str, str],
        timeouts: Timeouts, on_connection: Callable[[], None] | None = None,
    ) -> Response:
        """Send ``method`` with ``body`` to ``url`` + ``path``; the answer once its headers
        arrived. A header in ``headers`` replaces the client's own of that name.

        ``headers`` must not repeat Host, Content-Length or the client's own headers; ``path``
        must be a URL's path (and query) as it goes on the request line, or ValueError. Raises
        ``NotDelivered`` when the request never left, ``UpstreamError`` when it failed after,
        ``PoolExhausted`` when no connection slot came free in time. ``on_connection`` is
        called once a connection is held, before the request is sent (a caller's own limit on
        the worker's answer starts there, past the wait for the proxy's own connection).
        """
        if _REQUEST_PATH.fullmatch(path) is None:
            # A path decoded from a client's URL could hold a line break (a route pattern's
            # ``$`` matches before a trailing "\n") and split the request line.
            raise ValueError(f"not a request path that can go on a request line: {path!r}")
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = _Origin(url)
        # Built before a slot is taken: a header that cannot be sent is the caller's bug.
        fixed = self._fixed
        if self._fixed_names and any(name.lower() in self._fixed_names for name in headers):
            fixed = _header_lines(
                {k: v for k, v in self._fixed_headers.items() if k.lower() not in
                 {name.lower() for name in headers}}
            )
        head = (
            f"{method} {origin.prefix}{path} HTTP/1.1\r\nHost: {origin.authority}\r\n"
            f"{fixed}Content-Length: {len(body)}\r\n{_header_lines(headers)}\r\n"
        ).encode("latin-1")
        conn = await self._acquire(origin, timeouts)
        try:
            if on_connection is not None:
                on_connection()
            conn.send(head, body, timeouts.read_s)
            while not conn.headers_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            conn.close()
            self._free_slot()
            raise
        return Response(self, conn)

    # ``request("POST", ...)``, with no call of its own in between (the legs' hot path).
    post = partialmethod(request, "POST")

    def close(self) -> None:
        """Close every connection; requests waiting for a slot fail as not delivered."""
        self._closed = True
        for origin in self._origins.values():
            if origin.timer is not None:
                origin.timer.cancel()
                origin.timer = None
            origin.idle.clear()
        for conn in list(self._conns):
            conn.close()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(NotDelivered("the client was closed"))

    # -- connection slots and the pool ------------------------------------------------------

    async def _acquire(self, origin: _Origin, timeouts: Timeouts) -> _Connection:
        if self._closed:
            raise NotDelivered("the client was closed")
        loop = self._loop
        deadline = loop.time() + timeouts.acquire_s
        if self._in_use < self._limit and not self._waiters:
            self._in_use += 1
        else:
            await self._wait_for_slot(deadline, timeouts.acquire_s)
        try:
            conn = self._pooled(origin)
            if conn is None:
                conn = await self._connect(origin, timeouts, deadline)
        except BaseException:
            self._free_slot()
            raise
        return conn

    async def _wait_for_slot(self, deadline: float, acquire_s: float) -> None:
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout_at(deadline if math.isfinite(deadline) else None):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._free_slot()  # handed to us as we gave up: hand it on
            elif waiter in self._waiters:
                # Not left behind: a queue of dead waiters would make new requests wait for a
                # release that may never come.
                self._waiters.remove(waiter)
                waiter.cancel()
            if isinstance(exc, TimeoutError):
                raise PoolExhausted(
                    f"no free upstream connection within {acquire_s:g} s "
                    f"(all {self._limit} of the proxy's in use)") from None
            raise

    def _free_slot(self) -> None:
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; _in_use stays
                return
        self._in_use -= 1

    def _pooled(self, origin: _Origin) -> _Connection | None:
        idle = origin.idle
        if not idle:
            return None
        fresh_after = self._loop.time() - self._keepalive_s
        while idle:
            conn = idle.pop()  # the most recently used: the furthest from its expiry
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                # The worker closed it while idle (its connection_lost may not have run yet):
                # another connection, not a failed request, and no mark against the worker.
                conn.close()
                continue
            if conn.idle_since <= fresh_after:
                # The newest one expired, so did every older one.
                conn.close()
                for older in idle:
                    older.close()
                idle.clear()
                return None
            return conn
        return None

    async def _connect(self, origin: _Origin, timeouts: Timeouts, deadline: float) -> _Connection:
        loop = self._loop
        until = min(deadline, loop.time() + timeouts.connect_s)
        try:
            async with asyncio.timeout_at(until if math.isfinite(until) else None):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, origin), origin.host, origin.port,
                    ssl=origin.ssl, server_hostname=origin.server_hostname,
                )
        except TimeoutError:  # before OSError: TimeoutError is one
            raise NotDelivered(
                f"could not connect to {origin.url} within {timeouts.connect_s:g} s") from None
        except OSError as exc:
            raise NotDelivered(f"could not connect to {origin.url}: {exc!r}") from exc
        if self._closed:
            conn.close()
            raise NotDelivered("the client was closed")
        return conn

    def _release(self, conn: _Connection) -> None:
        if conn.finish() and not self._closed:
            origin = conn.origin
            conn.idle_since = self._loop.time()
            origin.idle.append(conn)
            if origin.timer is None:
                self._arm_expiry(origin)
        else:
            conn.close()
        self._free_slot()

    def _arm_expiry(self, origin: _Origin) -> None:
        if origin.idle:
            when = origin.idle[0].idle_since + self._keepalive_s
            origin.timer = self._loop.call_at(when, self._expire, origin)

    def _expire(self, origin: _Origin) -> None:
        origin.timer = None
        cutoff = self._loop.time() - self._keepalive_s + _SLACK_S
        idle = origin.idle
        gone = 0
        while gone < len(idle) and (idle[gone].closed or idle[gone].idle_since <= cutoff):
            idle[gone].close()
            gone += 1
        del idle[:gone]
        self._arm_expiry(origin)


def _header_lines(headers: Mapping[str, str]) -> str:
    lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    # One check for every name and value: each line may hold exactly its own CR LF, so a
    # header can never end early and smuggle in another.
    if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
        raise ValueError(f"a header name or value holds a line break: {dict(headers)!r}")
    return lines
