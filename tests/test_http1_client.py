"""The lean HTTP/1.1 client of the proxy's two legs (stages.serve.proxy.client.http1), against real
local servers written here: each test's server is an asyncio server on 127.0.0.1 in the test's
own loop, scripted to answer the way the test needs (framings, keep-alive, failures)."""

from __future__ import annotations

import asyncio
import gzip
import math
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

import pytest

from stages.serve.proxy.client.http1 import (
    Http1Client,
    NotDelivered,
    PoolExhausted,
    ReadTimeout,
    Timeouts,
    UpstreamError,
)

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]
FAST = Timeouts(read_s=5.0, connect_s=2.0, acquire_s=7.0)


_loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None


@pytest.fixture(autouse=True, params=["asyncio", "uvloop"])
def event_loop_kind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test on both loops: the proxy runs on uvloop under uvicorn, whose transports are
    its own implementation."""
    global _loop_factory
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        _loop_factory = uvloop.new_event_loop
    yield
    _loop_factory = None


def run(coro: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(20):  # a hang fails the test instead of stalling the run
            await coro

    with asyncio.Runner(loop_factory=_loop_factory) as runner:
        runner.run(bounded())


class Server:
    """Runs ``handler`` on each connection; counts connections, requests and disconnects."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body) as received
        self.disconnects = 0
        self.disconnected = asyncio.Event()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._on_connection, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self)
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """The next request's body; None when the client closed the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        self.requests.append((head, body))
        return body

    async def wait_for_close(self, reader: asyncio.StreamReader) -> None:
        """Until the client closes its end (what a worker sees when the client left)."""
        while await reader.read(65536):
            pass
        self.disconnects += 1
        self.disconnected.set()


def answer(body: bytes, *headers: str, status: str = "200 OK") -> bytes:
    lines = "".join(f"{h}\r\n" for h in headers)
    return (f"HTTP/1.1 {status}\r\n{lines}Content-Length: {len(body)}\r\n\r\n").encode() + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def keep_answering(*headers: str, body: bytes = b'{"ok":true}') -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(answer(body, "Content-Type: application/json", *headers))
            await writer.drain()
        server.disconnects += 1
        server.disconnected.set()

    return handle


def refused_url() -> str:
    with socket.socket() as sock:  # bound, never listening: connecting is refused
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


# -- bodies ---------------------------------------------------------------------------------


def test_a_content_length_body_and_the_request_as_the_worker_sees_it() -> None:
    async def main() -> None:
        async with Server(keep_answering("X-Thing: 1")) as server:
            async with Http1Client(8, 4.0, {"Authorization": "Bearer wk"}) as client:
                resp = await client.post(server.url, "/v1/completions", b'{"prompt":"hi"}',
                                         {"X-Request-Id": "r1", "traceparent": "00-ab"}, FAST)
                assert resp.status == 200
                assert resp.headers.get("content-type") == "application/json"
                assert resp.headers.get("CONTENT-TYPE") == "application/json"
                assert resp.headers.get("x-missing") is None
                assert resp.headers.get("x-missing", "d") == "d"
                assert await resp.read() == b'{"ok":true}'
                assert await resp.read() == b'{"ok":true}'  # read again: the same bytes
                assert client.in_use == 0
        head, body = server.requests[0]
        assert body == b'{"prompt":"hi"}'
        lines = head.decode().split("\r\n")
        assert lines[0] == "POST /v1/completions HTTP/1.1"
        port = server.url.rsplit(":", 1)[1]
        for line in (f"Host: 127.0.0.1:{port}", "Authorization: Bearer wk", "X-Request-Id: r1",
                     "traceparent: 00-ab", f"Content-Length: {len(body)}"):
            assert line in lines

    run(main())


def test_a_chunked_body_is_read_whole_and_de_chunked() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for part in (b"hello ", b"chunked ", b"world"):
                writer.write(chunk(part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")

    async def main() -> None:
        async with Server(handle) as server, Http1Client(8, 4.0) as client:
            for _ in range(3):
                resp = await client.post(server.url, "/x", b"{}", {}, FAST)
                assert await resp.read() == b"hello chunked world"
            assert server.connections == 1  # a chunked answer read to its end: reused

    run(main())


def test_a_body_that_ends_when_the_worker_closes() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"the end")
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with Server(handle) as server, Http1Client(8, 4.0) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            assert await resp.read() == b"until the end"
            assert client.idle(server.url) == 0
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            assert [c async for c in resp.iter_chunks()] != []
            assert server.connections == 2

    run(main())


def test_bytes_come_as_the_worker_sent_them_never_decompressed() -> None:
    packed = gzip.compress(b'{"text":"zipped"}')

    async def main() -> None:
        handler = keep_answering("Content-Encoding: gzip", body=packed)
        async with Server(handler) as server, Http1Client(8, 4.0) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            assert resp.headers.get("content-encoding") == "gzip"
            assert await resp.read() == packed

    run(main())


def test_an_interim_answer_is_skipped_for_the_real_one() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
            await writer.drain()
            writer.write(answer(b"real", "X-Final: yes", status="201 Created"))

    async def main() -> None:
        async with Server(handle) as server, Http1Client(8, 4.0) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            assert (resp.status, resp.headers.get("x-final")) == (201, "yes")
            assert resp.headers.get("link") is None
            assert await resp.read() == b"real"

    run(main())


# -- streaming ------------------------------------------------------------------------------


def test_streamed_chunks_arrive_as_they_are_sent() -> None:
    async def main() -> None:
        may_continue = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         server: Server) -> None:
            while await server.read_request(reader) is not None:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for i in range(3):
                    writer.write(chunk(b"data: %d\n\n" % i))
                    await writer.drain()
                    # The next event goes out only once the client holds this one: nothing
                    # can be buffered to the end.
                    await may_continue.wait()
                    may_continue.clear()
                writer.write(b"0\r\n\r\n")

        async with Server(handle) as server, Http1Client(8, 4.0) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            assert resp.headers.get("content-type") == "text/event-stream"
            got = []
            async for block in resp.iter_chunks():
                got.append(block)
                may_continue.set()
            assert got == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
            assert client.in_use == 0 and client.idle(server.url) == 1  # ended: pooled

    run(main())


def test_a_large_stream_read_slowly_arrives_whole() -> None:
    # More than the client buffers before it stops reading: flow control must not lose or
    # stall anything.
    part = bytes(range(256)) * 256  # 64 KiB
    parts = 64

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(parts):
                writer.write(chunk(part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")

    async def main() -> None:
        async with Server(handle) as server, Http1Client(8, 4.0) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            received = bytearray()
            async for block in resp.iter_chunks():
                received += block
                await asyncio.sleep(0.002)
            assert bytes(received) == part * parts
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            assert await resp.read() == part * parts
            assert server.connections == 1

    run(main())


# -- the pool -------------------------------------------------------------------------------


def test_sequential_requests_share_one_connection() -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server, Http1Client(8, 4.0) as client:
            for _ in range(50):
                resp = await client.post(server.url, "/x", b"{}", {}, FAST)
                assert await resp.read() == b'{"ok":true}'
            assert server.connections == 1
            assert len(server.requests) == 50
            assert client.idle(server.url) == 1 and client.in_use == 0

    run(main())


def test_an_answer_released_before_its_end_closes_the_connection() -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         server: Server) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(chunk(b"data: first\n\n"))
            await writer.drain()
            await server.wait_for_close(reader)  # as vLLM does: the client left, abort

        async with Server(handle) as server, Http1Client(8, 4.0) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            assert await anext(resp.iter_chunks()) == b"data: first\n\n"
            resp.release()
            resp.release()  # twice is harmless
            async with asyncio.timeout(2):
                await server.disconnected.wait()
            assert client.in_use == 0 and client.idle(server.url) == 0
            with pytest.raises(UpstreamError, match="released"):
                await anext(resp.iter_chunks())

    run(main())


def test_connection_close_is_honoured() -> None:
    async def main() -> None:
        # The worker says close but leaves the socket open: the client must still not reuse it.
        async with Server(keep_answering("Connection: close")) as server:
            async with Http1Client(8, 4.0) as client:
                for _ in range(3):
                    resp = await client.post(server.url, "/x", b"{}", {}, FAST)
                    assert await resp.read() == b'{"ok":true}'
                    assert client.idle(server.url) == 0
                assert server.connections == 3

    run(main())


def test_idle_connections_close_after_the_keepalive() -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server, Http1Client(8, 0.2) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            await resp.read()
            assert client.idle(server.url) == 1
            async with asyncio.timeout(2):
                await server.disconnected.wait()  # closed by the client, not the worker
            assert client.idle(server.url) == 0
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            await resp.read()
            assert server.connections == 2

    run(main())


def test_an_expired_connection_is_never_used_even_before_its_timer_ran() -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server, Http1Client(8, 0.05) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            await resp.read()
            # Blocks the loop past the keep-alive: the expiry timer has had no chance to run.
            time.sleep(0.1)
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            await resp.read()
            assert server.connections == 2

    run(main())


def test_waiting_for_a_free_connection_is_bounded_and_served_in_turn() -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server, Http1Client(1, 4.0) as client:
            held = await client.post(server.url, "/x", b"{}", {}, FAST)
            short = Timeouts(read_s=5.0, connect_s=2.0, acquire_s=0.1)
            with pytest.raises(PoolExhausted, match="no free upstream connection") as caught:
                await client.post(server.url, "/x", b"{}", {}, short)
            # The proxy's own limit: no failure of the worker's (legs catch UpstreamError).
            assert not isinstance(caught.value, UpstreamError)
            assert client.in_use == 1
            waiting = asyncio.create_task(client.post(server.url, "/x", b"{}", {}, FAST))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            await held.read()  # read to its end: the slot passes to the waiting request
            resp = await waiting
            assert await resp.read() == b'{"ok":true}'
            assert client.in_use == 0
            assert server.connections == 1

    run(main())


def test_on_connection_is_called_once_a_connection_is_held_not_while_waiting() -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server, Http1Client(1, 4.0) as client:
            held = await client.post(server.url, "/x", b"{}", {}, FAST)
            calls: list[int] = []
            waiting = asyncio.create_task(client.post(
                server.url, "/x", b"{}", {}, FAST, lambda: calls.append(len(server.requests))))
            await asyncio.sleep(0.1)
            assert calls == []  # still waiting for the proxy's own connection
            await held.read()
            await (await waiting).read()
            assert calls == [1]  # once, before its request went out

    run(main())


def test_a_request_cancelled_while_waiting_for_a_slot_leaks_nothing() -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server, Http1Client(1, 4.0) as client:
            held = await client.post(server.url, "/x", b"{}", {}, FAST)
            waiting = asyncio.create_task(client.post(server.url, "/x", b"{}", {}, FAST))
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            held.release()
            assert client.in_use == 0
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)  # not stuck behind it
            await resp.read()

    run(main())


def test_a_request_cancelled_while_awaiting_its_answer_closes_and_frees_its_slot() -> None:
    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         server: Server) -> None:
            body = await server.read_request(reader)
            if body == b"hang":
                await server.wait_for_close(reader)
                return
            writer.write(answer(b"fine"))
            await server.read_request(reader)

        async with Server(handle) as server, Http1Client(1, 4.0) as client:
            task = asyncio.create_task(client.post(server.url, "/x", b"hang", {}, FAST))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client.in_use == 0
            async with asyncio.timeout(2):
                await server.disconnected.wait()
            resp = await client.post(server.url, "/x", b"ok", {}, FAST)
            assert await resp.read() == b"fine"

    run(main())


def test_a_header_that_would_break_the_request_is_refused_before_anything_is_sent() -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server, Http1Client(1, 4.0) as client:
            with pytest.raises(ValueError, match="line break"):
                await client.post(server.url, "/x", b"{}", {"X-A": "a\r\nX-B: b"}, FAST)
            assert client.in_use == 0 and server.connections == 0

    run(main())


@pytest.mark.parametrize("path", ["/x\n", "/x\r\nHost: evil", "/x y", "/x\tz", "x",
                                  "/caf\u00e9", "/x\x00"])
def test_a_path_that_would_break_the_request_line_is_refused_before_anything_is_sent(
        path: str) -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server, Http1Client(1, 4.0) as client:
            with pytest.raises(ValueError, match="request path"):
                await client.post(server.url, path, b"{}", {}, FAST)
            assert client.in_use == 0 and server.connections == 0
            resp = await client.post(server.url, "/v1/x-y_z.~%20?a=b&c=d", b"{}", {}, FAST)
            assert await resp.read() == b'{"ok":true}'

    run(main())


# -- failures -------------------------------------------------------------------------------


def test_a_refused_connection_was_not_delivered() -> None:
    async def main() -> None:
        async with Http1Client(4, 4.0) as client:
            with pytest.raises(NotDelivered, match="could not connect"):
                await client.post(refused_url(), "/x", b"{}", {}, FAST)
            assert client.in_use == 0

    run(main())


def test_a_worker_that_closes_mid_body_fails_as_delivered() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
        await writer.drain()

    async def main() -> None:
        async with Server(handle) as server, Http1Client(4, 4.0) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            with pytest.raises(UpstreamError, match="before its answer ended") as caught:
                await resp.read()
            assert not isinstance(caught.value, NotDelivered)
            resp.release()
            assert client.in_use == 0 and client.idle(server.url) == 0

            # The same mid-stream: the chunks before the cut arrive, then the error.
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            chunks = resp.iter_chunks()
            assert await anext(chunks) == b"only ten b"
            with pytest.raises(UpstreamError):
                await anext(chunks)
            resp.release()

    run(main())


def test_a_body_without_framing_cut_by_a_reset_fails_and_one_closed_cleanly_ends() -> None:
    """Without Content-Length or chunks the body ends when the worker closes: a FIN ends it,
    a reset (a crashed worker, a dropped connection) cuts it and is an error."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        body = await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npartial ")
        await writer.drain()
        await asyncio.sleep(0.1)  # the head and the first bytes are read before the end
        if body == b"reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # closed with linger 0: a RST, not a FIN
        else:
            writer.write(b"end")
            await writer.drain()
            writer.close()

    async def main() -> None:
        async with Server(handle) as server, Http1Client(4, 4.0) as client:
            resp = await client.post(server.url, "/x", b"reset", {}, FAST)
            with pytest.raises(UpstreamError, match="before its answer ended"):
                await resp.read()
            resp.release()
            resp = await client.post(server.url, "/x", b"reset", {}, FAST)
            chunks = resp.iter_chunks()
            assert await anext(chunks) == b"partial "
            with pytest.raises(UpstreamError):
                await anext(chunks)
            resp.release()
            resp = await client.post(server.url, "/x", b"fin", {}, FAST)
            assert await resp.read() == b"partial end"
            assert client.in_use == 0 and client.idle(server.url) == 0

    run(main())


