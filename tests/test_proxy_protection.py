"""The proxy protecting itself and its clients: outlier ejection (a worker that answers its
health probes but keeps failing requests leaves rotation for a time that doubles on each
repeat, and comes back on probation) and load shedding (a burst past the queue bound gets 503
with Retry-After)."""

from __future__ import annotations

import time

import httpx
import pytest

from stages.errors import EldrError
from stages.serve.proxy import create_app
from stages.serve.proxy.config import Ejection
from stages.serve.proxy.errors import ProxyError
from stages.serve.proxy.front.completions import Overloaded, admit
from stages.serve.proxy.state import build_state
from stages.serve.proxy.view.workers import WorkerPool
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker
from tests.test_proxy import fast_config


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pool(clock: Clock) -> WorkerPool:
    return WorkerPool(["http://a", "http://b"], "decode",
                      Ejection(after_failures=3, base_s=10, max_s=60), clock)


def test_failures_in_a_row_eject_and_the_time_doubles_on_each_repeat() -> None:
    clock = Clock()
    workers = pool(clock)
    for _ in range(2):
        workers.record_failure(0, "500")
        workers.mark_healthy(0)  # a probe brings it back after each single failure
    assert workers.healthy(0) and not workers.ejected(0)
    workers.record_failure(0, "500")  # the third in a row
    assert workers.ejected(0) and not workers.healthy(0) and workers.ejections(0) == 1
    workers.mark_healthy(0)
    assert not workers.healthy(0)  # its probe answers, but it waits out the ejection
    clock.now += 10.1
    workers.mark_healthy(0)
    [view, other] = workers.views()
    assert view.healthy and view.probation and view.ejected_for_s == 0
    assert other.ejections == 0 and not other.probation  # the other worker is untouched
    workers.record_failure(0, "reset")  # one failure on probation ejects again, for longer
    assert workers.ejected(0) and workers.views()[0].ejected_for_s == pytest.approx(20)
    clock.now += 20.1
    workers.mark_healthy(0)
    workers.record_success(0)  # the probation is over
    assert not workers.views()[0].probation
    workers.record_failure(0, "500")
    workers.mark_healthy(0)
    assert workers.healthy(0)  # one failure off probation does not eject
    workers.record_success(0)  # and a success resets the count
    for _ in range(2):
        workers.record_failure(0, "500")
        workers.mark_healthy(0)
    assert workers.healthy(0)
    workers.record_failure(0, "500")
    assert workers.views()[0].ejected_for_s == pytest.approx(40)  # within max_s: doubled
    clock.now += 40.1 + 61  # then long in rotation: the next ejection starts from base_s
    workers.mark_healthy(0)
    workers.record_success(0)
    for _ in range(3):
        workers.record_failure(0, "500")
        workers.mark_healthy(0)
    assert workers.views()[0].ejected_for_s == pytest.approx(10)
    assert workers.ejections(0) == 4


def test_requests_running_when_it_was_ejected_do_not_extend_it() -> None:
    clock = Clock()
    workers = pool(clock)
    for _ in range(3):
        workers.record_failure(0, "500")
    for _ in range(5):
        workers.record_failure(0, "late 500")
    assert workers.ejections(0) == 1 and workers.views()[0].ejected_for_s == pytest.approx(10)


def test_the_rule_is_checked() -> None:
    for bad in (dict(after_failures=0), dict(base_s=0), dict(base_s=10, max_s=5)):
        with pytest.raises(EldrError):
            Ejection(**bad)  # type: ignore[arg-type]


