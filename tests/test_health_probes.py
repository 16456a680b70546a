"""Active health probes: every worker, healthy or not, is taken out and re-admitted on time."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterator

import pytest

from stages.serve.proxy.client.http1 import Http1Client
from stages.serve.proxy.client.upstream import leg_limits
from stages.serve.proxy.ops.health import Prober
from stages.serve.proxy.view.workers import WorkerPool
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker


@pytest.fixture
def fake() -> Iterator[tuple[FakeBehavior, str]]:
    behavior = FakeBehavior("d0")
    with BackgroundServer(create_fake_worker(behavior), "critical") as server:
        yield behavior, server.url


async def _silent_server() -> tuple[asyncio.Server, str]:
    """Accepts connections and never answers: a worker too busy or hung to reply."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the prober gives up and closes

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _run(check: Callable[[Prober], Awaitable[None]]) -> None:
    async def main() -> None:
        async with Http1Client(16, 4.0) as client:
            await check(Prober(client, leg_limits(0.3, 0.3)))

    asyncio.run(main())


def dead_url() -> str:
    """A localhost port with nothing listening (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_healthy_worker_that_says_it_is_not_leaves_at_once_and_returns(
    fake: tuple[FakeBehavior, str],
) -> None:
    behavior, url = fake
    pool = WorkerPool([url], "decode")

    async def check(prober: Prober) -> None:
        await prober.probe_all([pool])
        assert pool.healthy(0)
        behavior.healthy = False  # vLLM answers 503 once its engine died
        await prober.probe_all([pool])
        assert not pool.healthy(0)
        assert pool.views()[0].last_error == "health probe: /health answered 503"
        behavior.healthy = True
        await prober.probe_all([pool])
        assert pool.healthy(0)

    _run(check)


def test_a_worker_with_nothing_listening_leaves_at_the_first_probe() -> None:
    pool = WorkerPool([dead_url()], "prefill")

    async def check(prober: Prober) -> None:
        await prober.probe_all([pool])
        assert not pool.healthy(0)
        assert "no connection" in (pool.views()[0].last_error or "")

    _run(check)


def test_a_slow_answer_leaves_only_after_several_in_a_row() -> None:
    async def check(prober: Prober) -> None:
        server, url = await _silent_server()
        pool = WorkerPool([url], "decode")
        async with server:
            await prober.probe_all([pool])
            assert pool.healthy(0)  # one late answer: a loaded worker, not a broken one
            await prober.probe_all([pool])
            assert not pool.healthy(0)
            assert "2 probes in a row" in (pool.views()[0].last_error or "")

    _run(check)


def test_the_reason_a_worker_left_for_is_kept_while_probes_keep_failing() -> None:
    pool = WorkerPool([dead_url()], "decode")
    pool.mark_unhealthy(0, "stream broke: ServerDisconnectedError()")

    async def check(prober: Prober) -> None:
        for _ in range(3):
            await prober.probe_all([pool])
        assert pool.views()[0].last_error == "stream broke: ServerDisconnectedError()"

    _run(check)


def test_probes_run_concurrently(fake: tuple[FakeBehavior, str]) -> None:
    _, url = fake

    async def check(prober: Prober) -> None:
        servers = [await _silent_server() for _ in range(3)]
        pool = WorkerPool([url, *(u for _, u in servers)], "decode")
        loop = asyncio.get_running_loop()
        started = loop.time()
        await prober.probe_all([pool])
        # Three hanging workers cost one timeout, not three.
        assert loop.time() - started < 0.8
        assert pool.healthy(0)
        for server, _ in servers:
            server.close()

    _run(check)


def test_a_probe_answered_before_a_request_failed_does_not_bring_the_worker_back(
    fake: tuple[FakeBehavior, str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stages.serve.proxy.ops import health

    _, url = fake
    pool = WorkerPool([url], "decode")
    real_fetch = health.fetch

    async def answered_then_a_request_fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        reply = await real_fetch(*args, **kwargs)  # 200, from before the failure below
        pool.record_failure(0, "answered 503")  # a request's failure, while the probe was out
        return reply

    async def check(prober: Prober) -> None:
        monkeypatch.setattr(health, "fetch", answered_then_a_request_fails)
        await prober.probe_all([pool])
        assert not pool.healthy(0)  # the failure stands
        monkeypatch.setattr(health, "fetch", real_fetch)
        await prober.probe_all([pool])  # a probe sent after it: back in rotation
        assert pool.healthy(0)

    _run(check)
