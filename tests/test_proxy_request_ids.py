"""A client's ``X-Request-Id`` is echoed back and never becomes eldr's key: requests in flight
that share one each keep their own decode tag, recorded row and published view entry."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from stages.serve.proxy import create_app
from stages.serve.proxy.recording.recorder import RecordConfig
from stages.signature.dataset import SignatureDataset
from tests.fakes.publishing_workers import Workers, publishing_workers
from tests.fakes.worker import BackgroundServer
from tests.test_proxy import fast_config
from tests.test_recording import sparse_decode, sparse_signature

SHARED_ID = "the-same-id"
REQUESTS = 8


@pytest.fixture
def slow_recorded_workers() -> Iterator[Workers]:
    # Slow enough that the burst's requests are all in flight together on the two workers.
    with publishing_workers(sparse_signature, sparse_decode, token_delay_s=0.1) as workers:
        yield workers


def _prompt(i: int) -> str:
    return f"shared id {i} domain={i % 4}"


def _tokens(i: int) -> int:
    return 2 + i % 5


def _text(response: httpx.Response, stream: bool) -> str:
    if not stream:
        return response.json()["choices"][0]["text"]
    events = [orjson.loads(line[6:]) for line in response.text.split("\n\n")
              if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def test_requests_sharing_a_client_id_each_keep_their_own_answer_row_and_load(
        slow_recorded_workers: Workers, tmp_path: Path) -> None:
    behaviors, servers, endpoints = slow_recorded_workers
    path = tmp_path / "traffic.zarr"
    config = fast_config([servers[0].url], [s.url for s in servers[1:]], policy="jsq",
                         decode_batch_endpoints=tuple(endpoints), record=RecordConfig(path))
    app = create_app(config)
    state = app.state.proxy

    def send(client: httpx.Client, i: int) -> httpx.Response:
        body = {"prompt": _prompt(i), "max_tokens": _tokens(i), "stream": i % 2 == 0}
        return client.post("/v1/completions", json=body, headers={"X-Request-Id": SHARED_ID})

    with BackgroundServer(app) as proxy, httpx.Client(base_url=proxy.url, timeout=30) as client:
        # Ready, as a load balancer waits for it: both decode workers' batches heard, so no
        # finished request is published before the subscription joined (ZeroMQ's slow
        # joiner: its row would wait forever; CI's load made that happen).
        deadline = time.monotonic() + 30
        while (health := client.get("/health").json()) != {
                "status": "ok", "prefill_healthy": 1, "decode_healthy": 2,
                "unheard_streams": []}:
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
        with ThreadPoolExecutor(REQUESTS) as pool:
            answers = list(pool.map(lambda i: send(client, i), range(REQUESTS)))
        for i, r in enumerate(answers):
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == SHARED_ID  # the client's id, echoed
            assert _text(r, i % 2 == 0) == "".join(f"t{k} " for k in range(_tokens(i)))
        # Each leg went upstream under an id of its own, not the client's.
        seen = [rec.headers["x-request-id"] for b in behaviors for rec in b.received]
        assert len(seen) == 2 * REQUESTS and SHARED_ID not in seen
        assert len(set(seen)) == REQUESTS  # a prefill and its decode share their id
        deadline = time.monotonic() + 30  # generous: CI runs this beside compiling engines
        while client.get("/admin/state").json()["recording"]["waiting"]:
            assert time.monotonic() < deadline, "the workers' counts never came"
            time.sleep(0.05)
        # Nothing left in flight: not on this proxy's leases, not in the published views.
        deadline = time.monotonic() + 5
        while state.decode.loads().sum() or state.in_flight():
            assert time.monotonic() < deadline, (state.decode.loads(), state.in_flight())
            time.sleep(0.05)
    arrays = SignatureDataset.open(path).read()
    assert len(arrays) == REQUESTS
    shas = {hashlib.sha256(_prompt(i).encode()).hexdigest(): i for i in range(REQUESTS)}
    assert sorted(shas[sha] for sha in arrays.prompt_sha256) == list(range(REQUESTS))
    for row, sha in enumerate(arrays.prompt_sha256):
        i = shas[sha]
        body = {"prompt": _prompt(i)}
        np.testing.assert_array_equal(arrays.prefill_counts[row], sparse_signature(body))
        np.testing.assert_array_equal(arrays.decode_counts[row], sparse_decode(body, _tokens(i)))
        assert arrays.output_tokens[row] == _tokens(i)