def test_a_worker_that_fails_every_request_is_ejected_while_the_others_serve() -> None:
    prefill = FakeBehavior("p0")
    good, bad = FakeBehavior("d0"), FakeBehavior("d1", fail_status=500)
    workers = [BackgroundServer(create_fake_worker(b), "critical").start()
               for b in (prefill, good, bad)]
    config = fast_config([workers[0].url], [w.url for w in workers[1:]], policy="rr",
                         ejection=Ejection(after_failures=3, base_s=30, max_s=60),
                         max_attempts=2)
    try:
        with BackgroundServer(create_app(config)) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=10) as client:
            for i in range(12):
                r = client.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 3})
                assert r.status_code == 200, r.text  # failover: every request succeeds
                time.sleep(0.1)  # the probes (every 50 ms) bring a failed worker back
            state = client.get("/admin/state").json()
            [ok, out] = state["decode_workers"]
            assert out["ejections"] == 1 and out["ejected_for_s"] > 20 and out["probation"]
            assert not out["healthy"] and ok["healthy"] and ok["ejections"] == 0
            tried_bad = len(bad.received)
            for i in range(4):
                assert client.post("/v1/completions",
                                   json={"prompt": f"q{i}", "max_tokens": 3}).status_code == 200
            assert len(bad.received) == tried_bad  # nothing more reaches it while ejected
            metrics = client.get("/metrics").text
            assert 'eldr_worker_ejections_total{role="decode",worker="decode-1"} 1.0' in metrics
            assert 'eldr_router_worker_ejected{role="decode",worker="decode-1"} 1.0' in metrics
    finally:
        for w in workers:
            w.stop()


def test_requests_let_in_count_before_they_lease_a_worker() -> None:
    """The check-then-lease race: leases are taken only after the body is read, so requests
    let in but not yet leased must count, or a burst all passes the check at once."""
    state = build_state(fast_config(["http://p0"], ["http://d0", "http://d1"], policy="jsq",
                                    decode_slots=1, max_queued=1))
    tickets = [admit(state) for _ in range(3)]  # 2 slots + 1 queued, none leased yet
    with pytest.raises(Overloaded, match="3 in flight, at most 3"):
        admit(state)
    lease = state.prefill.acquire(0)
    tickets[0].settle()  # the first request now counts through its lease
    tickets[0].settle()  # idempotent: the handler settles again when it ends
    with pytest.raises(Overloaded):
        admit(state)
    lease.release()  # its prefill is over (and it left without decoding)
    tickets[1].settle()  # a request that failed before any lease
    assert state.cluster_load() == 1
    admit(state)


def test_waiting_for_the_proxys_own_connection_is_not_a_slow_first_token() -> None:
    """A stream's first-token limit is the worker's: time spent waiting for one of the proxy's
    connections (``max_connections``) does not count against it. One connection, two streams:
    A's prefill ends and hands the connection to B's prefill, waiting since; A's decode then
    waits (longer than the first-token limit) for B's prefill, then streams."""
    from concurrent.futures import ThreadPoolExecutor

    behaviors = [FakeBehavior("p0", delay_s=0.5), FakeBehavior("d0")]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    config = fast_config([workers[0].url], [workers[1].url], policy="rr", max_connections=1,
                         first_token_timeout_s=0.3,
                         ejection=Ejection(after_failures=1, base_s=30, max_s=60))
    body = {"prompt": "s", "max_tokens": 2, "stream": True}
    try:
        with BackgroundServer(create_app(config)) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=20) as client, \
                ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.post, "/v1/completions", json=body)
            time.sleep(0.2)  # A is prefilling: B waits for the connection
            second = pool.submit(client.post, "/v1/completions", json=body)
            for answer in (first.result(), second.result()):
                assert answer.status_code == 200, answer.text
                assert answer.content.endswith(b"data: [DONE]\n\n")
                assert b'"error"' not in answer.content
            decode = client.get("/admin/state").json()["decode_workers"][0]
            assert decode["last_error"] is None and decode["ejections"] == 0, decode
    finally:
        for w in workers:
            w.stop()


