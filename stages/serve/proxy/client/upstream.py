"""The proxy's HTTP clients to its workers and peers, their timeouts, their errors.

One client (``http1``) carries every call; a proxy holds two of its pools. The legs of every
client request (a prefill, then a decode) have one to themselves: they are the hot path. Health
probes, self-checks, /v1/models and peers share the other, so a burst of requests holding every
leg connection never starves the probes that keep workers in rotation.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from stages.serve.proxy.client.http1 import (
    Headers,
    Http1Client,
    NotDelivered,
    Timeouts,
    UpstreamError,
)
from stages.serve.proxy.config import ProxyConfig

# Raised before the request left the proxy (refused, unreachable, no connection in time): the
# worker never saw it.
NOT_DELIVERED: tuple[type[Exception], ...] = (NotDelivered,)
# Every failure of a request or of reading its answer, the ones above included; the decode
# leg's first-token deadline and a call's overall limit raise ``TimeoutError``.
UPSTREAM_ERRORS: tuple[type[Exception], ...] = (UpstreamError, TimeoutError)

# Idle connections are closed before the workers' own keep-alive (uvicorn's and vLLM's default
# is 5 s) can end them: neither client resends a POST that went out on a connection the worker
# was closing at that moment, so that race would fail a request.
KEEPALIVE_S = 4.0


def leg_limits(read_s: float, connect_s: float) -> Timeouts:
    """``read_s`` bounds every wait for the worker's next bytes, ``connect_s`` opening a
    connection, and waiting for a free connection and opening one together get ``read_s +
    connect_s``. No total: a decode stream may run as long as it keeps sending.
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
    return Http1Client(config.max_connections, KEEPALIVE_S, worker_headers(config))


def open_control_client(config: ProxyConfig) -> Http1Client:
    """The client of every other upstream call of one proxy (health checks, self-checks, peers,
    /v1/models; call inside its loop). It sends the worker key too: a peer's call replaces it
    with the admin key it passes on."""
    return Http1Client(config.max_connections, KEEPALIVE_S, worker_headers(config))


@dataclass(frozen=True)
class Reply:
    """An answer read to its end."""

    status: int
    headers: Headers
    content: bytes


async def fetch(
    client: Http1Client, method: str, url: str, path: str, timeouts: Timeouts,
    headers: Mapping[str, str] | None = None, body: bytes = b"",
) -> Reply:
    """``method`` ``url`` + ``path``, its answer read whole (the connection then goes back to
    the pool); raises as ``Http1Client.request`` does."""
    resp = await client.request(method, url, path, body, headers or {}, timeouts)
    try:
        return Reply(resp.status, resp.headers, await resp.read())
    finally:
        resp.release()
