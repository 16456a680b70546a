"""`eldr serve --record` loses no row without a count: a recorded request's decode counts ride
the decode worker's batch messages, and a message a proxy missed (the PUB socket drops past its
high-water mark) is replayed from the worker's buffer, as vLLM replays KV events; a gap the
worker can no longer fill is counted at once. A recorded request that fails on its way (a 4xx,
a client gone, a retry whose prefill failed) leaves no entry waiting for counts that never
come."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import zmq

from stages.capture.batch_publisher import BatchPublisher, FinishedRequest
from stages.serve.proxy import create_app
from stages.serve.proxy.errors import ProxyError
from stages.serve.proxy.legs import decode as decode_leg
from stages.serve.proxy.recording.recorder import RecordConfig
from stages.serve.proxy.view.published_batches import PublishedBatches, follow_batches
from tests.conftest import free_port
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker
from tests.test_proxy import fast_config

COUNTS = np.eye(2, 4, dtype=np.int32)


class LossyLink:
    """Between a publisher and a proxy: forwards every message but those that carry the
    finished requests named in ``drop`` (a PUB socket past its high-water mark drops whole
    messages, these among them)."""

    def __init__(self, source: str, drop: set[str]) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.dropped = 0
        self._source, self._drop = source, drop
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(5)

    def _run(self) -> None:
        context = zmq.Context.instance()
        sub, pub = context.socket(zmq.SUB), context.socket(zmq.PUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._source)
        pub.bind(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sub.poll(50):
                    continue
                raw = sub.recv()
                names = {f["name"] for f in orjson.loads(raw).get("finished", [])}
                if names & self._drop:
                    self.dropped += 1
                    continue
                pub.send(raw)
        finally:
            sub.close(linger=0)
            pub.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _follow_through_loss(publisher: BatchPublisher, link: LossyLink, names: list[str],
                         ) -> tuple[PublishedBatches, list[str]]:
    """Publish one finished request a message for each of ``names`` and follow them through
    ``link``; what the follower heard of them."""
    heard: list[str] = []
    batches = PublishedBatches(1)

    def on_finished(done: FinishedRequest) -> None:
        heard.append(done.name)

    async def run() -> None:
        follower = asyncio.create_task(follow_batches((link.endpoint,), batches, 2.0,
                                                      on_finished))
        try:
            deadline = time.monotonic() + 10
            while batches.age_s(0) is None:  # subscribed: a heartbeat came through
                assert time.monotonic() < deadline, "nothing came through the link"
                await asyncio.sleep(0.02)
            for name in names:
                publisher.finished(name, 8, 2, COUNTS)
                await asyncio.sleep(0.03)  # a message each
            deadline = time.monotonic() + 5
            while len(heard) < len(names) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.6)  # a heartbeat or two more: any gap is seen by now
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)

    asyncio.run(run())
    return batches, heard


@pytest.fixture
def publisher_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_finished_requests_a_proxy_missed_are_replayed_and_the_gap_counted(
        publisher_endpoint: str) -> None:
    publisher = BatchPublisher(publisher_endpoint, min_interval_s=0.001, heartbeat_s=0.1)
    link = LossyLink(publisher_endpoint, drop={"r3", "r4", "r5"})
    names = [f"r{i}" for i in range(10)]
    try:
        batches, heard = _follow_through_loss(publisher, link, names)
    finally:
        link.close()
        publisher.close()
    assert link.dropped == 3
    assert sorted(heard) == sorted(names)  # every one, the replayed ones too, once
    assert batches.missed.tolist() == [3] and batches.lost.tolist() == [0]


def test_a_gap_the_worker_can_no_longer_fill_is_counted_at_once(publisher_endpoint: str) -> None:
    publisher = BatchPublisher(publisher_endpoint, min_interval_s=0.001, heartbeat_s=0.1,
                               replay_bytes=0)  # keeps nothing to replay
    link = LossyLink(publisher_endpoint, drop={"r1"})
    try:
        batches, heard = _follow_through_loss(publisher, link, ["r0", "r1", "r2"])
    finally:
        link.close()
        publisher.close()
    assert sorted(heard) == ["r0", "r2"]
    assert batches.missed.tolist() == [1] and batches.lost.tolist() == [1]


# --- every failure path drops its entry -------------------------------------------------


@pytest.fixture
def recording_cluster(tmp_path: Path) -> Iterator[tuple[list[FakeBehavior], BackgroundServer]]:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    behaviors = [FakeBehavior("p0")] + [
        FakeBehavior(f"d{i}", publisher=BatchPublisher(e, heartbeat_s=0.2))
        for i, e in enumerate(endpoints)]
    servers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    config = fast_config([servers[0].url], [s.url for s in servers[1:]], policy="jsq",
                         decode_batch_endpoints=tuple(endpoints),
                         record=RecordConfig(tmp_path / "traffic.zarr"))
    try:
        with BackgroundServer(create_app(config)) as proxy:
            yield behaviors[1:], proxy
    finally:
        for server, behavior in zip(servers, behaviors, strict=True):
            server.stop()
            if behavior.publisher is not None:
                behavior.publisher.close()


def _waiting(client: httpx.Client) -> int:
    return client.get("/admin/state").json()["recording"]["waiting"]


def test_a_recorded_request_the_worker_refuses_leaves_no_entry(
        recording_cluster: tuple[list[FakeBehavior], BackgroundServer]) -> None:
    behaviors, proxy = recording_cluster
    for b in behaviors:
        b.fail_status = 400
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for stream in (False, True):
            r = client.post("/v1/completions",
                            json={"prompt": "hi", "max_tokens": 2, "stream": stream})
            assert r.status_code == 400
        assert _waiting(client) == 0


def test_a_recorded_request_whose_client_left_leaves_no_entry(
        recording_cluster: tuple[list[FakeBehavior], BackgroundServer]) -> None:
    behaviors, proxy = recording_cluster
    for b in behaviors:  # the client leaves while the decode worker has not answered
        b.delay_s = 3.0
    with httpx.Client(base_url=proxy.url, timeout=0.5) as client:
        for stream in (False, True):
            with pytest.raises(httpx.TimeoutException):
                client.post("/v1/completions",
                            json={"prompt": "hi", "max_tokens": 2, "stream": stream})
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        deadline = time.monotonic() + 2
        while _waiting(client) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _waiting(client) == 0


def test_a_recorded_request_whose_retry_failed_leaves_no_entry(
        recording_cluster: tuple[list[FakeBehavior], BackgroundServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    behaviors, proxy = recording_cluster

    async def prefill_fails(ctx: object) -> object:
        raise ProxyError(502, "prefill failed on every worker tried", "prefill_failed")

    monkeypatch.setattr(decode_leg, "run_prefill", prefill_fails)  # the retry's fresh hand-off
    for b in behaviors:  # delivered, then failed: a retry elsewhere needs a fresh prefill
        b.fail_status = 500
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 502 and "prefill failed" in r.text
        assert _waiting(client) == 0


def test_gaps_are_in_metrics_and_the_admin_state(
        recording_cluster: tuple[list[FakeBehavior], BackgroundServer]) -> None:
    _, proxy = recording_cluster
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        metrics = client.get("/metrics").text
        assert 'eldr_router_decode_batch_messages_missed_total{worker="decode-0"} 0.0' in metrics
        assert 'eldr_router_decode_batch_messages_lost_total{worker="decode-1"} 0.0' in metrics
        workers = client.get("/admin/state").json()["decode_workers"]
        assert [(w["messages_missed"], w["messages_lost"]) for w in workers] == [(0, 0), (0, 0)]
