"""The proxy's upstream HTTP client: CPU per request of aiohttp's ClientSession against the lean
HTTP/1.1 client (stages.serve.proxy.client.http1), side by side in one run.

A local server in its own process (raw asyncio + httptools, keep-alive) answers what the two
legs ask of the workers: a small JSON body (a prefill's answer, or a non-streamed decode) and an
SSE stream of ``--chunks`` events in chunked encoding, either written at once ("burst": chunks
coalesce into a few reads) or one every ``--pace-ms`` ("paced": one read per event, as a decode
streams tokens). The client sends requests one after the other, used the way the legs use it,
and the client process's CPU time (time.process_time) per request is measured, with its wall
time.

    python -m examples.bench_upstream_client                     # from the repo root; ~1 min
    python -m examples.bench_upstream_client --requests 20000 --loop asyncio
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httptools
import orjson

from stages.serve.proxy.client.http1 import Http1Client, Timeouts

_PROMPT = orjson.dumps({
    "model": "m", "prompt": "word " * 60, "max_tokens": 1, "stream": False,
    "kv_transfer_params": {"do_remote_decode": True},
})
_JSON_BODY = orjson.dumps({
    "id": "cmpl-1", "object": "text_completion", "model": "m",
    "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 61, "completion_tokens": 1, "total_tokens": 62},
    "kv_transfer_params": {"remote_block_ids": list(range(8)), "remote_engine_id": "e" * 32,
                           "remote_host": "127.0.0.1", "remote_port": 5600},
})
_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity",
            "X-Request-Id": "bench-0123456789abcdef"}


def _event(i: int) -> bytes:
    choice = {"index": 0, "text": f" tok{i}", "finish_reason": None}
    return b"data: " + orjson.dumps({"id": "cmpl-1", "choices": [choice]}) + b"\n\n"


class _Server(asyncio.Protocol):
    """Keep-alive HTTP/1.1: POST /json answers _JSON_BODY, POST /stream an SSE stream."""

    def __init__(self, chunks: int, pace_s: float) -> None:
        self.chunks = chunks
        self.pace_s = pace_s
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.json_answer = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(_JSON_BODY) + _JSON_BODY
        )
        self.stream_head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                            b"transfer-encoding: chunked\r\n\r\n")
        events = [_event(i) for i in range(chunks - 1)] + [b"data: [DONE]\n\n"]
        self.frames = [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        if self.url == b"/json":
            self.transport.write(self.json_answer)
        elif self.pace_s > 0:
            self.transport.write(self.stream_head)
            loop = asyncio.get_running_loop()
            for i, frame in enumerate(self.frames):
                loop.call_later(self.pace_s * (i + 1), self._write, frame)
        else:
            self.transport.write(self.stream_head + b"".join(self.frames))

    def _write(self, frame: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(frame)


def _serve(chunks: int, pace_s: float, ports: mp.Queue) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Server(chunks, pace_s), "127.0.0.1", 0)
        ports.put((pace_s, server.sockets[0].getsockname()[1]))
        await server.serve_forever()

    uvloop.run(main())


@dataclass
class Figures:
    client: str
    case: str
    requests: int
    cpu_us: float
    wall_us: float


Request = Callable[[], Awaitable[None]]


async def _measure(client: str, case: str, send: Request, n: int) -> Figures:
    for _ in range(min(200, n)):  # warm: connections open, code paths hot
        await send()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        await send()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return Figures(client, case, n, cpu / n * 1e6, wall / n * 1e6)


async def _run(url: str, paced_url: str, args: argparse.Namespace) -> list[Figures]:
    import aiohttp

    # As the proxy configured its aiohttp session before it moved to http1 alone.
    timeout = aiohttp.ClientTimeout(total=None, connect=603.0, sock_connect=3.0, sock_read=600.0)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=4096, limit_per_host=0, keepalive_timeout=4.0),
        timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
    )
    lean = Http1Client(4096, 4.0, {})
    limits = Timeouts(read_s=600.0, connect_s=3.0, acquire_s=603.0)
    chunks_seen: list[int] = []

    async def aiohttp_json() -> None:
        async with session.post(url + "/json", data=_PROMPT, headers=_HEADERS,
                                timeout=timeout) as resp:
            await resp.read()

    async def lean_json() -> None:
        resp = await lean.post(url, "/json", _PROMPT, _HEADERS, limits)
        try:
            await resp.read()
        finally:
            resp.release()

    def aiohttp_stream(base: str) -> Request:
        async def send() -> None:
            resp = await session.post(base + "/stream", data=_PROMPT, headers=_HEADERS,
                                      timeout=timeout)
            try:
                n = 0
                async for _ in resp.content.iter_any():
                    n += 1
                chunks_seen.append(n)
            finally:
                resp.release()
        return send

    def lean_stream(base: str) -> Request:
        async def send() -> None:
            resp = await lean.post(base, "/stream", _PROMPT, _HEADERS, limits)
            try:
                n = 0
                async for _ in resp.iter_chunks():
                    n += 1
                chunks_seen.append(n)
            finally:
                resp.release()
        return send

    cases: list[tuple[str, str, Request, int]] = [
        ("aiohttp", "json", aiohttp_json, args.requests),
        ("http1", "json", lean_json, args.requests),
        ("aiohttp", "stream burst", aiohttp_stream(url), args.requests),
        ("http1", "stream burst", lean_stream(url), args.requests),
        ("aiohttp", "stream paced", aiohttp_stream(paced_url), args.paced_requests),
        ("http1", "stream paced", lean_stream(paced_url), args.paced_requests),
    ]
    figures = []
    try:
        for client, case, send, n in cases:
            chunks_seen.clear()
            figures.append(await _measure(client, case, send, n))
            if chunks_seen:
                print(f"  {client:8s} {case:13s} reads per stream: "
                      f"{sum(chunks_seen) / len(chunks_seen):.1f}")
    finally:
        await session.close()
        lean.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000, help="per client, json and burst")
    parser.add_argument("--paced-requests", type=int, default=500)
    parser.add_argument("--chunks", type=int, default=20, help="SSE events per stream")
    parser.add_argument("--pace-ms", type=float, default=0.5, help="between paced events")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the client's event loop (the proxy runs on uvloop under uvicorn)")
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    ports: mp.Queue = ctx.Queue()
    servers = [ctx.Process(target=_serve, args=(args.chunks, pace, ports), daemon=True)
               for pace in (0.0, args.pace_ms / 1e3)]
    for server in servers:
        server.start()
    try:
        port_of = dict(ports.get(timeout=30) for _ in servers)  # pace -> port
        urls = [f"http://127.0.0.1:{port_of[pace]}" for pace in (0.0, args.pace_ms / 1e3)]
        if args.loop == "uvloop":
            import uvloop

            figures = uvloop.run(_run(*urls, args))
        else:
            figures = asyncio.run(_run(*urls, args))
    finally:
        for server in servers:
            server.kill()
    print(f"\nclient loop: {args.loop}; {args.chunks} events per stream, "
          f"paced every {args.pace_ms:g} ms")
    print(f"{'case':14s} {'client':8s} {'requests':>8s} {'CPU us/req':>11s} "
          f"{'wall us/req':>12s} {'CPU vs aiohttp':>15s}")
    base = {f.case: f.cpu_us for f in figures if f.client == "aiohttp"}
    for f in figures:
        ratio = f.cpu_us / base[f.case] if base.get(f.case) else math.nan
        print(f"{f.case:14s} {f.client:8s} {f.requests:8d} {f.cpu_us:11.1f} "
              f"{f.wall_us:12.1f} {ratio:15.2f}")


if __name__ == "__main__":
    main()
