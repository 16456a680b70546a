"""The ELDR PD proxy: a Starlette app that prefills, routes by expert locality, and decodes.

``create_app(config)`` builds it; ``run_proxy(config, host, port)`` serves it with uvicorn.
All mutable state lives in one ``ProxyState`` on ``app.state.proxy``; the HTTP clients and
background loops live exactly as long as the app's lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import socket
import time
from collections.abc import AsyncIterator, Callable
from types import FrameType

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from threadpoolctl import threadpool_limits

from stages.serve.proxy.client.upstream import open_control_client, open_leg_client
from stages.serve.proxy.config import ProxyConfig
from stages.serve.proxy.front import admin, endpoints
from stages.serve.proxy.front.auth import auth_middleware
from stages.serve.proxy.front.completions import chat_completions, completions
from stages.serve.proxy.front.readiness import Readiness, announce_ready
from stages.serve.proxy.front.responses import SERVER_SEND, InternalErrorMiddleware, http_error
from stages.serve.proxy.ops.health import health_loop
from stages.serve.proxy.ops.rejoin import RestartCounts, no_restarts
from stages.serve.proxy.router.artifact_source import ArtifactLoader, load_from_store
from stages.serve.proxy.router.online_refit import FitFn, balanced_fit
from stages.serve.proxy.router.refit_task import refit_loop
from stages.serve.proxy.state import ProxyState, build_state
from stages.serve.proxy.view.kv_events import KVEventSource, follow_kv_events
from stages.serve.proxy.view.published_batches import follow_batches

log = logging.getLogger(__name__)
# How long shutdown waits for the decode counts of recorded requests that already ended.
RECORD_SETTLE_S = 15.0


def _report_crash(task: asyncio.Task[None]) -> None:
    # These loops never return; one that died stops re-admitting workers or refitting, which
    # must be loud at once, not discovered at shutdown.
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died", task.get_name(), exc_info=task.exception())


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    state: ProxyState = app.state.proxy
    c = state.config
    async with open_control_client(c) as control_client, open_leg_client(c) as leg_client:
        state.control_client = control_client
        state.leg_client = leg_client
        loops = [
            (
                "eldr-health",
                health_loop(
                    control_client,
                    [state.prefill, state.decode],
                    c.health_interval_s,
                    state.health_timeout,
                    state.checks,
                ),
            )
        ]
        if state.router.refitter is not None:
            loops.append(
                ("eldr-refit", refit_loop(state.router, state.metrics, c.refit_interval_s))
            )
        if state.recorder is not None:
            loops.append(("eldr-record", state.recorder.run()))
        if state.decode.published is not None:
            recorder = state.recorder
            loops.append(("eldr-batches", follow_batches(
                c.decode_batch_endpoints, state.decode.published, c.batch_stale_after_s,
                recorder.finished if recorder is not None else None)))
        if state.kv is not None:
            for role, view in (("prefill", state.kv.prefill), ("decode", state.kv.decode)):
                loops.append((f"eldr-kv-{role}", follow_kv_events(state.kv.sources(role), view)))
        loops.append(("eldr-readiness", announce_ready(app.state.readiness, state)))
        if state.block_experts is not None and c.kv is not None:
            sources = [None if e is None else KVEventSource.parse(e) for e in c.kv.expert_events]
            loops.append(("eldr-experts", follow_kv_events(sources, state.block_experts)))
        tasks = [asyncio.create_task(coro, name=name) for name, coro in loops]
        for task in tasks:
            task.add_done_callback(_report_crash)
        # What start-up built (imported modules, the artifact, the routing state) lives as long
        # as the proxy, yet every full collection walked it: a pause of about 80 ms every few
        # thousand requests (most of the p99 at concurrency 64) and a sixth of the CPU a
        # request. Frozen, the collector walks only what requests allocate.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            if state.recorder is not None:
                # Requests that ended in the drain: their counts are one publication away,
                # seconds where the workers share busy cores. The wait ends as soon as they
                # are in, so only a worker that died mid-request makes shutdown wait it out.
                lost = await state.recorder.settle(timeout_s=RECORD_SETTLE_S)
                if lost:
                    log.warning("recording: %d requests' decode counts did not come within"
                                " %.0f s of shutdown; their rows are not written", lost,
                                RECORD_SETTLE_S)
            for task in tasks:
                task.cancel()
            # Crashes were logged by _report_crash; here we only wait for the cancellations.
            await asyncio.gather(*tasks, return_exceptions=True)
            del state.control_client, state.leg_client
            # Collectable again: at exit, objects never collected make extension modules
            # (nanobind's) print leak reports.
            gc.unfreeze()
            if state.recorder is not None:
                await asyncio.to_thread(state.recorder.close)  # every row handed over, written


class ProxyApp(Starlette):
    """Starlette that leaves the server's ``send`` in each request's scope, for the relayed
    streams' body (``RelayResponse``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def create_app(
    config: ProxyConfig,
    *,
    artifact_loader: ArtifactLoader = load_from_store,
    refit_fn: FitFn = balanced_fit,
    restarts: RestartCounts = no_restarts,
) -> ProxyApp:
    """The proxy app. Loads the artifact now, so a bad config fails before serving.

    ``artifact_loader`` and ``refit_fn`` exist for tests and the simulator; the defaults read
    ``eldr fit``'s artifact store and run the balanced spherical k-means. ``restarts`` reports
    how often `eldr serve` restarted each worker it started (metrics, admin state).
    """
    state = build_state(
        config, artifact_loader=artifact_loader, refit_fn=refit_fn, restarts=restarts
    )
    app = ProxyApp(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", endpoints.models, methods=["GET"]),
            Route("/health", endpoints.health, methods=["GET"]),
            Route("/metrics", endpoints.metrics, methods=["GET"]),
            Route("/version", endpoints.version, methods=["GET"]),
            Route("/admin/state", admin.get_state, methods=["GET"]),
            Route("/admin/policy", admin.set_policy, methods=["POST"]),
            Route("/admin/artifact", admin.set_artifact, methods=["POST"]),
            Route("/admin/workers/{name}/drain", admin.drain_worker, methods=["POST", "DELETE"]),
        ],
        # Outermost first: an unexpected error anywhere, the key check included, still gets
        # the JSON error shape; keys are checked before routing, as vLLM does, so an unknown
        # /v1 path answers 401 without a key.
        middleware=[Middleware(InternalErrorMiddleware), *auth_middleware(config)],
        exception_handlers={HTTPException: http_error, ClientDisconnect: _client_gone},
        lifespan=_lifespan,
    )
    app.state.proxy = state
    app.state.readiness = Readiness(config)  # its bounds count from here: serving follows
    return app


