"""The proxy reports ready (``/health`` 200 "ok") only once it heard every stream it records
and routes by, or waited each out its silence bound: a recorded request sent before its decode
worker's batches were heard would lose its row (ZeroMQ's slow joiner)."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from stages.capture.batch_publisher import BatchPublisher
from stages.paths import BUNDLED_MODELS_DIR
from stages.serve.proxy import create_app
from stages.serve.proxy.config import KVConfig
from stages.serve.proxy.front.readiness import Readiness, Verdict
from stages.serve.proxy.recording.recorder import RecordConfig
from stages.serve.proxy.state import ProxyState, build_state
from stages.signature.dataset import SignatureDataset
from tests.conftest import free_port
from tests.fakes.publishing_workers import Workers, publisher, publishing_workers
from tests.fakes.worker import BackgroundServer, FakeBehavior
from tests.test_proxy import dead_url, fast_config
from tests.test_recording import sparse_decode, sparse_signature

BATCHES = "tcp://127.0.0.1:{}"
EMPTY_KV_BATCH = msgspec.msgpack.encode([0.0, [], None])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _batch_state(workers: int = 2, stale_after_s: float = 2.0) -> ProxyState:
    endpoints = tuple(BATCHES.format(free_port()) for _ in range(workers))
    return build_state(fast_config(
        ["http://p0:1"], [f"http://d{i}:1" for i in range(workers)], policy="jsq",
        decode_batch_endpoints=endpoints, batch_stale_after_s=stale_after_s))


def test_ready_once_every_decode_workers_batches_were_heard() -> None:
    state, clock = _batch_state(), Clock()
    readiness = Readiness(state.config, clock)
    verdict = readiness.check(state)
    assert not verdict.ready
    assert verdict.unheard == ["batches of decode worker http://d0:1",
                               "batches of decode worker http://d1:1"]
    state.decode.published.heard(0, frozenset())
    assert readiness.check(state).unheard == ["batches of decode worker http://d1:1"]
    state.decode.published.heard(1, frozenset())
    assert readiness.check(state).ready and readiness.check(state).unheard == []


def test_a_silent_stream_stops_blocking_after_its_bound_and_stays_named() -> None:
    state, clock = _batch_state(stale_after_s=2.0), Clock()
    readiness = Readiness(state.config, clock)
    state.decode.published.heard(0, frozenset())
    clock.now = 1.9
    assert not readiness.check(state).ready
    clock.now = 2.0
    verdict = readiness.check(state)
    assert verdict.ready and verdict.unheard == ["batches of decode worker http://d1:1"]


def test_a_worker_out_of_rotation_is_not_waited_for() -> None:
    state, clock = _batch_state(), Clock()
    readiness = Readiness(state.config, clock)
    state.decode.published.heard(0, frozenset())
    state.decode.mark_unhealthy(1, "health probe: no connection")  # killed while starting
    assert readiness.check(state).ready and readiness.check(state).unheard == []


def _kv_state(policy: str) -> ProxyState:
    kv = KVConfig(tokenizer=str(BUNDLED_MODELS_DIR / "tiny"),
                  prefill_events=(BATCHES.format(free_port()),),
                  decode_events=(BATCHES.format(free_port()), None), silent_after_s=0.05)
    return build_state(fast_config(["http://p0:1"], ["http://d0:1", "http://d1:1"],
                                   policy=policy, kv=kv))


def test_kv_event_streams_are_waited_for_heard_or_untrusted() -> None:
    state, clock = _kv_state("kv"), Clock()
    readiness = Readiness(state.config, clock)
    streams = ["KV events of prefill worker http://p0:1", "KV events of decode worker http://d0:1"]
    assert readiness.check(state) == Verdict(False, [], streams)
    clock.now = 0.05  # their bound (silent_after_s): a worker that filled no block sends none
    assert readiness.check(state) == Verdict(True, [], streams)
    clock.now = 0.0
    assert state.kv is not None
    state.kv.prefill.apply(0, 0, EMPTY_KV_BATCH)  # heard (live, or replayed)
    assert not readiness.check(state).ready
    # Owes the events of a prompt it was sent, silent past its bound: it is routed on load
    # alone, so nothing waits on it.
    state.kv.decode.sent(0, [1, 2], unhashed=True)
    time.sleep(0.1)
    assert readiness.check(state) == Verdict(True, [], [])


def test_a_kv_stream_whose_replay_answered_is_heard_though_its_worker_stored_nothing() -> None:
    state, clock = _kv_state("kv"), Clock()
    readiness = Readiness(state.config, clock)
    assert state.kv is not None
    state.kv.prefill.replied[0] = True  # the follower's first replay came back empty
    assert readiness.check(state) == Verdict(False, [], ["KV events of decode worker"
                                                         " http://d0:1"])
    state.kv.decode.replied[0] = True
    assert readiness.check(state) == Verdict(True, [], [])


def test_kv_event_streams_are_not_waited_for_under_a_policy_that_ignores_them() -> None:
    state = _kv_state("jsq")
    assert Readiness(state.config, Clock()).check(state) == Verdict(True, [], [])


# --- through HTTP, with fake workers whose publishers bind late or never ---



@pytest.fixture
def unpublished_workers() -> Iterator[Workers]:
    """A prefill and two decode workers whose batch publishers are not up yet (a worker whose
    plugin is still starting, or attached without it)."""
    with publishing_workers(sparse_signature, sparse_decode, publish=False) as workers:
        yield workers


def _publish(behaviors: list[FakeBehavior], endpoints: list[str]) -> None:
    for behavior, endpoint in zip(behaviors[1:], endpoints, strict=True):
        behavior.publisher = publisher(endpoint)


def _proxy(servers: list[BackgroundServer], endpoints: list[str],
           **kw: object) -> BackgroundServer:
    return BackgroundServer(create_app(fast_config(
        [servers[0].url], [s.url for s in servers[1:]], policy="jsq",
        decode_batch_endpoints=tuple(endpoints), **kw)))


def _until_ok(client: httpx.Client, timeout_s: float) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while (health := client.get("/health")).status_code != 200:
        assert health.json()["status"] == "warming", health.text
        assert time.monotonic() < deadline, health.text
        time.sleep(0.02)
    return health


def test_health_is_warming_until_the_first_heartbeat_then_ok(
        unpublished_workers: Workers) -> None:
    behaviors, servers, endpoints = unpublished_workers
    with _proxy(servers, endpoints, batch_stale_after_s=60) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=10) as client:
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "warming", "prefill_healthy": 1, "decode_healthy": 2,
            "unheard_streams": [f"batches of decode worker {s.url}" for s in servers[1:]]}
        _publish(behaviors, endpoints)
        health = _until_ok(client, timeout_s=30)
        assert health.json()["unheard_streams"] == []


def test_a_worker_that_never_publishes_stops_blocking_after_the_bound_and_is_named(
        unpublished_workers: Workers, caplog: pytest.LogCaptureFixture) -> None:
    behaviors, servers, endpoints = unpublished_workers
    behaviors[1].publisher = BatchPublisher(endpoints[0], heartbeat_s=0.2)
    bound_s = 1.5
    created = time.monotonic()
    with caplog.at_level(logging.WARNING, "stages.serve.proxy.front.readiness"), \
            _proxy(servers, endpoints, batch_stale_after_s=bound_s) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=10) as client:
        _until_ok(client, timeout_s=30)
        assert time.monotonic() - created >= bound_s
        silent = f"batches of decode worker {servers[2].url}"
        # The publishing worker is heard within its first heartbeats, which a loaded machine
        # (CI runs two test processes) can delay past the bound; the silent one stays named.
        deadline = time.monotonic() + 30
        while (streams := client.get("/health").json()["unheard_streams"]) != [silent]:
            assert silent in streams and time.monotonic() < deadline, streams
            time.sleep(0.05)
        deadline = time.monotonic() + 5  # the announcement polls every 0.1 s
        while silent not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)
        assert "ready without hearing" in caplog.text


def test_a_decode_worker_gone_while_starting_leaves_rotation_and_is_not_waited_for(
        unpublished_workers: Workers) -> None:
    behaviors, servers, endpoints = unpublished_workers
    behaviors[1].publisher = BatchPublisher(endpoints[0], heartbeat_s=0.2)
    gone = dead_url()  # its process died before its API server (and publisher) came up
    config = fast_config([servers[0].url], [servers[1].url, gone], policy="jsq",
                         decode_batch_endpoints=tuple(endpoints), batch_stale_after_s=60)
    with BackgroundServer(create_app(config)) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=10) as client:
        health = _until_ok(client, timeout_s=30)  # the first probes took it out, not the bound
        assert health.json() == {"status": "ok", "prefill_healthy": 1, "decode_healthy": 1,
                                 "unheard_streams": []}


def test_a_publisher_sending_what_cannot_be_decoded_is_never_heard(
        unpublished_workers: Workers) -> None:
    """Another wire version mid-rollout, or another program on the port: not heard, so the
    proxy waits out the bound and names it."""
    _, servers, endpoints = unpublished_workers
    context = zmq.Context()
    sockets = [context.socket(zmq.PUB) for _ in endpoints]
    try:
        for sock, endpoint in zip(sockets, endpoints, strict=True):
            sock.bind(endpoint)
        with _proxy(servers, endpoints, batch_stale_after_s=1.0) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=10) as client:
            deadline = time.monotonic() + 30
            while (health := client.get("/health")).status_code != 200:
                for sock in sockets:
                    sock.send(b'{"v": 99}')
                assert time.monotonic() < deadline, health.text
                time.sleep(0.05)
            assert health.json()["unheard_streams"] == [
                f"batches of decode worker {s.url}" for s in servers[1:]]
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()


def test_requests_recorded_as_soon_as_health_says_ok_lose_no_row(
        unpublished_workers: Workers, tmp_path: Path) -> None:
    """Decode workers whose publishers bind just after the proxy started: a request sent once
    /health says ok finishes after the proxy's subscriptions joined, so its counts come."""
    behaviors, servers, endpoints = unpublished_workers
    path, requests = tmp_path / "traffic.zarr", 8
    # A bound long enough that ok means heard, on a machine loaded enough to delay the first
    # heartbeats past the default 2 s (CI did; ok then came from the bound, as it should).
    with _proxy(servers, endpoints, record=RecordConfig(path), batch_stale_after_s=60.0
                ) as proxy, httpx.Client(base_url=proxy.url, timeout=30) as client:
        _publish(behaviors, endpoints)
        assert _until_ok(client, timeout_s=60).json()["unheard_streams"] == []
        for i in range(requests):
            body = {"prompt": f"request {i}", "max_tokens": 2 + i % 3}
            assert client.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 30  # generous: a loaded machine
        while waiting := client.get("/admin/state").json()["recording"]["waiting"]:
            assert time.monotonic() < deadline, f"{waiting} rows' decode counts never came"
            time.sleep(0.05)
    arrays = SignatureDataset.open(path).read()
    assert sorted(arrays.prompt_sha256) == sorted(
        hashlib.sha256(f"request {i}".encode()).hexdigest() for i in range(requests))
