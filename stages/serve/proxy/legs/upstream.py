"""The proxy's HTTP clients to its workers, their timeouts, their errors.

The two legs of every client request (a prefill, then a decode) go through ``http1``'s lean
pooled client: they are the proxy's hot path, and aiohttp's client was its largest single share
of CPU per request. Everything else that talks to a worker (health checks, self-checks, peers,
/v1/models) goes through one pooled aiohttp session, where features matter more than
microseconds. (aiohttp rather than httpx there: httpx's own CPU per request was most of the
latency the proxy added when it carried the legs.)
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import aiohttp

from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.legs.http1 import Http1Client, NotDelivered, Timeouts, UpstreamError

# Raised before the request left the proxy (refused, unreachable, no connection in time): the
# worker never saw it.
NOT_DELIVERED: tuple[type[Exception], ...] = (
    NotDelivered,
    aiohttp.ClientConnectorError,
    aiohttp.ConnectionTimeoutError,
)
# Every failure of a request or of reading its answer, the ones above included. The timeouts of
# ``leg_timeout`` raise ``aiohttp.ServerTimeoutError`` (a ``ClientError``), but aiohttp lets a
# bare ``TimeoutError`` from the socket through in rare cases (aio-libs/aiohttp#9952), which is
# the same failure; the decode leg's first-token deadline raises one too.
UPSTREAM_ERRORS: tuple[type[Exception], ...] = (UpstreamError, aiohttp.ClientError, TimeoutError)

# Idle connections are closed before the workers' own keep-alive (uvicorn's and vLLM's default
# is 5 s) can end them: neither client resends a POST that went out on a connection the worker
# was closing at that moment, so that race would fail a request.
_KEEPALIVE_S = 4.0


def leg_timeout(read_s: float, connect_s: float) -> aiohttp.ClientTimeout:
    """``read_s`` bounds every wait for the worker's next bytes, ``connect_s`` opening a
    connection, and waiting for a free pooled connection gets ``read_s`` on top (aiohttp's
    ``connect`` covers the pool wait and the connect together). No total: a decode stream may
    run as long as it keeps sending.
    """
    return aiohttp.ClientTimeout(
        total=None, connect=read_s + connect_s, sock_connect=connect_s, sock_read=read_s
    )


def leg_limits(read_s: float, connect_s: float) -> Timeouts:
    """The legs' limits, as ``leg_timeout`` sets aiohttp's: ``read_s`` bounds every wait for
    the worker's next bytes, ``connect_s`` opening a connection, and waiting for a free
    connection and opening one together get ``read_s + connect_s``.
    """
    return Timeouts(read_s=read_s, connect_s=connect_s, acquire_s=read_s + connect_s)


def start_at_connection(deadline: asyncio.Timeout, limit_s: float) -> Callable[[], None] | None:
    """``Http1Client.post``'s ``on_connection`` that sets ``deadline`` ``limit_s`` from the
    moment a connection is held (None for an infinite limit: nothing to set)."""
    if not math.isfinite(limit_s):
        return None

    def start() -> None:
        deadline.reschedule(asyncio.get_running_loop().time() + limit_s)

    return start


def bearer_header(key: str | None) -> dict[str, str]:
    """vLLM's ``--api-key`` header for ``key``; none without one."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def worker_headers(config: ProxyConfig) -> dict[str, str]:
    """Headers on every request to a worker (completions, /v1/models, health checks).

    The one place the worker key is added: workers started with vLLM's --api-key want it on
    /v1/*, and the client's own key (checked by the proxy) is never passed on.
    """
    return bearer_header(config.worker_api_key)


def open_leg_client(config: ProxyConfig) -> Http1Client:
    """The client the prefill and decode legs of one proxy go through (call inside its loop;
    ``async with`` closes it). It sends no cookies and never decompresses: bytes are relayed as
    they come."""
    return Http1Client(config.max_connections, _KEEPALIVE_S, worker_headers(config))


def open_session(config: ProxyConfig) -> aiohttp.ClientSession:
    """The session every other upstream request of one proxy goes through (health checks,
    self-checks, peers, /v1/models; call inside its loop)."""
    connector = aiohttp.TCPConnector(
        limit=config.max_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S
    )
    return aiohttp.ClientSession(
        connector=connector,
        headers=worker_headers(config),
        timeout=leg_timeout(config.decode_timeout_s, config.connect_timeout_s),
        # Bytes are relayed as they come, never decompressed and re-compressed.
        auto_decompress=False,
        # Workers set no cookies, and one client's must never ride along on another's request.
        cookie_jar=aiohttp.DummyCookieJar(),
    )