def test_a_connection_the_worker_closed_while_idle_is_replaced_not_failed() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        await server.read_request(reader)
        writer.write(answer(b"ok"))
        await writer.drain()
        # The worker's keep-alive ends: it closes the idle connection (writer.close in Server).

    async def main() -> None:
        async with Server(handle) as server, Http1Client(4, 4.0) as client:
            for _ in range(2):
                resp = await client.post(server.url, "/x", b"{}", {}, FAST)
                assert await resp.read() == b"ok"
                async with asyncio.timeout(5):  # the worker's close arrives while it is idle
                    while client.idle(server.url):
                        await asyncio.sleep(0.01)
            assert server.connections == 2 and len(server.requests) == 2
            assert client.in_use == 0

    run(main())


def test_a_failure_on_a_reused_connection_is_reported_not_resent() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        await server.read_request(reader)
        writer.write(answer(b"first"))
        await writer.drain()
        await server.read_request(reader)  # took the second request, then went away

    async def main() -> None:
        async with Server(handle) as server, Http1Client(4, 4.0) as client:
            resp = await client.post(server.url, "/x", b"1", {}, FAST)
            assert await resp.read() == b"first"
            with pytest.raises(UpstreamError, match="reused connection") as caught:
                await client.post(server.url, "/x", b"2", {}, FAST)
            assert not isinstance(caught.value, NotDelivered)  # the worker may have run it
            assert [body for _, body in server.requests] == [b"1", b"2"]  # sent once
            assert client.in_use == 0

    run(main())