def test_a_split_request_reserves_a_place_for_each_of_its_sequences() -> None:
    """``max_queued`` bounds sequences: a request for n choices or a batch of prompts leases a
    worker per sequence, so it is let in only with room for all of them."""
    state = build_state(fast_config(["http://p0"], ["http://d0", "http://d1"], policy="jsq",
                                    decode_slots=1, max_queued=1))  # at most 3 at once
    request = admit(state)
    seats = request.reserve(3)  # its body asked for 3 sequences: each has its place
    assert state.cluster_load() == 3 and len(seats) == 3
    with pytest.raises(Overloaded):
        admit(state)
    lease = state.prefill.acquire(0)
    seats[0].settle()  # the first sequence now counts through its lease
    seats[0].settle()  # idempotent, as a retry's prefill settles again
    assert state.cluster_load() == 3
    lease.release()
    request.settle()  # the request ended: its sequences that never leased are let go
    assert state.cluster_load() == 0
    other = admit(state)
    request = admit(state)
    with pytest.raises(Overloaded, match="1 in flight, at most 3: this request asks for 3"):
        request.reserve(3)  # 1 in flight + 3 > 3: refused whole, not let in past the bound
    assert state.cluster_load() == 2  # the refused request still holds its own until it ends
    request.settle()
    other.settle()
    with pytest.raises(ProxyError, match="asks for 4 sequences") as too_many:
        admit(state).reserve(4)  # could never fit: no use retrying
    assert too_many.value.status == 400
    unbounded = build_state(fast_config(["http://p0"], ["http://d0"], policy="jsq"))
    assert len(admit(unbounded).reserve(1024)) == 1024 and unbounded.cluster_load() == 1024


def test_a_split_requests_sequences_count_once_while_on_their_workers() -> None:
    """Each sequence of a split request stops counting as let in once its prefill leases a
    worker: while both prompts prefill, the cluster holds two requests, not four."""
    from concurrent.futures import ThreadPoolExecutor

    behaviors = [FakeBehavior("p0", delay_s=1.0), FakeBehavior("d0")]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    config = fast_config([workers[0].url], [workers[1].url], policy="jsq", max_queued=8)
    app = create_app(config)
    state = app.state.proxy
    try:
        with BackgroundServer(app) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=20) as client, \
                ThreadPoolExecutor(1) as pool:
            answer = pool.submit(client.post, "/v1/completions",
                                 json={"prompt": ["a", "b"], "max_tokens": 2})
            deadline = time.monotonic() + 5
            while state.prefill.own_loads().sum() < 2:  # both prompts on the prefill worker
                assert time.monotonic() < deadline, "the prefills never started"
                time.sleep(0.01)
            assert state.cluster_load() == 2 and state.admitting == 0
            assert answer.result().status_code == 200
    finally:
        for w in workers:
            w.stop()


def test_the_proxy_refuses_a_request_whose_sequences_would_pass_the_bound() -> None:
    behaviors = [FakeBehavior("p0"), FakeBehavior("d0"), FakeBehavior("d1")]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    config = fast_config([workers[0].url], [w.url for w in workers[1:]], policy="jsq",
                         decode_slots=1, max_queued=1)
    try:
        with BackgroundServer(create_app(config)) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=20) as client:
            body = {"prompt": "x", "max_tokens": 2, "n": 3}
            assert client.post("/v1/completions", json=body).status_code == 200
            refused = client.post("/v1/completions", json={**body, "n": 4})
            assert refused.status_code == 400 and "asks for 4 sequences" in refused.text
            refused = client.post("/v1/completions",
                                  json={"prompt": ["a", "b", "c", "d"], "max_tokens": 2})
            assert refused.status_code == 400
            # Only the first request's 3 sequences reached a decode worker.
            assert sum(len(b.received) for b in behaviors[1:]) == 3
    finally:
        for w in workers:
            w.stop()


