"""Decode workers publishing their running batch, and proxies that route on it: the wire format,
the publisher over real ZMQ, the proxy's count of the other proxies' requests, and two proxies
in front of the same fake decode workers that each see the other's streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import zmq

from stages.capture.batch_publisher import REQUEST_TAG, BatchMessage, BatchPublisher, request_name
from stages.serve.proxy import create_app
from stages.serve.proxy.view.published_batches import PublishedBatches, follow_batches
from stages.signature import wire
from tests.conftest import free_port
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker
from tests.test_proxy import fast_config


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _receive_until(sub: zmq.Socket, want: frozenset[str], timeout_s: float = 5.0) -> BatchMessage:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            message = BatchMessage.decode(sub.recv())
            if message.requests == want:
                return message
    raise AssertionError(f"no message with {sorted(want)}")


def test_the_publisher_sends_what_the_worker_holds_as_it_changes() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = BatchPublisher(endpoint, min_interval_s=0.001, heartbeat_s=0.05)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        publisher.add("vllm-1", "p0-a")
        publisher.add("vllm-2", "vllm-2")  # untagged: its own id
        first = _receive_until(sub, frozenset({"p0-a", "vllm-2"}))
        publisher.remove("vllm-1")
        publisher.remove("never-added")  # vLLM frees requests the scheduler never looked at
        later = _receive_until(sub, frozenset({"vllm-2"}))
        assert later.seq > first.seq
        beat = _receive_until(sub, frozenset({"vllm-2"}))  # unchanged: the heartbeat
        assert beat.seq > later.seq
    finally:
        publisher.close()
        sub.close(linger=0)


def test_a_port_in_use_fails_the_publisher_at_once() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = BatchPublisher(endpoint)
    try:
        with pytest.raises(zmq.ZMQError):
            BatchPublisher(endpoint)
    finally:
        first.close()


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1]", b'{"v": 2, "seq": 0, "requests": []}',
                                 b'{"v": 1, "seq": "0", "requests": []}',
                                 b'{"v": 1, "seq": 0, "requests": [1]}'])
def test_anything_but_a_batch_message_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        BatchMessage.decode(raw)


def test_a_request_goes_by_its_proxys_tag() -> None:
    assert request_name("cmpl-x-0-abcd", {REQUEST_TAG: "p0-7", "do_remote_prefill": True}) == "p0-7"
    assert request_name("cmpl-x-0-abcd", None) == "cmpl-x-0-abcd"
    assert request_name("cmpl-x-0-abcd", {REQUEST_TAG: 5}) == "cmpl-x-0-abcd"


def test_only_the_other_proxies_requests_are_added() -> None:
    clock = Clock()
    batches = PublishedBatches(2, stale_after_s=2.0, forget_after_s=30.0, clock=clock)
    batches.sent("mine-1")
    batches.sent("mine-2")
    # Published before mine-2 reached the worker; an untagged request and another proxy's.
    batches.heard(0, frozenset({"mine-1", "theirs-1", "vllm-9"}))
    assert batches.others.tolist() == [2, 0]
    batches.ended("mine-1")  # ended here; the worker's next message may still list it
    batches.heard(0, frozenset({"mine-1", "mine-2", "theirs-1"}))
    assert batches.others.tolist() == [1, 0]
    clock.now += 31  # long after: a name that comes back is someone else's request
    batches.heard(0, frozenset({"mine-1"}))
    assert batches.others.tolist() == [1, 0]
    clock.now += 1  # 1 s without a message: still believed
    assert batches.others.tolist() == [1, 0]
    clock.now += 1.5  # past stale_after_s: routing falls back to its own counts
    assert batches.others.tolist() == [0, 0] and batches.age_s(0) == pytest.approx(2.5)
    assert batches.published.tolist() == [0, 0]
    assert batches.age_s(1) is None


def test_a_signature_goes_out_once_with_the_first_message_that_lists_its_request() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = BatchPublisher(endpoint, min_interval_s=0.001, heartbeat_s=0.05)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    signature = wire.encode(np.eye(2, 4, dtype=np.int32))
    try:
        time.sleep(0.2)  # subscribed before the request arrives, as a running proxy is
        publisher.add("vllm-1", "p0-a", signature)
        publisher.add("vllm-1", "p0-a", signature)  # the scheduler looks again: no resend
        first = _receive_until(sub, frozenset({"p0-a"}))
        assert first.signatures == {"p0-a": signature}
        beat = _receive_until(sub, frozenset({"p0-a"}))
        assert beat.seq > first.seq and beat.signatures == {}
    finally:
        publisher.close()
        sub.close(linger=0)


def test_staleness_is_judged_when_the_view_is_read_whoever_follows_it() -> None:
    """A dead follow task calls nothing more: the view still expires when routing reads it."""
    clock = Clock()
    batches = PublishedBatches(1, stale_after_s=2.0, forget_after_s=30.0, clock=clock)
    batches.heard(0, frozenset({"theirs-1", "theirs-2"}))
    assert batches.others.tolist() == [2]
    clock.now += 2.5
    assert batches.others.tolist() == [0] and batches.published.tolist() == [0]
    batches.heard(0, frozenset({"theirs-3"}))  # heard again: believed again
    assert batches.others.tolist() == [1]


def test_a_publisher_sending_only_undecodable_messages_goes_stale() -> None:
    """A worker on another wire version mid-rollout keeps the socket busy with messages this
    proxy cannot read: its view must expire from the last valid one, not freeze."""
    asyncio.run(_follow_a_publisher_gone_undecodable())


async def _follow_a_publisher_gone_undecodable() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    batches = PublishedBatches(1, stale_after_s=0.5)
    follower = asyncio.create_task(follow_batches((endpoint,), batches, stale_after_s=0.5))
    try:
        valid = BatchMessage(0, frozenset({"theirs-1"})).encode()
        deadline = time.monotonic() + 5
        while batches.others[0] != 1 and time.monotonic() < deadline:
            pub.send(valid)
            await asyncio.sleep(0.02)
        assert batches.others.tolist() == [1]
        newer = b'{"v": 2, "seq": 1, "requests": ["theirs-1"]}'
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # busier than the stale limit: no poll ever times out
            pub.send(newer)
            await asyncio.sleep(0.05)
        assert batches.others.tolist() == [0]
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        pub.close(linger=0)


class Listener:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, str]] = []

    def peer_joined(self, worker: int, name: str, signature: dict) -> None:
        self.events.append(("joined", worker, name))

    def peer_left(self, worker: int, name: str) -> None:
        self.events.append(("left", worker, name))


def test_the_listener_hears_the_others_requests_that_came_with_signatures() -> None:
    clock, listener, sig = Clock(), Listener(), {"eldr_signature": "AAAA"}
    batches = PublishedBatches(2, stale_after_s=2.0, forget_after_s=30.0, clock=clock)
    batches.listener = listener
    batches.sent("mine-1")
    batches.heard(0, frozenset({"mine-1", "theirs-1", "theirs-2"}),
                  {"mine-1": sig, "theirs-1": sig})  # theirs-2's signature was lost
    assert listener.events == [("joined", 0, "theirs-1")]
    assert batches.others.tolist() == [2, 0] and batches.weighed[0] == {"theirs-1"}
    batches.heard(0, frozenset({"mine-1", "theirs-1", "theirs-2"}))
    batches.heard(1, frozenset({"theirs-3"}), {"theirs-3": sig, "gone-already": sig})
    batches.heard(0, frozenset({"theirs-2"}))
    assert listener.events[1:] == [("joined", 1, "theirs-3"), ("left", 0, "theirs-1")]
    clock.now += 2.5  # a worker gone quiet: its others are forgotten, experts and all
    assert batches.others.tolist() == [0, 0]
    assert listener.events[3:] == [("left", 1, "theirs-3")]
    assert batches.weighed == [set(), set()]


@pytest.fixture
def published_workers() -> Iterator[tuple[list[BackgroundServer], list[str]]]:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    behaviors = [FakeBehavior("p0")] + [
        FakeBehavior(f"d{i}", tokens=12, token_delay_s=0.25,
                     publisher=BatchPublisher(e, min_interval_s=0.002, heartbeat_s=0.2))
        for i, e in enumerate(endpoints)]
    servers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    yield servers, endpoints
    for server, behavior in zip(servers, behaviors, strict=True):
        server.stop()
        if behavior.publisher is not None:
            behavior.publisher.close()


def _decode_views(client: httpx.Client) -> list[dict]:
    return client.get("/admin/state").json()["decode_workers"]


def test_two_proxies_each_see_the_others_streams_and_route_around_them(
        published_workers: tuple[list[BackgroundServer], list[str]]) -> None:
    servers, endpoints = published_workers
    config = fast_config([servers[0].url], [s.url for s in servers[1:]], policy="jsq",
                         decode_batch_endpoints=tuple(endpoints))
    with BackgroundServer(create_app(config)) as a, BackgroundServer(create_app(config)) as b, \
            httpx.Client(base_url=a.url, timeout=30) as via_a, \
            httpx.Client(base_url=b.url, timeout=30) as via_b, ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(via_a.post, "/v1/completions",
                               json={"prompt": f"s{i}", "max_tokens": 12, "stream": True})
                   for i in range(3)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen_by_b = [w["others_in_flight"] for w in _decode_views(via_b)]
            if sum(seen_by_b) == 3:
                break
            time.sleep(0.05)
        own_of_a = [w["in_flight"] for w in _decode_views(via_a)]
        assert seen_by_b == own_of_a and sum(own_of_a) == 3  # b sees a's streams where they run
        assert [w["others_in_flight"] for w in _decode_views(via_a)] == [0, 0]  # a: its own
        # b's next stream goes where a's are fewer, though b itself has sent nothing.
        lighter = own_of_a.index(min(own_of_a))
        extra = pool.submit(via_b.post, "/v1/completions",
                            json={"prompt": "b0", "max_tokens": 12, "stream": True})
        time.sleep(0.5)
        assert [w["in_flight"] for w in _decode_views(via_b)][lighter] == 1
        for f in [*streams, extra]:
            assert f.result().content.endswith(b"data: [DONE]\n\n")
        time.sleep(0.5)
        for client in (via_a, via_b):
            assert [w["others_in_flight"] for w in _decode_views(client)] == [0, 0]
        metrics = via_b.get("/metrics").text
        assert 'eldr_router_decode_others_inflight{worker="decode-0"} 0.0' in metrics
        age_of_1 = 'eldr_router_decode_published_age_seconds{worker="decode-1"}'
        age = next(line for line in metrics.splitlines() if line.startswith(age_of_1))
        assert 0 <= float(age.rsplit(" ", 1)[1]) < 2  # the heartbeat keeps it fresh


def test_a_proxy_weighs_the_experts_of_the_others_streams_where_they_run(
        published_workers: tuple[list[BackgroundServer], list[str]]) -> None:
    servers, endpoints = published_workers
    config = fast_config([servers[0].url], [s.url for s in servers[1:]], policy="eldr-union",
                         model_top_k=2, decode_batch_endpoints=tuple(endpoints))
    with BackgroundServer(create_app(config)) as a, BackgroundServer(create_app(config)) as b, \
            httpx.Client(base_url=a.url, timeout=30) as via_a, \
            httpx.Client(base_url=b.url, timeout=30) as via_b, ThreadPoolExecutor(4) as pool:

        def stream(client: httpx.Client, domain: int) -> Future[httpx.Response]:
            return pool.submit(client.post, "/v1/completions", json={
                "prompt": f"domain={domain}", "max_tokens": 24, "stream": True})

        def wait_for(check: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 10
            while not check():
                assert time.monotonic() < deadline, what
                time.sleep(0.02)

        def in_flight(client: httpx.Client) -> list[int]:
            return [w["in_flight"] for w in _decode_views(client)]

        streams = [stream(via_a, 3)]
        wait_for(lambda: sum(in_flight(via_a)) == 1, "a's first stream never started")
        home_of_3 = in_flight(via_a).index(1)
        streams.append(stream(via_a, 7))  # spread: the other worker is idle
        wait_for(lambda: in_flight(via_a) == [1, 1], "a's second stream went elsewhere")
        wait_for(lambda: [w["others_weighed"] for w in _decode_views(via_b)] == [1, 1],
                 "b never weighed a's streams")
        # To b each worker holds one request; only their experts tell b where a 3 belongs.
        streams.append(stream(via_b, 3))
        wait_for(lambda: sum(in_flight(via_b)) == 1, "b's stream never started")
        assert in_flight(via_b)[home_of_3] == 1
        for f in streams:
            assert f.result().content.endswith(b"data: [DONE]\n\n")
        wait_for(lambda: [w["others_weighed"] for w in _decode_views(via_b)] == [0, 0],
                 "b still weighs streams that ended")


def test_attached_workers_name_their_batch_endpoints_one_each() -> None:
    from stages.errors import EldrError
    from stages.serve.deploy import ServeOptions

    attached = dict(attach_prefill=("http://p0:8000",),
                    attach_decode=("http://d0:8000", "http://d1:8000"))
    ServeOptions(**attached, attach_batch=("tcp://d0:5600", "tcp://d1:5600")).check()
    with pytest.raises(EldrError, match="2 --attach-decode workers: one each"):
        ServeOptions(**attached, attach_batch=("tcp://d0:5600",)).check()
    with pytest.raises(EldrError, match="a tcp:// endpoint"):
        ServeOptions(**attached, attach_batch=("http://d0:5600", "tcp://d1:5600")).check()


def test_worker_args_prints_a_decode_workers_batch_endpoint() -> None:
    import json
    import shlex

    from typer.testing import CliRunner

    from eldr_cli.app import app

    runner = CliRunner()
    ok = runner.invoke(app, ["worker-args", "decode", "--publish-batch", "tcp://*:5600"])
    assert ok.exit_code == 0, ok.output
    config = json.loads(shlex.split(ok.output)[1])
    [eldr, _nixl] = config["kv_connector_extra_config"]["connectors"]
    assert eldr["kv_connector_extra_config"]["publish_batch"] == "tcp://*:5600"
    from stages.errors import EldrError

    refused = runner.invoke(app, ["worker-args", "prefill", "--publish-batch", "tcp://*:5600"])
    # eldr's entry point turns an EldrError into its message and exit status 2.
    assert isinstance(refused.exception, EldrError)
    assert "decode worker's tcp:// endpoint" in str(refused.exception)