def test_a_silent_worker_times_out_between_bytes() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        body = await server.read_request(reader)
        if body == b"headers":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(4):  # bytes keep coming, each within the limit: no timeout
                await asyncio.sleep(0.1)
                writer.write(chunk(b"tick"))
        await server.wait_for_close(reader)

    async def main() -> None:
        quick = Timeouts(read_s=0.25, connect_s=2.0, acquire_s=2.25)
        async with Server(handle) as server, Http1Client(4, 4.0) as client:
            with pytest.raises(ReadTimeout, match=r"no bytes .* for 0.25 s"):
                await client.post(server.url, "/x", b"nothing", {}, quick)
            resp = await client.post(server.url, "/x", b"headers", {}, quick)
            got = []
            with pytest.raises(ReadTimeout, match="no bytes"):
                async for block in resp.iter_chunks():
                    got.append(block)
            assert b"".join(got) == b"tick" * 4
            resp.release()
            assert client.in_use == 0

    run(main())


def test_a_garbage_answer_fails_as_delivered_without_hanging() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await server.wait_for_close(reader)

    async def main() -> None:
        async with Server(handle) as server, Http1Client(4, 4.0) as client:
            with pytest.raises(UpstreamError, match="malformed answer") as caught:
                await client.post(server.url, "/x", b"{}", {}, FAST)
            assert not isinstance(caught.value, NotDelivered)
            assert client.in_use == 0
            async with asyncio.timeout(2):
                await server.disconnected.wait()

    run(main())


