"""The bench's lean fake worker (tests.fakes.lean_worker) answers what the Starlette fake
(tests.fakes.worker) answers: the same requests to both, the same bodies, statuses, content
types, SSE events and publisher calls. And the bench's load generator counts right against it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from stages.capture.batch_publisher import RECORD_KEY, REQUEST_TAG
from tests.fakes import lean_worker
from tests.fakes.worker import BackgroundServer, FakeBehavior, create_fake_worker

pytestmark = pytest.mark.timeout(60)

TOKENS = 5
PACE_S = 0.004


def _held(name: str) -> str:
    """A fake's name for a request it holds without the ``id()`` of its body."""
    head, _, tail = name.rpartition("-")
    return head if tail.isdigit() else name


class Recorder:
    """Stands in for a BatchPublisher: the calls a fake makes, request ids made comparable."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def add(self, held: str, name: str, entries: Any) -> None:
        self.calls.append(("add", _held(held), _held(name), entries))

    def finished(self, name: str, prompt_tokens: int, tokens: int, counts: np.ndarray) -> None:
        self.calls.append(("finished", _held(name), prompt_tokens, tokens, counts.tolist()))

    def remove(self, held: str) -> None:
        self.calls.append(("remove", _held(held)))


class LeanServer:
    """The lean fake on a free localhost port, its loop in a thread."""

    def __init__(self, behavior: FakeBehavior) -> None:
        self._sock = lean_worker.listening_socket(0)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._behavior = behavior
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        workers = self._loop.run_until_complete(lean_worker.start([self._sock],
                                                                  [self._behavior]))
        self._started.set()
        self._loop.run_forever()
        for worker in workers:
            worker.close()
        self._loop.run_until_complete(asyncio.sleep(0))  # the connections' ends run
        self._loop.close()

    def __enter__(self) -> LeanServer:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._sock.close()


def behavior(pace_s: float = 0.0) -> FakeBehavior:
    return FakeBehavior("bench", tokens=TOKENS, token_delay_s=pace_s, record=False,
                        publisher=Recorder())  # type: ignore[arg-type]


def calls(b: FakeBehavior) -> list[tuple[Any, ...]]:
    return b.publisher.calls  # type: ignore[union-attr]


@pytest.fixture(scope="module", params=[0.0, PACE_S], ids=["unpaced", "paced"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[FakeBehavior, str, FakeBehavior, str]]:
    starlette, lean = behavior(request.param), behavior(request.param)
    with BackgroundServer(create_fake_worker(starlette), "critical") as s, LeanServer(lean) as le:
        yield starlette, s.url, lean, le.url


def completion(prompt: str, chat: bool, **extra: Any) -> tuple[str, dict[str, Any]]:
    if chat:
        return "/v1/chat/completions", {"model": "fake-model", **extra,
                                        "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {"model": "fake-model", "prompt": prompt, **extra}


PREFILL = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
RECORDED = {"kv_transfer_params": {RECORD_KEY: True, REQUEST_TAG: "recorded"}}
REQUESTS = [
    completion(f"domain={d} prompt", chat, **extra)
    for chat in (False, True)
    for d, extra in [
        (3, {**PREFILL, "max_tokens": 1}),
        (3, PREFILL),  # the next hand-off: its own block ids
        (7, PREFILL),
        (3, {"max_tokens": 3}),
        (5, {}),  # the fake's own token count
        (3, {"max_tokens": 3, "stream": True}),
        (5, {"stream": True}),
        (9, {"stream": True, **RECORDED}),
        (9, RECORDED),
    ]
]


def ask(client: httpx.Client, path: str, body: dict[str, Any] | None,
        request_id: str | None) -> httpx.Response:
    headers = {} if request_id is None else {"x-request-id": request_id}
    if body is None:
        return client.get(path, headers=headers)
    return client.post(path, json=body, headers=headers)


def same_answer(a: httpx.Response, b: httpx.Response) -> None:
    assert (a.status_code, a.content) == (b.status_code, b.content)
    for name in ("content-type", "x-request-id", "content-length", "transfer-encoding"):
        assert a.headers.get(name) == b.headers.get(name), name
    if b.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in b.content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: ") for e in events)


def test_same_answers(pair: tuple[FakeBehavior, str, FakeBehavior, str]) -> None:
    starlette, s_url, lean, l_url = pair
    # One keep-alive connection to each: every answer must leave it reusable.
    with httpx.Client(base_url=s_url, timeout=10) as s, httpx.Client(base_url=l_url,
                                                                     timeout=10) as le:
        for i, (path, body) in enumerate(REQUESTS):
            same_answer(ask(s, path, body, f"req-{i}"), ask(le, path, body, f"req-{i}"))
        for path in ("/health", "/v1/models"):
            same_answer(ask(s, path, None, "x"), ask(le, path, None, "x"))
        same_answer(ask(s, "/v1/completions", {"prompt": "x"}, None),
                    ask(le, "/v1/completions", {"prompt": "x"}, None))
    assert starlette.handed_off == lean.handed_off == 6
    # Starlette publishes a JSON answer's end in a background task, after the answer.
    deadline = time.monotonic() + 5
    while calls(starlette) != calls(lean) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls(starlette) == calls(lean)
    # Every decode (6 a variant, and the last) held and let go; the recorded ones published.
    assert [c[0] for c in calls(lean)].count("remove") == 13
    assert [c[1] for c in calls(lean) if c[0] == "finished"] == ["recorded"] * 4


def test_paced_stream_is_paced() -> None:
    with LeanServer(behavior(0.05)) as server:
        t0 = time.perf_counter()
        with httpx.stream("POST", server.url + "/v1/completions", timeout=10,
                          json={"prompt": "p", "max_tokens": 4, "stream": True}) as r:
            arrivals = [time.perf_counter() - t0 for _ in r.iter_raw()]
    assert arrivals[-1] >= 4 * 0.05 * 0.9
    assert len(arrivals) >= 3  # events arrive one by one, not in one piece at the end


def test_client_leaving_mid_stream_stops_it() -> None:
    b = behavior(0.02)
    with LeanServer(b) as server:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=10,
                          json={"prompt": "p", "max_tokens": 1000, "stream": True}) as r:
            first = next(r.iter_raw())
        assert first.startswith(b"data: ")
        deadline = time.monotonic() + 5
        while calls(b)[-1][0] != "remove" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [c[0] for c in calls(b)] == ["add", "remove"]  # and no "finished"
        assert httpx.get(server.url + "/health").status_code == 200
        connection_close = httpx.post(server.url + "/v1/completions", json={"prompt": "p"},
                                      headers={"connection": "close"})
        assert connection_close.headers["connection"] == "close"


@pytest.mark.parametrize("workload", ["plain", "burst"])
def test_bench_load_generator_counts(workload: str) -> None:
    from examples.bench_proxy import _generate

    b = FakeBehavior("bench", tokens=TOKENS, record=False)
    with LeanServer(b) as server:
        requests, failed, chunks, latencies = asyncio.run(
            _generate(server.url + "/v1/completions", workload, 4, 0.5, 7))
    assert failed == 0 and requests == len(latencies) > 50
    assert chunks == requests * (1 if workload == "plain" else 7 + 1)