def test_a_burst_past_the_queue_bound_is_shed_with_retry_after() -> None:
    """2 decode workers x 1 slot + 1 queued: three slow streams in flight at once, the rest
    of a burst of eight get vLLM-shaped 503s with Retry-After, and a request after the burst
    is served."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    # Each served stream lasts about 1.6 s and the eight senders start together, so the whole
    # burst arrives while the first three are still in flight, even on a loaded CI box.
    behaviors = [FakeBehavior("p0"), FakeBehavior("d0", token_delay_s=0.4),
                 FakeBehavior("d1", token_delay_s=0.4)]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    config = fast_config([workers[0].url], [w.url for w in workers[1:]], policy="jsq",
                         decode_slots=1, max_queued=1)
    start_together = threading.Barrier(8)

    def send(client: httpx.Client, i: int) -> httpx.Response:
        if i < 8:
            start_together.wait()
        return client.post("/v1/completions",
                           json={"prompt": f"b{i}", "max_tokens": 4, "stream": True})

    try:
        with BackgroundServer(create_app(config)) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=20) as client:
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda i: send(client, i), range(8)))
            served = [r for r in answers if r.status_code == 200]
            shed = [r for r in answers if r.status_code == 503]
            assert len(served) + len(shed) == 8 and 1 <= len(served) <= 3 and shed
            for r in shed:
                assert r.headers["retry-after"] == "1"
                error = r.json()["error"]
                assert error["type"] == "overloaded" and error["code"] == 503
                assert "at capacity" in error["message"]
            assert all(r.content.endswith(b"data: [DONE]\n\n") for r in served)
            assert send(client, 99).status_code == 200  # the burst is over
            metrics = client.get("/metrics").text
            assert f'eldr_router_request_errors_total{{kind="overloaded"}} {len(shed)}.0' in metrics
    finally:
        for w in workers:
            w.stop()


def test_the_proxys_own_connection_limit_is_its_503_not_a_workers_failure() -> None:
    """With every upstream connection slot held (``max_connections``), a new request waits
    its turn, then gets the proxy's own 503 with Retry-After and its own metric; the workers,
    healthy all along, record no failure and stay in rotation."""
    from concurrent.futures import ThreadPoolExecutor

    behaviors = [FakeBehavior("p0"), FakeBehavior("d0", token_delay_s=0.5)]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    config = fast_config([workers[0].url], [workers[1].url], policy="rr", max_connections=1,
                         prefill_timeout_s=0.3, connect_timeout_s=0.2,
                         ejection=Ejection(after_failures=1, base_s=30, max_s=60))
    try:
        with BackgroundServer(create_app(config)) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=20) as client, \
                ThreadPoolExecutor(1) as pool:
            # Holds the only connection while it streams (about 2 s).
            slow = pool.submit(client.post, "/v1/completions",
                               json={"prompt": "s", "max_tokens": 4, "stream": True})
            deadline = time.monotonic() + 10
            while client.get("/admin/state").json()["decode_workers"][0]["in_flight"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "proxy_connections_exhausted" and error["code"] == 503
            assert slow.result().content.endswith(b"data: [DONE]\n\n")
            state = client.get("/admin/state").json()
            for worker in state["prefill_workers"] + state["decode_workers"]:
                assert worker["healthy"] and worker["ejections"] == 0, worker
                assert worker["consecutive_failures"] == 0 and worker["last_error"] is None
            metrics = client.get("/metrics").text
            assert "eldr_router_connection_pool_exhausted_total 1.0" in metrics
            assert client.post("/v1/completions",
                               json={"prompt": "y", "max_tokens": 2}).status_code == 200
    finally:
        for w in workers:
            w.stop()


def test_an_operator_drains_one_worker_for_a_rolling_restart() -> None:
    from concurrent.futures import ThreadPoolExecutor

    behaviors = [FakeBehavior("p0"), FakeBehavior("d0"), FakeBehavior("d1", token_delay_s=0.2)]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    config = fast_config([workers[0].url], [w.url for w in workers[1:]], policy="rr")
    try:
        with BackgroundServer(create_app(config)) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=20) as client, \
                ThreadPoolExecutor(2) as pool:
            body = {"prompt": "x", "max_tokens": 6, "stream": True}
            slow = [pool.submit(client.post, "/v1/completions", json=body) for _ in range(2)]
            deadline = time.monotonic() + 10  # rr: one of them streams slowly from d1
            while client.get("/admin/state").json()["decode_workers"][1]["in_flight"] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            drained = client.post("/admin/workers/decode-1/drain").json()
            assert drained == {"worker": "decode-1", "draining": True, "in_flight": 1,
                               "healthy": True}
            before = len(behaviors[2].received)
            for i in range(4):
                assert client.post("/v1/completions",
                                   json={"prompt": f"n{i}", "max_tokens": 2}).status_code == 200
            assert len(behaviors[2].received) == before  # no new request reached it
            assert all(f.result().content.endswith(b"data: [DONE]\n\n") for f in slow)
            state = client.get("/admin/state").json()["decode_workers"][1]
            assert state["draining"] and state["in_flight"] == 0  # safe to restart it now
            last = client.post("/admin/workers/decode-0/drain")
            assert last.status_code == 409 and "last decode worker" in last.text
            assert client.post("/admin/workers/decode-7/drain").status_code == 404
            assert client.delete("/admin/workers/decode-1/drain").json()["draining"] is False
            for i in range(2):
                client.post("/v1/completions", json={"prompt": f"m{i}", "max_tokens": 2})
            assert len(behaviors[2].received) > before  # back in rotation
    finally:
        for w in workers:
            w.stop()


def _proxy_process(config: str, port: int, drain_s: float):  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    code = ("from stages.serve.proxy import run_proxy\n"
            "from stages.serve.proxy.config import ProxyConfig\n"
            f"run_proxy({config}, port={port}, log_level='warning', drain_timeout_s={drain_s})\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("drain_s", [30.0, 1.0])
def test_sigterm_drains_the_proxy_before_it_stops(drain_s: float) -> None:
    """In-flight streams finish (or the drain's time runs out); meanwhile new requests and
    /health get 503, and the process ends once nothing is left."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from stages.procs.health import wait_healthy
    from tests.conftest import free_port

    behaviors = [FakeBehavior("p0"), FakeBehavior("d0", tokens=10, token_delay_s=0.3)]
    workers = [BackgroundServer(create_fake_worker(b), "critical").start() for b in behaviors]
    port = free_port()
    config = (f"ProxyConfig(prefill_urls=({workers[0].url!r},), decode_urls=({workers[1].url!r},),"
              " policy='rr', health_interval_s=0.2)")
    proc = _proxy_process(config, port, drain_s)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, 30, proc.poll, interval_s=0.1)
        with httpx.Client(base_url=url, timeout=20) as client, ThreadPoolExecutor(1) as pool:
            stream = pool.submit(client.post, "/v1/completions",
                                 json={"prompt": "s", "max_tokens": 10, "stream": True})
            time.sleep(0.5)  # streaming now, about 3 s to go
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = client.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "draining"
            assert refused.headers["retry-after"] == "1"
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            started = time.monotonic()
            if drain_s > 5:
                answer = stream.result()
                assert answer.content.endswith(b"data: [DONE]\n\n")
                assert answer.content.count(b"data: {") == 10  # every token arrived
            proc.wait(timeout=30)
            stopped = time.monotonic() - started
        assert stopped < (4 if drain_s > 5 else 3), stopped  # once drained, not the full 30 s
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in workers:
            w.stop()


def test_the_bench_sends_a_cost_file_inline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from stages.bench.live.admin import inline_cost
    from stages.routing.cost_model import cpu_like

    cpu_like(4).save(tmp_path / "cost.json")
    sent = inline_cost({"cost": str(tmp_path / "cost.json"), "load_slack": 0.5})
    assert sent == {"cost": cpu_like(4).to_json(), "load_slack": 0.5}
    assert inline_cost({"cost": "gpu"}) == {"cost": "gpu"}
    with pytest.raises(EldrError, match="no cost model"):
        inline_cost({"cost": str(tmp_path / "missing.json")})