def test_bytes_after_an_answer_keep_its_connection_out_of_the_pool() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(answer(b"body") + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra")

    async def main() -> None:
        async with Server(handle) as server, Http1Client(4, 4.0) as client:
            for _ in range(2):
                resp = await client.post(server.url, "/x", b"{}", {}, FAST)
                assert await resp.read() == b"body"
            assert server.connections == 2
            assert client.idle(server.url) == 0

    run(main())


def test_a_closed_client_refuses_new_requests_as_not_delivered() -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server:
            client = Http1Client(4, 4.0)
            resp = await client.post(server.url, "/x", b"{}", {}, FAST)
            await resp.read()
            client.close()
            with pytest.raises(NotDelivered, match="closed"):
                await client.post(server.url, "/x", b"{}", {}, FAST)
            async with asyncio.timeout(2):
                await server.disconnected.wait()

    run(main())


def test_no_read_limit_means_no_timer() -> None:
    async def main() -> None:
        forever = Timeouts(read_s=math.inf, connect_s=math.inf, acquire_s=math.inf)
        async with Server(keep_answering()) as server, Http1Client(4, 4.0) as client:
            resp = await client.post(server.url, "/x", b"{}", {}, forever)
            assert await resp.read() == b'{"ok":true}'

    run(main())


def test_a_worker_url_with_a_path_and_an_ipv6_worker() -> None:
    async def main() -> None:
        async with Server(keep_answering()) as server, Http1Client(4, 4.0) as client:
            resp = await client.post(server.url + "/base/", "/v1/completions", b"{}", {}, FAST)
            await resp.read()
            assert server.requests[0][0].startswith(b"POST /base/v1/completions HTTP/1.1\r\n")
        try:
            v6 = await asyncio.start_server(lambda r, w: None, "::1", 0)
        except OSError:
            return  # no IPv6 loopback here
        v6.close()
        server = Server(keep_answering())
        server._server = await asyncio.start_server(server._on_connection, "::1", 0)
        port = server._server.sockets[0].getsockname()[1]
        async with Http1Client(4, 4.0) as client:
            resp = await client.post(f"http://[::1]:{port}", "/x", b"{}", {}, FAST)
            assert await resp.read() == b'{"ok":true}'
        server._server.close()
        assert f"Host: [::1]:{port}\r\n".encode() in server.requests[0][0]

    run(main())