async def _client_gone(request: Request, exc: Exception) -> Response:
    # A client that left mid-body reads no answer; 499 keeps it out of the server-error count.
    log.info("%s %s: client left while sending its body", request.method, request.url.path)
    return Response(status_code=499)


def _configure_logging(level: str) -> None:
    """eldr's own log lines at ``level``, in vLLM's style, without raising other libraries'."""
    logger = logging.getLogger("stages")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "(eldr proxy) %(levelname)s %(asctime)s [%(module)s] %(message)s", "%m-%d %H:%M:%S"
        ))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper())


def run_proxy(
    config: ProxyConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    *,
    artifact_loader: ArtifactLoader = load_from_store,
    restarts: RestartCounts = no_restarts,
    drain_timeout_s: float = 30.0,
    sockets: list[socket.socket] | None = None,
    on_signal: Callable[[], None] = lambda: None,
) -> None:
    """Serve the proxy until interrupted (blocking; the launcher's entry point); the first
    SIGINT or SIGTERM drains it (``DrainingServer``) and calls ``on_signal``.

    ``sockets``: listening sockets to serve instead of binding ``host``:``port`` (one process
    of several on one port: ``stages.serve.proxy.group``)."""
    # Routing math is one small matrix-vector product per request on the event loop; BLAS
    # helper threads would only add wake-up latency and steal cores from co-located workers.
    threadpool_limits(1, user_api="blas")
    app = create_app(config, artifact_loader=artifact_loader, restarts=restarts)
    _configure_logging(log_level)
    server = DrainingServer(uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # Per-request access lines cost more than the routing itself at 100 req/s.
        access_log=False,
        # Long decode streams must not be cut by uvicorn's keep-alive timer between requests.
        timeout_keep_alive=30,
        # What the drain left running when its time ran out is cancelled this much later.
        timeout_graceful_shutdown=1,
    ), app.state.proxy, drain_timeout_s, on_signal)
    server.run(sockets=sockets)


class DrainingServer(uvicorn.Server):
    """uvicorn that drains before it stops. The first SIGINT or SIGTERM turns new requests and
    ``/health`` into 503s (a load balancer in front stops sending) and waits until no request
    is in flight or ``drain_timeout_s`` passed; then uvicorn closes the socket and lets what is
    left finish for ``timeout_graceful_shutdown``. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state: ProxyState, drain_timeout_s: float,
                 on_signal: Callable[[], None] = lambda: None) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout_s = drain_timeout_s
        self._drain_deadline = math.inf
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self._state.draining:
            self._on_signal()
        if self._state.draining or self._drain_timeout_s <= 0:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised after the drain, as uvicorn does
        self._state.draining = True
        self._drain_deadline = time.monotonic() + self._drain_timeout_s
        log.warning("draining: %d request(s) in flight, at most %.0f s",
                    self._unfinished(), self._drain_timeout_s)

    def _unfinished(self) -> int:
        # Leased to a worker, or let in and still sending its body (no lease yet): stopping
        # before the latter lease would cut them off as surely as the ones decoding.
        return self._state.in_flight() + self._state.admitting

    async def on_tick(self, counter: int) -> bool:
        if self._state.draining and not self.should_exit:
            left = self._unfinished()
            if not left or time.monotonic() >= self._drain_deadline:
                if left:
                    log.warning("drain timed out with %d request(s) in flight", left)
                self.should_exit = True
        return await super().on_tick(counter)
